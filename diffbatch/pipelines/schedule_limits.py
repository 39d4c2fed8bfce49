"""The most denoising steps a model's scheduler can schedule.

Requests may ask for up to `MAX_NUM_INFERENCE_STEPS` steps, but a scheduler config can
stop short of that: SD 1.x's DDIM ("leading" spacing, `steps_offset` 1) makes a first
timestep of 1000 at 1000 steps, one past its 1000-entry schedule, and its `step`
raises an IndexError mid-wave. `schedulable_steps` finds such a limit once, at load,
on copies of the scheduler, so that admission refuses the request with a 400 naming
it (`PipelineInfo.max_inference_steps`) instead of a wave failing with a 500.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from diffbatch.sampling_params import MAX_NUM_INFERENCE_STEPS

logger = logging.getLogger(__name__)

SEARCH = 64  # step counts tried below the bound before giving up (then: no limit known)


def schedulable_steps(scheduler: Any, limit: int = MAX_NUM_INFERENCE_STEPS) -> int | None:
    """The largest step count <= `limit` whose first and last steps the scheduler runs;
    None when `limit` itself runs, or when the scheduler cannot be probed this way (its
    `set_timesteps` needs the pipeline's own arguments, e.g. Flux's shift `mu`)."""
    for steps in range(limit, max(limit - SEARCH, 0), -1):
        verdict = _runs(scheduler, steps)
        if verdict is None:
            return None
        if verdict:
            return None if steps == limit else steps
    logger.warning("%s cannot run %d to %d steps; no step limit is known for it",
                   type(scheduler).__name__, limit - SEARCH + 1, limit)
    return None


def _runs(scheduler: Any, steps: int) -> bool | None:
    """Whether a copy of `scheduler` set to `steps` steps runs its first and its last
    step on a dummy sample; None: it cannot be set to `steps` without the pipeline."""
    try:
        probe = copy.deepcopy(scheduler)
        probe.set_timesteps(steps)
        timesteps = list(probe.timesteps)
    except Exception:
        return None
    if not timesteps:
        return False
    sample = torch.zeros(1, 4, 8, 8)
    for timestep in (timesteps[0], timesteps[-1]):
        trial = copy.deepcopy(probe)
        try:
            scaled = trial.scale_model_input(sample, timestep) \
                if hasattr(trial, "scale_model_input") else sample
            trial.step(torch.zeros_like(scaled), timestep, scaled)
        except Exception:
            return False
    return True
