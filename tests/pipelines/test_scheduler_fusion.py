"""Step mode's batched scheduler step equals each request's own `scheduler.step`.

Each request has its own scheduler (its own step count, its own place in it); the
batched step must give every request what its own step gives and leave every
scheduler in the state its own step would. What it cannot batch runs per request.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
)

from diffbatch.pipelines.interception import Coordinator, ModuleCall, Unfusable, run_fused
from diffbatch.pipelines.interception.scheduler_fusion import (
    fused_scheduler_step,
    scheduler_point,
    wrap_scheduler,
)

STEP_COUNTS = [4, 8, 20, 3]  # one scheduler per request, each at its own step


def make_calls(template: Any, images_per_request: list[int], position: int = 1,
               **step_kwargs: Any) -> list[ModuleCall]:
    """One `scheduler.step` call per request, each on its own copy of `template`,
    with its own step count, at its own step (request i at step `position + i`,
    clipped to its last one, so the final step, whose previous timestep is below 0,
    is covered)."""
    point = scheduler_point()
    calls = []
    for i, n in enumerate(images_per_request):
        scheduler = copy.deepcopy(template)
        steps = STEP_COUNTS[i % len(STEP_COUNTS)]
        scheduler.set_timesteps(steps)
        index = min(position + i, steps - 1)
        if hasattr(scheduler, "_step_index"):
            scheduler._step_index = index
        generator = torch.Generator().manual_seed(i)
        model_output = torch.randn(n, 4, 8, 8, generator=generator)
        sample = torch.randn(n, 4, 8, 8, generator=generator)
        calls.append(ModuleCall(point, scheduler.step,
                                (model_output, scheduler.timesteps[index], sample),
                                dict(step_kwargs)))
    return calls


def own_steps(calls: list[ModuleCall]) -> tuple[list[Any], list[Any]]:
    """Each call run by its own scheduler (on copies); the results and the copies."""
    results, schedulers = [], []
    for call in calls:
        scheduler = copy.deepcopy(call.run.__self__)
        results.append(scheduler.step(*call.args, **call.kwargs))
        schedulers.append(scheduler)
    return results, schedulers


def tensors(result: Any) -> list[torch.Tensor]:
    return list(result.values() if isinstance(result, dict) else result)


def assert_same_results(fused: list[Any], own: list[Any]) -> None:
    assert len(fused) == len(own)
    for got, want in zip(fused, own, strict=True):
        assert type(got) is type(want)
        for a, b in zip(tensors(got), tensors(want), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("clip_sample", [False, True])
def test_ddim_batched_step_equals_each_requests_own_step(prediction_type: str,
                                                         clip_sample: bool) -> None:
    template = DDIMScheduler(prediction_type=prediction_type, clip_sample=clip_sample,
                             set_alpha_to_one=False, steps_offset=1)
    for position in (0, 2, 30):  # first steps, middle, every request at its last step
        calls = make_calls(template, [1, 2, 1, 2, 1], position,
                           eta=0.0, generator=None, return_dict=False)
        own, _ = own_steps(calls)
        assert_same_results(fused_scheduler_step(calls), own)


def test_ddim_batched_step_returns_the_output_type_when_asked_for_a_dict() -> None:
    calls = make_calls(DDIMScheduler(), [1, 1, 2])
    fused = fused_scheduler_step(calls)
    own, _ = own_steps(calls)
    assert all(type(r).__name__ == "DDIMSchedulerOutput" for r in fused)
    assert_same_results(fused, own)


def test_flow_match_batched_step_equals_own_steps_and_advances_each_scheduler() -> None:
    template = FlowMatchEulerDiscreteScheduler(shift=3.0)
    calls = make_calls(template, [2, 1, 1, 2, 1], return_dict=False)
    calls[1].run.__self__._step_index = None  # a first step: the scheduler finds its index
    own, own_schedulers = own_steps(calls)
    fused = fused_scheduler_step(calls)
    assert_same_results(fused, own)
    for call, scheduler in zip(calls, own_schedulers, strict=True):
        assert call.run.__self__.step_index == scheduler.step_index


@pytest.mark.parametrize("case", ["eta", "another family", "configs differ", "stochastic"])
def test_what_cannot_be_batched_is_refused_and_runs_per_request_unchanged(case: str) -> None:
    kwargs: dict[str, Any] = {"return_dict": False}
    if case == "eta":
        template: Any = DDIMScheduler()
        kwargs["eta"] = 0.5
        kwargs["variance_noise"] = torch.zeros(1, 4, 8, 8)
    elif case == "another family":
        template = DPMSolverMultistepScheduler()
    elif case == "stochastic":
        template = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)
    else:
        template = DDIMScheduler()
    calls = make_calls(template, [1, 1, 1], **kwargs)
    if case == "configs differ":
        other = DDIMScheduler(prediction_type="v_prediction")
        other.set_timesteps(STEP_COUNTS[2])
        calls[2] = ModuleCall(calls[2].point, other.step, calls[2].args, calls[2].kwargs)
    with pytest.raises(Unfusable):
        fused_scheduler_step(calls)
    own, own_schedulers = own_steps(calls)
    if case == "stochastic":  # random: compare the state, not the samples
        outcomes = run_fused(calls)
        assert all(ok for ok, _ in outcomes)
    else:
        outcomes = run_fused(calls)
        assert_same_results([value for _ok, value in outcomes], own)
    for call, scheduler in zip(calls, own_schedulers, strict=True):  # stepped once each
        assert getattr(call.run.__self__, "step_index", None) == \
            getattr(scheduler, "step_index", None)


def test_a_wrapped_scheduler_hands_its_step_to_the_coordinator_only_in_a_request() -> None:
    point = scheduler_point()
    scheduler = DDIMScheduler()
    scheduler.set_timesteps(4)
    wrap_scheduler(point, scheduler)
    wrap_scheduler(point, scheduler)  # twice is harmless
    # pipelines read the signature to decide whether to pass `eta` and `generator`
    assert inspect.signature(scheduler.step) == inspect.signature(DDIMScheduler().step)
    args = (torch.randn(1, 4, 8, 8), scheduler.timesteps[0], torch.randn(1, 4, 8, 8))
    direct = scheduler.step(*args, return_dict=False)  # outside a request: runs
    assert isinstance(direct, tuple)
    handed = Coordinator().start(lambda: scheduler.step(*args, return_dict=False)).pending
    assert isinstance(handed, ModuleCall) and handed.point is point
    assert handed.run(*handed.args, **handed.kwargs)[0].equal(direct[0])
    assert DDIMScheduler().step is not scheduler.step  # the class is untouched
