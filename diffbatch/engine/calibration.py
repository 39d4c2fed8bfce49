"""The start-up calibration: seed the cost curve at the model's default shape.

With `max_num_seqs="auto"` (or an "auto" wait), the engine runs a few synthetic
waves through the normal executor path before it serves: sizes 1, 2, 4, ... at the
model's default size, each twice (the faster counts, so a first allocation does
not), until a doubling stops cutting the cost per image by 5%, the size limit is
reached, or the next waves (a doubling's pair, or the re-measure that confirms a
doubling did not pay) would overrun the time budget (`calibration_budget_s`, 10 s
by default). A one-step probe first sets the step count: the model's default,
or fewer when sizes up to about 8 would not fit the budget at it (the curve scales
with steps, so a real model on a CPU is measured at one step).

It also bounds wave sizes by memory: the runner reports its peak memory after each
wave, so the growth per extra image is known, and a wave may use at most
`MEMORY_SHARE` of the memory that was free.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diffbatch.engine.cost_model import MIN_GAIN
from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.engine.batch_policy import BatchPolicy
    from diffbatch.executor.abstract import Executor
    from diffbatch.pipelines.interface import PipelineInfo

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.5  # a wave may use at most this share of the memory free at start-up
REPEATS = 2  # waves per size; the fastest counts


@dataclass
class CalibrationReport:
    """What the calibration measured, for the start-up log."""

    steps: int  # the step count it measured at
    forward_ms: dict[int, float] = field(default_factory=dict)  # wave size -> fastest ms
    memory_limit: int | None = None  # largest wave memory allows; None = not measured
    elapsed_s: float = 0.0
    stop_reason: str = ""  # gain, limit, budget, memory, error

    def describe(self) -> str:
        points = ", ".join(f"B={b}: {ms / b:.1f} ms/img" for b, ms in self.forward_ms.items())
        memory = "" if self.memory_limit is None else f", memory allows B<={self.memory_limit}"
        return (f"{points or 'nothing measured'} at {self.steps} steps in "
                f"{self.elapsed_s:.1f} s (stopped: {self.stop_reason}){memory}")


def calibrate(
    executor: Executor, info: PipelineInfo, policy: BatchPolicy, budget_s: float,
) -> CalibrationReport:
    """Run the calibration waves and feed them to `policy`; see the module docstring."""
    start = time.monotonic()
    # 1. A one-step probe sizes the step count: enough steps to be representative, few
    #    enough that sizes up to ~8 fit the budget (a real model on a CPU gets 1).
    probe = executor.execute_batch(_wave(info, 1, 1))
    probe_ms = max(probe.forward_time_ms, 1e-3)
    spent_ms = probe.forward_time_ms  # forward time so far (the wall clock counts too)
    fit = int(budget_s * 1000.0 / (REPEATS * 8 * probe_ms))
    report = CalibrationReport(steps=max(1, min(info.default_num_inference_steps, fit)))
    peaks: list[tuple[int, int]] = []  # (wave size, peak memory after it)
    free_at_start = probe.free_memory_bytes

    def remaining_ms() -> float:  # the budget left, by the wall clock or forward time
        return budget_s * 1000.0 - max((time.monotonic() - start) * 1000.0, spent_ms)

    size = 1
    while True:
        if size > policy.limit:
            report.stop_reason = "limit"
            break
        expected_ms = _expected_ms(report, size)
        if expected_ms is not None and REPEATS * expected_ms > remaining_ms():
            report.stop_reason = "budget"
            break
        best = None
        for _ in range(REPEATS):
            output = executor.execute_batch(_wave(info, size, report.steps))
            if not all(o.ok for o in output.outputs.values()):
                report.stop_reason = "error"
                break
            spent_ms += output.forward_time_ms
            best = output.forward_time_ms if best is None else min(best, output.forward_time_ms)
            free_at_start = free_at_start or output.free_memory_bytes
            peaks.append((size, output.peak_memory_bytes))
        if report.stop_reason == "error" or best is None:
            break
        report.forward_ms[size] = best
        policy.cost.observe(policy.default_shape, size, report.steps, best)
        memory_limit = _memory_limit(peaks, free_at_start)
        if memory_limit is not None:
            report.memory_limit = memory_limit
            if memory_limit < policy.limit:
                policy.set_limit(memory_limit)
            if size * 2 > memory_limit:
                report.stop_reason = "memory"
                break
        if size > 1 and not _pays(report, size):
            # Confirm before stopping: re-measure both sizes once (a neighbour's burst
            # of work during one of them would otherwise end the ladder early), where
            # the budget still holds both waves.
            if report.forward_ms[size // 2] + report.forward_ms[size] > remaining_ms():
                report.stop_reason = "budget"
                break
            for again in (size // 2, size):
                output = executor.execute_batch(_wave(info, again, report.steps))
                spent_ms += output.forward_time_ms
                report.forward_ms[again] = min(report.forward_ms[again],
                                               output.forward_time_ms)
                policy.cost.observe(policy.default_shape, again, report.steps,
                                    output.forward_time_ms)
            if not _pays(report, size):
                report.stop_reason = "gain"
                break
        size *= 2
    report.elapsed_s = time.monotonic() - start
    return report


def _pays(report: CalibrationReport, size: int) -> bool:
    """Whether doubling to `size` cut the measured cost per image by `MIN_GAIN`."""
    half = size // 2
    return report.forward_ms[size] / size <= (1.0 - MIN_GAIN) * report.forward_ms[half] / half


def _expected_ms(report: CalibrationReport, size: int) -> float | None:
    """A guess of the next wave's time: the last one's, scaled by size (no gain)."""
    if not report.forward_ms:
        return None
    last = max(report.forward_ms)
    return report.forward_ms[last] * size / last


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
