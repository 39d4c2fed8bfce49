"""The most steps a scheduler config can schedule, found by trying copies of it."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
)

from diffbatch.pipelines.schedule_limits import schedulable_steps


def test_sd1_ddim_stops_one_short_of_a_thousand_and_its_limit_runs_to_the_end() -> None:
    scheduler = DDIMScheduler(steps_offset=1, timestep_spacing="leading")
    assert schedulable_steps(scheduler) == 999
    original = copy.deepcopy(scheduler)
    with pytest.raises(IndexError):  # what a wave of 1000 steps met
        original.set_timesteps(1000)
        original.step(torch.zeros(1, 4, 8, 8), original.timesteps[0], torch.zeros(1, 4, 8, 8))
    original.set_timesteps(999)
    sample = torch.zeros(1, 4, 8, 8)
    for t in original.timesteps:  # the whole schedule runs
        sample = original.step(torch.zeros_like(sample), t, sample).prev_sample
    assert scheduler.config.steps_offset == 1 and scheduler.num_inference_steps is None


@pytest.mark.parametrize("scheduler", [
    DDIMScheduler(), DDIMScheduler(timestep_spacing="trailing"), DPMSolverMultistepScheduler(),
    FlowMatchEulerDiscreteScheduler(),
], ids=lambda s: f"{type(s).__name__}-{s.config.get('timestep_spacing')}")
def test_schedulers_that_reach_the_bound_have_no_limit(scheduler) -> None:
    assert schedulable_steps(scheduler) is None


def test_a_scheduler_that_needs_the_pipelines_arguments_is_not_limited() -> None:
    # Flux's dynamic shifting: set_timesteps needs `mu`, which only the pipeline knows
    assert schedulable_steps(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)) is None


def test_a_lower_bound_and_another_family() -> None:
    assert schedulable_steps(PNDMScheduler(steps_offset=1, skip_prk_steps=True)) == 999
    assert schedulable_steps(DDIMScheduler(steps_offset=1), limit=500) is None
