"""What the diffusers families do differently, read from the loaded pipeline.

A request served alone must equal the same call of the plain diffusers pipeline. The
adapter therefore passes each argument the way that call would (a request without a
negative prompt passes none), takes tables from the pipeline itself, and keys apart
the requests whose text encoding would depend on their batch mates:

- `negative_none_differs`: "no negative prompt" is not the same as `""` here (SDXL's
  `force_zeros_for_empty_prompt` uses zero embeddings), so the two kinds of request
  never share a wave. (Qwen-Image and Flux run true CFG only with a negative prompt:
  `PipelineInfo.cfg_enabled` follows that rule, and CFG on/off is in the key.)
- `uses_guidance_scale`: False where `guidance_scale` changes nothing (Qwen-Image's
  transformer without guidance embeddings): it is neither passed nor in the key.
- `resolution_binning`: on where the transformer's sample size has resolution bins
  in the pipeline's own `__call__` (PixArt's and Sana's tables differ), off where it
  has none or where binning would return another size (HunyuanDiT).
- `prompt_pad_multiple`: text encoders that pad the wave's prompts to the longest
  one without an attention mask (CogView4's GLM pads to a multiple of 16 on the left):
  a prompt's embedding depends on the padded length, so requests are keyed by it
  (`prompt_layout`, computed in the engine for `SamplingParamsKey`).
- `rotary_size_limit`: the largest size a precomputed rotary table covers (Z-Image),
  which caps the default size the warm-up runs at.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

# CogView4 pads GLM token ids to a multiple of this, on the left, without a mask.
_GLM_PAD_MULTIPLE = 16
# Pipelines whose text encoder pads to the wave's longest prompt without a mask,
# by class name, with the multiple it pads to.
_UNMASKED_PADDING = {"CogView4Pipeline": _GLM_PAD_MULTIPLE}
# Pipelines whose resolution binning maps any size to one of a fixed list of shapes
# and returns that shape (not the size asked for): binning stays off there.
_RESHAPING_BINS = frozenset({"HunyuanDiTPipeline"})


def call_params(pipe: Any) -> dict[str, inspect.Parameter]:
    """The parameters of the pipeline's `__call__`, by name."""
    return dict(inspect.signature(type(pipe).__call__).parameters)


def negative_none_differs(pipe: Any) -> bool:
    """Whether a request without a negative prompt computes something else than one
    with `""` (then their requests are keyed apart)."""
    config = getattr(pipe, "config", {}) or {}
    return bool(config.get("force_zeros_for_empty_prompt", False))


def true_cfg_default(pipe: Any) -> float | None:
    """The call's own `true_cfg_scale` (Qwen-Image 4.0, Flux 1.0); None: no true CFG."""
    param = call_params(pipe).get("true_cfg_scale")
    if param is None:
        return None
    return float(param.default) if isinstance(param.default, int | float) else 1.0


def uses_guidance_scale(pipe: Any) -> bool:
    """False for a true-CFG pipeline whose transformer has no guidance embedding:
    diffusers ignores (and warns about) its `guidance_scale`."""
    if "guidance_scale" not in call_params(pipe):
        return False
    transformer = getattr(pipe, "transformer", None)
    if "true_cfg_scale" in call_params(pipe) and transformer is not None:
        return bool(transformer.config.get("guidance_embeds", True))
    return True


def negative_prompt_fill(pipe: Any) -> str:
    """What an absent negative prompt means in a wave that mixes requests with and
    without one (only where `negative_none_differs` is False): the call's own default
    when it is a string (Sana's ""), else "" (the others turn None into "")."""
    default = call_params(pipe).get("negative_prompt")
    if default is not None and isinstance(default.default, str):
        return default.default
    return ""


@functools.cache
def _binning_sizes_of(cls: type) -> frozenset[int] | None:
    try:
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return None
    sizes = re.findall(r"sample_size\s*==\s*(\d+)", source)
    return frozenset(int(s) for s in sizes) if sizes else None


def resolution_binning(pipe: Any) -> bool | None:
    """The `use_resolution_binning` the adapter passes: None (the pipeline's default,
    on) where the transformer's sample size has bins in the pipeline's own table,
    False where it has none (the call would raise "Invalid sample size") or where
    binning would return another size than the one asked for."""
    if "use_resolution_binning" not in call_params(pipe):
        return None
    if type(pipe).__name__ in _RESHAPING_BINS:
        return False
    transformer = getattr(pipe, "transformer", None)
    sizes = _binning_sizes_of(type(pipe))  # type: ignore[arg-type]  # classes hash
    if transformer is None or sizes is None:
        return None
    return None if transformer.config.get("sample_size") in sizes else False


def prompt_pad_multiple(pipe: Any) -> int | None:
    """The multiple an unmasked text encoder pads the wave's prompts to (CogView4);
    None where a prompt's embedding does not depend on its batch mates."""
    for cls in type(pipe).__mro__:
        if cls.__name__ in _UNMASKED_PADDING:
            return _UNMASKED_PADDING[cls.__name__]
    return None


def padded_length(tokenizer: Any, text: str, multiple: int, max_length: int) -> int:
    """The token count `text` pads to, alone, in an encoder that pads to `multiple`."""
    count = len(tokenizer(text, truncation=True, max_length=max_length,
                          add_special_tokens=True).input_ids)
    return -(-count // multiple) * multiple


@functools.cache
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def prompt_layout(info: Any, prompt: str, params: Any) -> tuple[Any, ...]:
    """The key's `prompt_layout` of a request (see `SamplingParamsKey`): whether it has
    a negative prompt where that changes the encoding, and the lengths an unmasked
    encoder pads its prompt and negative prompt to."""
    layout: list[Any] = []
    if info.negative_prompt_none_differs:
        layout.append(params.negative_prompt is not None)
    if info.prompt_pad_multiple and info.prompt_pad_tokenizer:
        tokenizer = _tokenizer(info.prompt_pad_tokenizer)
        max_length = int(params.extra.get("max_sequence_length", info.prompt_pad_max_length))
        layout += [padded_length(tokenizer, text, info.prompt_pad_multiple, max_length)
                   for text in (prompt, params.negative_prompt or "")]
    return tuple(layout)


def rotary_size_limit(transformer: Any, pixels_per_latent: int) -> int | None:
    """The largest image side a transformer's precomputed rotary table covers
    (Z-Image: `axes_lens` positions per axis of patches, each patch
    `all_patch_size` latent pixels of `pixels_per_latent` image pixels), or None
    where it has none."""
    config = getattr(transformer, "config", None)
    if config is None:
        return None
    lens, patches = config.get("axes_lens"), config.get("all_patch_size")
    if not lens or len(lens) < 3 or not patches:
        return None
    return int(min(lens[1:])) * int(max(patches)) * int(pixels_per_latent)


# Two prompts of different lengths for `encoding_depends_on_batch`.
_SHORT_PROMPT = "a cat"
_LONG_PROMPT = ("a large old castle on a mountain over a dark forest under the night sky with "
                "a bright moon, a river and a bridge in the valley below, oil painting")


def _first_tensor(result: Any) -> Any:
    import torch

    while isinstance(result, tuple | list) and result:
        if isinstance(result, list) and all(isinstance(r, torch.Tensor) for r in result):
            return result[0]  # one embedding per prompt (Z-Image)
        result = result[0]
    return result if isinstance(result, torch.Tensor) else None


def encoding_depends_on_batch(pipe: Any) -> bool | None:
    """Whether a prompt's text embedding changes when a longer prompt is encoded with
    it (an encoder that pads to the longest prompt without a mask), found by encoding
    a short prompt alone and beside a long one with the pipeline's own
    `encode_prompt`; None where that cannot be called generically.

    Embeddings of different lengths are compared on the short prompt's tokens, at
    either end (right or left padding): with a mask, one of them matches.
    """
    import torch

    encode = getattr(pipe, "encode_prompt", None)
    if encode is None:
        return None
    try:
        params = inspect.signature(encode).parameters
        kwargs: dict[str, Any] = {}
        if "device" in params:
            kwargs["device"] = getattr(pipe, "_execution_device", None) or pipe.device
        if "num_images_per_prompt" in params:
            kwargs["num_images_per_prompt"] = 1
        if "do_classifier_free_guidance" in params:
            kwargs["do_classifier_free_guidance"] = False
        for name in ("prompt_2", "prompt_3"):  # SD3's other encoders read the prompt too
            if name in params and params[name].default is inspect.Parameter.empty:
                kwargs[name] = None
        with torch.no_grad(), _libraries_quiet():  # no warning about a probe's prompt
            alone = _first_tensor(encode(prompt=[_SHORT_PROMPT], **kwargs))
            together = _first_tensor(encode(prompt=[_SHORT_PROMPT, _LONG_PROMPT], **kwargs))
    except Exception:  # an encode_prompt that needs more than a prompt: not decided here
        return None
    if alone is None or together is None or alone.dim() < 2:
        return None
    a, b = alone[0].float(), together[0].float()
    if a.shape == b.shape:
        return not torch.allclose(a, b, atol=1e-4, rtol=1e-3)
    if a.dim() != b.dim() or a.shape[1:] != b.shape[1:] or a.shape[0] > b.shape[0]:
        return None
    n = a.shape[0]
    return not (torch.allclose(a, b[:n], atol=1e-4, rtol=1e-3)
                or torch.allclose(a, b[-n:], atol=1e-4, rtol=1e-3))


def prompt_padding(pipe: Any, max_length: int) -> dict[str, Any]:
    """`PipelineInfo.prompt_pad_*` of a pipeline whose text encoder pads without a
    mask: a known family's multiple (CogView4: 16), else, where encoding a short prompt
    beside a long one changes it (the start-up check), its exact token count."""
    tokenizer = getattr(pipe, "tokenizer", None)
    folder = getattr(tokenizer, "name_or_path", None)
    multiple = prompt_pad_multiple(pipe)
    if multiple is None and encoding_depends_on_batch(pipe):
        logger.warning(
            "%s: a prompt's text embedding depends on the other prompts encoded with "
            "it (padding without a mask); %s", type(pipe).__name__,
            "requests are keyed by their prompts' token counts" if folder
            else "its tokenizer has no folder, so waves may mix prompt lengths")
        multiple = 1
    if multiple is None or not isinstance(folder, str) or not folder:
        return {}
    return {"prompt_pad_multiple": multiple, "prompt_pad_tokenizer": folder,
            "prompt_pad_max_length": max_length}


def negative_prompts(pipe: Any, info: Any, negatives: list[str | None]) -> list[str]:
    """A wave's negative prompts as one list for the call, for a wave where some
    request has one: "none" filled in as this pipeline means it. A pipeline where none
    and "" differ (`info.negative_prompt_none_differs`, keyed apart) cannot mix them."""
    if any(p is None for p in negatives) and info.negative_prompt_none_differs:
        raise ValueError(f"{info.name}: a wave mixes requests with and without a negative "
                         "prompt, which it cannot share")
    fill = negative_prompt_fill(pipe)
    return [fill if p is None else p for p in negatives]


@contextlib.contextmanager
def _libraries_quiet() -> Iterator[None]:
    """transformers' and diffusers' warnings off (errors still show), e.g. a tokenizer's
    "longer than the specified maximum" for a start-up probe's long prompt."""
    libraries = [logging.getLogger(name) for name in ("transformers", "diffusers")]
    levels = [library.level for library in libraries]
    for library in libraries:
        library.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for library, level in zip(libraries, levels, strict=True):
            library.setLevel(level)
