"""Pick the scheduler for a scheduling policy name."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffbatch.sched.grouped import GroupedScheduler
from diffbatch.sched.scheduler import FifoScheduler

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.sched.base import WaveCapacity
    from diffbatch.sched.interface import SchedulerInterface


def make_scheduler(
    config: EngineConfig, clock: Callable[[], float] = time.monotonic,
    capacity_of: WaveCapacity | None = None,
) -> SchedulerInterface:
    """`grouped` (the default): waves from the best compatible group; `fifo`: FIFO waves.

    Waves hold at most `config.capacity_limit` requests, and per key at most what
    `capacity_of(key, num_waiting)` says (the engine's `BatchPolicy.capacity`).
    """
    if config.scheduling_policy == "grouped":
        return GroupedScheduler(
            config.capacity_limit,
            max_head_wait_ms=config.max_head_wait_ms,
            max_wave_pixels=config.max_wave_pixels,
            clock=clock,
            capacity_of=capacity_of,
        )
    return FifoScheduler(config.capacity_limit, capacity_of,
                     max_wave_pixels=config.max_wave_pixels)
