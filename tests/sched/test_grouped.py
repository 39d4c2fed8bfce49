"""The `grouped` scheduler: no head-of-line blocking, no starvation, pixel cap, priority."""

from __future__ import annotations

import pytest

from diffbatch import (
    BatchRunnerOutput,
    DiffusionOutput,
    DiffusionRequest,
    RequestStatus,
    SamplingParams,
    SamplingParamsKey,
)
from diffbatch.sched.grouped import GroupedScheduler
from tests.clock import ManualClock


def make_request(rid: str, size: int = 64, priority: int = 0, arrival: float = 1000.0,
                 n: int = 1) -> DiffusionRequest:
    params = SamplingParams(height=size, width=size, num_inference_steps=2,
                            guidance_scale=5.0, seed=0, num_outputs_per_prompt=n)
    request = DiffusionRequest(rid, "p", params, arrival_time=arrival, priority=priority)
    request.key = SamplingParamsKey.from_params(params, cfg_enabled=True)
    return request


def finish(sched, wave) -> None:
    sched.update_from_output(wave, BatchRunnerOutput(
        {r.request_id: DiffusionOutput(r.request_id, images=[1]) for r in wave.requests}))


def run_all(sched) -> list[list[str]]:
    waves = []
    while not (wave := sched.schedule()).is_empty:
        waves.append(wave.req_ids)
        finish(sched, wave)
    return waves


def test_looks_past_an_incompatible_head():
    sched = GroupedScheduler(3, clock=ManualClock(1000.0))
    for rid, size in [("A", 64), ("B", 128), ("C", 64), ("D", 64)]:
        sched.add_request(make_request(rid, size))
    assert run_all(sched) == [["A", "C", "D"], ["B"]]


def test_a_steady_stream_cannot_starve_a_different_group():
    clock = ManualClock(1000.0)
    sched = GroupedScheduler(2, max_head_wait_ms=100, clock=clock)
    sched.add_request(make_request("big", 128, arrival=clock.now, priority=1))
    waves, i = [], 0
    # 64² requests with better priority keep arriving, 2 per 30 ms wave
    while "big" not in [r for w in waves for r in w]:
        for _ in range(2):
            sched.add_request(make_request(f"s{i}", 64, arrival=clock.now))
            i += 1
        wave = sched.schedule()
        waves.append(wave.req_ids)
        if "big" in wave.req_ids:
            assert wave.close_reason == "starvation"
        finish(sched, wave)
        clock.now += 0.030
        assert len(waves) < 100
    # served by the first wave after it waited > 100 ms: within max_head_wait + one wave
    assert len(waves) == 5  # scheduled at t = 120 ms


def test_pixel_cap_splits_waves():
    sched = GroupedScheduler(8, max_wave_pixels=3 * 64 * 64, clock=ManualClock(1000.0))
    for i in range(7):
        sched.add_request(make_request(f"r{i}"))
    waves = []
    while not (wave := sched.schedule()).is_empty:
        waves.append((len(wave.requests), wave.close_reason))
        finish(sched, wave)
    assert waves == [(3, "pixel_cap"), (3, "pixel_cap"), (1, "group_empty")]
    # a single request larger than the cap still runs, alone
    sched.add_request(make_request("huge", 128))
    assert sched.schedule().req_ids == ["huge"]


def test_priorities_order_groups_and_equal_priority_keeps_arrival_order():
    sched = GroupedScheduler(4, clock=ManualClock(1000.0))
    sched.add_request(make_request("low-64", 64, priority=5))
    sched.add_request(make_request("hi-128", 128, priority=0))
    sched.add_request(make_request("mid-256", 256, priority=1))
    sched.add_request(make_request("hi2-128", 128, priority=0))
    sched.add_request(make_request("low2-64", 64, priority=5))
    assert run_all(sched) == [["hi-128", "hi2-128"], ["mid-256"], ["low-64", "low2-64"]]


def test_abort_in_grouped_queue():
    sched = GroupedScheduler(4, clock=ManualClock(1000.0))
    for rid in "abc":
        sched.add_request(make_request(rid))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert run_all(sched) == [["b", "c"]]
    assert sched.num_waiting == 0 and sched.requests == {}


def test_schedule_stays_cheap_with_ten_thousand_waiting():
    sched = GroupedScheduler(8, clock=ManualClock(1000.0))
    sizes = [64, 128, 256, 512]
    for i in range(10_000):
        sched.add_request(make_request(f"r{i}", sizes[i % 4]))
    adds = sched.num_heap_ops
    wave = sched.schedule()
    assert len(wave.requests) == 8
    work = sched.num_heap_ops - adds
    # a full sort would be ~10,000 * log2(10,000) ~ 130,000 operations; we pop ~a wave.
    assert work <= 4 * len(wave.requests), f"schedule() did {work} heap operations"


def test_grouped_is_the_default_policy_and_fifo_an_option():
    from diffbatch.config import EngineConfig
    from diffbatch.sched.policy import make_scheduler
    from diffbatch.sched.scheduler import FifoScheduler

    assert type(make_scheduler(EngineConfig())) is GroupedScheduler
    assert type(make_scheduler(EngineConfig(scheduling_policy="fifo"))) is FifoScheduler
    with pytest.raises(ValueError, match="max_head_wait_ms"):
        GroupedScheduler(2, max_head_wait_ms=-1)


def test_has_full_wave_counts_the_next_group_up_to_capacity_or_pixel_cap():
    sched = GroupedScheduler(4, max_wave_pixels=2 * 128 * 128, clock=ManualClock(1000.0))
    sched.add_request(make_request("big0", 128))
    sched.add_request(make_request("s0"))
    assert not sched.has_full_wave()  # the best group (big) holds 1 of the 2 the cap allows
    sched.add_request(make_request("big1", 128))
    assert sched.has_full_wave()  # 2 images of 128x128 reach the pixel cap
    assert sched.schedule().req_ids == ["big0", "big1"]
    for i in range(1, 3):
        sched.add_request(make_request(f"s{i}"))
    assert not sched.has_full_wave()  # 3 small ones: under capacity and cap
    sched.add_request(make_request("s3"))
    sched.finish_requests(["s1"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_full_wave()  # the aborted one does not count
    sched.add_request(make_request("s4"))
    assert sched.has_full_wave()
    assert sched.schedule().req_ids == ["s0", "s2", "s3", "s4"]
