"""The start-up calibration: seed the cost curve at the model's default shape.

With `max_num_seqs="auto"` (or an "auto" wait), the engine runs a few synthetic
waves through the normal executor path before it serves, at the model's default
size: sizes 1, 2, 4, ..., each new size measured `REPEATS` times in waves that
alternate with the size below it, so a neighbour's burst of work lands on both
sizes rather than on one. Every wave teaches the cost curve, whose capacity rule
compares medians and asks for evidence beyond the measured spread before it calls a
doubling not worth it (`diffbatch.engine.cost_model`). The ladder stops at the first
of: the curve has that evidence against the newest size ("gain"), the size limit,
memory, or the time budget.

The budget (`calibration_budget_s`, 10 s by default) is a bound: a wave starts only
if it is expected to end within it (expected at the slowest time measured per image,
with no gain for a new size), and a wave still running at the deadline is cancelled
(the runner stops it at its next denoising step). A one-step probe first sets the
step count: the model's default, or fewer when the ladder up to about 8 would not
fit the budget at it (the curve scales with steps, so a real model on a CPU is
measured at one step).

It also bounds wave sizes by memory: the runner reports its peak memory after each
wave, so the growth per extra image is known, and a wave may use at most
`MEMORY_SHARE` of the memory that was free.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.engine.batch_policy import BatchPolicy
    from diffbatch.executor.abstract import Executor
    from diffbatch.outputs import BatchRunnerOutput
    from diffbatch.pipelines.interface import PipelineInfo

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.5  # a wave may use at most this share of the memory free at start-up
REPEATS = 3  # waves per size, each beside one of the size below
# probe-wave units the ladder up to 8 takes: REPEATS x (1 + (2 + 1) + (4 + 2) + (8 + 4))
_LADDER_TO_8 = REPEATS * 22
_CANCEL_GRACE_S = 5.0  # a cancelled wave ends at its next step; wait this long for it


@dataclass
class CalibrationReport:
    """What the calibration measured, for the start-up log."""

    steps: int  # the step count it measured at
    forward_ms: dict[int, float] = field(default_factory=dict)  # wave size -> median ms
    memory_limit: int | None = None  # largest wave memory allows; None = not measured
    elapsed_s: float = 0.0
    stop_reason: str = ""  # gain, limit, budget, memory, error

    def describe(self) -> str:
        points = ", ".join(f"B={b}: {ms / b:.1f} ms/img" for b, ms in self.forward_ms.items())
        memory = "" if self.memory_limit is None else f", memory allows B<={self.memory_limit}"
        return (f"{points or 'nothing measured'} at {self.steps} steps in "
                f"{self.elapsed_s:.1f} s (stopped: {self.stop_reason}){memory}")


class _Ladder:
    """The waves of one calibration, within its budget; see the module docstring."""

    def __init__(self, executor: Executor, info: PipelineInfo, policy: BatchPolicy,
                 budget_s: float) -> None:
        self.executor, self.info, self.policy = executor, info, policy
        self.start = time.monotonic()
        self.budget_ms = budget_s * 1000.0
        self.spent_ms = 0.0  # forward time so far (the wall clock counts too)
        # wave size -> the slowest ms per image of its waves, wall clock or forward
        self.slowest_ms_per_image: dict[int, float] = {}
        self.samples: dict[int, list[float]] = {}  # wave size -> forward ms
        self.peaks: list[tuple[int, int]] = []  # (wave size, peak memory after it)
        self.free_bytes = 0
        self.out_of_time = False  # a wave was cancelled at the deadline

    def remaining_ms(self) -> float:
        return self.budget_ms - max((time.monotonic() - self.start) * 1000.0, self.spent_ms)

    def fits(self, size: int) -> bool:
        """Whether a wave of `size` is expected to end within the budget: at the slowest
        cost per image of the largest size measured up to it (no gain beyond it)."""
        known = [b for b in self.slowest_ms_per_image if b <= size] or [0]
        return size * self.slowest_ms_per_image.get(max(known), 0.0) <= self.remaining_ms()

    def run(self, size: int, steps: int) -> BatchRunnerOutput | None:
        """One wave; None when it failed or the budget ran out under it (cancelled)."""
        began = time.monotonic()
        future = self.executor.submit_batch(_wave(self.info, size, steps))
        try:
            output = future.result(timeout=max(0.0, self.remaining_ms() / 1000.0))
        except FutureTimeout:
            self.out_of_time = True
            self.executor.cancel(future)
            with contextlib.suppress(Exception):  # cancelled: its result is not used
                future.result(timeout=_CANCEL_GRACE_S)
            return None
        wall_ms = (time.monotonic() - began) * 1000.0
        self.spent_ms += output.forward_time_ms
        self.slowest_ms_per_image[size] = max(self.slowest_ms_per_image.get(size, 0.0),
                                              max(wall_ms, output.forward_time_ms) / size)
        if not all(o.ok for o in output.outputs.values()):
            return None
        self.free_bytes = self.free_bytes or output.free_memory_bytes
        self.peaks.append((size, output.peak_memory_bytes))
        return output

    def measure(self, size: int, steps: int) -> str | None:
        """One wave of `size` taught to the curve; the stop reason if it did not run."""
        if not self.fits(size):
            return "budget"
        output = self.run(size, steps)
        if output is None:
            return "budget" if self.out_of_time else "error"
        self.samples.setdefault(size, []).append(output.forward_time_ms)
        self.policy.cost.observe(self.policy.default_shape, size, steps,
                                 output.forward_time_ms)
        return None


def calibrate(
    executor: Executor, info: PipelineInfo, policy: BatchPolicy, budget_s: float,
) -> CalibrationReport:
    """Run the calibration waves and feed them to `policy`; see the module docstring."""
    ladder = _Ladder(executor, info, policy, budget_s)
    report = CalibrationReport(steps=1)
    # 1. A one-step probe sizes the step count: enough steps to be representative, few
    #    enough that the ladder up to ~8 fits the budget (a real model on a CPU gets 1).
    probe = ladder.run(1, 1)
    if probe is None:
        report.stop_reason = "budget" if ladder.out_of_time else "error"
        report.elapsed_s = time.monotonic() - ladder.start
        return report
    fit = int(ladder.budget_ms / (_LADDER_TO_8 * max(probe.forward_time_ms, 1e-3)))
    report.steps = steps = max(1, min(info.default_num_inference_steps, fit))
    ladder.slowest_ms_per_image[1] *= steps  # the probe ran one step
    # 2. The ladder: size 1 alone, then each doubling beside the size below it.
    size, stop = 1, None
    while stop is None:
        if size > policy.limit:
            stop = "limit"
            break
        half = size // 2
        for repeat in range(REPEATS):
            order = (size,) if not half else (size, half) if repeat % 2 == 0 else (half, size)
            for b in order:
                stop = ladder.measure(b, steps)
                if stop:
                    break
            if stop:
                break
        if size not in ladder.samples:
            break
        memory_limit = _memory_limit(ladder.peaks, ladder.free_bytes)
        if memory_limit is not None:
            report.memory_limit = memory_limit
            if memory_limit < policy.limit:
                policy.set_limit(memory_limit)
            if size * 2 > memory_limit:
                stop = stop or "memory"
        if stop is None and policy.cost.capacity(policy.default_shape, steps) < size:
            stop = "gain"  # evidence beyond the spread that this doubling does not pay
        size *= 2
    report.stop_reason = stop or ""
    report.forward_ms = {b: statistics.median(ms) for b, ms in sorted(ladder.samples.items())}
    report.elapsed_s = time.monotonic() - ladder.start
    return report


def _memory_limit(peaks: list[tuple[int, int]], free_bytes: int) -> int | None:
    """The largest wave that fits `MEMORY_SHARE` of the free memory, from the peak
    memory's growth per extra image; None while it cannot be told."""
    if free_bytes <= 0 or len({size for size, _ in peaks}) < 2:
        return None
    (small, low), (large, high) = min(peaks), max(peaks)
    per_image = max(high - low, 0) / max(large - small, 1)
    if per_image <= 0:
        return None
    return max(1, int(MEMORY_SHARE * free_bytes / per_image))


def _wave(info: PipelineInfo, size: int, steps: int) -> SchedulerOutput:
    """A wave of `size` synthetic requests at the model's default shape."""
    params = SamplingParams(
        height=info.default_height, width=info.default_width, num_inference_steps=steps,
        guidance_scale=info.default_guidance_scale,
    )
    key = SamplingParamsKey.from_params(
        params, cfg_enabled=info.cfg_enabled(params),
        per_request_guidance=info.supports_per_request_guidance,
    )
    requests = []
    for i in range(size):
        request = DiffusionRequest(f"calibration-{uuid.uuid4().hex[:8]}-{i}",
                                   f"calibration image {i}", params.clone(seed=i))
        request.key = key
        requests.append(request)
    return SchedulerOutput(wave_id=0, requests=requests, key=key, close_reason="calibration")


__all__ = ["CalibrationReport", "calibrate"]
