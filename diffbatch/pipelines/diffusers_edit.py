"""Edits on the diffusers adapter: image-to-image and inpainting from the loaded model.

Edits run on pipelines built from the loaded one's own components
(`AutoPipelineForImage2Image.from_pipe` / `AutoPipelineForInpainting.from_pipe`: the
same modules, no second copy of the weights, LoRA adapters shared) for every family
diffusers has such a pipeline for (SD, SDXL, SD3, Flux, ...; not PixArt), each checked
by a one-step run when the model loads. The runs' verdicts are kept under the cache dir,
keyed by what decides them (the pipelines' classes, every component's config, the
library versions, the device and dtype): a restart of the same model, e.g. a worker
replaced after a crash, reads them instead of running again.

A wave of edits is one diffusers call, like a wave of text-to-image: each request's
image (and mask) repeated n times, in request order, so image i meets generator i
(tests/pipelines/test_diffusers_edit.py checks batch invariance for both tasks).
`DiffusersT2IPipeline` (diffusers_t2i.py) uses these.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from diffbatch.pipelines.interception.execution_device import pin_execution_device

if TYPE_CHECKING:
    from diffbatch.pipelines.interface import DiffusionRequestBatch

logger = logging.getLogger(__name__)

# diffusers' pipelines for the edit tasks, by the `Task` name they serve.
_EDIT_AUTO_PIPELINES = {"image-to-image": "AutoPipelineForImage2Image",
                        "inpaint": "AutoPipelineForInpainting"}


def edit_inputs(batch: DiffusionRequestBatch) -> dict[str, Any]:
    """The `image` (and `mask_image`) arguments of an edit wave's diffusers call.

    Each request's image repeated n times, in request order: [B*n, 3, H, W] float in
    [0, 1], so image i of the call meets generator i (diffusers would otherwise repeat
    a B-image batch as [r0, r1, r0, r1], pairing images with other requests' noise).
    Masks likewise, [B*n, 1, H, W] in [0, 1], 1 = paint.
    """
    n = batch.num_outputs_per_prompt
    images = [image for image in batch.images for _ in range(n)]
    if any(image is None for image in images):
        raise ValueError("an edit wave needs an image for every request")
    stacked = torch.stack(images).permute(0, 3, 1, 2)  # type: ignore[arg-type]  # [B*n, 3, H, W] uint8
    inputs: dict[str, Any] = {"image": stacked.to(torch.float32) / 255.0}
    masks = [mask for mask in batch.masks for _ in range(n)]
    if any(mask is not None for mask in masks):
        if any(mask is None for mask in masks):
            raise ValueError("an inpainting wave needs a mask for every request")
        mask = torch.stack(masks).unsqueeze(1)  # type: ignore[arg-type]  # [B*n, 1, H, W] uint8
        inputs["mask_image"] = mask.to(torch.float32) / 255.0
    return inputs


def at_least_one_step(strength: float | None, num_inference_steps: int | None) -> Any:
    """`strength`, raised just enough that an edit runs at least one denoising step.

    NOTE: SD's `get_timesteps` runs `int(num_inference_steps * strength)` steps and
    raises for none, so 0.1 of 4 steps would fail the wave; diffbatch defines a small
    strength as the lightest edit, one step (the smallest float that rounds to one:
    `int(49 * (1 / 49))` is 0).
    """
    if strength is None or not num_inference_steps:
        return strength
    lowest = 1.0 / num_inference_steps
    while int(num_inference_steps * lowest) < 1:
        lowest = math.nextafter(lowest, 2.0)
    return max(float(strength), lowest)


def edit_pipes(pipe: Any, probe_size: int) -> dict[str, Any]:
    """The edit pipelines diffusers has for `pipe`'s family, built from its components,
    each checked by one tiny run.

    NOTE: `AutoPipelineFor*.from_pipe` passes the same module objects (no copy, and
    no dtype change, unlike `DiffusionPipeline.from_pipe`, which casts to float32 unless
    told the dtype). A family without such a pipeline (from_pipe raises ValueError), or
    whose pipeline takes no `strength` with a default, is left out, and so is one that
    fails a one-step run at `probe_size` x `probe_size`: the pipelines check the model
    only when called (SD's inpainting takes a UNet of 4 or 9 input channels, so the
    8-channel `shapes` model can do image-to-image but not inpainting). A task left out
    is refused at admission, never failed inside a wave.
    """
    import diffusers

    pipes: dict[str, Any] = {}
    verdicts = _ProbeVerdicts(pipe, probe_size)
    for task, auto_name in _EDIT_AUTO_PIPELINES.items():
        # (why a task is left out is a detail for DEBUG: the summary below says which run)
        try:
            task_pipe = getattr(diffusers, auto_name).from_pipe(pipe)
        except Exception as exc:  # ValueError: no such pipeline; anything else: can't build
            logger.debug("%s: diffusers has no %s pipeline for %s (%s: %s)", task, task,
                         type(pipe).__name__, type(exc).__name__, exc)
            continue
        strength = call_parameters(task_pipe).get("strength")
        if strength is None or not isinstance(strength.default, int | float):
            logger.debug("%s: %s takes no `strength`", task, type(task_pipe).__name__)
            continue
        task_pipe.set_progress_bar_config(disable=True)
        pin_execution_device(task_pipe)
        runs = verdicts.get(task_pipe)
        if runs is None:
            try:
                _probe(task_pipe, task, probe_size)
                runs = True
            except Exception as exc:
                logger.debug("%s: %s cannot run this model's components (%s: %s)", task,
                             type(task_pipe).__name__, type(exc).__name__, exc)
                runs = False
            verdicts.put(task_pipe, runs)
        if runs:
            pipes[task] = task_pipe
    verdicts.save()
    left_out = [task for task in _EDIT_AUTO_PIPELINES if task not in pipes]
    logger.info("edit tasks: this model runs %s%s", " and ".join(pipes) or "none",
                f" (not {' or '.join(left_out)}: its diffusers pipeline does not fit this "
                "model)" if left_out else "")
    return pipes


def _probe(task_pipe: Any, task: str, size: int) -> None:
    """One denoising step of `task` on a blank `size` x `size` image, without CFG."""
    params = call_parameters(task_pipe)
    kwargs: dict[str, Any] = {
        "prompt": "", "image": torch.zeros(1, 3, size, size), "strength": 1.0,
        "num_inference_steps": 1, "guidance_scale": 1.0, "output_type": "pt",
        "height": size, "width": size,
    }
    if task == "inpaint":
        kwargs["mask_image"] = torch.ones(1, 1, size, size)
    with torch.inference_mode():
        task_pipe(**{name: value for name, value in kwargs.items() if name in params})


class _ProbeVerdicts:
    """Whether each edit pipeline ran its probe, cached on disk by a key of everything
    the verdict depends on. Weights are left out: they change numbers, not whether a
    pipeline can run. A cache dir that cannot be read or written only means probing."""

    def __init__(self, pipe: Any, probe_size: int) -> None:
        from diffbatch.pipelines.tiny import cache_dir

        self._verdicts: dict[str, bool] = {}
        self._changed = False
        self._path = None
        key = _verdict_key(pipe, probe_size)
        if key is not None:
            self._path = cache_dir() / "edit_probes" / f"{key}.json"
            with contextlib.suppress(OSError, ValueError, AttributeError):  # unreadable: probe
                self._verdicts = {str(k): bool(v)
                                  for k, v in json.loads(self._path.read_text()).items()}

    def get(self, task_pipe: Any) -> bool | None:
        return self._verdicts.get(type(task_pipe).__qualname__)

    def put(self, task_pipe: Any, runs: bool) -> None:
        self._verdicts[type(task_pipe).__qualname__] = runs
        self._changed = True

    def save(self) -> None:
        """Write the verdicts (atomically: another process may start the same model)."""
        if not self._changed or self._path is None:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self._verdicts, f)
            os.replace(tmp, self._path)
        except OSError as exc:
            logger.debug("edit probe verdicts not cached (%s)", exc)


def _verdict_key(pipe: Any, probe_size: int) -> str | None:
    """A digest of the pipeline's class, its components' classes and configs, the
    library versions, device and dtype; None if a component's config cannot be read."""
    import diffusers
    import transformers

    import diffbatch

    parts: dict[str, Any] = {
        "pipeline": type(pipe).__qualname__, "probe_size": probe_size,
        "versions": [diffbatch.__version__, diffusers.__version__, transformers.__version__,
                     torch.__version__],
        "device": str(getattr(pipe, "device", "")), "dtype": str(getattr(pipe, "dtype", "")),
    }
    try:
        for name, component in sorted(pipe.components.items()):
            config: Any = getattr(component, "config", None)
            if hasattr(config, "to_dict"):  # transformers' configs
                config = config.to_dict()
            elif config is None and component is not None:  # tokenizers, feature extractors
                config = {"vocab": len(component)} if hasattr(component, "__len__") else {}
            parts[name] = [type(component).__qualname__, dict(config or {})]
        text = json.dumps(parts, sort_keys=True, default=str)
    except Exception:  # an unusual component: probe every time rather than guess
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def call_parameters(pipe: Any) -> Any:
    """The parameters of a diffusers pipeline's `__call__`, by name."""
    return inspect.signature(type(pipe).__call__).parameters
