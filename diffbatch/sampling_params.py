"""Sampling parameters of one request, and the key that decides who may share a wave.

`SamplingParams` is what a user passes; it is validated on construction so a bad
value fails at the call that gave it. `SamplingParamsKey` is built once per
request, after the pipeline's defaults are filled in, and holds exactly the
fields that change the shape or the computation of a fused forward: two requests
may share a wave only if their keys are equal.
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from diffbatch.errors import InvalidRequestError
from diffbatch.step_cache import StepCacheConfig

if TYPE_CHECKING:
    import torch

OutputType = Literal["pil", "pt", "np"]
OUTPUT_TYPES: tuple[str, ...] = ("pil", "pt", "np")
# What a request asks the pipeline to do, decided by which inputs it carries: no
# `image` is text-to-image, an `image` alone image-to-image, an `image` and a `mask`
# inpainting. Requests of different tasks never share a wave (the key holds the task).
Task = Literal["text-to-image", "image-to-image", "inpaint"]
TEXT_TO_IMAGE: Task = "text-to-image"
IMAGE_TO_IMAGE: Task = "image-to-image"
INPAINT: Task = "inpaint"
TASKS: tuple[Task, ...] = (TEXT_TO_IMAGE, IMAGE_TO_IMAGE, INPAINT)
_TASK_LABELS = {IMAGE_TO_IMAGE: "i2i", INPAINT: "inpaint"}  # in `SamplingParamsKey.short()`

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
MAX_LORA_STACK = 8  # most adapters one request may stack

# A request's LoRA adapters with their scales, in the order given; () runs the base model.
LoraStack = tuple[tuple[str, float], ...]


def _as_int(value: Any) -> Any:
    """An integer of another type (numpy's int64, ...) as a plain int; else as it is."""
    if isinstance(value, int) or not hasattr(value, "__index__"):  # bool is an int
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(
            f"`{name}` must be an integer, got {value!r}", param=name
        )
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"between {low} and {high}"
        raise InvalidRequestError(f"`{name}` must be {rule}, got {value}", param=name)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    """A schedule given as a list or tuple (of numbers, checked by the caller)."""
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise InvalidRequestError(
            f"`{name}` must be a list of numbers, got {type(value).__name__}", param=name)
    return tuple(value)


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


def _as_uint8_tensor(name: str, value: Any, channels: int) -> torch.Tensor:
    """A PIL image or a uint8 tensor as a contiguous uint8 tensor [H, W, C] (C = 3 for
    an image) or [H, W] (a mask, C = 1); anything else is refused."""
    import torch

    shape = "[H, W, 3]" if channels == 3 else "[H, W]"
    if not isinstance(value, torch.Tensor):
        from PIL import Image

        if not isinstance(value, Image.Image):
            raise InvalidRequestError(
                f"`{name}` must be a uint8 tensor {shape} or a PIL image, got "
                f"{type(value).__name__}", param=name,
            )
        import numpy as np

        value = torch.from_numpy(np.array(value.convert("RGB" if channels == 3 else "L")))
    if value.dtype != torch.uint8:
        raise InvalidRequestError(
            f"`{name}` must be a uint8 tensor {shape}, got dtype {value.dtype}", param=name
        )
    if channels == 1 and value.ndim == 3 and value.shape[-1] == 1:
        value = value[..., 0]
    expected_ndim = 3 if channels == 3 else 2
    if value.ndim != expected_ndim or (channels == 3 and value.shape[-1] != 3):
        raise InvalidRequestError(
            f"`{name}` must be a uint8 tensor {shape}, got shape {list(value.shape)}", param=name
        )
    height, width = int(value.shape[0]), int(value.shape[1])
    if not (1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE):
        raise InvalidRequestError(
            f"`{name}` sides must be between 1 and {MAX_SIDE} pixels, got {width}x{height}",
            param=name,
        )
    if value.device.type != "cpu" or not value.is_contiguous():
        value = value.to("cpu").contiguous()
    return value  # the same tensor when it already was one (clones share it)


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


def _refusing_unknown_options(cls: type) -> type:
    """Make `cls(foo=1)` an `InvalidRequestError` that names the option and suggests
    the closest known one (Python's own TypeError says neither what is known nor
    where a pipeline's own arguments go)."""
    init = cls.__init__  # type: ignore[misc]  # the dataclass' own, replaced below
    known = [f.name for f in fields(cls)]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean `{close[0]}`?" if close else "."
                raise InvalidRequestError(
                    f"unknown sampling option `{name}`{hint} SamplingParams takes "
                    f"{', '.join(known)}; other arguments of the pipeline's call go in "
                    "`extra={...}`", param=name)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_refusing_unknown_options
@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request's images. Every option is given by name
    (`SamplingParams(4)` would not say whether 4 is the height or the steps).

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
        lora: LoRA adapter name or path, or a stack of several: a list of
            (name, scale) pairs or of {"name", "scale"} dicts (scale defaults to 1);
            None runs the base model. Requests with different adapters share a wave.
        lora_scale: Strength of a single adapter given by name; with a stack, it
            multiplies each entry's own scale.
        sigmas: Custom sigma schedule, when the pipeline's scheduler takes one.
        timesteps: Custom timesteps, when the pipeline's scheduler takes them.
        extra: Model-specific keyword arguments passed to the pipeline call. They are
            part of the batch key, so requests with different extras never share a wave.
        image: The image to edit, a uint8 tensor [H, W, 3] (RGB) or a PIL image (turned
            into one); None generates from text alone. With an image, `height` and
            `width` default to its own and must equal them when given.
        mask: Where to paint, a uint8 tensor [H, W] (or [H, W, 1]) or a PIL image (taken
            as grayscale): 255 repaints a pixel, 0 keeps it (diffusers' convention;
            the HTTP API converts OpenAI's transparent-where-to-paint masks). Needs
            `image`, of the same size. With a mask the task is inpainting.
        strength: How far an edit may move away from `image`, in (0, 1]: the share
            of the denoising schedule that runs, at least one step (1 ignores the
            image's content where it paints). None takes the pipeline's default for
            the task. Edits only.
        partial_images: Previews to stream per image while the request runs (0: none),
            at evenly spaced denoising steps before the last; fewer when the request
            runs fewer steps. Only `Engine.generate_stream` hands them out (the other
            entry points drop the field). Not part of the batch key: a request that
            asks for previews shares waves with requests that do not.
        step_cache: Step caching for this request (transformer models): a spec such as
            "first_block:0.05" or "off", a dict or a `StepCacheConfig`
            (`diffbatch.step_cache`); None takes the server's `--step-cache`. Not part
            of the batch key: each request decides for itself inside the shared forward.
    """

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    num_outputs_per_prompt: int = 1
    seed: int | None = None
    output_type: OutputType = "pil"
    lora: str | LoraStack | None = None
    lora_scale: float = 1.0
    sigmas: tuple[float, ...] | None = None
    timesteps: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # NOTE: tensors are left out of `==` (an ambiguous truth value) and of the repr (a
    # log line must not hold pixels); the key tells waves apart by task and size.
    image: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [H, W, 3]
    mask: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [H, W]
    strength: float | None = None
    partial_images: int = 0
    step_cache: StepCacheConfig | None = None

    def __post_init__(self) -> None:
        for name in ("height", "width", "num_inference_steps", "num_outputs_per_prompt", "seed",
                     "partial_images"):
            setattr(self, name, _as_int(getattr(self, name)))
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
        _check_float("lora_scale", self.lora_scale, -MAX_ABS_LORA_SCALE, MAX_ABS_LORA_SCALE)
        if self.lora is not None:
            self.lora = _lora_value(self.lora, self.lora_scale)
            if not isinstance(self.lora, str):  # folded into the stack's scales
                self.lora_scale = 1.0
        if self.sigmas is not None:
            self.sigmas = _sequence("sigmas", self.sigmas)
            for s in self.sigmas:
                _check_float("sigmas", s, 0.0)
            self.sigmas = tuple(float(s) for s in self.sigmas)
        if self.timesteps is not None:
            self.timesteps = tuple(_as_int(t) for t in _sequence("timesteps", self.timesteps))
            for t in self.timesteps:
                _check_int("timesteps", t, 0)
        if self.sigmas is not None and self.timesteps is not None:
            raise InvalidRequestError(
                "give at most one of `sigmas` and `timesteps`", param="sigmas"
            )
        _check_int("partial_images", self.partial_images, 0, MAX_NUM_INFERENCE_STEPS)
        if self.step_cache is not None:
            self.step_cache = StepCacheConfig.parse(self.step_cache)
        if not isinstance(self.extra, dict):
            raise InvalidRequestError(
                f"`extra` must be a dict, got {type(self.extra).__name__}", param="extra"
            )
        self._check_edit_inputs()

    def _check_edit_inputs(self) -> None:
        """`image`, `mask` and `strength`: types, shapes and how they go together."""
        if self.image is not None:
            self.image = _as_uint8_tensor("image", self.image, 3)
            height, width = int(self.image.shape[0]), int(self.image.shape[1])
            for name, side in (("height", height), ("width", width)):
                given = getattr(self, name)
                if given is not None and given != side:
                    raise InvalidRequestError(
                        f"`{name}` must equal the image's {name} ({side}) when an image is "
                        f"given, got {given}; resize the image instead", param=name,
                    )
        if self.mask is not None:
            if self.image is None:
                raise InvalidRequestError(
                    "`mask` needs an `image` to paint into", param="mask"
                )
            self.mask = _as_uint8_tensor("mask", self.mask, 1)
            if tuple(self.mask.shape) != tuple(self.image.shape[:2]):
                raise InvalidRequestError(
                    f"`mask` must have the image's size "
                    f"({self.image.shape[1]}x{self.image.shape[0]}), got "
                    f"{self.mask.shape[1]}x{self.mask.shape[0]}",
                    param="mask",
                )
        if self.strength is not None:
            if self.image is None:
                raise InvalidRequestError(
                    "`strength` applies to edits only; give an `image` or leave it out",
                    param="strength",
                )
            _check_float("strength", self.strength, 0.0, 1.0)
            if self.strength == 0:
                raise InvalidRequestError(
                    "`strength` must be > 0 (0 would return the image unchanged), got 0",
                    param="strength",
                )

    @property
    def lora_stack(self) -> LoraStack:
        """The request's adapters as (name or path, scale) pairs; () for none."""
        if self.lora is None:
            return ()
        if isinstance(self.lora, str):
            return ((self.lora, float(self.lora_scale)),)
        return self.lora  # `lora_scale` is folded in

    @property
    def task(self) -> Task:
        """What the request asks for, from the inputs it carries (see `Task`)."""
        if self.image is None:
            return TEXT_TO_IMAGE
        return IMAGE_TO_IMAGE if self.mask is None else INPAINT

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (and validated)."""
        changes.setdefault("extra", dict(self.extra))  # a copy: the dict is mutable
        return replace(self, **changes)


@dataclass(frozen=True)
class SamplingParamsKey:
    """The batch-compatibility key of a request: equal keys may share a wave.

    Built from *resolved* params (pipeline defaults filled in), so a default value
    and an explicitly given equal value make the same key. It never holds the prompt,
    the negative prompt text, the seed, a generator or `partial_images` (previews are
    taken per request inside the shared forward).
    """

    # With `any_size`: the reference size capacity is counted in (the model's default).
    height: int
    width: int
    num_frames: int | None  # video-capable pipelines only; None for images
    num_inference_steps: int
    task: Task  # text-to-image, image-to-image or inpaint: each runs its own pipeline
    # Share of the schedule an edit runs (it sets how many steps run); None for text-to-image.
    strength: float | None
    # None when the pipeline applies per-request guidance and CFG is on: then requests
    # that differ only in guidance_scale share a wave.
    guidance_scale: float | None
    cfg_enabled: bool  # whether classifier-free guidance doubles the batch
    sigmas: tuple[float, ...] | None
    timesteps: tuple[int, ...] | None
    num_outputs_per_prompt: int
    output_type: str
    # NOTE: no LoRA field: each sample of a wave carries its own adapter stack into
    # the one forward (`diffbatch.pipelines.interception.lora_mixing`).
    extra: tuple[tuple[str, Any], ...]  # frozen, sorted model-specific kwargs
    # Requests of any size share a wave (mixed resolution: the pipeline packs them).
    any_size: bool = False
    # What of the request's prompts its text encoding shares with the wave, where
    # the pipeline cannot keep them apart (`family_rules.prompt_layout`): e.g. whether
    # it has a negative prompt (SDXL's zero embeddings), the length an unmasked
    # encoder pads its prompts to (CogView4); () where nothing.
    prompt_layout: tuple[Any, ...] = ()

    @classmethod
    def from_params(
        cls, params: SamplingParams, *, cfg_enabled: bool, per_request_guidance: bool = False,
        reference_size: tuple[int, int] | None = None, guidance_used: bool = True,
        prompt_layout: tuple[Any, ...] = (),
    ) -> SamplingParamsKey:
        """Build the key of already-resolved params (height, width, steps, guidance set).

        With `per_request_guidance` (the pipeline applies each request's own scale) and
        CFG on, the guidance scale is left out of the key. With a `reference_size`
        (height, width; the pipeline packs requests of different sizes into one
        forward) the request's size leaves the key: it holds the reference size
        instead, and `any_size`. Without `guidance_used` (the pipeline ignores the
        scale) the guidance scale is left out too.
        """
        assert params.height is not None and params.width is not None
        assert params.num_inference_steps is not None and params.guidance_scale is not None
        extra = dict(params.extra)
        num_frames = extra.pop("num_frames", None)
        return cls(
            height=params.height if reference_size is None else reference_size[0],
            width=params.width if reference_size is None else reference_size[1],
            num_frames=num_frames,
            num_inference_steps=params.num_inference_steps,
            task=params.task,
            strength=float(params.strength) if params.strength is not None
            and params.task != TEXT_TO_IMAGE else None,
            guidance_scale=None if (per_request_guidance and cfg_enabled) or not guidance_used
            else float(params.guidance_scale),
            cfg_enabled=cfg_enabled,
            sigmas=params.sigmas,
            timesteps=params.timesteps,
            num_outputs_per_prompt=params.num_outputs_per_prompt,
            output_type=params.output_type,
            extra=_freeze(extra),
            any_size=reference_size is not None,
            prompt_layout=prompt_layout,
        )

    def for_step_execution(self) -> SamplingParamsKey:
        """The key of step mode, where each request runs its own schedule: what only
        sets the schedule (steps, strength, sigmas, timesteps) and the guidance scale
        (applied per request inside its own call) leave the key; step count 0 means
        "any" (`short()` shows `s*`)."""
        return replace(self, num_inference_steps=0, strength=None,
                                   guidance_scale=None, sigmas=None, timesteps=None)

    @property
    def num_denoising_steps(self) -> int:
        """Denoising steps a wave of this key runs (about: pipelines round differently):
        an edit runs `strength` of the schedule, at least one step; text-to-image all."""
        steps = self.num_inference_steps
        if self.strength is None:
            return steps
        return max(1, min(int(steps * self.strength), steps))

    def short(self) -> str:
        """A compact form for logs and metric labels, e.g. `64x64/s4/g7.5/n1` (an edit
        adds its task and strength: `/i2i@0.8`, `/inpaint@1`; a video its frames: `/f9`)."""
        guidance = "*" if self.guidance_scale is None else f"{self.guidance_scale:g}"
        steps = self.num_inference_steps or "*"
        size = "*x*" if self.any_size else f"{self.width}x{self.height}"
        text = f"{size}/s{steps}/g{guidance}"
        text += f"/n{self.num_outputs_per_prompt}"
        if self.num_frames is not None:  # a video's frames
            text += f"/f{self.num_frames}"
        if self.task != TEXT_TO_IMAGE:
            strength = "?" if self.strength is None else f"{self.strength:g}"
            text += f"/{_TASK_LABELS[self.task]}@{strength}"
        return text


def lora_entry(index: int, entry: Any) -> tuple[str, float]:
    """Entry `index` of a `lora` stack checked, as (name, scale); each fault names its
    own field (`lora[1].scale`, `lora[0].name`) and says what was expected."""
    at = f"lora[{index}]"
    if isinstance(entry, dict):
        unknown = sorted(str(k) for k in entry if k not in ("name", "scale"))
        if unknown:
            raise InvalidRequestError(
                f"`{at}` has an unknown field {unknown[0]!r:.60}; an entry is "
                "{\"name\": <adapter>, \"scale\": <number>}", param=f"{at}.{unknown[0]:.60}")
        if "name" not in entry:
            raise InvalidRequestError(f"`{at}.name` is required: the adapter to apply",
                                      param=f"{at}.name")
        name, scale = entry["name"], entry.get("scale", 1.0)
    elif isinstance(entry, list | tuple) and len(entry) == 2:
        name, scale = entry
    else:
        raise InvalidRequestError(
            f"`{at}` must be a {{\"name\", \"scale\"}} object (or a (name, scale) pair in "
            f"Python), got {_json_type(entry)}", param=at)
    if not isinstance(name, str):
        raise InvalidRequestError(f"`{at}.name` must be a string, got {_json_type(name)}",
                                  param=f"{at}.name")
    if not name.strip():
        raise InvalidRequestError(f"`{at}.name` must name an adapter, got {name!r:.60}",
                                  param=f"{at}.name")
    check_text(f"{at}.name", name, allow_nul=False)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise InvalidRequestError(f"`{at}.scale` must be a number, got {_json_type(scale)}",
                                  param=f"{at}.scale")
    _check_float(f"{at}.scale", scale, -MAX_ABS_LORA_SCALE, MAX_ABS_LORA_SCALE)
    return name, float(scale)


def _json_type(value: Any) -> str:
    """A value named by its JSON type, with a short form of it."""
    kind = {bool: "a boolean", type(None): "null", str: "a string", dict: "an object",
            list: "an array", tuple: "an array", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)
    return kind if value is None else f"{kind} ({value!r:.60})"


def _lora_value(lora: Any, lora_scale: float) -> str | LoraStack:
    """`lora` checked: a name stays a string; a stack becomes a tuple of (name, scale)."""
    if isinstance(lora, str):
        if not lora:
            raise InvalidRequestError("`lora` must be a non-empty string, a list or None, "
                                      "got ''", param="lora")
        check_text("lora", lora, allow_nul=False)
        return lora
    if not isinstance(lora, list | tuple) or not 1 <= len(lora) <= MAX_LORA_STACK:
        raise InvalidRequestError(
            f"`lora` must be an adapter name or a list of 1 to {MAX_LORA_STACK} "
            f"{{\"name\", \"scale\"}} entries, got {lora!r:.200}", param="lora")
    stack = [lora_entry(i, entry) for i, entry in enumerate(lora)]
    # An adapter named twice adds up (its delta is linear in the scale); `lora_scale`
    # scales the whole stack.
    merged: dict[str, float] = {}
    for name, scale in stack:
        merged[name] = merged.get(name, 0.0) + scale * float(lora_scale)
    for scale in merged.values():
        _check_float("lora", scale, -MAX_ABS_LORA_SCALE, MAX_ABS_LORA_SCALE)
    return tuple(merged.items())
