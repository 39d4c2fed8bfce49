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
   `--api-key` is set, and the work limit (`--max-request-work`): in the
   description of `num_inference_steps`, and exactly, as the request schemas' `allOf`
   (`work_limit.py`);
4. a single allowed value (`const`) is written as a one-value `enum`, like the
   others (`response_format`, `moderation`);
5. the edits route reads its multipart form itself, so its request body is declared
   here: `ImageEditRequest`'s fields (without the `null` branches: a form field is
   left out, never null) plus the `image` and `mask` files, with the media types
   each part may be (`encoding`).

The image routes' 200 is JSON, or with `stream: true` a `text/event-stream` whose
schema (OpenAPI 3.1: one event's) the routes declare (`serving_stream.event_schema`).

NOTE: what the spec cannot say about the files, it says in their descriptions: the
image's pixel cap, and that the mask must have the image's size and an alpha channel.

NOTE: the `size` pattern lists the sizes whose sides are the model's size multiple
times a power of two (8, 16, 32, ... for a multiple of 8), or a side of the default
size, up to the largest square's side: a subset of what the server takes (any
multiple, up to a cap on width * height), like OpenAI's own short list of sizes. The
description states the exact rule; every size the pattern allows is one the server
accepts. The subset keeps the work limit sayable: width x height x steps is a
product, which JSON Schema can only state as a union of boxes, one per step cap of a
declared size (`work_limit.py`); power-of-two sides share few pixel counts, so there
are few boxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.openapi.utils import get_openapi

from diffbatch.entrypoints.openai import work_limit
from diffbatch.entrypoints.openai.middleware import PROTECTED_PREFIX
from diffbatch.entrypoints.openai.protocol import ImageEditRequest, ImageGenerationRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

    from diffbatch.entrypoints.openai.serving_images import SizeRule

_REQUEST_SCHEMA = "ImageGenerationRequest"
_EDIT_SCHEMA = "ImageEditRequest"
EDITS_PATH = "/v1/images/edits"
# The media type each part of the edit form may be. `prompt` is plain text, as every
# text field; it is named because it is required (see NOTE in `_declare_edit_body`).
_EDIT_MEDIA_TYPES = {"image": "image/png, image/jpeg, image/webp", "mask": "image/png",
                     "prompt": "text/plain"}
_BEARER = "bearer"
_ERROR_SCHEMA_REF = "#/components/schemas/ErrorResponse"


def install_openapi(
    app: FastAPI, *, size_rule: SizeRule, lora_enabled: bool, api_key_required: bool,
    max_upload_pixels: int | None = None, open_prefixes: tuple[str, ...] = (),
    max_request_work: int | None = None, default_steps: int = 1,
    negative_prompt: bool = True, step_cache: bool = True,
) -> None:
    """Make `app.openapi()` (and so `/openapi.json` and `/docs`) this server's spec.

    `max_upload_pixels` is the largest upload the edits route takes (default: the
    size rule's cap); `open_prefixes` are `/v1` paths served without the API key;
    `max_request_work` (None: no limit) is stated with `default_steps`, the model's
    step count when a request gives none (`work_limit.py`); `negative_prompt` False
    leaves the field out (a model that would drop it refuses it: `PipelineInfo`), and
    so does `step_cache` False (a model that cannot cache steps refuses the field).
    """
    limit = None if max_request_work is None else _WorkLimit(max_request_work, default_steps)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes,
            )
            _specialise(spec, size_rule=size_rule, lora_enabled=lora_enabled,
                        api_key_required=api_key_required, open_prefixes=open_prefixes,
                        limit=limit, negative_prompt=negative_prompt)
            _declare_edit_body(spec, size_rule=size_rule, lora_enabled=lora_enabled,
                               max_upload_pixels=max_upload_pixels or size_rule.max_pixels,
                               limit=limit, negative_prompt=negative_prompt)
            if not step_cache:
                _drop_field(spec, "step_cache")
            _normalise(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_field(spec: dict[str, Any], name: str) -> None:
    """Leave field `name` out of both image request bodies."""
    schemas = spec.get("components", {}).get("schemas", {})
    for body in (_REQUEST_SCHEMA, _EDIT_SCHEMA):
        schemas.get(body, {}).get("properties", {}).pop(name, None)


@dataclass(frozen=True)
class _WorkLimit:
    """The work limit and what it needs to be stated (`work_limit.py`)."""

    max_request_work: int  # most width x height x steps of one image
    default_steps: int  # the steps of a request that gives none


def declared_sides(size_rule: SizeRule) -> list[int]:
    """The sides of the sizes the spec declares (see NOTE): the size multiple times a
    power of two, and the default size's sides, up to the largest square's side."""
    top = size_rule.largest_square
    sides = {side for side in size_rule.default_size if side <= top}
    side = size_rule.multiple
    while side <= top:
        sides.add(side)
        side *= 2
    return sorted(sides)


def size_pattern(size_rule: SizeRule) -> str:
    """A pattern of "auto" and every declared size (see NOTE)."""
    sides = "|".join(str(side) for side in declared_sides(size_rule))
    return f"^(?:auto|(?:{sides})x(?:{sides}))$" if sides else "^auto$"


def _state_work_limit(
    schema: dict[str, Any], limit: _WorkLimit | None, size_rule: SizeRule, auto_pixels: int,
) -> None:
    """Require the work limit's boxes (`work_limit.py`) in a request schema, and say
    the limit in the description of its `num_inference_steps`."""
    if limit is None:
        return
    properties = schema["properties"]
    steps = properties["num_inference_steps"]
    steps["description"] = work_limit.describe(limit.max_request_work)
    sides = declared_sides(size_rule)
    default_w, default_h = size_rule.default_size
    boxes = work_limit.work_limit_boxes(
        limit.max_request_work, [(w, h) for w in sides for h in sides],
        auto_pixels=auto_pixels, default_steps=limit.default_steps,
        max_steps=_max_steps(steps), default_pixels=default_w * default_h,
    )
    if boxes is not None:
        schema["allOf"] = [*schema.get("allOf", []), {"anyOf": boxes}]


def _max_steps(steps: dict[str, Any]) -> int:
    """`num_inference_steps`' maximum, from the field or its integer branch."""
    return next(int(branch["maximum"]) for branch in steps.get("anyOf", [steps])
                if "maximum" in branch)


def _size_description(size_rule: SizeRule, auto: str) -> str:
    square = size_rule.largest_square
    return (
        f'"<width>x<height>" or "auto" ({auto}): sides multiples of {size_rule.multiple}, at '
        f"most {size_rule.max_side} each and {size_rule.max_pixels} pixels in all"
        + (f" (the largest square is {square}x{square})" if square else "")
    )


def _specialise(
    spec: dict[str, Any], *, size_rule: SizeRule, lora_enabled: bool, api_key_required: bool,
    open_prefixes: tuple[str, ...] = (), limit: _WorkLimit | None = None,
    negative_prompt: bool = True,
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
    _specialise_fields(request["properties"], size_rule=size_rule, lora_enabled=lora_enabled,
                       auto=f"{size_rule.default_size[0]}x{size_rule.default_size[1]}",
                       negative_prompt=negative_prompt)
    default_w, default_h = size_rule.default_size
    _state_work_limit(request, limit, size_rule, auto_pixels=default_w * default_h)
    if api_key_required:
        schemas_root = spec["components"]
        schemas_root["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
        for path, operations in spec.get("paths", {}).items():
            if path.startswith(PROTECTED_PREFIX) and not path.startswith(open_prefixes):
                for operation in operations.values():
                    operation["security"] = [{_BEARER: []}]
    # 4. (`_normalise`, once the edit body is declared too.)


def _specialise_fields(
    properties: dict[str, Any], *, size_rule: SizeRule, lora_enabled: bool, auto: str,
    negative_prompt: bool = True,
) -> None:
    """Step 3 on a request model's properties: this server's sizes, LoRA and whether
    its model takes a negative prompt."""
    if not negative_prompt:
        properties.pop("negative_prompt", None)
    properties["size"]["anyOf"][0]["pattern"] = size_pattern(size_rule)
    properties["size"]["description"] = _size_description(size_rule, auto)
    if lora_enabled:
        lora = properties["lora"]
        pattern = lora.pop("pattern")
        for branch in lora["anyOf"]:
            if branch.get("type") == "string":
                branch["pattern"] = pattern
    else:
        del properties["lora"]


def _declare_edit_body(
    spec: dict[str, Any], *, size_rule: SizeRule, lora_enabled: bool, max_upload_pixels: int,
    limit: _WorkLimit | None = None, negative_prompt: bool = True,
) -> None:
    """Step 5: the multipart body of the edits route."""
    operation = spec.get("paths", {}).get(EDITS_PATH, {}).get("post")
    if operation is None:
        return
    schema = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    properties = schema["properties"]
    _specialise_fields(
        properties, size_rule=size_rule, lora_enabled=lora_enabled,
        negative_prompt=negative_prompt,
        auto=f"the image's size, scaled down to fit the pixel cap and the work limit, sides "
        f"rounded down to multiples of {size_rule.multiple}",
    )
    if "lora" in properties:  # a form field is text: one adapter name, not a stack
        lora = properties["lora"]
        lora["anyOf"] = [b for b in lora["anyOf"] if b.get("type") != "array"]
        lora["description"] = "a LoRA adapter served here (a name; a stack of several " \
            "needs the JSON body of /v1/images/generations)"
    for name in list(properties):
        field = _without_null(properties[name])
        if field is None:  # a field that can only be null (`style`): not a form field
            del properties[name]
        else:
            properties[name] = field
    properties["image"] = {
        "type": "string", "format": "binary",
        "description": f"the image to edit: PNG, JPEG or WebP, at most {max_upload_pixels} "
        "pixels (width * height)",
    }
    properties["mask"] = {
        "type": "string", "format": "binary",
        "description": "inpainting: a PNG of the image's size with an alpha channel, "
        "transparent (alpha 0) where the image is to be edited; without it the edit is "
        "image-to-image",
    }
    # A form field is present or not (never null), so the JSON body's "if an integer
    # output_compression then a lossy output_format" is plain dependence on presence.
    # NOTE: schemathesis 4.x cannot judge `if` against a file part; this says the same.
    schema.pop("if", None)
    lossy = schema.pop("then", None)
    if lossy is not None:
        schema["dependentSchemas"] = {"output_compression": lossy}
    schema["required"] = ["image", *schema.get("required", [])]
    # "auto" scales the image to fit the work limit too: refused only below one multiple.
    _state_work_limit(schema, limit, size_rule, auto_pixels=size_rule.multiple ** 2)
    spec["components"]["schemas"][_EDIT_SCHEMA] = schema
    # NOTE: `prompt`'s media type is stated (text/plain is every text part's default)
    # because schemathesis 4.x fills a required part without one with "" when it
    # builds a form from the parts' media types, though the schema asks for text.
    operation["requestBody"] = {
        "required": True,
        "content": {"multipart/form-data": {
            "schema": {"$ref": f"#/components/schemas/{_EDIT_SCHEMA}"},
            "encoding": {name: {"contentType": media} for name, media
                         in _EDIT_MEDIA_TYPES.items()},
        }},
    }


def _without_null(field: dict[str, Any]) -> dict[str, Any] | None:
    """A property schema without its `null` branch (and null default); None if only null."""
    field = dict(field)
    if field.get("default", 0) is None:
        del field["default"]
    if field.get("type") == "null":
        return None
    branches = field.get("anyOf")
    if branches is not None:
        kept = [b for b in branches if b.get("type") != "null"]
        if not kept:
            return None
        del field["anyOf"]
        if len(kept) == 1:
            field = {**kept[0], **field}
        else:
            field["anyOf"] = kept
    return field


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
