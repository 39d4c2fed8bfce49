"""Pick the scheduler for a scheduling policy name."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffbatch.sched.grouped import GroupedScheduler
from diffbatch.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.sched.interface import SchedulerInterface


def make_scheduler(
    config: EngineConfig, clock: Callable[[], float] = time.monotonic
) -> SchedulerInterface:
    """`fifo`: conservative FIFO waves (the default); `grouped`: best compatible group."""
    if config.scheduling_policy == "grouped":
        return GroupedScheduler(
            config.max_num_seqs,
            max_head_wait_ms=config.max_head_wait_ms,
            max_wave_pixels=config.max_wave_pixels,
            clock=clock,
        )
    return Scheduler(config.max_num_seqs)
