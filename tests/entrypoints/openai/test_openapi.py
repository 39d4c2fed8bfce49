"""`/openapi.json` says what the server checks, and the server keeps to it.

The first tests read the spec; the last runs schemathesis (all its checks: status
codes, content types, response schemas, schema-valid requests accepted, invalid ones
refused, undeclared methods; every phase, stateful included) over a real server with a
fake pipeline, with a fixed number of examples and a fixed seed so it is quick and
repeatable. Of `--checks all` it leaves out only the response-time limit, a timing
assertion about the machine, not the API.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis

from diffbatch import Engine
from diffbatch.engine.request_checks import check_against_model
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.entrypoints.openai.openapi import size_pattern
from diffbatch.entrypoints.openai.protocol import NOT_BLANK_PATTERN
from diffbatch.entrypoints.openai.serving_images import SizeRule
from diffbatch.errors import InvalidRequestError
from diffbatch.sampling_params import SamplingParams
from tests.entrypoints.openai.conftest import serve_in_thread
from tests.fake_pipelines import FakeBatchPipeline

MAX_PIXELS = 32 * 32


@pytest.fixture(scope="module")
def engine(lora_dir: str) -> Iterator[Engine]:
    # The engine's defaults, the work limit included ("auto": 100 x 16 x 16 x 2 steps).
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                lora_dir=lora_dir) as engine:
        yield engine


def spec_of(engine: Engine, **app_kwargs: Any) -> dict[str, Any]:
    app = build_app(engine, served_model_name="fake", max_image_pixels=MAX_PIXELS,
                    close_engine_on_shutdown=False, **app_kwargs)
    return app.openapi()


@pytest.fixture(scope="module")
def spec(engine: Engine) -> dict[str, Any]:
    return spec_of(engine)


def request_properties(spec: dict[str, Any]) -> dict[str, Any]:
    return spec["components"]["schemas"]["ImageGenerationRequest"]["properties"]


def string_branch(schema: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in schema.get("anyOf", [schema]) if s.get("type") == "string")


def test_prompts_declare_their_length_and_not_blank(spec) -> None:
    props = request_properties(spec)
    text = string_branch(props["prompt"])
    assert (text["minLength"], text["maxLength"], text["pattern"]) \
        == (1, 10_000, NOT_BLANK_PATTERN)
    # a blank negative prompt is no negative prompt: any text up to the limit
    negative = string_branch(props["negative_prompt"])
    assert negative["maxLength"] == 10_000 and "minLength" not in negative \
        and "pattern" not in negative


@pytest.mark.parametrize(
    ("field", "allowed"),
    [("output_format", ["png", "jpeg", "webp", "jpg"]), ("response_format", ["b64_json", "url"]),
     ("quality", ["auto", "low", "medium", "high", "standard", "hd"]),
     ("background", ["auto", "opaque"]),
     ("moderation", ["auto"])],
)
def test_closed_choices_are_enums(spec, field: str, allowed: list[Any]) -> None:
    schema = request_properties(spec)[field]
    branches = schema.get("anyOf", [schema])
    assert [b["enum"] for b in branches if "enum" in b] == [allowed]
    assert "const" not in str(schema)


@pytest.mark.parametrize(("path", "kind"), [("/v1/images/generations", "image_generation"),
                                             ("/v1/images/edits", "image_edit")])
def test_image_routes_declare_their_event_stream(spec, path: str, kind: str) -> None:
    content = spec["paths"][path]["post"]["responses"]["200"]["content"]
    assert list(content) == ["application/json", "text/event-stream"]
    event = content["text/event-stream"]["schema"]
    assert event["properties"]["event"]["enum"] == [f"{kind}.partial_image",
                                                    f"{kind}.completed", "error"]
    [integer] = [branch for branch in request_properties(spec)["partial_images"]["anyOf"]
                 if branch.get("type") == "integer"]
    assert (integer["minimum"], integer["maximum"]) == (0, 3)


def test_style_is_declared_unsupported(spec) -> None:
    assert request_properties(spec)["style"]["type"] == "null"


def test_integer_bounds_are_exact_integers(spec) -> None:
    props = request_properties(spec)
    bounds = {name: (branch["minimum"], branch["maximum"])
              for name in ("n", "num_inference_steps", "seed", "priority", "output_compression")
              for branch in props[name].get("anyOf", [props[name]]) if "maximum" in branch}
    assert bounds == {"n": (1, 10), "num_inference_steps": (1, 1000), "seed": (0, 2**63 - 1),
                      "priority": (-1_000_000, 1_000_000), "output_compression": (0, 100)}
    for low, high in bounds.values():
        assert type(low) is int and type(high) is int
    guidance = string_or_number(props["guidance_scale"])
    assert (guidance["minimum"], guidance["maximum"]) == (0, 50)


def string_or_number(schema: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in schema.get("anyOf", [schema]) if s.get("type") in ("number", "string"))


def test_the_size_pattern_declares_power_of_two_sides_and_the_defaults(spec) -> None:
    pattern = string_branch(request_properties(spec)["size"])["pattern"]
    assert pattern == "^(?:auto|(?:8|16|32)x(?:8|16|32))$"
    assert re.fullmatch(pattern, "32x8") and re.fullmatch(pattern, "auto")
    assert not re.fullmatch(pattern, "40x8") and not re.fullmatch(pattern, "12x8")
    assert size_pattern(SizeRule(multiple=64, max_pixels=32 * 32, default_size=(64, 64))) \
        == "^auto$"
    assert size_pattern(SizeRule(multiple=8, max_pixels=64 * 64, default_size=(48, 24))) \
        == "^(?:auto|(?:8|16|24|32|48|64)x(?:8|16|24|32|48|64))$"


def test_lora_is_declared_only_where_it_is_served(spec, engine: Engine) -> None:
    lora = string_branch(request_properties(spec)["lora"])
    for name in ("style", "a/b", "my.adapter"):
        assert re.fullmatch(lora["pattern"], name), name
    for name in (".", "..", "../x", "a/../b", "/etc", "a\x00b", ""):
        assert not re.fullmatch(lora["pattern"], name), name
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc") as no_loras:
        assert "lora" not in request_properties(spec_of(no_loras))
    assert "lora_scale" in request_properties(spec_of(engine))


class NoNegativePromptPipeline(FakeBatchPipeline):
    """Declares that a negative prompt would be dropped (as Flux's without true CFG)."""

    def info(self):
        import dataclasses

        return dataclasses.replace(super().info(), negative_prompt="true_cfg")


def test_negative_prompt_is_declared_only_where_the_model_uses_it(spec) -> None:
    assert "negative_prompt" in request_properties(spec)
    with Engine(pipeline_class=NoNegativePromptPipeline, executor="inproc") as engine:
        dropped = spec_of(engine)
        assert "negative_prompt" not in request_properties(dropped)
        edit = dropped["components"]["schemas"]["ImageEditRequest"]["properties"]
        assert "negative_prompt" not in edit and "prompt" in edit


def test_no_422_and_every_error_is_json(spec) -> None:
    assert "422" not in str(spec["paths"])
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for operations in spec["paths"].values():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    assert list(response["content"]) == ["application/json"]


def test_metrics_is_plain_text(spec) -> None:
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) \
        == ["text/plain"]


def test_an_api_key_is_declared_as_bearer_on_v1_routes(engine: Engine) -> None:
    spec = spec_of(engine, api_key="k")
    assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                                "scheme": "bearer"}}
    assert spec["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/health"]["get"]


# -- schemathesis ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server_url(engine: Engine) -> Iterator[str]:
    app = build_app(engine, served_model_name="fake", max_image_pixels=MAX_PIXELS,
                    close_engine_on_shutdown=False)
    with serve_in_thread(app) as url:
        yield url


def register_image_media_types() -> None:
    """Tell schemathesis what the edit route's file parts hold: real images.

    The spec says `image` is a PNG, JPEG or WebP and `mask` a PNG (their `encoding`),
    and in words what a schema cannot: the mask has the image's size and an alpha
    channel. Every image here is 16x16 with transparent pixels, so any draw makes a
    valid image and a valid mask for it; without this, schemathesis sends arbitrary
    bytes as a "valid" image, which the server rightly refuses.
    """
    import io

    from hypothesis import strategies as st
    from PIL import Image

    def encode(alpha: list[int], fmt: str) -> bytes:
        image = Image.new("RGBA", (16, 16), (200, 30, 30, 255))
        image.putalpha(Image.frombytes("L", (16, 16), bytes(alpha)))
        buffer = io.BytesIO()
        (image if fmt == "PNG" else image.convert("RGB")).save(buffer, format=fmt)
        return buffer.getvalue()

    alphas = st.lists(st.sampled_from([0, 255]), min_size=256, max_size=256)
    for media_type, fmt in (("image/png", "PNG"), ("image/jpeg", "JPEG"),
                            ("image/webp", "WEBP")):
        schemathesis.openapi.media_type(media_type, alphas.map(lambda a, f=fmt: encode(a, f)))
    # The edit's `prompt` part (text/plain): what the schema asks, as UTF-8 text.
    prompts = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=200)
    schemathesis.openapi.media_type(
        "text/plain", prompts.filter(lambda text: not text.isspace()).map(str.encode))


def run_schemathesis(url: str, *, seed: int, max_examples: int) -> list[str]:
    """What `schemathesis run URL/openapi.json --checks all` finds: one line per failure.

    NOTE: this drives schemathesis' engine (the `run` command's own entry point) rather
    than its pytest plugin, whose fixture-based loader reads a node attribute that
    pytest 9 no longer has; the engine also runs the stateful phase the plugin lacks.
    """
    from schemathesis.engine import Status, events, from_schema

    register_image_media_types()

    # Deterministic: no example database (hypothesis' `.hypothesis/` folder would replay
    # what an earlier run found, so a run would depend on the runs before it) and the
    # seed given, so every run sends the same requests.
    config = schemathesis.Config.from_dict({"seed": seed, "generation": {
        "max-examples": max_examples, "database": "none", "deterministic": True}})
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    found: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished) and event.status != Status.SUCCESS \
                and event.status != Status.SKIP:
            failures = [check.failure_info.failure for checks in event.recorder.checks.values()
                        for check in checks if check.failure_info is not None]
            found += [f"{event.recorder.label}: {f.code} {f.title}: {f.message}"
                      for f in failures] or [f"{event.recorder.label}: {event.status}"]
        elif isinstance(event, events.NonFatalError | events.FatalError):
            found.append(f"schemathesis error: {event}")
    return found


@pytest.mark.slow
def test_schemathesis_finds_no_failure(server_url: str) -> None:
    found = run_schemathesis(server_url, seed=1, max_examples=25)
    assert not found, "\n".join(dict.fromkeys(found))


STEPS = (None, 1, 49, 50, 51, 199, 200, 201, 800, 801, 1000)


def engine_accepts(engine: Engine, width: int, height: int, steps: int) -> bool:
    """Whether the engine's work limit lets an image of this size and steps through."""
    params = SamplingParams(width=width, height=height, num_inference_steps=steps)
    try:
        check_against_model(engine.info, params, engine.max_request_work)
    except InvalidRequestError as exc:
        # the size is blamed when one step of it is over the limit, else the steps
        one_step = SamplingParams(width=width, height=height, num_inference_steps=1)
        try:
            check_against_model(engine.info, one_step, engine.max_request_work)
            blamed = "num_inference_steps"
        except InvalidRequestError:
            blamed = "height"
        assert exc.param == blamed, exc.message
        return False
    return True


@pytest.mark.parametrize(("schema", "auto_side"), [
    ("ImageGenerationRequest", 16),  # no size: the model's default
    ("ImageEditRequest", 8),  # no size: the image, scaled to fit (at least 8x8)
])
def test_the_work_limit_is_stated_exactly(spec, engine: Engine, schema: str,
                                          auto_side: int) -> None:
    """For every declared size (and none) and step count (and none), the request schema
    accepts the request exactly when the server's work limit does."""
    limit = engine.max_request_work
    assert limit == 100 * 16 * 16 * 2
    request = spec["components"]["schemas"][schema]
    assert f"above {limit} (--max-request-work" in \
        request["properties"]["num_inference_steps"]["description"]
    validator = jsonschema.Draft202012Validator(request)
    pattern = string_branch(request_properties(spec)["size"])["pattern"]
    sides = re.findall(r"\d+", pattern.split("x")[0])
    sizes = [None, "auto", *(f"{w}x{h}" for w in sides for h in sides)]
    for size in sizes:
        width, height = (auto_side, auto_side) if size in (None, "auto") else \
            (int(size.split("x")[0]), int(size.split("x")[1]))
        for steps in STEPS:
            body: dict[str, Any] = {"prompt": "a cat", "n": 10}
            body |= {"image": "x"} if schema == "ImageEditRequest" else {}
            body |= {"size": size} if size else {}
            body |= {"num_inference_steps": steps} if steps else {}
            accepted = engine_accepts(engine, width, height, steps or 2)
            assert validator.is_valid(body) == accepted, (schema, size, steps)


def test_the_spec_is_served_as_built(server_url: str, engine: Engine) -> None:
    served = httpx.get(f"{server_url}/openapi.json").json()
    assert served == spec_of(engine)
