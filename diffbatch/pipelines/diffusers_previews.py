"""Partial images of a diffusers call: the predicted clean image, decoded by the model's VAE.

`DiffusersPreviews` serves one wave's diffusers call. While the call runs it wraps
the scheduler's `step` (an instance attribute, removed afterwards), and the
adapter's per-step callback (`callback_on_step_end`, or PixArt's older `callback`)
calls `after_step`, which decodes the rows that owe a preview now and hands them to
the wave's `PartialImagePlan` (`partial_images.py`).

NOTE: how x0 is got. The per-step callbacks see the latents only after the scheduler
step, and the noise prediction is not among the tensors they may read, so the
prediction of the clean sample cannot be recovered there. The step wrapper sees the
step's inputs: on a step that owes a preview it runs the scheduler's own step (with
`return_dict=True`, converted back to the tuple the pipeline asked for) and keeps
its `pred_original_sample` where the scheduler reports one (DDIM, DDPM, Euler, LMS,
Heun), else computes x0 from the step's model output and sample: flow matching (SD3,
Flux) `x0 = x_t - sigma_t * v`; schedulers on `alphas_cumprod` (DPM-Solver, PNDM,
UniPC, DEIS) by their prediction type. Other steps call the scheduler untouched, so
a wave's final images do not change with the previews it streams
(tests/pipelines/test_diffusers_previews.py). A scheduler of neither kind gives no
previews (logged once).

NOTE: why the VAE. Decoding x0 with the model's own VAE gives the colours the final
image will have, on every model that has a VAE, with no per-model coefficients (a
latent-to-RGB projection needs a fitted matrix per latent space: the built-in models
have 4, 8 and 16 latent channels). It costs one VAE decode per previewed image
(measured in docs/benchmarks.md), and only the rows that owe a preview are decoded,
so a wave's other requests pay that time but no memory.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffbatch.pipelines.diffusers_edit import call_parameters

if TYPE_CHECKING:
    from diffbatch.pipelines.interface import DiffusionRequestBatch
    from diffbatch.pipelines.partial_images import PartialImagePlan

logger = logging.getLogger(__name__)

_warned: set[str] = set()  # scheduler classes already logged as giving no previews


def predicted_x0(scheduler: Any, model_output: torch.Tensor, timestep: Any,
                 sample: torch.Tensor) -> torch.Tensor | None:
    """x0 from one scheduler step's inputs, called right after the step ran; None for a
    scheduler whose parameterisation is not known here."""
    config = scheduler.config
    prediction = config.get("prediction_type")
    if type(scheduler).__name__.startswith("FlowMatch") or prediction == "flow_prediction":
        index = getattr(scheduler, "step_index", None)
        if index is None or index < 1:
            return None
        sigma = scheduler.sigmas[index - 1].to(sample.device, torch.float32)  # this step's
        return sample.float() - sigma * model_output.float()
    alphas = getattr(scheduler, "alphas_cumprod", None)
    if alphas is None or float(getattr(scheduler, "init_noise_sigma", 1.0)) != 1.0:
        return None  # e.g. Euler-type samplers in sigma space (they report x0 themselves)
    alpha = alphas[int(timestep)].to(sample.device, torch.float32)
    x, out = sample.float(), model_output.float()
    if prediction == "epsilon":
        return (x - (1 - alpha).sqrt() * out) / alpha.sqrt().clamp(min=1e-4)
    if prediction == "v_prediction":
        return alpha.sqrt() * x - (1 - alpha).sqrt() * out
    if prediction == "sample":
        return out
    return None


def decode_latents(pipe: Any, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Latents of the pipeline's latent space as images [k, 3, height, width], float in
    [0, 1] on the CPU, as the pipeline's own decode would give them."""
    vae = pipe.vae
    if hasattr(type(pipe), "_unpack_latents"):  # Flux packs 2x2 latent patches
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    config = vae.config
    scale = config.get("scaling_factor", 1.0) or 1.0
    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is not None and std is not None:  # SDXL-style per-channel statistics
        shape = (1, len(mean), 1, 1)
        mean_t = torch.tensor(mean, device=latents.device).view(shape)
        std_t = torch.tensor(std, device=latents.device).view(shape)
        latents = latents * std_t / scale + mean_t
    else:
        latents = latents / scale + (config.get("shift_factor") or 0.0)
    image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    image = (image.float() / 2 + 0.5).clamp(0, 1)
    if tuple(image.shape[-2:]) != (height, width):  # e.g. PixArt's resolution binning
        image = torch.nn.functional.interpolate(image, size=(height, width), mode="bilinear")
    return image.cpu()


class DiffusersPreviews:
    """The partial images of one wave's diffusers call; see the module docstring."""

    def __init__(self, batch: DiffusionRequestBatch, pipe: Any) -> None:
        self.batch = batch
        self.pipe = pipe
        params = batch.requests[0].sampling_params
        assert params.height is not None and params.width is not None  # resolved
        self.height, self.width = params.height, params.width
        self.plan: PartialImagePlan | None = None
        self._planned = False
        self._num_calls = 0  # scheduler steps run so far in this call
        self._x0: tuple[int, torch.Tensor] | None = None  # (step, x0 [B*n, ...]) last kept

    @classmethod
    def for_wave(cls, batch: DiffusionRequestBatch, pipe: Any) -> DiffusersPreviews | None:
        """The previews of `batch` on `pipe`; None when no request asked for any, or the
        pipeline has no VAE or scheduler to make them with."""
        if batch.on_partial_image is None or not any(
                r.sampling_params.partial_images for r in batch.requests):
            return None
        if getattr(pipe, "vae", None) is None or getattr(pipe, "scheduler", None) is None:
            return None
        return cls(batch, pipe)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Wrap the scheduler's `step` for the duration of the call."""
        scheduler = self.pipe.scheduler
        original = scheduler.step
        signature = inspect.signature(original)

        # functools.wraps keeps `inspect.signature` (pipelines read it to decide whether
        # to pass `eta` and `generator`) what the scheduler's own says.
        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            self._num_calls += 1
            if not self._owes(self._num_calls):
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            as_dict = bound.arguments.get("return_dict", True)
            bound.arguments["return_dict"] = True
            out = original(*bound.args, **bound.kwargs)
            x0 = getattr(out, "pred_original_sample", None)
            if x0 is None:
                x0 = predicted_x0(scheduler, bound.arguments["model_output"],
                                  bound.arguments["timestep"], bound.arguments["sample"])
            if x0 is None:
                _warn_once(scheduler)
            else:
                self._x0 = (self._num_calls, x0)
            return out if as_dict else out.to_tuple()

        scheduler.step = step
        try:
            yield
        finally:
            del scheduler.step  # the class's method again

    def _owes(self, step: int) -> bool:
        if not self._planned:  # the pipeline has set its timesteps by its first step
            self._planned = True
            num_steps = getattr(self.pipe, "_num_timesteps", None) \
                or len(self.pipe.scheduler.timesteps)
            self.plan = self.batch.partial_image_plan(int(num_steps))
        return self.plan is not None and bool(self.plan.rows_at(step))

    def after_step(self, step: int) -> None:
        """Send the previews owed after `step` (1-based steps done), from the per-step
        callback; nothing when none is owed or x0 was not kept at that step."""
        if self.plan is None or self._x0 is None or self._x0[0] != step:
            return
        rows = self.plan.rows_at(step)
        x0 = self._x0[1]
        self._x0 = None
        images = decode_latents(self.pipe, x0[rows], self.height, self.width)
        self.plan.send(step, images)


def _warn_once(scheduler: Any) -> None:
    name = type(scheduler).__name__
    if name not in _warned:
        _warned.add(name)
        logger.info("%s reports no predicted clean sample and its parameterisation is not "
                    "known here: its waves stream no partial images", name)


def step_callbacks(batch: DiffusionRequestBatch, pipe: Any,
                   previews: DiffusersPreviews | None, *, interrupt: bool = True,
                   ) -> dict[str, Any]:
    """The diffusers call's per-step callback: it stops the diffusers loop once nobody
    waits for the wave (with `interrupt`), and sends the partial images owed after the step
    (`diffusers_previews.py`); none when it has neither to do.

    NOTE: the hook raises `WaveInterrupted` rather than setting the pipeline's
    `_interrupt` flag: with the flag, diffusers skips the remaining steps but still
    decodes the latents and returns images nobody wants; raising stops at once, and
    the runner turns it into aborted outputs (never a bisected error).
    """
    def after_step(step: int) -> None:  # `step`: 0-based, as diffusers counts
        if interrupt:
            batch.check_interrupt()
        if previews is not None:
            previews.after_step(step + 1)

    if not interrupt and previews is None:
        return {}
    call_params = call_parameters(pipe)
    if "callback_on_step_end" in call_params:
        def on_step_end(pipe: Any, step: int, timestep: Any,
                        callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            after_step(step)
            return callback_kwargs

        return {"callback_on_step_end": on_step_end}
    if "callback" in call_params and "callback_steps" in call_params:
        # the older per-step hook (PixArt-Sigma): callback(step, timestep, latents)
        return {"callback": lambda step, *_: after_step(step), "callback_steps": 1}
    return {}
