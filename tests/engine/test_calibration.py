"""The start-up calibration, on an executor whose waves take synthetic times."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from diffbatch.config import EngineConfig
from diffbatch.engine.batch_policy import BatchPolicy
from diffbatch.engine.calibration import calibrate
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput
from diffbatch.pipelines.interface import PipelineInfo

INFO = PipelineInfo(name="P", default_height=64, default_width=64,
                    default_num_inference_steps=20, default_guidance_scale=5.0,
                    size_multiple=8)
MiB = 1 << 20


class SyntheticExecutor:
    """Forward ms = (fixed + per_image * B) * steps; memory grows per image."""

    def __init__(self, fixed_ms=10.0, per_image_ms=1.0, per_image_bytes=MiB,
                 free_bytes=1 << 40) -> None:
        self.fixed_ms, self.per_image_ms = fixed_ms, per_image_ms
        self.per_image_bytes, self.free_bytes = per_image_bytes, free_bytes
        self.waves: list[tuple[int, int]] = []  # (size, steps) of every wave run

    def execute_batch(self, wave):
        size = wave.num_requests
        steps = wave.requests[0].sampling_params.num_inference_steps
        self.waves.append((size, steps))
        return BatchRunnerOutput(
            outputs={r.request_id: DiffusionOutput(r.request_id) for r in wave.requests},
            forward_time_ms=(self.fixed_ms + self.per_image_ms * size) * steps,
            peak_memory_bytes=100 * MiB + size * self.per_image_bytes,
            free_memory_bytes=self.free_bytes,
        )

    def submit_batch(self, wave, *, stall_after_s=None):
        future = Future()
        future.set_result(self.execute_batch(wave))
        return future

    def cancel(self, future):
        pass


def policy(**options) -> BatchPolicy:
    return BatchPolicy(EngineConfig.from_options(model="fake", **options), INFO,
                       supports_request_batch=True)


def test_stops_where_doubling_stops_paying():
    p = policy()
    executor = SyntheticExecutor(fixed_ms=0.5, per_image_ms=1.0)  # 0.5 + B per step
    report = calibrate(executor, INFO, p, budget_s=1000.0)
    assert report.stop_reason == "gain"
    assert report.steps == 20  # the model's default: it fits the budget
    assert sorted(report.forward_ms) == [1, 2, 4, 8, 16]
    assert p.cost.capacity(p.default_shape) == 8  # 8 -> 16 cut the cost per image < 5%
    runs = {b: executor.waves.count((b, 20)) for b in report.forward_ms}
    # each size beside the one below it: 3 waves as the new size, 3 as the size below
    assert runs == {1: 6, 2: 6, 4: 6, 8: 6, 16: 3}


def test_sizes_alternate_so_no_size_is_measured_only_in_one_stretch():
    executor = SyntheticExecutor(fixed_ms=0.5, per_image_ms=1.0)
    calibrate(executor, INFO, policy(), budget_s=1000.0)
    sizes = [b for b, _ in executor.waves[1:]]  # (after the one-step probe)
    assert sizes[:9] == [1, 1, 1, 2, 1, 1, 2, 2, 1]


def test_the_limit_and_memory_bound_the_sizes():
    p = policy(max_num_seqs_limit=4)
    report = calibrate(SyntheticExecutor(per_image_ms=0.0), INFO, p, budget_s=1000.0)
    assert report.stop_reason == "limit" and max(report.forward_ms) == 4
    tight = policy()  # 1 GiB free, 100 MiB per image: half the free memory holds 5
    report = calibrate(SyntheticExecutor(per_image_ms=0.0, per_image_bytes=100 * MiB,
                                         free_bytes=1 << 30), INFO, tight, budget_s=1000.0)
    assert report.memory_limit == 5 and report.stop_reason == "memory"
    assert tight.limit == 5 and tight.capacity(None) == 5


def test_a_slow_model_is_measured_at_fewer_steps_within_the_budget():
    p = policy()
    executor = SyntheticExecutor(fixed_ms=500.0, per_image_ms=100.0)  # 600 ms per step
    report = calibrate(executor, INFO, p, budget_s=10.0)
    assert executor.waves[0] == (1, 1)  # the one-step probe
    assert report.steps == 1  # 20 steps would take 12 s for one wave
    assert report.stop_reason == "budget"
    spent_ms = sum((500.0 + 100.0 * b) * s for b, s in executor.waves)
    assert spent_ms <= 10_000.0
    assert p.cost.estimate_ms(p.default_shape, 1, 20) == pytest.approx(600.0 * 20)


@pytest.mark.parametrize("budget_s", [0.2, 0.7, 1.5, 3.0])
def test_no_wave_starts_that_would_end_past_the_budget(budget_s):
    executor = SyntheticExecutor(fixed_ms=0.5, per_image_ms=1.0)
    report = calibrate(executor, INFO, policy(), budget_s=budget_s)
    spent_ms = sum((0.5 + 1.0 * b) * s for b, s in executor.waves)
    assert spent_ms <= 1000.0 * budget_s
    assert report.stop_reason in ("budget", "gain")


def test_a_wave_running_at_the_deadline_is_cancelled():
    """The budget is a bound, not a hint: a wave that runs on past it (a neighbour took
    the CPUs) is cancelled, and calibration returns at the deadline."""

    class Stalling(SyntheticExecutor):
        def __init__(self):
            super().__init__(fixed_ms=1.0, per_image_ms=1.0)
            self.cancelled = threading.Event()

        def submit_batch(self, wave, *, stall_after_s=None):
            if len(self.waves) < 4:
                return super().submit_batch(wave)
            self.waves.append((wave.num_requests, 0))
            future = Future()  # this one never ends on its own
            threading.Thread(target=lambda: self.cancelled.wait(5.0) and future.set_result(
                self.execute_batch(wave)), daemon=True).start()
            return future

        def cancel(self, future):
            self.cancelled.set()

    executor = Stalling()
    start = time.monotonic()
    report = calibrate(executor, INFO, policy(), budget_s=0.5)
    assert executor.cancelled.is_set()
    assert report.stop_reason == "budget"
    assert time.monotonic() - start < 2.0  # the deadline, not the 5 s the wave would take


@pytest.mark.parametrize("factor", [10.0, 0.1])
def test_one_bad_sample_at_two_does_not_move_the_capacity(factor):
    """One wave of size 2 hit a neighbour's burst of work (or ran alone while the rest
    shared the CPUs): the capacity is the one the clean curve gives."""

    class OneBadSample(SyntheticExecutor):
        def execute_batch(self, wave):
            out = super().execute_batch(wave)
            if wave.num_requests == 2 and self.waves.count((2, 20)) == 1:
                out.forward_time_ms *= factor
            return out

    clean = policy()
    calibrate(SyntheticExecutor(fixed_ms=0.5, per_image_ms=1.0), INFO, clean, budget_s=1000.0)
    noisy = policy()
    calibrate(OneBadSample(fixed_ms=0.5, per_image_ms=1.0), INFO, noisy, budget_s=1000.0)
    assert noisy.cost.capacity(noisy.default_shape) == \
        clean.cost.capacity(clean.default_shape) == 8


def test_a_busy_stretch_does_not_end_the_ladder():
    """Two of the three waves of size 2 hit a neighbour's burst of work: not evidence
    that 2 costs more per image, so the ladder goes on."""

    class Spiky(SyntheticExecutor):
        def execute_batch(self, wave):
            out = super().execute_batch(wave)
            if self.waves.count((2, 20)) in (1, 2) and wave.num_requests == 2:
                out.forward_time_ms *= 10
            return out

    p = policy()
    report = calibrate(Spiky(fixed_ms=0.5, per_image_ms=1.0), INFO, p, budget_s=1000.0)
    assert max(report.forward_ms) == 16 and p.cost.capacity(p.default_shape) == 8
