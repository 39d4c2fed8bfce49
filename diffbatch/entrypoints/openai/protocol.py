"""Request and response models of the OpenAI-compatible image API.

This is the HTTP layer's one validation place for input that does not depend on
the served model: types, ranges and closed choices. What depends on the model or
the server's options (the model name, the size multiple and cap, LoRA names) is
checked in `serving_images.py` and by the engine.

Every rule raises `InvalidRequestError` with the OpenAI `param` it blames; pydantic
wraps it, and `errors.py` unwraps it again into the OpenAI error shape. The field
types and constraints are also what `/openapi.json` publishes (`openapi.py` adds
what depends on the server), so a request valid by the schema is one the server
accepts, and every numeric field is strict: `true` or `"1.5"` is not a number. An
integer field takes `2.0` as 2: JSON Schema's "integer" is any number with a zero
fraction, and JSON does not tell 2.0 from 2.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from diffbatch.errors import InvalidRequestError
from diffbatch.request import MAX_PROMPT_CHARS, validate_prompt
from diffbatch.sampling_params import (
    MAX_ABS_LORA_SCALE,
    MAX_GUIDANCE_SCALE,
    MAX_LORA_STACK,
    MAX_NUM_INFERENCE_STEPS,
    lora_entry,
)

# OpenAI's own bound on `n` for image generation.
MAX_N = 10
# OpenAI's bound on `partial_images` (previews streamed per image).
MAX_PARTIAL_IMAGES = 3
OUTPUT_FORMATS: tuple[str, ...] = ("png", "jpeg", "webp")
# What `output_format` accepts: the three formats, and "jpg" as a name of jpeg.
OutputFormat = Literal["png", "jpeg", "webp", "jpg"]
# "<width>x<height>", sides in ASCII digits; the server checks multiples and limits.
_SIZE_RE = re.compile(r"^\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*$")
_MAX_SIDE_DIGITS = 12  # longer sides are "too large" without being converted to int
# JSON Schema pattern of a prompt that is not only whitespace: some character outside
# Python's whitespace (`str.isspace`, what `validate_prompt` strips), not the regex `\S`,
# whose whitespace leaves out U+001C-U+001F and U+0085 and adds U+FEFF.
NOT_BLANK_PATTERN = (
    r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
)
# JSON Schema pattern of a LoRA name: relative, no NUL, no part that starts with a dot
# (so no "." or ".."; the server itself refuses only what leaves --lora-dir).
LORA_NAME_PATTERN = r"^[^/\x00.][^/\x00]*(?:/[^/\x00.][^/\x00]*)*$"

# OpenAI fields that only some OpenAI models honour. diffbatch accepts each at the
# values it can honour and rejects the others with a clear message, rather than
# silently ignoring a request: `quality` sets the step count (`QUALITY_STEP_FACTORS`),
# the others only at the values that ask for nothing special.
Quality = Literal["auto", "low", "medium", "high", "standard", "hd"]
# `quality` -> the model's default step count times this, when the request gives no
# `num_inference_steps` (gpt-image-1's low/medium/high, dall-e-3's standard/hd; the
# values missing here keep the default).
QUALITY_STEP_FACTORS: dict[str, float] = {"low": 0.5, "high": 2.0, "hd": 2.0}
Background = Literal["auto", "opaque"]
Moderation = Literal["auto"]
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "quality": get_args(Quality),
    "style": (),
    "background": get_args(Background),
    "moderation": get_args(Moderation),
}
# The JSON Schema of the rules between fields that `_check_combinations` enforces.
# NOTE: the stream rules are implications written as `anyOf` (either the premise is
# false or the conclusion holds), not `if`/`then`: schemathesis takes an `if` for a
# constraint of its own and "violates" it in requests it expects refused.
_OUTPUT_COMPRESSION_RULE: dict[str, Any] = {
    # `output_compression` (a number) needs a lossy `output_format`.
    "if": {"properties": {"output_compression": {"type": "integer"}},
           "required": ["output_compression"]},
    "then": {"properties": {"output_format": {"enum": ["jpeg", "webp", "jpg"]}},
             "required": ["output_format"]},
}
_STREAM_RULES: list[JsonValue] = [
    # A stream is one image, base64 in its events.
    {"anyOf": [{"properties": {"stream": {"enum": [False, None]}}},
               {"properties": {"n": {"enum": [1]},
                               "response_format": {"enum": ["b64_json", None]}}}]},
    # Partial images are streamed.
    {"anyOf": [{"properties": {"partial_images": {"enum": [0, None]}}},
               {"properties": {"stream": {"enum": [True]}}, "required": ["stream"]}]},
]


class OpenAIBaseModel(BaseModel):
    """Base of request models: unknown fields are an error, named in the message."""

    model_config = ConfigDict(extra="forbid")


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_size(size: str | None) -> tuple[int, int] | None:
    """Parse an OpenAI `size` ("WxH" or "auto") into (width, height); None means default.

    Only the format is checked here: a side too large for the server (even one of
    20 digits) comes back as a large number, for `OpenAIServingImages.check_size` to
    refuse as too large.

    Raises:
        InvalidRequestError: `size` is neither "auto" nor "<width>x<height>" with
            positive integers.
    """
    if size is None or size == "auto":
        return None
    if not isinstance(size, str):
        raise InvalidRequestError(
            f"`size` must be a string like \"512x512\" or \"auto\", got {size!r}", param="size"
        )
    match = _SIZE_RE.match(size)
    if match is None:
        raise InvalidRequestError(
            f"`size` must be \"<width>x<height>\" (e.g. \"512x512\") or \"auto\", "
            f"got {_clip(repr(size))}",
            param="size",
        )
    width, height = (
        int(side) if len(side) <= _MAX_SIDE_DIGITS else 10**_MAX_SIDE_DIGITS
        for side in match.groups()
    )
    if width < 1 or height < 1:
        raise InvalidRequestError(f"`size` must have positive sides, got {size!r}", param="size")
    return width, height


def _is_one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value in allowed`, but type-exact: 0 is not False and "0" is not 0."""
    return any(type(value) is type(choice) and value == choice for choice in allowed)


def _integral_to_int(value: Any) -> Any:
    """2.0 -> 2 (the same JSON number); anything else unchanged, for strict validation."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


class LoraEntry(BaseModel):
    """One adapter of a request's LoRA stack."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, json_schema_extra={"pattern": LORA_NAME_PATTERN})
    scale: float = Field(default=1.0, ge=-MAX_ABS_LORA_SCALE, le=MAX_ABS_LORA_SCALE,
                         strict=True, allow_inf_nan=False)

    @field_validator("scale", mode="before")
    @classmethod
    def _integral_scale(cls, value: Any) -> Any:
        return float(value) if type(value) is int else value


# Fields with a non-null default, which `null` stands for.
_DEFAULTED = ("n", "output_format", "lora_scale", "priority")


def _or_null(schema: dict[str, Any]) -> None:
    """The JSON schema of a field that also takes null (for its default)."""
    kept = ("default", "description", "title")
    value = {k: schema.pop(k) for k in list(schema) if k not in kept}
    schema["anyOf"] = [value, {"type": "null"}]


# A step-cache spec as text (`diffbatch.step_cache`), exactly what the parser takes.
_THRESHOLD = r"(10(\.0+)?|[0-9](\.[0-9]+)?|\.[0-9]+)"
STEP_CACHE_PATTERN = (rf"^(off|none|(first_block|fbc|taylorseer)(:{_THRESHOLD})?"
                      r"(,warmup=[0-9]{1,4})?(,max_cached=[1-9][0-9]{0,3})?)$")


class StepCacheFields(BaseModel):
    """A request's step-cache settings as fields (see `diffbatch.step_cache`)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["first_block", "taylorseer", "off"] = "first_block"
    threshold: float = Field(default=0.05, ge=0.0, le=10.0, allow_inf_nan=False)
    warmup_steps: int = Field(default=0, ge=0, le=1000, strict=True)
    max_cached_steps: int | None = Field(default=None, ge=1, le=1000, strict=True)


class ImageGenerationRequest(OpenAIBaseModel):
    """Body of `POST /v1/images/generations`: OpenAI's fields plus diffusion extensions.

    Args:
        prompt: One non-empty prompt (lists are rejected: batching is across requests).
        model: The served model name, or a LoRA adapter's (vLLM: it selects the
            adapter); None serves the default model.
        n: Images to generate for this prompt, 1-10.
        size: "<width>x<height>" or "auto"/None for the model's default size.
        response_format: "b64_json" (default) or "url": links to the images, kept by
            the server for an hour (`image_store.py`).
        output_format: Image encoding: "png" (default), "jpeg" or "webp".
        output_compression: Quality 0-100 of jpeg/webp (100 = best, the default).
        user: End-user id; accepted and ignored.
        negative_prompt: Extension: what the image should not show (blank: none).
        num_inference_steps: Extension: denoising steps (None = the model's default).
        guidance_scale: Extension: classifier-free guidance scale (None = default).
        seed: Extension: seed of this request's noise; equal seeds give equal images.
        lora: Extension: a LoRA adapter's name (`--lora-modules`, or inside the server's
            `--lora-dir`), or a stack of several: a list of {"name", "scale"}.
        priority: Extension: lower runs first (ignored under `--scheduling-policy
            fifo`, which keeps arrival order exactly).
        lora_scale: Extension: strength of the LoRA adapter given by name.
        stream: Answer as server-sent events (OpenAI's image streaming): partial
            images, then the completed image. Only with n = 1 (as OpenAI) and base64.
        partial_images: Previews to stream before the image, 0-3 (with `stream`).
        step_cache: Extension: step caching for this request, "first_block[:threshold]"
            (with ",warmup=N", ",max_cached=M") or "off", or a dict of those fields;
            None takes the server's `--step-cache` (`diffbatch.step_cache`).
    """

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={**_OUTPUT_COMPRESSION_RULE, "allOf": _STREAM_RULES},
    )

    prompt: str = Field(
        min_length=1, max_length=MAX_PROMPT_CHARS, pattern=NOT_BLANK_PATTERN,
        description=f"One prompt: at most {MAX_PROMPT_CHARS} characters, not only whitespace.",
    )
    model: str | None = Field(
        default=None,
        description="The served model, or one of its LoRA adapters (see /v1/models).")
    n: int = Field(default=1, ge=1, le=MAX_N, strict=True, json_schema_extra=_or_null)
    size: str | None = Field(
        default=None,
        description='"<width>x<height>" or "auto" (the model\'s default size); both sides '
        "multiples of the model's size multiple, within the server's pixel cap",
    )
    response_format: Literal["b64_json", "url"] | None = Field(
        default=None, description='"b64_json" (the default): the images in the response; '
        '"url": links to them, valid for an hour',
    )
    output_format: OutputFormat = Field(default="png", description='"jpg" is "jpeg"',
                                        json_schema_extra=_or_null)
    output_compression: int | None = Field(
        default=None, ge=0, le=100, strict=True,
        description="quality of jpeg and webp (100 = best, the default); not with png",
    )
    user: str | None = None
    # OpenAI fields accepted only at the values of _NEUTRAL_VALUES.
    quality: Quality | None = None
    style: None = None
    background: Background | None = None
    moderation: Moderation | None = None
    stream: bool | None = Field(
        default=None, strict=True,
        description="answer as server-sent events: partial images, then the image "
        "(`image_generation.*` events; `image_edit.*` for edits); needs n = 1",
    )
    partial_images: int | None = Field(
        default=None, ge=0, le=MAX_PARTIAL_IMAGES, strict=True,
        description="previews to stream before the image (with `stream`), at evenly "
        "spaced denoising steps; fewer when the request runs fewer steps",
    )
    # Diffusion extensions (send them with the openai client's `extra_body`).
    negative_prompt: str | None = Field(
        default=None, max_length=MAX_PROMPT_CHARS,
        description="what the image should not show; empty or only whitespace: none "
        "(what the pipelines do without one)",
    )
    num_inference_steps: int | None = Field(
        default=None, ge=1, le=MAX_NUM_INFERENCE_STEPS, strict=True
    )
    guidance_scale: float | None = Field(
        default=None, ge=0.0, le=MAX_GUIDANCE_SCALE, strict=True, allow_inf_nan=False
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, strict=True)
    lora: str | list[LoraEntry] | None = Field(
        default=None,
        description="a LoRA adapter served here (--lora-modules, or a relative name inside "
        "--lora-dir), or a stack of several, each with its own scale",
        json_schema_extra={"pattern": LORA_NAME_PATTERN},
    )
    lora_scale: float = Field(
        default=1.0, ge=-MAX_ABS_LORA_SCALE, le=MAX_ABS_LORA_SCALE, strict=True,
        allow_inf_nan=False, json_schema_extra=_or_null,
    )
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000, strict=True,
                          json_schema_extra=_or_null)
    step_cache: Any = Field(
        default=None,
        description='step caching: "first_block[:threshold][,warmup=N][,max_cached=M]" or '
        '"off", or those as fields; transformer models only; null: the server default',
        json_schema_extra={"anyOf": [
            {"type": "string", "pattern": STEP_CACHE_PATTERN},
            StepCacheFields.model_json_schema(), {"type": "null"}]})

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        """`null` for a field with a default is the default (OpenAI's API takes
        `"n": null`; the official client sends it for an explicit None)."""
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in _DEFAULTED):
            return {k: v for k, v in data.items() if not (v is None and k in _DEFAULTED)}
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> str:
        return validate_prompt(value)

    @field_validator("negative_prompt", mode="before")
    @classmethod
    def _check_negative_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            return None  # as UIs send an empty field; the pipelines encode "" for None
        if value is not None:
            validate_prompt(value, param="negative_prompt")
        return value

    @field_validator("size", mode="before")
    @classmethod
    def _check_size(cls, value: Any) -> Any:
        parse_size(value)
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _check_response_format(cls, value: Any) -> Any:
        if value not in (None, "b64_json", "url"):
            raise InvalidRequestError(
                f"`response_format` must be \"b64_json\" or \"url\", got {value!r}",
                param="response_format",
            )
        return value

    @field_validator("output_format", mode="before")
    @classmethod
    def _check_output_format(cls, value: Any) -> Any:
        if value == "jpg":
            return "jpeg"
        if not _is_one_of(value, OUTPUT_FORMATS):
            raise InvalidRequestError(
                f"`output_format` must be one of {list(OUTPUT_FORMATS)}, got {value!r}",
                param="output_format",
            )
        return value

    @field_validator("n", "output_compression", "num_inference_steps", "seed", "priority",
                     "partial_images", mode="before")
    @classmethod
    def _check_integral(cls, value: Any) -> Any:
        return _integral_to_int(value)

    @field_validator(*_NEUTRAL_VALUES, mode="before")
    @classmethod
    def _check_neutral(cls, value: Any, info: Any) -> Any:
        allowed = _NEUTRAL_VALUES[info.field_name]
        if any(type(choice) is int for choice in allowed):
            value = _integral_to_int(value)
        if value is not None and not _is_one_of(value, allowed):
            fix = f"leave it out or use one of {list(allowed)}" if allowed else "leave it out"
            raise InvalidRequestError(
                f"`{info.field_name}` {value!r} is not supported by this server; {fix}",
                param=info.field_name,
            )
        return value

    @field_validator("step_cache", mode="before")
    @classmethod
    def _check_step_cache(cls, value: Any) -> Any:
        """What the spec states, checked here so that every refusal names `step_cache`."""
        if value is None:
            return None
        if isinstance(value, str) and re.fullmatch(STEP_CACHE_PATTERN, value):
            return value
        if isinstance(value, dict):
            try:
                return StepCacheFields.model_validate(value).model_dump()
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise InvalidRequestError(f"`step_cache`{' ' + where if where else ''}: "
                                          f"{first['msg']}", param="step_cache") from None
        raise InvalidRequestError(
            '`step_cache` must be "off" or "first_block[:THRESHOLD]" (THRESHOLD between 0 '
            'and 10), optionally followed by ",warmup=N" and ",max_cached=M" (M >= 1), or '
            f"an object of those fields, got {str(value)[:100]!r}", param="step_cache")

    @field_validator("lora", mode="before")
    @classmethod
    def _check_lora(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise InvalidRequestError(
                "`lora` must be an adapter name or a list of at least 1 {\"name\", "
                f"\"scale\"}} entry, got {value!r}", param="lora")
        if isinstance(value, list) and len(value) > MAX_LORA_STACK:
            raise InvalidRequestError(
                f"`lora` may stack at most {MAX_LORA_STACK} adapters, got {len(value)}",
                param="lora")
        if isinstance(value, list):  # each entry's fault under its own param
            for i, entry in enumerate(value):
                if not isinstance(entry, dict):
                    raise InvalidRequestError(
                        f"`lora[{i}]` must be a {{\"name\", \"scale\"}} object, got "
                        f"{type(entry).__name__ if entry is not None else 'null'}",
                        param=f"lora[{i}]")
                lora_entry(i, entry)
        elif value is not None and not isinstance(value, str):
            raise InvalidRequestError(
                "`lora` must be an adapter name or a list of {\"name\", \"scale\"} objects, "
                f"got {type(value).__name__}", param="lora")
        return value

    @field_validator("guidance_scale", "lora_scale", mode="before")
    @classmethod
    def _check_finite(cls, value: Any, info: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(
                f"`{info.field_name}` must be a finite number, got {value}",
                param=info.field_name,
            )
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> ImageGenerationRequest:
        if self.output_compression is not None and self.output_format == "png":
            raise InvalidRequestError(
                "`output_compression` applies to \"jpeg\" and \"webp\" only; PNG is lossless. "
                "Leave it out or set `output_format`",
                param="output_compression",
            )
        if self.stream:
            if self.n != 1:
                raise InvalidRequestError(
                    f"`n` must be 1 when `stream` is true (OpenAI streams one image per "
                    f"request), got {self.n}; send {self.n} streamed requests instead",
                    param="n",
                )
            if self.response_format == "url":
                raise InvalidRequestError(
                    "`response_format` \"url\" cannot be streamed: stream events carry "
                    "the image as base64; leave it out or use \"b64_json\"",
                    param="response_format",
                )
        elif self.partial_images:
            raise InvalidRequestError(
                f"`partial_images` ({self.partial_images}) needs `stream`: partial images "
                "are streamed; set `stream` to true or leave `partial_images` out",
                param="partial_images",
            )
        return self

    def image_size(self) -> tuple[int, int] | None:
        """(width, height) asked for, or None for the model's default size."""
        return parse_size(self.size)


# Numbers in a multipart form arrive as text: "2", "0.5", "1e-05" (JSON's spelling).
_FORM_INT_RE = re.compile(r"^[+-]?[0-9]+$")
_FORM_FLOAT_RE = re.compile(r"^[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$")
_FORM_BOOLS = {"true": True, "false": False}  # JSON's spelling, as clients send them


def _form_number(value: Any) -> Any:
    """A form field's text as the number it spells; any other text is left for the
    field's own (strict) validation to refuse, naming the field."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if _FORM_INT_RE.match(text) and len(text) <= 40:
        return int(text)
    if _FORM_FLOAT_RE.match(text):
        return float(text)
    return value


class ImageEditRequest(ImageGenerationRequest):
    """Text fields of `POST /v1/images/edits` (multipart): the generation fields plus `strength`.

    The files (`image`, and `mask` for inpainting) are parts of the same form, decoded
    and checked by `uploads.py`. Form fields are text, so numbers are read from their
    spelling ("2", "0.5") and booleans from "true"/"false"; past that every rule is the
    generation request's.

    Args:
        strength: Extension: how far the edit may move away from the image, in (0, 1]
            (the share of the denoising schedule that runs); None = the model's default.
        input_fidelity: OpenAI's; only "low" (the default), since diffbatch has no
            high-fidelity mode.
    """

    strength: float | None = Field(
        default=None, gt=0.0, le=1.0, strict=True, allow_inf_nan=False,
        description="how far the edit may move from the image, in (0, 1] (the share of "
        "the schedule that runs, at least one step); the model's default when left out",
    )
    input_fidelity: Literal["low"] | None = None

    @field_validator("n", "output_compression", "num_inference_steps", "seed", "priority",
                     "partial_images", "guidance_scale", "lora_scale", "strength",
                     mode="before")
    @classmethod
    def _read_form_number(cls, value: Any) -> Any:
        return _form_number(value)

    @field_validator("stream", mode="before")
    @classmethod
    def _read_form_bool(cls, value: Any) -> Any:
        return _FORM_BOOLS.get(value, value) if isinstance(value, str) else value

    @field_validator("input_fidelity", mode="before")
    @classmethod
    def _check_input_fidelity(cls, value: Any) -> Any:
        if value is not None and value != "low":
            raise InvalidRequestError(
                f"`input_fidelity` {value!r} is not supported by this server; leave it out "
                "or use \"low\"", param="input_fidelity",
            )
        return value

    @field_validator("strength", mode="before")
    @classmethod
    def _check_strength(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(f"`strength` must be a finite number, got {value}",
                                      param="strength")
        return value


class ImageObject(BaseModel):
    """One generated image in the response: `b64_json` or `url`, as the request asked."""

    b64_json: str | None = None  # the encoded image, base64 (response_format "b64_json")
    url: str | None = None  # a link to it, valid for an hour (response_format "url")
    revised_prompt: str | None = None  # diffbatch never rewrites prompts


class DiffbatchInfo(BaseModel):
    """Extension: how diffbatch ran the request (only for requests that cached steps)."""

    step_cache: str  # the request's step-cache settings, e.g. "first_block:0.05"
    computed_steps: int  # denoiser forwards whose remaining blocks ran
    cached_steps: int  # forwards that reused the request's cached residual


class ImageGenerationResponse(BaseModel):
    """Body of a successful `POST /v1/images/generations`."""

    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageObject]
    output_format: str
    size: str  # the size actually generated, "WxH"
    diffbatch: DiffbatchInfo | None = None  # what diffbatch did for this request

    def to_json(self) -> dict[str, Any]:
        """The JSON body: each image with `b64_json` or `url`, whichever it has (and
        the `diffbatch` object when there is one)."""
        body = self.model_dump(exclude_none=False)
        if body["diffbatch"] is None:
            del body["diffbatch"]
        for item in body["data"]:
            for name in ("b64_json", "url"):
                if item[name] is None:
                    del item[name]
        return body


class WaveInfo(BaseModel):
    """One finished wave in `GET /v1/waves` (see `diffbatch.engine.wave_log.WaveEvent`)."""

    id: int  # increasing; pass the last one seen as `after`
    wave_id: int
    num_requests: int
    key: str  # the wave's batch key, short form, e.g. "64x64/s15/g5/n1"
    close_reason: str
    admission: str
    max_queue_wait_ms: float
    forward_ms: float
    num_errors: int  # requests that failed
    num_aborted: int  # requests aborted before the end (a client gone, a timeout)
    finished_at: float  # Unix time


class WaveList(BaseModel):
    """Body of `GET /v1/waves`: the waves after `after`, oldest first."""

    object: Literal["list"] = "list"
    data: list[WaveInfo]
    last_id: int  # the newest wave's id (0 before any); poll with `after=last_id`


class ModelAccepts(BaseModel):
    """What a served model takes: diffbatch's extension of OpenAI's model object, so a
    client (the playground) offers only requests the server would run."""

    default_size: str  # "WxH" of `size` "auto"
    sizes: list[str]  # square sizes it takes, smallest first (any WxH of multiples
    # of `size_multiple` within `max_pixels` works too)
    size_multiple: int
    max_pixels: int  # most width * height of one image
    default_steps: int  # `num_inference_steps` when none is given
    edits: list[str]  # the edit tasks it runs: "image-to-image", "inpaint" (none: [])


class ModelCard(BaseModel):
    """One entry of `GET /v1/models` (a LoRA adapter has the base model as `parent`)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "diffbatch"
    root: str | None = None  # what the model was loaded from (an adapter: its name)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    diffbatch: ModelAccepts | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """Body of `POST /v1/load_lora_adapter` (vLLM's fields)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=200,
                           json_schema_extra={"pattern": r"^[^/=\x00.\s][^/=\x00]*$"})
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of `POST /v1/unload_lora_adapter` (vLLM's fields)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=200)


class ModelList(BaseModel):
    """Body of `GET /v1/models`: OpenAI's list shape."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """Body of `GET /health` while the engine can take work."""

    status: Literal["ok"] = "ok"


class ErrorInfo(BaseModel):
    """The inside of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo
