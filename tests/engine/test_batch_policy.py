"""The batch policy: fixed or auto capacity, the probe of the next size, and the wait."""

from __future__ import annotations

import math

import pytest

from diffbatch.config import EngineConfig
from diffbatch.engine.admission import AdmissionWait
from diffbatch.engine.batch_policy import (
    LOAD_WINDOW_S,
    MAX_WAIT_MS,
    PERSIST_WAVES,
    TOGETHER_MAX_MS,
    TOGETHER_MS,
    BatchPolicy,
    WaitPlan,
    choose_wait,
)
from diffbatch.engine.cost_model import MIN_SAMPLES, Shape
from diffbatch.metrics import learned_batching
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
    """Wave ms shaped like tiny-sd at 64x64: a fixed cost amortised by the wave."""
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


# -- the policy --------------------------------------------------------------------------


def policy(clock: ManualClock | None = None, **options) -> BatchPolicy:
    config = EngineConfig.from_options(model="fake", **options)
    return BatchPolicy(config, INFO, supports_request_batch=True, clock=clock or ManualClock())


def teach(p: BatchPolicy, wave_ms=tiny_sd_like, sizes=(1, 2, 4, 8, 16, 32)) -> None:
    """Each size measured twice, the same both times: a curve known without spread."""
    for size in sizes:
        for _ in range(2):
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
    assert learned_batching(p)[Shape.of(key()).label(4)]["wait_ms"] == 20.0


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


def test_capacity_asked_twice_answers_the_same_and_changes_nothing():
    """The scheduler asks on every check of a forming wave: a query, whatever the
    backlog it is told of."""
    p = policy()
    teach(p, sizes=(1, 2, 4))
    before = (dict(p._backlog_waves), p.cost.tables(), p.cost.num_samples(p.default_shape, 4))
    answers = [p.capacity(key(), num_waiting=100) for _ in range(2 * PERSIST_WAVES)]
    assert set(answers) == {4}
    assert (dict(p._backlog_waves), p.cost.tables(),
            p.cost.num_samples(p.default_shape, 4)) == before
    assert p.plan_wait(key(), 1) == p.plan_wait(key(), 1)


def test_the_next_size_is_probed_only_while_a_backlog_persists():
    p = policy()
    teach(p, sizes=(1, 2, 4))  # every doubling paid so far: 8 is worth a probe
    assert p.capacity(key()) == 4
    for _ in range(PERSIST_WAVES - 1):
        p.observe_backlog(key(), 20)
        assert p.capacity(key(), 20) == 4  # not yet: a burst that drains is no reason
    p.observe_backlog(key(), 6)  # the backlog fell below the probe size: start over
    for _ in range(PERSIST_WAVES):
        assert p.capacity(key(), 20) == 4
        p.observe_backlog(key(), 20)
    assert p.capacity(key(), 20) == 8  # persisted: waves of 8 are measured
    for _ in range(MIN_SAMPLES):
        p.observe_wave(key(), 8, tiny_sd_like(8))
    assert p.capacity(key()) == 8  # 8 paid: the knee moved
    assert p.capacity(key(), 12) == 8  # (a probe of 16 only where 16 wait)
    p.observe_backlog(key(), 40)  # (the row goes on: the next doubling is probed)
    assert p.capacity(key(), 40) == 16
    p.observe_backlog(key(), 3)
    assert p.capacity(key(), 40) == 8


def serve_backlog(p: BatchPolicy, num_waiting: int, waves: int, wave_ms=tiny_sd_like,
                  regressed=lambda size, nth: 1.0) -> list[int]:
    """The engine's loop under a backlog that stays at `num_waiting`: note the backlog,
    schedule a wave at the policy's capacity, teach its time; the wave sizes."""
    sizes: list[int] = []
    for _ in range(waves):
        p.observe_backlog(key(), num_waiting)
        size = min(p.capacity(key(), num_waiting), num_waiting)
        p.observe_wave(key(), size, wave_ms(size) * regressed(size, sizes.count(size)))
        sizes.append(size)
    return sizes


def test_a_capacity_learned_too_small_grows_under_a_persistent_backlog():
    """A busy start measured 8 as dear (one slow wave): capacity 4. A closed loop of
    16 clients keeps 8 waiting (one wave runs, one full wave queued behind it): within
    a bounded number of waves the policy measures 8 and keeps it."""
    p = policy()
    teach(p, sizes=(1, 2, 4))
    p.cost.observe(p.default_shape, 8, 4, 5 * tiny_sd_like(8))  # the busy start's 8
    p.cost.observe(p.default_shape, 8, 4, 5 * tiny_sd_like(8))
    assert p.capacity(key()) == 4
    sizes = serve_backlog(p, num_waiting=8, waves=PERSIST_WAVES + MIN_SAMPLES + 4)
    assert sizes[-1] == 8 and p.capacity(key()) == 8


def test_growth_goes_on_past_one_regressed_sample_per_size():
    """Under a deep backlog the policy keeps probing doublings up to the limit, though
    the first wave of every new size is slowed (a neighbour's burst)."""
    p = policy()
    teach(p, sizes=(1, 2))
    sizes = serve_backlog(p, num_waiting=64, waves=40,
                          regressed=lambda size, nth: 3.0 if nth == 0 else 1.0)
    assert sizes[-1] == p.limit == 32


def test_growth_stops_where_bigger_waves_cost_more_per_image():
    p = policy()
    teach(p, sizes=(1, 2, 4))
    dear_above_8 = lambda size: tiny_sd_like(size) if size <= 8 else 30.0 * size  # noqa: E731
    sizes = serve_backlog(p, num_waiting=64, waves=60, wave_ms=dear_above_8)
    assert sizes[-10:] == [8] * 10


def test_a_probe_that_does_not_pay_leaves_the_knee_where_it_was():
    p = policy(max_num_seqs_limit=8)
    teach(p, wave_ms=lambda size: 40.0 + 7.0 * size if size <= 4 else 100.0 * size,
          sizes=(1, 2, 4))
    for _ in range(PERSIST_WAVES):
        p.observe_backlog(key(), 20)
    assert p.capacity(key(), 20) == 8
    for _ in range(MIN_SAMPLES):
        p.observe_wave(key(), 8, 800.0)
    p.observe_backlog(key(), 20)
    assert p.capacity(key(), 20) == 4  # measured enough: no further probe of 8


# -- the wait rule, on a driven clock ------------------------------------------------


def arrive(p: BatchPolicy, clock: ManualClock, count: int, gap_s: float) -> None:
    for _ in range(count):
        p.observe_arrivals(1)
        clock.now += gap_s


def test_waits_on_a_burst_at_an_idle_worker():
    clock = ManualClock(100.0)
    p = policy(clock)
    teach(p)
    arrive(p, clock, 3, 0.001)  # 3 requests 1 ms apart, the worker idle for long
    plan = p.plan_wait(key(), 3)
    assert plan.target > 3 and 0 < plan.max_wait_ms <= tiny_sd_like(1)


def test_never_waits_under_a_sustained_load():
    """The worker busy half the time or more: the queue refills while each wave runs,
    so a burst of arrivals right now does not make it wait."""
    clock = ManualClock(100.0)
    p = policy(clock)
    teach(p)
    for _ in range(int(LOAD_WINDOW_S / 0.1)):  # waves of 60 ms every 100 ms
        clock.now += 0.1
        p.observe_wave(key(), 3, 60.0)
    arrive(p, clock, 3, 0.001)
    assert p.plan_wait(key(), 3) == WaitPlan.start_now(3)
    clock.now += LOAD_WINDOW_S  # the load is over: the next burst waits again
    arrive(p, clock, 3, 0.001)
    assert p.plan_wait(key(), 3).max_wait_ms > 0


@pytest.mark.parametrize("gap_s", [0.0001, 0.001, 0.005, 0.02, 0.1, 0.5])
def test_never_waits_past_its_bound(gap_s):
    clock = ManualClock(100.0)
    p = policy(clock)
    slow = lambda size: 5000.0 + 7.0 * size  # noqa: E731 - a single wave takes 5 s
    teach(p, wave_ms=slow)
    arrive(p, clock, 3, gap_s)
    plan = p.plan_wait(key(), 3)
    assert plan.max_wait_ms <= MAX_WAIT_MS
    assert plan.stable_window_ms <= plan.max_wait_ms
    p = policy(clock)
    teach(p)
    arrive(p, clock, 3, gap_s)
    bound = p.wait_bound_ms(Shape.of(key()), 4)
    assert p.plan_wait(key(), 3).max_wait_ms <= max(bound, TOGETHER_MAX_MS)
    assert bound == tiny_sd_like(1)


def test_a_lone_request_at_low_load_waits_only_for_requests_sent_with_it():
    clock = ManualClock(100.0)
    p = policy(clock)
    teach(p)
    together = WaitPlan(target=p.capacity(key()), max_wait_ms=TOGETHER_MAX_MS,
                        stable_window_ms=TOGETHER_MS)
    arrive(p, clock, 1, 0.0)
    assert p.plan_wait(key(), 1) == together  # nothing says more are coming
    arrive(p, clock, 3, 0.4)  # requests 400 ms apart: waiting longer never pays
    assert p.plan_wait(key(), 1) == together
    assert TOGETHER_MS <= 3.0  # what a lone request may pay (the lone-request bar)


def test_near_simultaneous_arrivals_at_an_idle_worker_share_a_wave():
    """Four requests sent together, 1 ms apart, at an idle worker: the admission wait
    gathers all four before the wave starts; a lone one starts after TOGETHER_MS."""
    clock = ManualClock(100.0)
    p = policy(clock)
    teach(p)
    arrive(p, clock, 1, 0.0)
    plan = p.plan_wait(key(), 1)
    waiting = [1]
    arrivals = iter([0.001, 0.002, 0.003])  # the other three, 1 ms apart
    next_at = [next(arrivals)]
    start = clock.now

    def wait_s(timeout_s: float) -> None:
        # the engine's condition: wakes at the next arrival or after the timeout
        due = start + next_at[0] if next_at[0] is not None else math.inf
        if due <= clock.now + timeout_s:
            clock.now = due
            waiting[0] += 1
            next_at[0] = next(arrivals, None)
        else:
            clock.now += timeout_s

    wait = AdmissionWait(plan.max_wait_ms, plan.target, plan.stable_window_ms)
    assert wait.should_wait(supports_request_batch=True, num_running=0)
    reason = wait.wait(lambda: waiting[0], lambda: False, wait_s, clock)
    assert waiting[0] == 4 and reason == "stable"
    assert (clock.now - start) * 1000.0 == pytest.approx(3.0 + TOGETHER_MS)
    lone = AdmissionWait(plan.max_wait_ms, plan.target, plan.stable_window_ms)
    start = clock.now
    assert lone.wait(lambda: 1, lambda: False, lambda t: setattr(clock, "now", clock.now + t),
                     clock) == "stable"
    assert (clock.now - start) * 1000.0 == pytest.approx(TOGETHER_MS)


def test_no_wait_before_anything_is_learned():
    clock = ManualClock()
    p = policy(clock)
    p.serving = True
    arrive(p, clock, 5, 0.0005)
    assert p.plan_wait(key(), 2).max_wait_ms == 0.0


def test_arrivals_before_serving_do_not_count():
    clock = ManualClock(100.0)
    p = policy(clock)
    teach(p)
    p.serving = False  # the start-up warm-up request arrives
    p.observe_arrivals(1)
    p.serving = True
    clock.now += 0.001
    p.observe_arrivals(1)
    assert p.plan_wait(key(), 1).max_wait_ms == TOGETHER_MAX_MS  # no rate: no longer wait


def test_waves_teach_the_model_only_while_serving_and_only_clean_ones():
    p = policy()
    p.observe_wave(key(), 4, 100.0)  # the warm-up, before serving
    assert p.cost.tables() == {}
    p.serving = True
    p.observe_wave(key(), 4, 100.0, num_forwards=3)  # a bisected wave: not one forward
    assert p.cost.tables() == {}
    p.observe_wave(key(), 4, 100.0)
    assert p.cost.estimate_ms(Shape.of(key()), 4, 4) == pytest.approx(100.0)
    snapshot = learned_batching(p)["64x64/s4/n1/cfg"]
    assert snapshot["per_image_ms"] == {4: 25.0} and snapshot["capacity"] == 4


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


def test_step_mode_stall_bound_follows_the_longest_recent_tick_and_the_curve():
    step_key = key().for_step_execution()
    p = policy(wave_stall_factor=10, worker_stall_timeout_s=0.5)
    assert p.stalls.step_s(step_key, 8) is None  # nothing known: the heartbeat alone
    p.observe_tick(step_key, tick(8, 900.0))  # the warm-up, before serving: not learned
    assert p.stalls.step_s(step_key, 8) is None
    p.serving = True
    for ms in (20.0, 80.0, 30.0):
        p.observe_tick(step_key, tick(8, ms))
    assert p.stalls.step_s(step_key, 8) == pytest.approx(0.8)  # 10 x the longest
    p.observe_tick(key(128).for_step_execution(), tick(8, 500.0))  # another shape's ticks
    assert p.stalls.step_s(step_key, 8) == pytest.approx(0.8)
    teach(p)  # the curve: one step of a wave of 32 is (40 + 7 * 32) / 4 = 66 ms
    assert p.stalls.step_s(step_key, 32) == pytest.approx(0.8)  # the tick is longer
    for _ in range(64):  # the long tick ages out: the curve's step is the longer
        p.observe_tick(step_key, tick(8, 1.0))
    assert p.stalls.step_s(step_key, 32) == pytest.approx(0.66)
    assert p.stalls.step_s(step_key, 1) == 0.5  # 10 x 11.75 ms: the floor holds
    assert policy(wave_stall_factor=0).stalls.step_s(step_key, 8) is None


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
    assert learned_batching(p)[p.default_shape.label(4)]["capacity"] == 4


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
    assert len(p.step_cost.num_samples(Shape.of(step_key), 1)) == 2
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


def test_the_tick_curve_learns_a_mixed_size_batch_in_capacity_units():
    """A fused call over one 128x128 and one 64x64 request on a 64x64 model is 5 units
    of the curve, as request mode's waves count them, not 2 requests."""
    step_key = key().for_step_execution()
    p = policy()
    p.serving = True
    p.observe_tick(step_key, TickStats(2, 50.0, 40.0, 0, 0, batch_units=5))
    assert p.step_cost.num_samples(Shape.of(step_key), 1) == {5: 1}  # size 5, not 2
