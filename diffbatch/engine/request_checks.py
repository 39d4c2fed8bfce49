"""The checks a request passes at admission against the loaded model, and its LoRA path.

Run once per request by `Engine.resolve_params`, before it is queued: a request that
fails one is refused with a 4xx (`InvalidRequestError`, naming the parameter) and
never reaches a wave, where it would cost its wave mates their forward. Messages name
what the caller gave and what the model takes, never a server path.
"""

from __future__ import annotations

import os

from diffbatch.errors import InvalidRequestError, ModelNotFoundError
from diffbatch.image_size import largest_square, size_too_large
from diffbatch.pipelines.interface import PipelineInfo
from diffbatch.request_work import describe_work, max_steps
from diffbatch.request_work import max_pixels as max_work_pixels
from diffbatch.sampling_params import SamplingParams


def check_task(info: PipelineInfo, params: SamplingParams) -> None:
    """Refuse an edit the loaded pipeline has no pipeline for (before any wave)."""
    task = params.task
    if info.supports_task(task):
        return
    # NOTE: the pipeline's class name, not `config.model`, which may be a server path.
    supported = ["text-to-image", *info.default_strengths]
    raise InvalidRequestError(
        f"{task} is not supported by this model ({info.name}): no diffusers "
        f"{task} pipeline runs it; it supports {', '.join(supported)}",
        param="mask" if task == "inpaint" else "image",
    )


def check_against_model(info: PipelineInfo, params: SamplingParams,
                        max_request_work: int | None) -> None:
    """The checks that depend on the loaded model, run once, at admission (the HTTP
    server checks only its own limits: see `diffbatch.image_size`)."""
    # the engine resolved every default before (`Engine.resolve_params`)
    assert params.height is not None and params.width is not None \
        and params.num_inference_steps is not None
    pixels = params.height * params.width
    size = f"{params.width}x{params.height}"
    cap, multiple = info.model_max_pixels, info.size_multiple
    if cap is not None and pixels > cap:  # first: "99999x99999" is told it is too large
        raise size_too_large(size, info.name, cap, largest_square(cap, multiple))
    for name in ("height", "width"):
        value = getattr(params, name)
        if value % multiple:
            raise InvalidRequestError(
                f"`{name}` must be a multiple of {multiple} for {info.name}, got {value} "
                f"(size {size}: both sides must be multiples of {multiple}, e.g. "
                f"{info.default_width}x{info.default_height})", param=name,
            )
    most_steps = info.max_inference_steps
    if most_steps is not None and params.num_inference_steps > most_steps:
        raise InvalidRequestError(
            f"`num_inference_steps` must be at most {most_steps} for {info.name} (its "
            f"scheduler's schedule ends there), got {params.num_inference_steps}",
            param="num_inference_steps",
        )
    # The work limit comes after the model's own limits, whose messages say more.
    # NOTE: per image (n multiplies it, at most 10x): the OpenAPI spec can state a
    # per-image limit in a form fuzzers generate from (openai/work_limit.py). A video's
    # pixels are those of all its frames, against the model's default clip.
    default_pixels = info.default_height * info.default_width
    frames = 1
    if info.default_num_frames is not None:  # a video pipeline
        frames = int(params.extra.get("num_frames", info.default_num_frames))
        pixels, default_pixels = pixels * frames, default_pixels * info.default_num_frames
        size = f"{size} x {frames} frames"
    step_cap = None if max_request_work is None else \
        max_steps(max_request_work, pixels, default_pixels)
    if max_request_work is not None and step_cap is not None \
            and params.num_inference_steps > step_cap:
        work = describe_work(params.width, params.height, params.num_inference_steps,
                             default_pixels, pixels=pixels)
        # the size when even one step of it is over the limit (the HTTP layer names the
        # sides `size`), else the steps
        size_alone = step_cap < 1
        side = largest_square(max_work_pixels(max_request_work, params.num_inference_steps,
                                              default_pixels) // frames, multiple)
        steps = params.num_inference_steps
        fits = [f"at most {step_cap} step{'s' * (step_cap != 1)} at {size}"] \
            if not size_alone else []
        if side:
            fits.append(f"at most {side}x{side} at {steps} step{'s' * (steps != 1)}")
        raise InvalidRequestError(
            f"this request asks for {work}; this server allows at most {max_request_work} "
            "per image (--max-request-work, `max_request_work` of an Engine): ask for "
            + ("a smaller size" if size_alone else "fewer steps or a smaller size")
            + (f" ({' or '.join(fits)})" if fits else ""),
            param="height" if size_alone else "num_inference_steps",
        )
    check_negative_prompt(info, params)
    accepted = info.call_arguments
    if accepted is None:
        return
    for name in ("sigmas", "timesteps"):
        if getattr(params, name) is not None and name not in accepted:
            raise InvalidRequestError(f"`{name}` is not supported by {info.name}",
                                      param=name)
    for name in params.extra:
        if name not in accepted or name in ("sigmas", "timesteps"):
            raise InvalidRequestError(
                f"`extra` argument {name!r} is not accepted by {info.name}; it takes "
                f"{', '.join(sorted(accepted - {'sigmas', 'timesteps'})) or 'none'}",
                param="extra",
            )


def resolve_num_frames(info: PipelineInfo, params: SamplingParams) -> dict[str, object]:
    """A video request's `extra` with its frame count filled in (the model's default
    when not given) and checked: an integer from 1 to the model's most, one more than a
    multiple of the VAE's temporal step (Wan would round any other count silently).
    Image pipelines' extras pass unchanged (`num_frames` is then an unknown extra)."""
    extra = dict(params.extra)
    if info.default_num_frames is None:  # an image pipeline
        return extra
    frames = extra.get("num_frames", info.default_num_frames)
    most = info.max_num_frames or info.default_num_frames
    if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= most:
        raise InvalidRequestError(
            f"`num_frames` must be an integer from 1 to {most} for {info.name}, got "
            f"{frames!r:.40}", param="num_frames")
    step = info.frame_multiple
    if (frames - 1) % step:
        lower = (frames - 1) // step * step + 1
        raise InvalidRequestError(
            f"`num_frames` must be one more than a multiple of {step} for {info.name} "
            f"(its VAE compresses {step} frames into one), got {frames}; e.g. {lower} or "
            f"{lower + step}", param="num_frames")
    extra["num_frames"] = frames
    return extra


def check_negative_prompt(info: PipelineInfo, params: SamplingParams) -> None:
    """Refuse a negative prompt the pipeline would drop without a word: one whose call
    takes none, or Flux's, which uses it only with true CFG (`true_cfg_scale` > 1)."""
    if not params.negative_prompt or info.negative_prompt == "yes":
        return
    if info.negative_prompt == "no":
        raise InvalidRequestError(f"`negative_prompt` is not supported by {info.name}",
                                  param="negative_prompt")
    try:
        true_cfg = float(params.extra.get("true_cfg_scale", 1.0))
    except (TypeError, ValueError):
        true_cfg = 1.0
    if not true_cfg > 1.0:
        raise InvalidRequestError(
            f"`negative_prompt` has no effect on {info.name} without true classifier-free "
            "guidance (`true_cfg_scale` > 1 in the Python API's `extra`, which runs the "
            "model twice per step); leave negative_prompt out", param="negative_prompt")


def resolve_lora(lora: str | None, lora_dir: str | None) -> str | None:
    """The absolute path of adapter `lora` (symlinks kept: the runner checks where they
    lead), checked to exist and to look like LoRA weights.

    NOTE: the weights check runs here, at admission, because a folder that is no
    adapter would otherwise fail inside the wave's forward: a 500 for every request
    of the wave, with a message naming the server's path. Messages here name only
    what the caller gave.
    """
    if lora is None:
        return None
    if "\x00" in lora:  # (os.path raises ValueError on it)
        raise InvalidRequestError("`lora` must not contain a NUL character", param="lora")
    if lora_dir is None:
        given = os.path.abspath(lora)
        path = os.path.realpath(lora)
        if not os.path.exists(path):
            raise InvalidRequestError(f"LoRA adapter path {lora!r} does not exist",
                                      param="lora")
    else:
        root = os.path.realpath(lora_dir)
        given = os.path.abspath(os.path.join(lora_dir, lora))
        path = os.path.realpath(os.path.join(root, lora))
        if os.path.commonpath([root, path]) != root or path == root:
            raise InvalidRequestError(
                f"`lora` must name an adapter inside the LoRA directory, got {lora!r}",
                param="lora",
            )
        if not os.path.exists(path):
            raise ModelNotFoundError(f"LoRA adapter {lora!r} not found", param="lora")
    # What diffusers' `load_lora_weights` loads: a weights file, or a folder holding
    # one (scheduler/optimizer/checkpoint files are not adapters to it).
    if os.path.isdir(path):
        try:
            names = os.listdir(path)
        except OSError:
            names = []
    else:
        names = [os.path.basename(path)]
    if not any(n.endswith((".safetensors", ".bin")) and not any(
        word in n for word in ("scheduler", "optimizer", "checkpoint")
    ) for n in names):
        raise InvalidRequestError(
            f"`lora` {lora!r} is not a LoRA adapter: it must be a .safetensors (or .bin) "
            "weights file, or a folder holding one, as `save_lora_weights` writes",
            param="lora",
        )
    return given
