"""The server's `/openapi.json`: FastAPI's spec, made to say exactly what the server checks.

A client (or a fuzzer such as schemathesis) should be able to trust the spec both
ways: a request valid by it is accepted, and one invalid by it is refused. FastAPI
derives the spec from the routes and the pydantic models in `protocol.py`; what it
cannot know, or gets wrong, is fixed here once, when the spec is first asked for:

1. integer bounds: FastAPI's OpenAPI models turn them into floats (`"maximum": 10.0`,
   and 2**63 - 1 into 9.223372036854776e18, which is not the bound), so the request
   schema is taken from pydantic as it is;
2. the 422 FastAPI declares on every route with input: this server never sends one
   (validation errors are 400s in the OpenAI shape), so it goes, with its schemas;
   and every error answer is the JSON `ErrorResponse`, also on `/metrics`, whose
   success is `text/plain`;
3. what depends on this server: the `size` values its model and pixel cap allow,
   `lora` only when it serves adapters (`--lora-dir`), the bearer key when
   `--api-key` is set, and the work limit (`--max-request-work`) in the description
   of `num_inference_steps`;
4. a single allowed value (`const`) is written as a one-value `enum`, like the
   others (`response_format`, `moderation`, `stream`, `partial_images`).

NOTE: the `size` pattern lists the sides of square-bounded sizes (each side at most
the largest square's), a subset of what the server takes: the exact rule, a cap
on width * height, is not a regular language worth writing out. The description
states the exact rule; every size the pattern allows is one the server accepts.
The work limit is a product of four fields (width x height x steps x n), which JSON
Schema cannot state at all: a request above it is valid by the spec and refused with
400, so the spec holds both ways only on a server run with `--max-request-work 0`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.openapi.utils import get_openapi

from diffbatch.entrypoints.openai.middleware import PROTECTED_PREFIX
from diffbatch.entrypoints.openai.protocol import ImageGenerationRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

    from diffbatch.entrypoints.openai.serving_images import SizeRule

_REQUEST_SCHEMA = "ImageGenerationRequest"
_BEARER = "bearer"
_ERROR_SCHEMA_REF = "#/components/schemas/ErrorResponse"


def install_openapi(
    app: FastAPI, *, size_rule: SizeRule, lora_enabled: bool, api_key_required: bool,
    max_request_work: int | None = None,
) -> None:
    """Make `app.openapi()` (and so `/openapi.json` and `/docs`) this server's spec."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes,
            )
            _specialise(spec, size_rule=size_rule, lora_enabled=lora_enabled,
                        api_key_required=api_key_required, max_request_work=max_request_work)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def size_pattern(size_rule: SizeRule) -> str:
    """A pattern of "auto" and every size whose sides are allowed multiples (see NOTE)."""
    sides = "|".join(str(side) for side in size_rule.sides())
    return f"^(?:auto|(?:{sides})x(?:{sides}))$" if sides else "^auto$"


def _specialise(
    spec: dict[str, Any], *, size_rule: SizeRule, lora_enabled: bool, api_key_required: bool,
    max_request_work: int | None = None,
) -> None:
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    # 1. The request schema from pydantic, with exact integer bounds.
    request = ImageGenerationRequest.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    schemas[_REQUEST_SCHEMA] = request
    # 2. No 422; errors are JSON.
    error_content = {"application/json": {"schema": {"$ref": _ERROR_SCHEMA_REF}}}
    for operations in spec.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            for status, response in responses.items():
                if int(status) >= 400:
                    response["content"] = dict(error_content)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    # 3. This server's sizes, LoRA and key.
    properties = request["properties"]
    square = size_rule.largest_square
    properties["size"]["anyOf"][0]["pattern"] = size_pattern(size_rule)
    properties["size"]["description"] = (
        f'"<width>x<height>" or "auto" ({size_rule.default_size[0]}x'
        f"{size_rule.default_size[1]}): sides multiples of {size_rule.multiple}, at most "
        f"{size_rule.max_side} each and {size_rule.max_pixels} pixels in all"
        + (f" (the largest square is {square}x{square})" if square else "")
    )
    if max_request_work is not None:
        steps = properties["num_inference_steps"]
        steps["description"] = (
            steps.get("description", "").rstrip(".") + f". This server refuses (400) a "
            f"request whose width x height x num_inference_steps x n is above "
            f"{max_request_work} (--max-request-work)").lstrip(". ")
    if lora_enabled:
        lora = properties["lora"]
        lora["anyOf"][0]["pattern"] = lora.pop("pattern")
    else:
        del properties["lora"]
    if api_key_required:
        schemas_root = spec["components"]
        schemas_root["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
        for path, operations in spec.get("paths", {}).items():
            if path.startswith(PROTECTED_PREFIX):
                for operation in operations.values():
                    operation["security"] = [{_BEARER: []}]
    # 4. Integer bounds as integers everywhere, and `const` as a one-value `enum`.
    _normalise(spec)


def _normalise(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _normalise(item)
        return
    if not isinstance(node, dict):
        return
    if "const" in node and not isinstance(node["const"], dict | list):
        node["enum"] = [node.pop("const")]
    if node.get("type") == "integer":
        for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(bound)
            if isinstance(value, float) and value.is_integer():
                node[bound] = int(value)
    for value in node.values():
        _normalise(value)
