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

import array
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from diffbatch.pipelines.interception.coordinator import wrap_method
from diffbatch.pipelines.interception.fusion import FusionPoint, ModuleCall, Unfusable


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
    # (request copies of one scheduler share its config object: `is` settles most)
    if any(type(s) is not cls or (s.config is not first.config and s.config != first.config)
           for s in schedulers[1:]):
        raise Unfusable("the calls' schedulers differ in class or config")
    names = _parameter_names(cls)  # type: ignore[arg-type]  # (classes hash)
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
def _coefficients(columns: list[list[float]], sizes: list[int], like: torch.Tensor,
                  groups: int = 1) -> list[torch.Tensor]:
    """The columns of per-call values as float32 tensors on `like`'s device, to broadcast
    over samples: call i's value repeated sizes[i] times along the batch dimension.
    With `groups` g, each tensor stacks g columns: [g, sum(sizes), 1, ..., 1];
    otherwise [sum(sizes), 1, ..., 1]. One tensor is made for all (every op counts at a
    tiny model's step time)."""
    flat = [v for column in columns for v, n in zip(column, sizes, strict=True)
            for _ in range(n)]
    per_sample = (sum(sizes),) + (1,) * (like.ndim - 1)
    shape = (len(columns) // groups,) + ((groups,) if groups > 1 else ()) + per_sample
    # from a float32 buffer: half the time of `torch.tensor(list)` (the tensor keeps
    # the array alive)
    values = torch.frombuffer(array.array("f", flat), dtype=torch.float32)
    if like.device.type != "cpu":
        values = values.to(like.device)
    return list(values.view(shape).unbind(0))


def _tolist_once(owner: Any, name: str, values: torch.Tensor) -> Any:
    """`values.tolist()` (a list, or a float for a 0-d tensor), kept on `owner` while
    `values` is the tensor it came from (a schedule read at every step: one conversion
    per scheduler, not one per step)."""
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] is not values:
        cached = (values, values.tolist())
        owner.__dict__[name] = cached
    return cached[1]


def _ddim_step(schedulers: list[Any], bound: list[dict[str, Any]], sizes: list[int],
               model_output: torch.Tensor, sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
    config = schedulers[0].config
    prediction, train_steps = config.prediction_type, config.num_train_timesteps
    if config.thresholding:
        raise Unfusable("DDIM with dynamic thresholding")
    if prediction not in ("epsilon", "sample", "v_prediction"):
        raise Unfusable(f"DDIM prediction type {prediction!r}")
    # the configs are equal, so are the schedules: one list for all
    alphas = _tolist_once(schedulers[0], "_diffbatch_alphas", schedulers[0].alphas_cumprod)
    final = _tolist_once(schedulers[0], "_diffbatch_final_alpha",
                         schedulers[0].final_alpha_cumprod)
    # every call's timestep in one conversion, not one `item()` per call
    timesteps = [values["timestep"] for values in bound]
    if all(isinstance(t, torch.Tensor) and t.ndim == 0 for t in timesteps):
        timesteps = torch.stack(timesteps).tolist()
    # Per call, in double precision: the scheduler's square roots, and x0 and epsilon
    # as linear forms in the sample s and the model output m (x0 = ps*s + pm*m,
    # eps = es*s + em*m), the scheduler's formulas rearranged.
    ps: list[Any]
    pm: list[Any]
    es: list[Any]
    em: list[Any]
    ps, pm, es, em, root_prev, root_prev_b = [], [], [], [], [], []
    for scheduler, values, timestep in zip(schedulers, bound, timesteps, strict=True):
        if values.get("eta", 0.0) or values.get("variance_noise") is not None \
                or values.get("use_clipped_model_output", False):
            raise Unfusable("DDIM with eta > 0, variance noise or clipped model output")
        if scheduler.num_inference_steps is None:
            raise Unfusable("a DDIM scheduler without timesteps set")
        t = int(timestep)
        previous = t - train_steps // scheduler.num_inference_steps
        alpha, alpha_prev = alphas[t], alphas[previous] if previous >= 0 else final
        a, b = math.sqrt(alpha), math.sqrt(1.0 - alpha)
        root_prev.append(math.sqrt(alpha_prev))
        root_prev_b.append(math.sqrt(1.0 - alpha_prev))
        if prediction == "epsilon":
            forms = (1.0 / a, -b / a, 0.0, 1.0)
        elif prediction == "sample":
            forms = (0.0, 1.0, 1.0 / b, -a / b)
        else:  # v_prediction
            forms = (a, -b, b, a)
        for column, value in zip((ps, pm, es, em), forms, strict=True):
            column.append(value)
    dtype = model_output.dtype
    if config.clip_sample:
        p_s, p_m, e_s, e_m, r, q = _coefficients([ps, pm, es, em, root_prev, root_prev_b],
                                                 sizes, sample)
        pred_original = torch.addcmul(p_s * sample, p_m, model_output).clamp(
            -config.clip_sample_range, config.clip_sample_range)
        pred_epsilon = torch.addcmul(e_s * sample, e_m, model_output)
        prev_sample = torch.addcmul(r * pred_original, q, pred_epsilon)
        return prev_sample.to(dtype), pred_original.to(dtype)
    # Unclipped, x_prev = sqrt(a_prev) * x0 + sqrt(1 - a_prev) * eps is a linear form
    # too, so both outputs come from one multiply-add over [2, batch, ...].
    prev_s = [r * p + q * e for r, q, p, e in zip(root_prev, root_prev_b, ps, es, strict=True)]
    prev_m = [r * p + q * e for r, q, p, e in zip(root_prev, root_prev_b, pm, em, strict=True)]
    on_sample, on_output = _coefficients([prev_s, ps, prev_m, pm], sizes, sample, groups=2)
    prev_sample, pred_original = torch.addcmul(on_sample * sample, on_output,
                                               model_output).to(dtype).unbind(0)
    return prev_sample, pred_original


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
        sigmas = _tolist_once(scheduler, "_diffbatch_sigmas", scheduler.sigmas)
        dts.append(sigmas[index + 1] - sigmas[index])
    # as the scheduler does: upcast to float32, one Euler step, cast back
    (dt,) = _coefficients([dts], sizes, sample)
    prev_sample = torch.addcmul(sample.to(torch.float32), dt, model_output)
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
def _parameter_names(cls: Any) -> tuple[str, ...]:
    """The names of `cls.step`'s parameters after `self`, to bind a call's arguments."""
    return tuple(inspect.signature(cls.step).parameters)[1:]
