"""One batched scheduler step per tick, for the schedulers whose step is per-sample math.

In step mode every running request steps its own scheduler instance (its own timesteps
and state), so a tick would run one `scheduler.step` per request: a dozen small tensor
operations each, which at a tiny model's step time is a visible share of the tick.
The scheduler's `step` is therefore a fusion point too (`scheduler_point`, wrapped on
each request's own scheduler copy by `wrap_scheduler`), and `fused_scheduler_step`
runs the steps of all the running requests as one computation, with each sample's own
coefficients (its timestep, its schedule), then advances each scheduler's state as its
own `step` would have.

Fused here, when every call is of one of these exact classes with equal configs:
- `DDIMScheduler`, deterministic (eta 0, no thresholding, no variance noise), any
  prediction type, with or without sample clipping;
- `FlowMatchEulerDiscreteScheduler`, not stochastic, without per-token timesteps.

Anything else (another scheduler family, a subclass, an option outside these) raises
`Unfusable`, and `run_fused` runs each request's own `step`: slower, never different.
The math is the schedulers' own, with per-sample coefficients in place of scalars
(tested against the per-request steps, `tests/pipelines/test_scheduler_fusion.py`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from diffbatch.pipelines.step_fusion import FusionPoint, ModuleCall, Unfusable, wrap_method


def scheduler_point() -> FusionPoint:
    """The fusion point of the schedulers' `step` (one per pipeline; `wrap_scheduler`
    installs it on each request's scheduler copy)."""
    return FusionPoint(None, "step", "boundary", "scheduler.step",
                       fuse=fused_scheduler_step)


def wrap_scheduler(point: FusionPoint, scheduler: Any) -> None:
    """Route `scheduler.step` (a request's own scheduler instance) through `point`."""
    wrap_method(point, scheduler)


def fused_scheduler_step(calls: Sequence[ModuleCall]) -> list[Any]:
    """One result per call, as each call's own `scheduler.step` would return it."""
    schedulers = [call.run.__self__ for call in calls]  # type: ignore[attr-defined]
    cls = type(schedulers[0])
    family = _families().get(cls)
    if family is None:
        raise Unfusable(f"no batched step for {cls.__name__}")
    first = schedulers[0]
    if any(type(s) is not cls or s.config != first.config for s in schedulers[1:]):
        raise Unfusable("the calls' schedulers differ in class or config")
    names = _parameter_names(cls)
    bound = []
    for call in calls:
        values = dict(zip(names, call.args, strict=False))
        values.update(call.kwargs)
        bound.append(values)
    model_output = torch.cat([b["model_output"] for b in bound])
    sample = torch.cat([b["sample"] for b in bound])
    sizes = [call.batch_size for call in calls]
    if sample.shape != model_output.shape or sum(sizes) != model_output.shape[0]:
        raise Unfusable("the calls' samples and model outputs do not line up")
    outputs = family.step(schedulers, bound, sizes, model_output, sample)  # tuples of tensors
    results = []
    split = [torch.split(t, sizes) for t in outputs]
    for i, (scheduler, values) in enumerate(zip(schedulers, bound, strict=True)):
        parts = tuple(pieces[i] for pieces in split)
        if values.get("return_dict", True):
            results.append(family.output_type(*parts))
        else:
            results.append(parts)
        family.after_step(scheduler)
    return results


# -- per-sample coefficients -------------------------------------------------------------
def _per_row(columns: list[list[float]], sizes: list[int],
             like: torch.Tensor) -> list[torch.Tensor]:
    """For each column of per-call values, a float32 tensor [sum(sizes), 1, ..., 1] on
    `like`'s device (call i's value repeated sizes[i] times), to broadcast over samples."""
    rows = [[v for v, n in zip(column, sizes, strict=True) for _ in range(n)]
            for column in columns]
    shape = (len(columns), len(rows[0])) + (1,) * (like.ndim - 1)
    return list(torch.tensor(rows, dtype=torch.float32).reshape(shape).to(like.device))


def _ddim_step(schedulers: list[Any], bound: list[dict[str, Any]], sizes: list[int],
               model_output: torch.Tensor, sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
    config = schedulers[0].config
    if config.thresholding:
        raise Unfusable("DDIM with dynamic thresholding")
    timesteps, previous = [], []
    for scheduler, values in zip(schedulers, bound, strict=True):
        if values.get("eta", 0.0) or values.get("variance_noise") is not None \
                or values.get("use_clipped_model_output", False):
            raise Unfusable("DDIM with eta > 0, variance noise or clipped model output")
        if scheduler.num_inference_steps is None:
            raise Unfusable("a DDIM scheduler without timesteps set")
        t = int(values["timestep"])
        timesteps.append(t)
        previous.append(t - config.num_train_timesteps // scheduler.num_inference_steps)
    # the configs are equal, so are the schedules: one lookup for all
    alphas = schedulers[0].alphas_cumprod[torch.tensor(
        timesteps + [max(p, 0) for p in previous])].tolist()
    final = float(schedulers[0].final_alpha_cumprod)
    count = len(timesteps)
    alpha_prev = [a if p >= 0 else final for a, p in zip(alphas[count:], previous, strict=True)]
    # The scheduler's formulas with its scalars per sample; the square roots are taken
    # once per request in double precision (the scheduler takes them in float32).
    root_a = [math.sqrt(a) for a in alphas[:count]]
    root_b = [math.sqrt(1.0 - a) for a in alphas[:count]]
    root_prev = [math.sqrt(a) for a in alpha_prev]
    root_prev_b = [math.sqrt(1.0 - a) for a in alpha_prev]
    a, b, ap, bp = _per_row([root_a, root_b, root_prev, root_prev_b], sizes, sample)
    if config.prediction_type == "epsilon":
        pred_original = (sample - b * model_output) / a
        pred_epsilon = model_output
    elif config.prediction_type == "sample":
        pred_original = model_output
        pred_epsilon = (sample - a * pred_original) / b
    elif config.prediction_type == "v_prediction":
        pred_original = a * sample - b * model_output
        pred_epsilon = a * model_output + b * sample
    else:
        raise Unfusable(f"DDIM prediction type {config.prediction_type!r}")
    if config.clip_sample:
        pred_original = pred_original.clamp(-config.clip_sample_range, config.clip_sample_range)
    prev_sample = torch.addcmul(ap * pred_original, bp, pred_epsilon)
    dtype = model_output.dtype
    return prev_sample.to(dtype), pred_original.to(dtype)


def _flow_match_euler_step(schedulers: list[Any], bound: list[dict[str, Any]],
                           sizes: list[int], model_output: torch.Tensor,
                           sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if schedulers[0].config.stochastic_sampling:
        raise Unfusable("stochastic flow-match sampling")
    dts = []
    for scheduler, values in zip(schedulers, bound, strict=True):
        timestep = values["timestep"]
        if values.get("per_token_timesteps") is not None or isinstance(timestep, int) \
                or (isinstance(timestep, torch.Tensor) and not timestep.is_floating_point()):
            raise Unfusable("per-token or integer timesteps")  # its own step says why
        if scheduler.step_index is None:
            scheduler._init_step_index(timestep)
        index = scheduler.step_index
        dts.append(float(scheduler.sigmas[index + 1]) - float(scheduler.sigmas[index]))
    # as the scheduler does: upcast to float32, one Euler step, cast back
    (dt,) = _per_row([dts], sizes, sample)
    prev_sample = sample.to(torch.float32) + dt * model_output
    return (prev_sample.to(model_output.dtype),)


def _advance_step_index(scheduler: Any) -> None:
    scheduler._step_index += 1


def _nothing(scheduler: Any) -> None:
    pass


class _Family(NamedTuple):
    step: Callable[..., tuple[torch.Tensor, ...]]  # the batched step: output tensors
    output_type: Callable[..., Any]  # what `step(return_dict=True)` returns
    after_step: Callable[[Any], None]  # the state change of one step, per scheduler


@functools.cache
def _families() -> dict[type, _Family]:
    """The exact scheduler classes with a batched step (imported on first use)."""
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
    from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteSchedulerOutput,
    )
    return {
        DDIMScheduler: _Family(_ddim_step, DDIMSchedulerOutput, _nothing),
        FlowMatchEulerDiscreteScheduler: _Family(
            _flow_match_euler_step, FlowMatchEulerDiscreteSchedulerOutput,
            _advance_step_index),
    }


@functools.cache
def _parameter_names(cls: type) -> tuple[str, ...]:
    """The names of `cls.step`'s parameters after `self`, to bind a call's arguments."""
    return tuple(inspect.signature(cls.step).parameters)[1:]
