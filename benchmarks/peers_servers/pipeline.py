"""The diffusers pipeline every peer server serves, with diffbatch's request shape.

What a user would write without diffbatch: load the model's diffusers pipeline,
call it with a list of prompts, one generator per image and `output_type="pt"`
(the same call diffbatch's adapter makes per wave), turn the images into PNGs and
answer in diffbatch's (OpenAI's) response shape. `generate(pipe, jobs)` runs one
call per group of compatible jobs, so a batch of mixed sizes stays correct.

`batch_gain.py` and `overhead.py` use `load_pipeline` and `pipeline_call` for the
raw-pipeline baselines, so "raw" and every peer run exactly the same call.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

IMAGES_ROUTE = "/v1/images/generations"
MAX_N = 10


@dataclass(frozen=True)
class ImageJob:
    """One image request, parsed from its JSON body."""

    prompt: str
    n: int
    width: int | None  # None = the model's default size
    height: int | None
    num_inference_steps: int | None  # None = the pipeline's default
    guidance_scale: float | None  # None = the pipeline's default
    negative_prompt: str | None
    seed: int

    @classmethod
    def from_body(cls, body: Any) -> ImageJob:
        """Parse and check a request body; raises ValueError naming the bad field."""
        if not isinstance(body, dict):
            raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"`prompt` must be a non-empty string, got {prompt!r}")
        n = body.get("n", 1)
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise ValueError(f"`n` must be an integer 1-{MAX_N}, got {n!r}")
        width = height = None
        size = body.get("size")
        if size not in (None, "auto"):
            w, sep, h = str(size).partition("x")
            if not sep or not w.isdigit() or not h.isdigit():
                raise ValueError(f"`size` must be \"<width>x<height>\", got {size!r}")
            width, height = int(w), int(h)
        steps = body.get("num_inference_steps")
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"`num_inference_steps` must be an integer >= 1, got {steps!r}")
        guidance = body.get("guidance_scale")
        if guidance is not None and not isinstance(guidance, int | float):
            raise ValueError(f"`guidance_scale` must be a number, got {guidance!r}")
        seed = body.get("seed")
        if seed is None:
            seed = random.randrange(2**31)
        elif not isinstance(seed, int) or seed < 0:
            raise ValueError(f"`seed` must be an integer >= 0, got {seed!r}")
        return cls(prompt, n, width, height, steps, guidance, body.get("negative_prompt"), seed)

    @property
    def key(self) -> tuple[Any, ...]:
        """Jobs with equal keys can share one pipeline call."""
        return (self.n, self.width, self.height, self.num_inference_steps, self.guidance_scale)


def error_body(message: str) -> dict[str, Any]:
    """diffbatch's (OpenAI's) error shape."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": None}}


def load_kwargs(path: str) -> dict[str, Any]:
    """What `from_pretrained` needs for components the folder leaves out."""
    with open(os.path.join(path, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    kwargs: dict[str, Any] = {}
    for name, value in index.items():
        if not name.startswith("_") and isinstance(value, list) and value == [None, None]:
            kwargs[name] = None
    if index.get("_class_name") == "StableDiffusionPipeline":
        kwargs.update(safety_checker=None, requires_safety_checker=False)
    return kwargs


def load_pipeline(model: str, threads: int | None = None, device: str | None = None) -> Any:
    """Load `model` (a built-in name or a diffusers folder) as a plain diffusers pipeline.

    Args:
        model: e.g. "tiny-sd"; built-in names resolve through diffbatch's registry,
            which builds the tiny models offline on first use.
        threads: torch intra-op threads of this process (None = leave as is).
        device: where the pipeline runs ("cuda", as a user's GPU script would move it;
            None = where `from_pretrained` puts it, the CPU).
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    import diffusers
    import transformers

    from diffbatch.pipelines.registry import resolve_model_path

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    path = resolve_model_path(model)
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, **load_kwargs(path))
    pipe.set_progress_bar_config(disable=True)
    if device is not None:
        pipe.to(device)
    return pipe


def default_size(pipe: Any) -> tuple[int, int]:
    """(width, height) the pipeline makes when the request gives no size."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    sample = getattr(pipe, "default_sample_size", None) or denoiser.config.sample_size
    side = int(sample) * int(getattr(pipe, "vae_scale_factor", 8))
    return side, side


def pipeline_call(pipe: Any, jobs: Sequence[ImageJob]) -> Any:
    """One pipeline call for compatible `jobs`; returns float images [B*n, C, H, W] in [0, 1].

    The call diffbatch's adapter makes for a wave: prompts and negative prompts as
    lists, `num_images_per_prompt = n`, one generator per image seeded `seed + i`.
    """
    import torch

    first = jobs[0]
    width, height = (first.width, first.height) if first.width else default_size(pipe)
    kwargs: dict[str, Any] = {
        "prompt": [j.prompt for j in jobs],
        "negative_prompt": [j.negative_prompt or "" for j in jobs],
        "num_images_per_prompt": first.n,
        "generator": [torch.Generator().manual_seed(j.seed + i)
                      for j in jobs for i in range(j.n)],
        "width": width,
        "height": height,
        "output_type": "pt",
    }
    if first.num_inference_steps is not None:
        kwargs["num_inference_steps"] = first.num_inference_steps
    if first.guidance_scale is not None:
        kwargs["guidance_scale"] = first.guidance_scale
    with torch.inference_mode():
        return pipe(**kwargs).images


def to_png_b64(images: Any) -> list[str]:
    """Float images [N, C, H, W] in [0, 1] -> base64 PNG strings."""
    import torch
    from PIL import Image

    array = (images.clamp(0, 1).permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
    encoded = []
    for image in array:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


def generate(pipe: Any, jobs: Sequence[ImageJob]) -> list[dict[str, Any]]:
    """Run `jobs` (one pipeline call per group of equal keys); one response body each."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.key, []).append(i)
    responses: list[dict[str, Any]] = [{} for _ in jobs]
    for indexes in groups.values():
        group = [jobs[i] for i in indexes]
        images = pipeline_call(pipe, group)
        encoded = to_png_b64(images)
        width, height = images.shape[-1], images.shape[-2]
        for k, i in enumerate(indexes):
            n = jobs[i].n
            responses[i] = {
                "created": int(time.time()),
                "data": [{"b64_json": b64, "revised_prompt": None}
                         for b64 in encoded[k * n:(k + 1) * n]],
                "output_format": "png",
                "size": f"{width}x{height}",
            }
    return responses


def warm_up(pipe: Any) -> None:
    """One small call, so the first measured request does not pay first-call costs."""
    generate(pipe, [ImageJob("warm-up", 1, None, None, 1, None, None, 0)])
