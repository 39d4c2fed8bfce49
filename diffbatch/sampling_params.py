"""Sampling parameters of one request, and the key that decides who may share a wave.

`SamplingParams` is what a user passes; it is validated on construction so a bad
value fails at the call that gave it. `SamplingParamsKey` is built once per
request, after the pipeline's defaults are filled in, and holds exactly the
fields that change the shape or the computation of a fused forward: two requests
may share a wave only if their keys are equal.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from diffbatch.errors import InvalidRequestError

OutputType = Literal["pil", "pt", "np"]
OUTPUT_TYPES: tuple[str, ...] = ("pil", "pt", "np")

# Upper bounds that keep one request from monopolising a server; pipelines may be stricter.
MAX_NUM_INFERENCE_STEPS = 1000
MAX_NUM_OUTPUTS_PER_PROMPT = 64
MAX_SIDE = 8192
# Bounds that keep the output finite: a guidance scale of 1e308 (or a LoRA scale as large)
# overflows the noise prediction to inf and the image to NaN, which encodes all black.
# Hosted SD APIs cap guidance at 20-50 and LoRA strength at a few units; at these bounds
# tiny-sd's images stay finite (tests/test_sampling_params.py).
MAX_GUIDANCE_SCALE = 50.0
MAX_ABS_LORA_SCALE = 10.0


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(
            f"`{name}` must be an integer, got {value!r}", param=name
        )
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"between {low} and {high}"
        raise InvalidRequestError(f"`{name}` must be {rule}, got {value}", param=name)


def _check_float(
    name: str, value: Any, low: float | None = None, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"`{name}` must be a number, got {value!r}", param=name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"`{name}` must be finite, got {value}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        rule = (f">= {low:g}" if high is None else f"<= {high:g}" if low is None
                else f"between {low:g} and {high:g}")
        raise InvalidRequestError(f"`{name}` must be {rule}, got {value:g}", param=name)


def check_text(name: str, value: str, *, allow_nul: bool = True) -> None:
    """Reject text that cannot reach a tokenizer or a file system intact.

    A JSON escape such as `"\\ud800"` decodes to a lone surrogate, which no UTF-8
    encoder (tokenizers, file names) accepts; a NUL byte ends a C path string.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"`{name}` must be valid Unicode text, got a lone surrogate "
            f"({value[exc.start]!r}) at index {exc.start}",
            param=name,
        ) from None
    nul = -1 if allow_nul else value.find("\x00")
    if nul >= 0:
        raise InvalidRequestError(
            f"`{name}` must not contain a NUL character, got one at index {nul}", param=name
        )


def _freeze(value: Any) -> Any:
    """Turn lists/dicts into tuples so a value can live in a hashable key."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass
class SamplingParams:
    """How to sample one request's images.

    Args:
        height: Image height in pixels; None takes the pipeline's default. Must be a
            multiple of the pipeline's size multiple (checked when the request is added).
        width: Image width in pixels; None takes the pipeline's default.
        num_inference_steps: Denoising steps (>= 1); None takes the pipeline's default.
        guidance_scale: Classifier-free guidance scale; None takes the pipeline's default.
        negative_prompt: Per-request negative prompt; may differ inside one wave.
        num_outputs_per_prompt: Images per prompt (the OpenAI `n`).
        seed: Seed of this request's generators; None lets the engine pick one.
        output_type: "pil" (PIL images), "pt" (float tensor [n, C, H, W] in [0, 1])
            or "np" (float array [n, H, W, C] in [0, 1]).
        lora: LoRA adapter name or path; None runs the base model.
        lora_scale: Strength of the LoRA adapter.
        sigmas: Custom sigma schedule, when the pipeline's scheduler takes one.
        timesteps: Custom timesteps, when the pipeline's scheduler takes them.
        extra: Model-specific keyword arguments passed to the pipeline call. They are
            part of the batch key, so requests with different extras never share a wave.
    """

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    num_outputs_per_prompt: int = 1
    seed: int | None = None
    output_type: OutputType = "pil"
    lora: str | None = None
    lora_scale: float = 1.0
    sigmas: tuple[float, ...] | None = None
    timesteps: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 1, MAX_SIDE)
        if self.num_inference_steps is not None:
            _check_int("num_inference_steps", self.num_inference_steps, 1, MAX_NUM_INFERENCE_STEPS)
        if self.guidance_scale is not None:
            _check_float("guidance_scale", self.guidance_scale, 0.0, MAX_GUIDANCE_SCALE)
        if self.negative_prompt is not None:
            if not isinstance(self.negative_prompt, str):
                raise InvalidRequestError(
                    "`negative_prompt` must be a string or None, got "
                    f"{type(self.negative_prompt).__name__}; batching is across requests, "
                    "so send one request per prompt",
                    param="negative_prompt",
                )
            check_text("negative_prompt", self.negative_prompt)
        _check_int("num_outputs_per_prompt", self.num_outputs_per_prompt, 1,
                   MAX_NUM_OUTPUTS_PER_PROMPT)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.output_type not in OUTPUT_TYPES:
            raise InvalidRequestError(
                f"`output_type` must be one of {list(OUTPUT_TYPES)}, got {self.output_type!r}",
                param="output_type",
            )
        if self.lora is not None:
            if not isinstance(self.lora, str) or not self.lora:
                raise InvalidRequestError(
                    f"`lora` must be a non-empty string or None, got {self.lora!r}", param="lora"
                )
            check_text("lora", self.lora, allow_nul=False)
        _check_float("lora_scale", self.lora_scale, -MAX_ABS_LORA_SCALE, MAX_ABS_LORA_SCALE)
        if self.sigmas is not None:
            self.sigmas = tuple(float(s) for s in self.sigmas)
            for s in self.sigmas:
                _check_float("sigmas", s, 0.0)
        if self.timesteps is not None:
            self.timesteps = tuple(self.timesteps)
            for t in self.timesteps:
                _check_int("timesteps", t, 0)
        if self.sigmas is not None and self.timesteps is not None:
            raise InvalidRequestError(
                "give at most one of `sigmas` and `timesteps`", param="sigmas"
            )
        if not isinstance(self.extra, dict):
            raise InvalidRequestError(
                f"`extra` must be a dict, got {type(self.extra).__name__}", param="extra"
            )

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (and validated)."""
        return replace(self, extra=dict(self.extra), **changes)


@dataclass(frozen=True)
class SamplingParamsKey:
    """The batch-compatibility key of a request: equal keys may share a wave.

    Built from *resolved* params (pipeline defaults filled in), so a default value
    and an explicitly given equal value make the same key. It never holds the prompt,
    the negative prompt text, the seed or a generator.
    """

    height: int
    width: int
    num_frames: int | None  # video-capable pipelines only; None for images
    num_inference_steps: int
    # None when the pipeline applies per-request guidance and CFG is on: then requests
    # that differ only in guidance_scale share a wave.
    guidance_scale: float | None
    cfg_enabled: bool  # whether classifier-free guidance doubles the batch
    sigmas: tuple[float, ...] | None
    timesteps: tuple[int, ...] | None
    num_outputs_per_prompt: int
    output_type: str
    lora: str | None  # adapter identity; None is its own bucket
    lora_scale: float | None  # None exactly when lora is None
    extra: tuple[tuple[str, Any], ...]  # frozen, sorted model-specific kwargs

    @classmethod
    def from_params(
        cls, params: SamplingParams, *, cfg_enabled: bool, per_request_guidance: bool = False
    ) -> SamplingParamsKey:
        """Build the key of already-resolved params (height, width, steps, guidance set).

        With `per_request_guidance` (the pipeline applies each request's own scale) and
        CFG on, the guidance scale is left out of the key.
        """
        assert params.height is not None and params.width is not None
        assert params.num_inference_steps is not None and params.guidance_scale is not None
        extra = dict(params.extra)
        num_frames = extra.pop("num_frames", None)
        return cls(
            height=params.height,
            width=params.width,
            num_frames=num_frames,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=None if per_request_guidance and cfg_enabled
            else float(params.guidance_scale),
            cfg_enabled=cfg_enabled,
            sigmas=params.sigmas,
            timesteps=params.timesteps,
            num_outputs_per_prompt=params.num_outputs_per_prompt,
            output_type=params.output_type,
            lora=params.lora,
            lora_scale=float(params.lora_scale) if params.lora is not None else None,
            extra=_freeze(extra),
        )

    def short(self) -> str:
        """A compact form for logs and metric labels, e.g. `64x64/s4/g7.5/n1/lora=style@0.5`.

        The LoRA shows as its adapter name (the last part of its path), never the
        path: `/metrics` is unauthenticated and must not reveal the server's folders.
        """
        guidance = "*" if self.guidance_scale is None else f"{self.guidance_scale:g}"
        text = f"{self.width}x{self.height}/s{self.num_inference_steps}/g{guidance}"
        text += f"/n{self.num_outputs_per_prompt}"
        if self.lora is not None:
            text += f"/lora={lora_adapter_name(self.lora)}@{self.lora_scale:g}"
        return text


def lora_adapter_name(lora: str) -> str:
    """The name a LoRA shows in logs and metrics: the last part of its path."""
    return os.path.basename(os.path.normpath(lora)) or "adapter"
