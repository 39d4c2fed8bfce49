"""What a loaded diffusers image pipeline tells the engine: its `PipelineInfo`.

`image_info` reads it from the pipeline's components, its `__call__` signature and
the folder's `diffbatch_defaults.json` (`defaults`): default size and schedule, the
call arguments a request may set through `extra`, how it uses guidance and negative
prompts, its prompt limit, and which of diffbatch's features it supports.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from diffbatch.pipelines import family_rules
from diffbatch.pipelines.diffusers_edit import call_parameters
from diffbatch.pipelines.diffusers_quirks import (
    default_size,
    negative_prompt_use,
    per_sample_guidance_ok,
    prompt_limit,
    true_cfg,
    unscheduled,
)
from diffbatch.pipelines.interception.step_cache import step_cache_unsupported
from diffbatch.pipelines.interface import PipelineInfo
from diffbatch.pipelines.mixed_sizes import packable
from diffbatch.pipelines.schedule_limits import schedulable_steps

# Call arguments the adapter fills in itself; `SamplingParams.extra` may not set them.
RESERVED_ARGUMENTS = frozenset({
    "prompt", "negative_prompt", "num_images_per_prompt", "generator", "output_type",
    "return_dict", "height", "width", "num_inference_steps", "guidance_scale", "sigmas",
    "timesteps", "latents", "prompt_embeds", "negative_prompt_embeds", "image", "mask_image",
    "strength", "masked_image_latents",
})
# Call arguments no request sets: the adapter's own callbacks and `**kwargs`.
CALLBACK_ARGUMENTS = frozenset({
    "self", "kwargs", "callback_on_step_end", "callback_on_step_end_tensor_inputs",
    "callback", "callback_steps",
})


def call_default(call_params: Mapping[str, inspect.Parameter], name: str,
                 fallback: Any) -> Any:
    """The default of `__call__`'s argument `name`, or `fallback` where it has none."""
    param = call_params.get(name)
    if param is None or param.default is inspect.Parameter.empty or param.default is None:
        return fallback
    return param.default


def image_info(pipe: Any, *, call_params: Mapping[str, inspect.Parameter],
               defaults: Mapping[str, Any], device: str, task_pipes: Mapping[str, Any],
               supports_step_execution: bool) -> PipelineInfo:
    """The `PipelineInfo` of the text-to-image pipeline `pipe` and its edit pipelines."""
    d = defaults
    size, size_multiple = default_size(pipe)
    # NOTE: Flux-style pipelines do CFG only through `true_cfg_scale`; `guidance_scale`
    # is embedded in the model and never doubles the batch.
    cfg_threshold = d.get("cfg_threshold", None if true_cfg(call_params) else 1.0)
    true_cfg_default = float(call_default(call_params, "true_cfg_scale", 1.0))
    return PipelineInfo(
        name=type(pipe).__name__,
        default_height=int(d.get("height", size)),
        default_width=int(d.get("width", size)),
        default_num_inference_steps=int(d.get(
            "num_inference_steps", call_default(call_params, "num_inference_steps", 50))),
        default_guidance_scale=float(d.get(
            "guidance_scale", call_default(call_params, "guidance_scale", 1.0))),
        size_multiple=int(d.get("size_multiple", size_multiple)),
        device=device,
        cfg_threshold=cfg_threshold,
        supports_per_request_guidance=per_sample_guidance_ok(pipe, cfg_threshold),
        supports_step_execution=supports_step_execution,
        model_max_pixels=int(d["model_max_pixels"]) if "model_max_pixels" in d else None,
        max_inference_steps=schedulable_steps(pipe.scheduler),
        call_arguments=frozenset(
            name for name in call_params
            if name not in RESERVED_ARGUMENTS or name in ("sigmas", "timesteps")
        ) - CALLBACK_ARGUMENTS - unscheduled(pipe.scheduler),
        default_strengths={
            task: float(call_parameters(task_pipe)["strength"].default)
            for task, task_pipe in task_pipes.items() if task != "text-to-image"
        },
        negative_prompt=negative_prompt_use(call_params, true_cfg_default),
        **prompt_limit(pipe),
        supports_mixed_resolution=packable(pipe),
        uses_guidance_scale=family_rules.uses_guidance_scale(pipe),
        true_cfg_default=family_rules.true_cfg_default(pipe),
        negative_prompt_none_differs=family_rules.negative_none_differs(pipe),
        **family_rules.prompt_padding(
            pipe, int(call_default(call_params, "max_sequence_length", 1024))),
        step_cache_unsupported=step_cache_unsupported(pipe),
    )
