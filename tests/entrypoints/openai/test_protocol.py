"""Tests of the request models and size parsing (no server)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from diffbatch.entrypoints.openai.protocol import (
    MAX_N,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ImageObject,
    parse_size,
)
from diffbatch.errors import InvalidRequestError
from diffbatch.request import MAX_PROMPT_CHARS
from diffbatch.sampling_params import MAX_NUM_INFERENCE_STEPS


@pytest.mark.parametrize(
    ("size", "expected"),
    [(None, None), ("auto", None), ("64x64", (64, 64)), ("512x256", (512, 256)),
     ("1024X768", (1024, 768)), (" 64 x 32 ", (64, 32))],
)
def test_parse_size(size: str | None, expected: tuple[int, int] | None) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["abc", "64", "64x", "x64", "-64x64", "64x64x64", "0x64", "", 64])
def test_parse_size_rejects(size: object) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        parse_size(size)  # type: ignore[arg-type]
    assert exc_info.value.param == "size"


def test_defaults() -> None:
    request = ImageGenerationRequest(prompt="a red circle")
    assert request.n == 1
    assert request.output_format == "png"
    assert request.image_size() is None
    assert request.seed is None and request.lora is None


def test_extension_fields() -> None:
    request = ImageGenerationRequest.model_validate({
        "prompt": "a cat", "model": "tiny-sd", "n": 2, "size": "64x32",
        "response_format": "b64_json", "output_format": "webp", "output_compression": 80,
        "user": "u1", "negative_prompt": "blurry", "num_inference_steps": 2,
        "guidance_scale": 3.5, "seed": 7, "lora": "style", "lora_scale": 0.5, "priority": -2,
    })
    assert request.image_size() == (64, 32)
    assert request.priority == -2
    assert ImageGenerationRequest.model_validate({"prompt": "a"}).priority == 0
    assert (request.n, request.seed, request.num_inference_steps) == (2, 7, 2)
    assert (request.output_format, request.output_compression) == ("webp", 80)


def _error_of(body: dict) -> tuple[str, str]:
    """(param, message) of the first validation error, as the server will see it."""
    with pytest.raises(ValidationError) as exc_info:
        ImageGenerationRequest.model_validate(body)
    error = exc_info.value.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return cause.param or "", cause.message
    return ".".join(str(p) for p in error["loc"]), error["msg"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({}, "prompt", "Field required"),
        ({"prompt": ["a", "b"]}, "prompt", "send one request per prompt"),
        ({"prompt": ""}, "prompt", "non-empty"),
        ({"prompt": "a", "priority": "high"}, "priority", "integer"),
        ({"prompt": "   "}, "prompt", "non-empty"),
        ({"prompt": 5}, "prompt", "must be a string"),
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt", f"at most {MAX_PROMPT_CHARS}"),
        ({"prompt": "p", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "p", "n": MAX_N + 1}, "n", f"less than or equal to {MAX_N}"),
        ({"prompt": "p", "n": "2"}, "n", "valid integer"),
        ({"prompt": "p", "size": "abc"}, "size", "<width>x<height>"),
        ({"prompt": "p", "num_inference_steps": 0}, "num_inference_steps",
         "greater than or equal to 1"),
        ({"prompt": "p", "num_inference_steps": 10_000}, "num_inference_steps",
         f"less than or equal to {MAX_NUM_INFERENCE_STEPS}"),
        ({"prompt": "p", "guidance_scale": math.nan}, "guidance_scale", "finite"),
        ({"prompt": "p", "guidance_scale": math.inf}, "guidance_scale", "finite"),
        ({"prompt": "p", "guidance_scale": -1}, "guidance_scale", "greater than or equal"),
        ({"prompt": "p", "seed": -1}, "seed", "greater than or equal to 0"),
        ({"prompt": "p", "response_format": "gif"}, "response_format", '"b64_json" or "url"'),
        ({"prompt": "p", "output_format": "gif"}, "output_format", "png"),
        ({"prompt": "p", "output_compression": 101}, "output_compression", "less than"),
        ({"prompt": "p", "output_compression": 50}, "output_compression", "PNG is lossless"),
        ({"prompt": "p", "quality": "ultra"}, "quality", "not supported"),
        ({"prompt": "p", "background": "transparent"}, "background", "not supported"),
        ({"prompt": "p", "style": "vivid"}, "style", "leave it out"),
        ({"prompt": "p", "stream": True, "n": 2}, "n", "must be 1 when `stream`"),
        ({"prompt": "p", "stream": True, "response_format": "url"}, "response_format",
         "cannot be streamed"),
        ({"prompt": "p", "partial_images": 2}, "partial_images", "needs `stream`"),
        ({"prompt": "p", "stream": True, "partial_images": 4}, "partial_images",
         "less than or equal to 3"),
        ({"prompt": "p", "stream": "true"}, "stream", "valid boolean"),
        ({"prompt": "p", "lora": ""}, "lora", "at least 1"),
        ({"prompt": "p", "negative_prompt": ["a"]}, "negative_prompt", "single string"),
        ({"prompt": "p", "colour": "red"}, "colour", "Extra inputs"),
    ],
)
def test_invalid_requests_name_the_field(body: dict, param: str, fragment: str) -> None:
    got_param, message = _error_of(body)
    assert got_param == param
    assert fragment in message


def test_jpg_is_jpeg_and_neutral_openai_values_pass() -> None:
    request = ImageGenerationRequest(
        prompt="p", output_format="jpg", quality="auto", background="opaque",
        moderation="auto", stream=False, partial_images=0,
    )
    assert request.output_format == "jpeg"
    streamed = ImageGenerationRequest(prompt="p", stream=True, partial_images=3.0)
    assert streamed.partial_images == 3  # an integral number, as JSON spells it


def test_response_shape() -> None:
    response = ImageGenerationResponse(
        data=[ImageObject(b64_json="AAAA")], output_format="png", size="64x64"
    )
    body = response.to_json()
    assert set(body) == {"created", "data", "output_format", "size"}
    assert body["data"] == [{"b64_json": "AAAA", "revised_prompt": None}]
    assert isinstance(body["created"], int)
    linked = ImageGenerationResponse(data=[ImageObject(url="http://x/1.png")],
                                     output_format="png", size="64x64").to_json()
    assert linked["data"] == [{"url": "http://x/1.png", "revised_prompt": None}]


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_a_blank_negative_prompt_is_no_negative_prompt(blank: str) -> None:
    """What a form with an empty field sends; the pipelines encode "" when given None."""
    assert ImageGenerationRequest(prompt="p", negative_prompt=blank).negative_prompt is None
    assert ImageGenerationRequest(prompt="p", negative_prompt=" ugly ").negative_prompt \
        == " ugly "


def test_null_is_the_default_for_fields_that_have_one() -> None:
    """OpenAI's API takes `"n": null`; the official client sends null for a None."""
    request = ImageGenerationRequest.model_validate({
        "prompt": "p", "n": None, "output_format": None, "lora_scale": None,
        "priority": None})
    assert (request.n, request.output_format, request.lora_scale, request.priority) \
        == (1, "png", 1.0, 0)
    with pytest.raises(ValidationError, match="n"):
        ImageGenerationRequest.model_validate({"prompt": "p", "n": "two"})
