"""What diffbatch must know about particular diffusers pipelines (model quirks).

Each function names the pipelines it is about and why; the adapter
(`diffusers_t2i.py`) calls them when it describes a pipeline or builds a call.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Literal

# diffusers classes (exact, not subclasses: those may override __call__) whose only
# uses of `guidance_scale` in __call__ are a `> 1` check and the CFG combine
# `noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)`; read
# in diffusers 0.42 and tested with the tiny models. Add a class only after doing both.
PER_SAMPLE_GUIDANCE_CLASSES = (
    "StableDiffusionPipeline", "StableDiffusion3Pipeline", "PixArtSigmaPipeline",
)


def true_cfg(call_params: Any) -> bool:
    """Whether the pipeline does CFG only through `true_cfg_scale` (Flux, QwenImage):
    `guidance_scale` is then embedded in the model and never doubles the batch, and
    the negative pass is a denoiser call of its own."""
    return "true_cfg_scale" in call_params


def cfg_copies(call_params: Any, guidance_scale: Any) -> int:
    """Copies of the image rows in one denoiser call: 2 when the pipeline runs CFG's
    negative and positive halves as one batch (diffusers' `guidance_scale > 1`
    convention), else 1. `guidance_scale` None: the call's own default."""
    if guidance_scale is None and "guidance_scale" in call_params:
        guidance_scale = call_params["guidance_scale"].default
    if true_cfg(call_params) or not isinstance(guidance_scale, int | float):
        return 1
    return 2 if float(guidance_scale) > 1.0 else 1


def unscheduled(scheduler: Any) -> set[str]:
    """Of custom `sigmas` and `timesteps`, those the scheduler cannot take (its
    `set_timesteps` has no such parameter): the pipeline would accept them and then
    fail in the wave, so the engine refuses them when they are submitted."""
    try:
        accepted = inspect.signature(scheduler.set_timesteps).parameters
    except (AttributeError, TypeError, ValueError):
        return set()
    return {name for name in ("sigmas", "timesteps") if name not in accepted}


def prompt_limit(pipe: Any) -> dict[str, Any]:
    """`prompt_tokenizer` and `max_prompt_tokens` of a pipeline with one tokenizer
    loaded from a folder (with several, the longest encoder reads what the others
    cut: nothing is declared)."""
    tokenizers = [c for name, c in pipe.components.items()
                  if name.startswith("tokenizer") and c is not None]
    if len(tokenizers) != 1:
        return {}
    folder, length = getattr(tokenizers[0], "name_or_path", None), \
        getattr(tokenizers[0], "model_max_length", None)
    if not (isinstance(folder, str) and os.path.isdir(folder) and isinstance(length, int)
            and 0 < length < 1_000_000):  # transformers' "no limit" is a huge number
        return {}
    return {"prompt_tokenizer": folder, "max_prompt_tokens": length}


def per_sample_guidance_ok(pipe: Any, cfg_threshold: float | None) -> bool:
    """Whether `forward` may pass a `PerSampleGuidance` to this diffusers pipeline.

    Only the listed classes (see `PER_SAMPLE_GUIDANCE_CLASSES`), only with CFG
    switched on above 1 (the pipelines' own `> 1` check must agree with the key's
    "CFG on"), and not for an SD UNet that embeds the guidance scale
    (`time_cond_proj_dim`, LCM-style), which uses the scale outside the combine.
    """
    import diffusers

    if not any(type(pipe) is getattr(diffusers, name, None)
               for name in PER_SAMPLE_GUIDANCE_CLASSES):
        return False
    if cfg_threshold is None or cfg_threshold < 1.0:
        return False
    unet = getattr(pipe, "unet", None)
    return unet is None or unet.config.get("time_cond_proj_dim") is None


def apply_quirks(pipe: Any, kwargs: dict[str, Any], extra: dict[str, Any],
                 call_params: Any) -> None:
    from diffbatch.pipelines import family_rules

    # PixArt, Sana: resolution binning exists only for the sample sizes in the
    # pipeline's own table and raises "Invalid sample size" for any other (e.g.
    # tiny) transformer; HunyuanDiT's would return another size than asked for.
    if "use_resolution_binning" in call_params and "use_resolution_binning" not in extra \
            and family_rules.resolution_binning(pipe) is False:
        kwargs["use_resolution_binning"] = False
    # PixArt: clean_caption=True without bs4/ftfy falls back to False with a
    # warning on every call; pass the fallback explicitly.
    if "clean_caption" in call_params and "clean_caption" not in extra:
        from diffusers.utils import is_bs4_available, is_ftfy_available

        if not (is_bs4_available() and is_ftfy_available()):
            kwargs["clean_caption"] = False


def default_size(pipe: Any) -> tuple[int, int]:
    """The pipeline's default image side and the multiple its sides must be: the VAE's
    scale times the denoiser's downsampling (UNet blocks, a transformer's patch, Flux's
    2x2 latent packing)."""
    from diffbatch.pipelines import family_rules

    vae_scale = int(getattr(pipe, "vae_scale_factor", 8))
    unet, transformer = getattr(pipe, "unet", None), getattr(pipe, "transformer", None)
    denoiser = unet if unet is not None else transformer
    if unet is not None:  # every down block but the last halves the latent
        down = 2 ** (len(unet.config.block_out_channels) - 1)
    elif transformer is not None:
        # Z-Image names its patch sizes `all_patch_size`
        down = int(transformer.config.get("patch_size")
                   or max(transformer.config.get("all_patch_size") or [1]))
        if hasattr(type(pipe), "_pack_latents"):  # Flux packs 2x2 latent patches
            down *= 2
    else:
        down = 1
    sample = getattr(pipe, "default_sample_size", None)
    if sample is None and denoiser is not None:
        sample = denoiser.config.get("sample_size")
    size = int(sample) * vae_scale if isinstance(sample, int) else 512
    # A transformer whose rotary table is shorter than the default size needs
    # (Z-Image's `axes_lens`) gets the largest size the table covers.
    size = min(size, family_rules.rotary_size_limit(transformer, vae_scale) or size)
    return size, vae_scale * down


def negative_prompt_use(call_params: Any, true_cfg_default: float,
                        ) -> Literal["yes", "no", "true_cfg"]:
    """`PipelineInfo.negative_prompt`: what a request's negative prompt does on a
    pipeline with these `__call__` parameters and default `true_cfg_scale`."""
    if "negative_prompt" not in call_params:
        return "no"
    if true_cfg(call_params) and not true_cfg_default > 1.0:
        return "true_cfg"
    return "yes"


def uses_negative_prompt(call_params: Any, true_cfg_default: float, extra: dict[str, Any],
                         key: Any = None) -> bool:
    """Whether a wave's call takes its negative prompts. Flux and Qwen-Image use them
    only with true CFG (`true_cfg_scale` > 1, and a negative prompt: the key's CFG
    flag); passing them otherwise is wasted encoding at best."""
    if true_cfg(call_params):
        if key is not None and not key.cfg_enabled:
            return False
        return float(extra.get("true_cfg_scale", true_cfg_default)) > 1.0
    return True
