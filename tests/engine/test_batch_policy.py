"""The batch policy: fixed or auto capacity, and the auto admission-wait rule."""

from __future__ import annotations

import pytest

from diffbatch.config import EngineConfig
from diffbatch.engine.batch_policy import (
    FIRST_REQUEST_HOLD_SHARE,
    INCOMING_WAIT_MS,
    MIN_SUSTAINED_SPAN_S,
    SUSTAINED_WINDOW_S,
    ArrivalRate,
    BatchPolicy,
    WaitPlan,
    choose_wait,
    load_capacity,
    wave_size_for_load,
)
from diffbatch.engine.cost_model import MIN_SAMPLES, RETRY_AFTER_S, RETRY_AFTER_WAVES, Shape
from diffbatch.outputs import TickStats
from diffbatch.pipelines.interface import PipelineInfo
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
from tests.clock import ManualClock

INFO = PipelineInfo(name="P", default_height=64, default_width=64,
                    default_num_inference_steps=4, default_guidance_scale=5.0, size_multiple=8)


def key(size: int = 64, steps: int = 4) -> SamplingParamsKey:
    params = SamplingParams(height=size, width=size, num_inference_steps=steps,
                            guidance_scale=5.0)
    return SamplingParamsKey.from_params(params, cfg_enabled=True)


def tiny_sd_like(size: int) -> float:
    """Wave ms shaped like tiny-sd at 64x64 here: a fixed cost amortised by the wave."""
    return 40.0 + 7.0 * size



# -- the wait rule, on numbers ---------------------------------------------------------


def test_waits_under_a_burst_until_the_wave_is_full():
    plan = choose_wait(1, rate_per_s=2000.0, wave_ms=tiny_sd_like, capacity=8,
                       wait_bound_ms=tiny_sd_like(1))
    assert plan.target == 8
    assert 0 < plan.max_wait_ms <= tiny_sd_like(1)


@pytest.mark.parametrize("rate_per_s", [0.0, 0.5, 2.0, 10.0])
def test_never_waits_at_low_load(rate_per_s):
    plan = choose_wait(1, rate_per_s=rate_per_s, wave_ms=tiny_sd_like, capacity=8,
                       wait_bound_ms=tiny_sd_like(1))
    assert plan.max_wait_ms == 0.0 and plan.target == 1


def test_never_waits_past_the_bound():
    for rate in (30.0, 100.0, 300.0, 1000.0, 1e6):
        plan = choose_wait(1, rate_per_s=rate, wave_ms=tiny_sd_like, capacity=32,
                           wait_bound_ms=25.0)
        assert plan.max_wait_ms <= 25.0
        assert plan.stable_window_ms <= plan.max_wait_ms


def test_no_wait_when_batching_does_not_pay_or_the_wave_is_full():
    flat = lambda size: 40.0 * size  # noqa: E731 - every image costs the same
    assert choose_wait(1, 2000.0, flat, 8, 40.0).max_wait_ms == 0.0
    assert choose_wait(8, 2000.0, tiny_sd_like, 8, 47.0).max_wait_ms == 0.0


# -- the wave size a load needs, on numbers ------------------------------------------
# tiny_sd_like's throughput by wave size: 1 -> 21/s, 2 -> 37, 4 -> 59, 8 -> 83,
# 16 -> 105, 32 -> 121 requests/s; its capacity (5% rule) is 32.


@pytest.mark.parametrize(("rate_per_s", "size"), [
    (0.0, 1), (5.0, 1), (10.0, 2), (40.0, 8), (80.0, 16), (100.0, 32), (1000.0, 32)])
def test_the_load_needs_the_size_that_answers_soonest_at_its_rate(rate_per_s, size):
    assert load_capacity(rate_per_s, tiny_sd_like, capacity=32) == size


def test_a_small_wave_near_full_utilization_loses_to_a_cheaper_bigger_one():
    """Shaped like tiny-sd at 128x128 here (served ms per image 1: 130, 2: 88, 4: 67,
    8: 52, 16: 48): at 11/s waves of 4 keep up (74% busy) but queue; waves of 8 (57%
    busy) answer sooner. At 6/s waves of 2 already leave slack."""
    served = {1: 130.0, 2: 176.0, 4: 268.0, 8: 416.0, 16: 768.0}
    assert load_capacity(11.0, served.__getitem__, capacity=16) == 8
    assert load_capacity(6.0, served.__getitem__, capacity=16) == 2
    # a size nothing is known of yet (inf) is no candidate
    known = {1: 130.0, 2: 176.0, 4: 268.0, 8: float("inf"), 16: 768.0}
    assert load_capacity(11.0, known.__getitem__, capacity=16) == 4
    # no size below the capacity keeps up with room to spare: the capacity
    assert load_capacity(40.0, served.__getitem__, capacity=16) == 16


def test_a_size_without_headroom_is_not_picked_even_if_it_would_answer_sooner():
    """Nearly flat per-image cost (tiny-sd 64x64 served: 8 at 17 ms, 16 at 16 ms per
    image) under a closed loop whose rate is the server's own 50/s: waves of 8 are 85%
    busy. Taken, they would lower the throughput the rate is measured from."""
    served = {1: 45.0, 2: 60.0, 4: 88.0, 8: 136.0, 16: 256.0}
    assert load_capacity(50.0, served.__getitem__, capacity=16) == 16
    assert wave_size_for_load(14, 50.0, served.__getitem__, capacity=16) == 16


def test_a_backlog_below_saturation_runs_in_waves_the_load_needs():
    # 80/s needs waves of 16: a backlog of 32 runs as 16 + 16, the first half sooner
    assert wave_size_for_load(32, 80.0, tiny_sd_like, capacity=32) == 16
    assert wave_size_for_load(20, 80.0, tiny_sd_like, capacity=32) == 16
    # a backlog the load's waves did not keep up with runs at the capacity
    assert wave_size_for_load(33, 80.0, tiny_sd_like, capacity=32) == 32
    # an overload needs the capacity's throughput
    assert wave_size_for_load(32, 100.0, tiny_sd_like, capacity=32) == 32
    # a backlog no bigger than the load's size is one wave
    assert wave_size_for_load(16, 80.0, tiny_sd_like, capacity=32) == 32


def test_a_split_that_does_not_lower_the_latencies_is_not_made():
    """A pair at low load (the load needs waves of one) still runs together: two waves
    of one answer the second request later than one wave of two answers both."""
    assert wave_size_for_load(2, 5.0, tiny_sd_like, capacity=32) == 32
    # 6 at a load that needs 4: 4 + 2 sums to 516 ms of latency, one wave of 6 to 492
    assert wave_size_for_load(6, 30.0, tiny_sd_like, capacity=32) == 32


# -- the arrival rate, on a driven clock -------------------------------------------------



def test_a_curve_that_dips_at_a_bigger_size_does_not_make_waiting_look_free():
    """Learned times are noisy: a size seen once may read faster than a smaller one.
    Waiting for it must still cost at least the wave that could start now."""
    measured = {6: 150.0, 7: 147.0, 8: 100.0}  # 8 dips below 6 (noise)

    def dipping(size: int) -> float:
        return measured.get(size, 40.0 + 14.0 * size)

    plan = choose_wait(6, rate_per_s=50.0, wave_ms=dipping, capacity=8,
                       wait_bound_ms=dipping(1))
    assert plan.max_wait_ms == 0.0 and plan.target == 6
    # (a real gain still waits: a fixed cost that a burst's next 2 share)
    assert choose_wait(6, rate_per_s=2000.0, wave_ms=lambda size: 100.0 + size,
                       capacity=8, wait_bound_ms=101.0).target == 8

def test_arrival_rate_from_gaps_between_events():
    clock = ManualClock()
    rate = ArrivalRate(clock)
    assert rate.rate_per_s() == 0.0  # one event says nothing about a rate
    rate.observe()
    for _ in range(20):
        clock.now += 0.01
        rate.observe()
    assert rate.rate_per_s() == pytest.approx(100.0)
    clock.now += 1.0  # a quiet second: the stream slowed down
    assert rate.rate_per_s() == pytest.approx(1.0)


def test_a_pause_is_not_averaged_into_the_stream_after_it():
    """A burst after a quiet spell reads as a burst from its second arrival: the
    spell's gap (seconds) is no part of either stream."""
    clock = ManualClock()
    rate = ArrivalRate(clock)
    for _ in range(10):  # one request a second
        rate.observe()
        clock.now += 1.0
    clock.now += 20.0  # a quiet spell
    rate.observe()
    assert rate.rate_per_s() == 0.0  # nothing to go on yet (not the spell's 1/30 s)
    for _ in range(2):  # then an arrival every 0.5 ms
        clock.now += 0.0005
        rate.observe()
    assert rate.rate_per_s() == pytest.approx(2000.0)
    # an ordinary long gap (a few times the mean) is averaged in as before
    clock.now += 0.002
    rate.observe()
    assert rate.rate_per_s() == pytest.approx(1.0 / (0.0005 + 0.2 * 0.0015))


def test_a_closed_loops_silence_while_its_requests_run_is_no_pause():
    """32 clients, waves of 16 a second: each wave's end brings 16 arrivals within a few
    ms, then silence while the next wave runs. That silence is the load, not a pause:
    mid-clump, the sustained rate is the loop's 16/s, not the clump's 9 so far."""
    def loop(busy: bool) -> ArrivalRate:
        clock = ManualClock()
        rate = ArrivalRate(clock)
        for _ in range(8):
            for _ in range(16):
                rate.observe(busy=busy)
                clock.now += 0.001
            clock.now += 1.0 - 0.016
        for _ in range(9):  # the next clump, half in
            rate.observe(busy=busy)
            clock.now += 0.001
        return rate

    assert loop(busy=True).sustained_rate_per_s() == pytest.approx(16.0, rel=0.1)
    # the same clumps reaching an idle engine: each is a new stream (a burst)
    assert loop(busy=False).sustained_rate_per_s() == pytest.approx(9.0)


def test_a_list_of_prompts_is_one_event_not_a_burst():
    clock = ManualClock()
    rate = ArrivalRate(clock)
    rate.observe(32)  # one `generate` call with 32 prompts
    assert rate.rate_per_s() == 0.0
    clock.now += 2.0
    rate.observe(4)  # 4 requests 2 s later: 2 requests per second
    assert rate.rate_per_s() == pytest.approx(2.0)


# -- the policy --------------------------------------------------------------------------


def policy(clock: ManualClock | None = None, overlaps: bool | None = None,
           **options) -> BatchPolicy:
    config = EngineConfig.from_options(model="fake", **options)
    return BatchPolicy(config, INFO, supports_request_batch=True, clock=clock or ManualClock(),
                       overlaps=overlaps)


def teach(p: BatchPolicy, wave_ms=tiny_sd_like, sizes=(1, 2, 4, 8, 16, 32)) -> None:
    for size in sizes:
        p.cost.observe(p.default_shape, size, 4, wave_ms(size))
    p.serving = True


def tick(batch_size: int, step_ms: float, joins: int = 0, leaves: int = 0) -> TickStats:
    """A tick of the running batch: `step_ms` for one step of `batch_size` requests."""
    return TickStats(batch_size, step_ms, step_ms * 0.95, joins, leaves)


def test_fixed_settings_pass_through():
    p = policy(max_num_seqs=8, request_batch_max_wait_ms=20)
    assert not p.learns
    assert p.capacity(key()) == 8 and p.capacity(key(), num_waiting=100) == 8
    plan = p.plan_wait(key(), 1)
    assert (plan.target, plan.max_wait_ms, plan.stable_window_ms) == (8, 20.0, 4.0)


def test_a_fixed_wait_beside_an_auto_capacity_is_what_the_metrics_show():
    p = policy(request_batch_max_wait_ms=20)  # max_num_seqs stays auto
    teach(p, wave_ms=lambda size: 10.0 + 10.0 * size)
    plan = p.plan_wait(key(), 1)
    assert plan.max_wait_ms == 20.0 and plan.target == 16
    assert p.snapshot()[Shape.of(key()).label(4)]["wait_ms"] == 20.0


def test_a_pipeline_that_cannot_batch_gets_waves_of_one():
    config = EngineConfig(model="fake")
    p = BatchPolicy(config, INFO, supports_request_batch=False)
    assert p.capacity(key()) == 1 and not p.learns
    assert p.plan_wait(key(), 1).max_wait_ms == 0.0


def test_auto_capacity_follows_the_learned_curve_per_shape():
    p = policy()
    assert p.learns and p.limit == 32
    teach(p, wave_ms=lambda size: 10.0 + 10.0 * size)
    assert p.capacity(key()) == 16  # 10 + 10B: the 16 -> 32 doubling gains < 5%
    assert p.capacity(key(128)) == 4  # an unseen shape: 4x the pixels
    assert policy(max_num_seqs_limit=8).limit == 8


def test_a_backlog_beyond_capacity_tries_the_next_doubling():
    clock = ManualClock()
    p = policy(clock)
    teach(p, sizes=(1, 2, 4))  # every doubling paid so far: 8 is worth a try
    assert p.capacity(key()) == 4
    wave_s = tiny_sd_like(4) / 1000.0
    assert p.capacity(key(), num_waiting=20) == 4
    clock.now += 2 * wave_s  # a backlog beyond the trial size that lasts: try 8
    assert p.capacity(key(), num_waiting=20) == 8
    p.observe_wave(key(), 8, tiny_sd_like(8))
    assert p.capacity(key(), num_waiting=40) == 8  # 8 paid too: 16 next, once the
    clock.now += 2 * tiny_sd_like(8) / 1000.0  # backlog has lasted two waves of 8
    assert p.capacity(key(), num_waiting=40) == 16
    assert p.capacity(key(), num_waiting=16) == 8  # no bigger than the trial: no trial


def test_a_trial_leaves_requests_behind_only_under_a_sustained_backlog():
    clock = ManualClock()
    p = policy(clock)
    teach(p, sizes=(1, 2, 4))  # capacity 4, trial 8
    wave_s = tiny_sd_like(4) / 1000.0
    # a burst: the backlog beyond the trial runs in waves of the capacity ...
    assert p.capacity(key(), num_waiting=20) == 4
    clock.now += wave_s
    assert p.capacity(key(), num_waiting=16) == 4
    clock.now += wave_s * 0.9  # not yet two waves deep
    assert p.capacity(key(), num_waiting=12) == 4
    # ... and so does its rest: a trial of all of it would answer its first half a
    # wave later
    assert p.capacity(key(), num_waiting=8) == 4
    assert p.capacity(key(), num_waiting=6) == 4
    p.observe_arrivals(1, busy=True)  # whether or not arrivals still join it
    assert p.capacity(key(), num_waiting=8) == 4
    # a new backlog starts its count afresh
    clock.now += wave_s * 10
    assert p.capacity(key(), num_waiting=30) == 4
    clock.now += wave_s * 2  # two waves later it still stands: sustained
    assert p.capacity(key(), num_waiting=30) == 8
    # asking about the admission wait does not end the backlog's count
    p.plan_wait(key(), 1)
    assert p.capacity(key(), num_waiting=30) == 8


def test_a_stale_rung_is_forgotten_only_when_its_trial_wave_is_chosen():
    """Waves of 8 measured long ago at no gain: a short backlog asks about the next
    size without running a trial, and that keeps their evidence (and the retry's
    wait); the sustained backlog's trial drops it, to measure 8 afresh."""
    clock = ManualClock(1000.0)
    p = policy(clock)
    teach(p, sizes=(1, 2, 4))
    for _ in range(MIN_SAMPLES):
        p.cost.observe(p.default_shape, 8, 4, 2 * tiny_sd_like(4))  # no gain over 4
    for _ in range(RETRY_AFTER_WAVES):
        p.cost.observe(p.default_shape, 4, 4, tiny_sd_like(4))
    clock.now += RETRY_AFTER_S
    assert p.capacity(key(), num_waiting=6) == 4  # a backlog no bigger than the trial
    assert p.cost.num_samples(p.default_shape, 8, 4) == MIN_SAMPLES
    assert p.capacity(key(), num_waiting=30) == 4
    clock.now += 3 * tiny_sd_like(4) / 1000.0  # three waves later it still stands
    assert p.capacity(key(), num_waiting=30) == 8
    assert p.cost.num_samples(p.default_shape, 8, 4) == 0


def test_auto_capacity_follows_the_load_below_saturation():
    clock = ManualClock()
    p = policy(clock)
    teach(p)  # capacity 32
    for _ in range(160):  # 80 requests/s for 2 s
        p.observe_arrivals(1)
        clock.now += 1 / 80
    assert p.capacity(key(), num_waiting=24) == 16
    assert p.capacity(key(), num_waiting=40) == 32  # waves of 16 fell behind
    for _ in range(320):  # then 160/s for 2 s: an overload
        p.observe_arrivals(1)
        clock.now += 1 / 160
    assert p.capacity(key(), num_waiting=24) == 32
    # fixed settings are what they say, whatever the load
    fixed = policy(clock, max_num_seqs=32)
    teach(fixed)
    for _ in range(160):  # the same 80/s that gave the auto policy waves of 16
        fixed.observe_arrivals(1)
        clock.now += 1 / 80
    assert fixed.capacity(key(), num_waiting=24) == 32


def test_the_load_rule_trusts_what_served_waves_took_over_the_calibration():
    """A saturated server's arrival rate is its own throughput: waves of 16 that the
    calibration overrates, served at 80/s by a closed loop, would keep reading as
    enough for the load. Once four served waves of about 16 show what they deliver,
    the capacity holds; waves the engine serves at the calibrated speed keep the
    split."""
    clock = ManualClock()

    def loaded(served_ms_of_16: float) -> BatchPolicy:
        p = policy(clock)
        teach(p)  # calibrated: capacity 32, waves of 16 serve 105/s
        for size in (16, 14, 12, 15):  # about 16 (sizes from 3/4 of it count)
            p.observe_wave(key(), size, served_ms_of_16 * size / 16)
        for _ in range(160):  # 80 requests/s for 2 s
            p.observe_arrivals(1)
            clock.now += 1 / 80
        return p

    # served waves of 16 took 300 ms (53/s): they do not cover 1.25 x 80/s
    assert loaded(300.0).capacity(key(), num_waiting=24) == 32
    # served at the calibrated 152 ms (105/s): the load needs no more than 16
    assert loaded(tiny_sd_like(16)).capacity(key(), num_waiting=24) == 16
    # until four served waves of about 16 ran, the curve decides (the split is served,
    # and measured)
    p = policy(clock)
    teach(p)
    for size in (16, 12, 8, 20):  # 8 and 20 are not about 16
        p.observe_wave(key(), size, 300.0 * size / 16)
    for _ in range(160):
        p.observe_arrivals(1)
        clock.now += 1 / 80
    assert p.capacity(key(), num_waiting=24) == 16


def test_auto_wait_waits_for_a_burst_and_not_at_low_load():
    clock = ManualClock()
    p = policy(clock)
    teach(p)
    for _ in range(3):  # a burst: an arrival every 0.5 ms
        p.observe_arrivals(1)
        clock.now += 0.0005
    burst = p.plan_wait(key(), 3)
    assert burst.target > 3 and 0 < burst.max_wait_ms <= tiny_sd_like(1)
    clock.now += 2.0  # then one 2 s later: a light load, no burst
    p.observe_arrivals(1)
    alone = p.plan_wait(key(), 1)
    assert alone.max_wait_ms == 0.0 and alone.target == 1
    for _ in range(2):  # ... unless a burst follows: its third arrival waits for more
        clock.now += 0.0005
        p.observe_arrivals(1)
    again = p.plan_wait(key(), 3)
    assert again.target > 3 and 0 < again.max_wait_ms <= tiny_sd_like(1)



def test_no_wait_under_a_steady_sustained_load_but_a_burst_waits():
    """A steady stream at half the capacity's throughput or more, sustained over the
    window: the worker would idle in a wait while the queue refills anyway, so start
    at once, even with requests at the door. A burst, alone or on top of that load,
    still waits for its last requests (they are milliseconds away)."""
    per_image_ms = tiny_sd_like(32) / 32  # at the capacity (32) here

    def steady(p: BatchPolicy, clock: ManualClock, share: float) -> None:
        gap_s = per_image_ms / 1000.0 / share  # `share` of what the worker can serve
        for _ in range(int(SUSTAINED_WINDOW_S / gap_s)):
            p.observe_arrivals(1)
            clock.now += gap_s

    def burst(p: BatchPolicy, clock: ManualClock) -> None:
        for _ in range(40):  # an arrival every 0.5 ms
            p.observe_arrivals(1)
            clock.now += 0.0005

    def plans(load: float | None, then_burst: bool) -> list:
        clock = ManualClock()
        p = policy(clock)
        teach(p)
        if load is not None:
            steady(p, clock, load)
        if then_burst:
            burst(p, clock)
        # q requests waiting where the steady stream's own rule would wait for more
        return [p.plan_wait(key(), 3), p.plan_wait(key(), 3, num_incoming=5)]

    assert [plan.max_wait_ms for plan in plans(0.6, then_burst=False)] == [0.0, 0.0]
    for load in (None, 0.6):
        assert all(plan.target > 3 and plan.max_wait_ms > 0.0
                   for plan in plans(load, then_burst=True))
    # below half the capacity's throughput the rule itself decides (here: the requests
    # at the door are waited for)
    assert plans(0.3, then_burst=False)[1].max_wait_ms > 0.0


def test_an_idle_servers_first_request_holds_briefly_for_a_burst_behind_it():
    """After `SUSTAINED_WINDOW_S` without arrivals, nothing says whether a request is
    alone or the first of a burst: it waits a fifth of its wave time (at most 20 ms)
    for a second, and the wave goes on collecting while they keep coming that close,
    up to the capacity and the wait's bound. Where waves have no fixed cost to share,
    it starts at once."""
    clock = ManualClock()
    p = policy(clock)
    teach(p)  # capacity 32, a wave of one 47 ms
    p.observe_arrivals(1)
    first = p.plan_wait(key(), 1)
    assert first.target == 32
    assert first.stable_window_ms == pytest.approx(FIRST_REQUEST_HOLD_SHARE * tiny_sd_like(1))
    assert first.max_wait_ms == pytest.approx(tiny_sd_like(1))
    # the same request 2 s after the last one (a light load, not an idle server)
    clock.now += 2.0
    p.observe_arrivals(1)
    assert p.plan_wait(key(), 1) == WaitPlan.start_now(1)
    # idle again: the hold returns; a slow model's window stays at 20 ms
    clock.now += SUSTAINED_WINDOW_S
    p.observe_arrivals(1)
    assert p.plan_wait(key(), 1).stable_window_ms > 0.0
    slow = policy(clock)
    teach(slow, wave_ms=lambda size: 900.0 + 100.0 * size)
    slow.observe_arrivals(1)
    assert slow.plan_wait(key(), 1).stable_window_ms == INCOMING_WAIT_MS
    # a cost per request without a fixed part: one wave of all saves nothing
    flat = policy(clock, max_num_seqs=16)
    teach(flat, wave_ms=lambda size: 10.0 * size, sizes=(1, 2, 4, 8, 16) * 4)
    flat.observe_arrivals(1)
    assert flat.plan_wait(key(), 1) == WaitPlan.start_now(1)


def test_a_burst_at_an_idle_server_is_not_split_by_the_load_rule():
    """A young stream has no sustained rate: its first requests spread over a second
    read as a light load, under which the load rule would split them into small
    waves. Within its first second the capacity holds; a stream that has lasted the
    second at that rate is split."""
    def fixed_cost(size: int) -> float:
        return 150.0 + 15.0 * size  # capacity 32; 24 per second need waves of 16

    clock = ManualClock()
    p = policy(clock)
    teach(p, wave_ms=fixed_cost)
    assert p.capacity(key()) == 32
    for _ in range(24):  # 24 requests 1 ms apart at an idle server
        p.observe_arrivals(1)
        clock.now += 0.001
    assert p.capacity(key(), num_waiting=24) == 32
    for _ in range(48):  # ... then 20 per second for 2.4 s
        clock.now += 0.05
        p.observe_arrivals(1)
    assert p.capacity(key(), num_waiting=24) == 16


def test_a_load_counts_as_load_from_its_first_second():
    """A steady stream at 0.6 of the capacity's throughput that began 1.5 s ago, after a
    quiet spell: its waves start at once (measured over the whole 5 s window it would
    read as 0.18 of the throughput, and the rule would wait for more)."""
    clock = ManualClock()
    p = policy(clock)
    teach(p)
    p.observe_arrivals(1)
    clock.now += 60.0  # quiet
    gap_s = tiny_sd_like(32) / 32 / 1000.0 / 0.6
    for _ in range(int(1.5 / gap_s)):
        p.observe_arrivals(1)
        clock.now += gap_s
    assert p.plan_wait(key(), 3, num_incoming=5).max_wait_ms == 0.0


def test_the_sustained_rate_counts_the_window_or_the_streams_age():
    clock = ManualClock()
    rate = ArrivalRate(clock)
    rate.observe(10)
    assert rate.sustained_rate_per_s() == 10 / MIN_SUSTAINED_SPAN_S  # spread over a second
    clock.now += SUSTAINED_WINDOW_S / 2
    rate.observe(5)
    assert rate.sustained_rate_per_s() == 15 / (SUSTAINED_WINDOW_S / 2)  # over its age
    clock.now += SUSTAINED_WINDOW_S * 0.75  # the first 10 are older than the window
    assert rate.sustained_rate_per_s() == 5 / SUSTAINED_WINDOW_S
    # a load after a pause (30 s: far beyond the last gaps) is measured from its own
    # start, not diluted by the quiet window before it
    clock.now += 30.0
    for _ in range(40):  # 20 per second for 2 s
        rate.observe()
        clock.now += 0.05
    assert rate.sustained_rate_per_s() == pytest.approx(40 / 2.0)
    clock.now += 30.0
    for _ in range(3):  # a new stream of 3 within 0.1 s: spread over a second
        rate.observe()
        clock.now += 0.05
    assert rate.sustained_rate_per_s() == pytest.approx(3 / MIN_SUSTAINED_SPAN_S)


def test_no_wait_before_anything_is_learned():
    clock = ManualClock()
    p = policy(clock)
    for _ in range(5):
        p.observe_arrivals(1)
        clock.now += 0.0005
    assert p.plan_wait(key(), 2).max_wait_ms == 0.0


def test_waves_teach_the_model_only_while_serving_and_only_clean_ones():
    p = policy()
    p.observe_wave(key(), 4, 100.0)  # the warm-up, before serving
    assert p.cost.curves() == []
    p.serving = True
    p.observe_wave(key(), 4, 100.0, num_forwards=3)  # a bisected wave: not one forward
    assert p.cost.curves() == []
    p.observe_wave(key(), 4, 100.0)
    assert p.cost.estimate_ms(Shape.of(key()), 4, 4) == pytest.approx(100.0)
    snapshot = p.snapshot()["64x64/s4/n1/cfg"]
    assert snapshot["per_image_ms"] == {4: 25.0} and snapshot["capacity"] == 4
    assert snapshot["served_per_image_ms"] == {4: 25.0}


@pytest.mark.parametrize(("options", "message"), [
    ({"max_num_seqs": "autoo"}, "`max_num_seqs` must be 'auto' or an integer >= 1, got 'autoo'"),
    ({"max_num_seqs": -1}, "`max_num_seqs` must be 'auto' or an integer >= 1, got -1"),
    ({"request_batch_max_wait_ms": "soon"},
     "`request_batch_max_wait_ms` must be 'auto' or a finite number >= 0, got 'soon'"),
    ({"max_num_seqs_limit": 0}, "`max_num_seqs_limit` must be an integer >= 1, or None"),
    ({"calibration_budget_s": -1}, "`calibration_budget_s` must be a finite number >= 0"),
    ({"max_num_seqs": 64, "max_num_seqs_limit": 4},
     "`max_num_seqs_limit` bounds the waves `max_num_seqs='auto'` chooses; with "
     "max_num_seqs=64 it has no effect"),
])
def test_bad_values_name_the_option(options, message):
    from diffbatch import ConfigError

    with pytest.raises(ConfigError) as info:
        EngineConfig.from_options(**options)
    assert message in info.value.message


def test_announced_requests_are_waited_for_briefly():
    """A burst whose bodies are still being read: the first request does not go alone."""
    clock = ManualClock()
    p = policy(clock)
    teach(p)
    p.observe_arrivals(1)
    clock.now += 3.0  # quiet until now: the rate alone says "start at once"
    p.observe_arrivals(1)
    assert p.plan_wait(key(), 1).max_wait_ms == 0.0
    plan = p.plan_wait(key(), 1, num_incoming=7)
    assert plan.target == 8 and 0 < plan.max_wait_ms <= 20.0
    assert p.plan_wait(key(), 1, num_incoming=100).target == p.capacity(key())


def test_step_mode_stall_bound_follows_the_longest_recent_tick_and_the_curve():
    step_key = key().for_step_execution()
    p = policy(wave_stall_factor=10, worker_stall_timeout_s=0.5)
    assert p.step_stall_bound_s(step_key, 8) is None  # nothing known: the heartbeat alone
    p.observe_tick(step_key, tick(8, 900.0))  # the warm-up, before serving: not learned
    assert p.step_stall_bound_s(step_key, 8) is None
    p.serving = True
    for ms in (20.0, 80.0, 30.0):
        p.observe_tick(step_key, tick(8, ms))
    assert p.step_stall_bound_s(step_key, 8) == pytest.approx(0.8)  # 10 x the longest
    p.observe_tick(key(128).for_step_execution(), tick(8, 500.0))  # another shape's ticks
    assert p.step_stall_bound_s(step_key, 8) == pytest.approx(0.8)
    teach(p)  # the curve: one step of a wave of 32 is (40 + 7 * 32) / 4 = 66 ms
    assert p.step_stall_bound_s(step_key, 32) == pytest.approx(0.8)  # the tick is longer
    for _ in range(64):  # the long tick ages out: the curve's step is the longer
        p.observe_tick(step_key, tick(8, 1.0))
    assert p.step_stall_bound_s(step_key, 32) == pytest.approx(0.66)
    assert p.step_stall_bound_s(step_key, 1) == 0.5  # 10 x 11.75 ms: the floor holds
    assert policy(wave_stall_factor=0).step_stall_bound_s(step_key, 8) is None


def test_step_capacity_grows_from_the_ticks_past_a_calibration_that_said_one():
    """A calibration on a busy machine found no gain (capacity 1); with demand, the
    running batch tries doublings and keeps those the ticks say pay."""
    step_key = key().for_step_execution()
    p = policy()
    teach(p, wave_ms=lambda size: 100.0 * size)  # no gain at any size: capacity 1
    assert p.step_capacity(step_key) == 1
    assert p.step_capacity(step_key, demand=1) == 1  # no more demand than capacity

    def step_ms(size: int) -> float:  # a tick gains up to 4, then costs per request
        return 10.0 + 2.0 * min(size, 4) + 12.0 * max(0, size - 4)

    def run_ticks(size: int) -> None:
        for _ in range(MIN_SAMPLES):
            p.observe_tick(step_key, tick(size, step_ms(size)))

    run_ticks(1)
    assert p.step_capacity(step_key, demand=6) == 2  # the doubling is tried
    run_ticks(2)
    assert p.step_capacity(step_key, demand=6) == 4  # 2 paid: the next one
    assert p.step_capacity(step_key, demand=3) == 3  # never above the demand
    run_ticks(4)
    assert p.step_capacity(step_key) == 4
    assert p.step_capacity(step_key, demand=20) == 8
    run_ticks(8)  # 8 costs more per request than 4: tried enough, not kept
    assert p.step_capacity(step_key) == 4
    assert p.step_capacity(step_key, demand=20) == 4
    assert p.snapshot()[p.default_shape.label(4)]["capacity"] == 4


def test_every_tick_teaches_the_step_capacity_by_its_denoiser_time():
    """Ticks with joins and leaves teach too, by their fused denoiser call (their
    encoding and decoding left out): requests of one step, every tick of which has
    both, still grow the batch."""
    step_key = key().for_step_execution()
    p = policy()
    teach(p, wave_ms=lambda size: 100.0 * size)  # the calibration found no gain
    for _ in range(MIN_SAMPLES):  # (batch, tick ms, denoiser ms, joins, leaves)
        p.observe_tick(step_key, TickStats(1, 50.0, 5.0, 1, 1))  # encode and decode
        p.observe_tick(step_key, TickStats(2, 90.0, 6.0, 2, 2))  # dominate the tick
        p.observe_tick(step_key, TickStats(0, 0.0, 0.0, 0, 1))  # a leave between ticks
    assert p.step_cost.num_sizes(Shape.of(step_key)) == 2
    assert p.step_capacity(step_key) == 2  # per request 5 -> 3 ms
    assert p.step_capacity(step_key, demand=6) == 4  # 2 paid: the next doubling


def test_fixed_step_capacity_is_never_exceeded():
    step_key = key().for_step_execution()
    p = policy(max_num_seqs=3)
    p.serving = True
    for size in (1, 2, 3):
        for _ in range(MIN_SAMPLES):
            p.observe_tick(step_key, tick(size, 10.0))
    assert p.step_capacity(step_key, demand=50) == 3


def test_arrivals_before_serving_do_not_count():
    clock = ManualClock()
    p = policy(clock)
    teach(p)
    p.serving = False  # the start-up warm-up request arrives
    p.observe_arrivals(1)
    p.serving = True
    clock.now += 0.05  # the first real request, right after start-up
    p.observe_arrivals(2)
    assert p.arrivals.rate_per_s() == 0.0  # one event: no rate yet
    # planned as an idle server's first request (a brief hold for a burst behind it),
    # not as the tail of a burst of arrivals 50 ms apart
    fresh = policy(clock)
    teach(fresh)
    fresh.observe_arrivals(2)
    assert p.plan_wait(key(), 2) == fresh.plan_wait(key(), 2)
    assert p.plan_wait(key(), 2).stable_window_ms == FIRST_REQUEST_HOLD_SHARE * tiny_sd_like(1)
