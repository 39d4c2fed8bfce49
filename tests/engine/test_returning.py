"""Answered clients that come back at once (a closed loop), on a driven clock."""

from __future__ import annotations

import pytest

from diffbatch.engine.batch_policy import holding_pays
from diffbatch.engine.cost_model import MIN_SAMPLES
from diffbatch.engine.returning import (
    ANSWERS_KEPT,
    MAX_RETURN_WINDOW_MS,
    MIN_POPULATION,
    POPULATION_WAVES,
    RETURN_SLACK,
    UNTOLD_WAVES_FORGET,
    ReturningClients,
)
from tests.clock import ManualClock
from tests.engine.test_batch_policy import key, policy, teach, tiny_sd_like


def closed_loop(clients: ReturningClients, clock: ManualClock, sizes: list[int],
                cycle_s: float = 0.8, return_gap_s: float = 0.001,
                steady_rate: float = 20.0) -> None:
    """Waves of `sizes` answered one after another; each wave's clients come back one
    every `return_gap_s` right after their answers, `cycle_s` apart."""
    for size in sizes:
        clients.answered(size, steady_rate)
        for _ in range(size):
            clock.now += return_gap_s
            clients.arrived(1)
        clock.now += cycle_s - size * return_gap_s


def test_a_closed_loops_clients_are_expected_back_after_their_answers():
    """16 clients back 1 ms apart after each wave's answers: once two waves showed it,
    the clients of the newest one are due 16 ms after it, waited for up to 24 ms."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [16] * ANSWERS_KEPT)
    assert clients.expected() is None  # nobody answered a moment ago
    clients.answered(16, 20.0)
    window_ms = RETURN_SLACK * 16.0
    expected = clients.expected()
    assert expected.count == 16
    assert (expected.due_ms, expected.window_left_ms) == pytest.approx((16.0, window_ms))
    clock.now += 0.002
    clients.arrived(1)
    expected = clients.expected()
    assert expected.count == 15
    assert (expected.due_ms, expected.window_left_ms) == pytest.approx((14.0, window_ms - 2))
    clock.now += 0.020
    assert clients.expected().due_ms == 0.0  # overdue, still waited for
    clock.now += 0.002  # the window closed: those not back by now are not expected
    assert clients.expected() is None


def test_the_window_follows_how_long_the_clients_took():
    """Clients 10 ms apart (a slower machine) are waited for longer, up to the cap."""
    for gap_s, window_ms in ((0.010, RETURN_SLACK * 160.0), (0.030, MAX_RETURN_WINDOW_MS)):
        clock = ManualClock()
        clients = ReturningClients(clock)
        closed_loop(clients, clock, [16] * ANSWERS_KEPT, return_gap_s=gap_s, cycle_s=2.0,
                    steady_rate=8.0)
        clients.answered(16, 8.0)
        expected = clients.expected()
        assert expected.count == 16
        assert expected.window_left_ms == pytest.approx(window_ms)


def test_one_closed_loop_wave_is_not_enough():
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [16] * (ANSWERS_KEPT - 1))
    clients.answered(16, 20.0)
    assert clients.expected() is None


def test_an_open_stream_is_never_expected_back():
    """Arrivals every 50 ms whatever the answers (20/s), waves of 8 answered every
    400 ms: a window after an answer holds one arrival at most, as any window does."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    for step in range(400):  # 20 s in 5 ms steps
        if step % 80 == 0:
            clients.answered(8, 20.0)
        if step % 10 == 3:
            clients.arrived(1)
        assert clients.expected() is None
        clock.now += 0.005


def test_a_crowd_the_steady_stream_explains_is_no_loop():
    """8 arrivals after each wave of 8, but 5 ms apart, as a steady 200/s brings them
    anyway: no loop to wait for."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [8] * 3, return_gap_s=0.005, steady_rate=200.0)
    clients.answered(8, 200.0)
    assert clients.expected() is None


def test_waves_too_small_to_tell_do_not_break_the_loop():
    """Waves of 1 and 15 in turn (16 clients): a wave of one says nothing, the waves
    of 15 show the loop, and after either the rest of the loop is expected back."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [15, 1, 15, 1])
    clients.answered(1, 20.0)
    assert clients.expected().count == 1
    clock.now += 1.0
    clients.answered(15, 20.0)
    assert clients.expected().count == 15


def test_waves_that_tell_nothing_for_long_forget_a_chance_loop():
    """Two waves whose arrivals crowded after their answers, as an open stream's now
    and then do by chance, then waves too small to tell (an open stream's usual): the
    chance is forgotten after `UNTOLD_WAVES_FORGET` of them, not kept for good."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [16] * ANSWERS_KEPT)
    for untold in range(UNTOLD_WAVES_FORGET + 1):
        clients.answered(2, 20.0)  # 2 arrivals after it, 100 ms apart: too few to tell
        expected = clients.expected()
        if untold < UNTOLD_WAVES_FORGET:
            assert expected is not None and expected.count == 2
        else:
            assert expected is None
        for _ in range(2):
            clock.now += 0.1
            clients.arrived(1)
        clock.now += 0.2
    closed_loop(clients, clock, [16] * (ANSWERS_KEPT - 1))
    clients.answered(16, 20.0)
    assert clients.expected() is None  # one loop-like wave since: not a loop yet


def test_a_loop_that_stops_costs_one_window():
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [16] * ANSWERS_KEPT)
    clients.answered(16, 20.0)  # nobody comes back this time
    assert clients.expected().count == 16
    clock.now += 1.0
    assert clients.expected() is None
    clients.answered(16, 20.0)
    assert clients.expected() is None


def test_answers_before_the_clients_came_back_tell_nothing():
    """A wave answered right behind another (it was queued at the worker), before the
    first one's clients were back: the first one's count was cut short, so it does
    not count against the loop."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    closed_loop(clients, clock, [16] * ANSWERS_KEPT)
    clients.answered(16, 20.0)
    clock.now += 0.001
    clients.arrived(1)
    clients.answered(16, 20.0)
    for _ in range(16):
        clock.now += 0.001
        clients.arrived(1)
    clock.now += 1.0
    clients.answered(16, 20.0)
    assert clients.expected().count == 16


def two_cohorts(answer, arrive, clock: ManualClock, turns: int = POPULATION_WAVES,
                return_gap_s: float = 0.008) -> None:
    """A loop of 16 clients split into cohorts of 12 and 4 that run in turn: each
    wave's clients come back `return_gap_s` apart while the other cohort's wave runs
    (12 over 96 ms during a 50 ms wave of 4 and the wait after it; 4 over 32 ms during
    a 120 ms wave of 12). `answer(size, in_engine)` and `arrive()` are told; at each
    answer the other cohort is in the engine, all of it after the wave of 12 (its 4
    are back), 8 of the 12 after the wave of 4."""
    back = {12: 4, 4: 8}  # of the other cohort, in the engine at this one's answers
    for turn in range(turns):
        size = 12 if turn % 2 == 0 else 4
        answer(size, size + back[size])
        for _ in range(size):
            clock.now += return_gap_s
            arrive()
        clock.now += 0.12 if size == 4 else 0.02


def test_a_split_loop_shows_its_population_where_no_wave_tells():
    """Two cohorts of a 16-client loop at its own rate (~80/s): each cohort's return
    is no denser than that stream, so no wave tells; but the engine never held more
    than 16 requests at an answer, and held 16 at half of them. After the wave of 12
    with the other 4 waiting, the 12 are expected, due when the loop's returns came
    lately (the 90th percentile of their lags)."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    two_cohorts(lambda size, in_engine: clients.answered(size, 80.0, in_engine),
                lambda: clients.arrived(1), clock)
    assert clients.population() == 16
    clients.answered(12, 80.0, 16)
    expected = clients.expected(in_engine=4)
    assert expected is not None and expected.count == 12
    # the last 64 lags: 8, 16, ..., 96 ms after each wave of 12, 8-32 after each of 4
    assert expected.due_ms == pytest.approx(88.0)
    assert expected.window_left_ms == pytest.approx(RETURN_SLACK * 88.0)
    assert clients.expected() is None  # the engine's count not given: nothing to go by
    assert clients.expected(in_engine=16) is None  # all in: nobody to wait for


def test_counts_at_answers_that_wander_or_grow_show_no_population():
    """An open stream's count at its answers wanders with its queue, an overload's
    grows, a small loop's is too small to bother: none is a population."""
    def answers(counts: list[int]) -> ReturningClients:
        clock = ManualClock()
        clients = ReturningClients(clock)
        for count in counts:
            clients.answered(4, 80.0, count)
            for _ in range(4):
                clock.now += 0.01
                clients.arrived(1)
            clock.now += 0.1
        return clients

    for counts in ([5, 7, 4, 6, 8, 5, 6, 7],  # Poisson-like: the maximum reached once
                   [16, 20, 24, 28, 32, 36, 40, 44],  # a queue that grows
                   [3, 3, 2, 3, 3, 1, 3, 3]):  # below MIN_POPULATION
        clients = answers(counts)
        assert clients.population() is None, counts
        clients.answered(4, 80.0, counts[-1])
        assert clients.expected(in_engine=0) is None, counts
    assert MIN_POPULATION > 3
    # a pinned count shows the population only once `POPULATION_WAVES` answers did
    assert answers([16] * (POPULATION_WAVES - 1)).population() is None
    assert answers([16] * POPULATION_WAVES).population() == 16
    # and only while it comes back: a loop that ended, an open stream after it
    assert answers([16] * POPULATION_WAVES + [1]).population() == 16
    assert answers([16] * POPULATION_WAVES + [1, 2]).population() is None


def test_a_wave_that_showed_no_loop_outweighs_a_population():
    """A population in the counts, but the last wave that could tell saw its clients
    not come back: no one is expected."""
    clock = ManualClock()
    clients = ReturningClients(clock)
    two_cohorts(lambda size, in_engine: clients.answered(size, 80.0, in_engine),
                lambda: clients.arrived(1), clock)
    clients.answered(12, 0.1, 16)  # a stream of 0.1/s: a wave of 12 can tell
    clock.now += 1.0  # nobody came back within the window
    clients.answered(12, 0.1, 16)
    assert clients.population() == 16
    assert clients.expected(in_engine=4) is None


# -- in the admission wait ---------------------------------------------------------------


def serve_loop(p, clock: ManualClock, clients: int = 16, return_gap_s: float = 0.001,
               cycle_s: float = 0.25, answers_seen: bool = True) -> None:
    """20 waves of a loop of `clients`, `cycle_s` apart, each one's clients back
    `return_gap_s` apart after its answers, then the next wave's answers; the policy
    is told of the answers only if `answers_seen`."""
    for _ in range(20):
        if answers_seen:
            p.observe_answers(clients)
        for _ in range(clients):
            clock.now += return_gap_s
            p.observe_arrivals(1, busy=True)
        clock.now += cycle_s - clients * return_gap_s
    if answers_seen:
        p.observe_answers(clients)


def first_back(p, clock: ManualClock):
    """The plan for the loop's first client back, 3 ms after the last answers."""
    clock.now += 0.003
    p.observe_arrivals(1)
    return p.plan_wait(key(), 1)


def test_the_admission_wait_holds_for_a_closed_loops_clients():
    """16 clients at capacity 16, a wave every 0.25 s: a sustained load (64/s, 0.6 of
    what waves of 16 serve), under which the wait rule itself starts at once. Told of
    the answers, the first client back does not start alone: the wave waits, within
    the window, for the 15 on their way."""
    def plan(answers_seen: bool):
        clock = ManualClock()
        p = policy(clock, max_num_seqs=16)
        teach(p)
        serve_loop(p, clock, answers_seen=answers_seen)
        return first_back(p, clock)

    held = plan(answers_seen=True)
    assert held.target == 16
    assert held.max_wait_ms == pytest.approx(RETURN_SLACK * 16.0 - 3.0)
    assert plan(answers_seen=False).max_wait_ms == 0.0


def test_a_young_open_streams_first_waves_are_no_loop():
    """A stream at 48/s starts after a quiet spell, its requests evenly 20.8 ms apart;
    its first waves grow (4, 4, 8, 16), each answered when the arrivals double, with
    the arrivals since the last answers. Counted
    over a whole second, those arrivals would read as a stream of 4-8/s, and the
    requests right after each answer as a loop's clients coming back, twice in a row;
    over the stream's own age they are the stream's 48/s. No clients are expected
    back, and the admission wait holds for none."""
    clock = ManualClock()
    p = policy(clock, max_num_seqs=16)
    teach(p)
    clock.now += 60.0
    for arrival in range(1, 33):
        p.observe_arrivals(1, busy=arrival > 1)
        if arrival in (4, 8, 16, 32):
            p.observe_answers(max(arrival // 2, 4))
            assert p.returns.expected() is None, f"after {arrival} arrivals"
        clock.now += 1.0 / 48.0
    assert p.plan_wait(key(), 3).max_wait_ms == 0.0


def test_the_returns_hold_never_grows_a_wave_past_the_capacity():
    clock = ManualClock()
    p = policy(clock, max_num_seqs=8)
    teach(p)
    for _ in range(ANSWERS_KEPT + 1):
        p.observe_answers(16)
        clock.now += 0.001
        p.observe_arrivals(16)
        clock.now += 1.0
    p.observe_answers(16)
    clock.now += 0.001
    p.observe_arrivals(1)
    assert p.plan_wait(key(), 5).target == 8
    assert p.plan_wait(key(), 8).max_wait_ms == 0.0  # full already


def test_holding_pays_where_one_wave_turns_the_loop_faster():
    """A wave's fixed cost (40 ms + 7 ms per request): one wave of 16 beats 1 then 15
    when the 15 are due soon, and 8 then 8 when the 8 are due sooner than the fixed
    cost they save; a cost per request without a fixed part never pays a wait."""
    def fixed_part(size: int) -> float:
        return 40.0 + 7.0 * size

    assert holding_pays(1, 15, 13.0, fixed_part)  # 13 + 152 < 47 + 145
    assert holding_pays(8, 8, 10.0, fixed_part)  # 10 + 152 < 96 + 96
    assert not holding_pays(8, 8, 100.0, fixed_part)  # 100 + 152 > 100 + 96
    assert not holding_pays(1, 15, 1.0, lambda size: 10.0 * size)
    assert not holding_pays(0, 15, 1.0, fixed_part) and not holding_pays(4, 0, 1.0, fixed_part)


def test_where_the_front_end_needs_the_waves_cpus_a_late_return_is_still_worth_holding_for():
    """A first wave overlaps the others' return only where the forward leaves the
    front end CPUs of its own; where it does not, the two take turns, and one wave of
    them all saves the fixed cost whenever they come back."""
    def fixed_part(size: int) -> float:
        return 40.0 + 7.0 * size

    assert not holding_pays(8, 8, 100.0, fixed_part)  # 100 + 152 > max(96, 100) + 96
    assert holding_pays(8, 8, 100.0, fixed_part, overlaps=False)  # 252 < 96 + 100 + 96
    assert not holding_pays(1, 15, 60.0, fixed_part)  # 60 + 152 > 60 + 145
    assert holding_pays(1, 15, 60.0, fixed_part, overlaps=False)  # 212 < 47 + 60 + 145
    # no fixed cost, nothing saved either way
    assert not holding_pays(8, 8, 100.0, lambda size: 10.0 * size, overlaps=False)


def test_forwards_overlap_the_front_end_on_an_accelerator_or_where_cpus_are_left_over():
    from dataclasses import replace

    from diffbatch.config import EngineConfig
    from diffbatch.engine.batch_policy import forward_overlaps_front_end
    from diffbatch.worker.threads import usable_cpu_count
    from tests.engine.test_batch_policy import INFO

    config = EngineConfig.from_options(model="fake")
    assert forward_overlaps_front_end(config, replace(INFO, device="cuda"), env={})
    assert not forward_overlaps_front_end(config, INFO, env={})  # the worker takes every CPU
    # a thread count that is no number is ignored, as OpenMP ignores it
    assert not forward_overlaps_front_end(config, INFO, env={"OMP_NUM_THREADS": "all"})
    if usable_cpu_count() >= 2:
        one_thread = EngineConfig.from_options(model="fake", torch_num_threads=1)
        assert forward_overlaps_front_end(one_thread, INFO, env={})
        # the user's OMP_NUM_THREADS, which the worker inherits, leaves CPUs over too
        assert forward_overlaps_front_end(config, INFO, env={"OMP_NUM_THREADS": "1"})
        # ...unless torch_num_threads, which wins over it, takes them all
        every = EngineConfig.from_options(model="fake", torch_num_threads=usable_cpu_count())
        assert not forward_overlaps_front_end(every, INFO, env={"OMP_NUM_THREADS": "1"})


def test_a_loop_slow_to_come_back_is_held_for_only_where_the_front_end_shares_the_cpus():
    """16 clients back 4 ms apart (the last 64 ms after the answers): with the wave
    overlapping their return, the first back starts alone (one wave of 16 would not
    turn the loop sooner); with the front end on the wave's CPUs, it waits for them."""
    def plan(overlaps: bool):
        clock = ManualClock()
        p = policy(clock, max_num_seqs=16, overlaps=overlaps)
        teach(p, sizes=(1, 2, 4, 8, 16) * MIN_SAMPLES)  # every size known
        serve_loop(p, clock, return_gap_s=0.004)
        return first_back(p, clock)

    assert plan(overlaps=True).max_wait_ms == 0.0
    held = plan(overlaps=False)
    assert held.target == 16 and held.max_wait_ms > 0.0


def test_no_hold_where_it_does_not_pay():
    """The loop of the test above on a curve without a fixed cost: the clients come
    back, but one wave of them all would not run faster; the first starts at once."""
    clock = ManualClock()
    p = policy(clock, max_num_seqs=16)
    teach(p, wave_ms=lambda size: 10.0 * size, sizes=(1, 2, 4, 8, 16) * 4)
    serve_loop(p, clock)
    plan = first_back(p, clock)
    assert p.returns.expected().count == 15
    assert plan.max_wait_ms == 0.0


def test_a_loop_of_twice_the_capacity_tries_the_next_size():
    """Waves of 8 known, 16 never tried: 16 clients run as two full waves of 8 in turn
    and never leave a backlog beyond 8 that would try 16. With 8 waiting and the last
    wave's 8 on their way back, the wave waits for them as a trial of 16; once 16 has
    been measured, the curve decides."""
    def next_wave(answers_seen: bool, sizes=(1, 2, 4, 8), wave_ms=tiny_sd_like):
        clock = ManualClock()
        p = policy(clock)
        teach(p, wave_ms=wave_ms, sizes=sizes)
        # waves of 8 every 0.3 s, their clients back 2 ms apart
        serve_loop(p, clock, clients=8, return_gap_s=0.002, cycle_s=0.3,
                   answers_seen=answers_seen)
        return p.capacity(key()), p.plan_wait(key(), 8)

    capacity, plan = next_wave(answers_seen=True)
    assert capacity == 8 and plan.target == 16 and plan.max_wait_ms > 0.0
    capacity, plan = next_wave(answers_seen=False)
    assert capacity == 8 and plan.max_wait_ms == 0.0
    # 16 measured four times at 9.5 ms per image against 8's 12: the capacity is 16,
    # and one wave of the loop pays
    measured = (1, 2, 4, 8, 16, 16, 16, 16)
    capacity, plan = next_wave(answers_seen=True, sizes=measured)
    assert capacity == 16 and plan.target == 16
    # measured at 8's cost per image: the capacity stays 8, and 8 start at once
    capacity, plan = next_wave(answers_seen=True, sizes=measured, wave_ms=lambda size:
                               tiny_sd_like(min(size, 8)) * max(size / 8, 1))
    assert capacity == 8 and plan.max_wait_ms == 0.0


def test_the_wave_a_loop_was_held_for_runs_as_the_trial():
    """The held-for clients are back: the wave takes all 16 (not the capacity's 8 and
    8 more behind them, which the hold would have waited for in vain). Without the
    hold, 16 waiting for a moment are no sustained backlog: waves of 8."""
    def wave_after(answers_seen: bool) -> int:
        clock = ManualClock()
        p = policy(clock)
        teach(p, sizes=(1, 2, 4, 8))
        serve_loop(p, clock, clients=8, return_gap_s=0.002, cycle_s=0.3,
                   answers_seen=answers_seen)
        p.plan_wait(key(), 8)
        clock.now += 0.016  # the 8 are back
        return p.capacity(key(), 16)

    assert wave_after(answers_seen=True) == 16
    assert wave_after(answers_seen=False) == 8


def test_a_held_for_trial_ends_with_its_wave():
    clock = ManualClock()
    p = policy(clock)
    teach(p, sizes=(1, 2, 4, 8))
    serve_loop(p, clock, clients=8, return_gap_s=0.002, cycle_s=0.3)
    assert p.plan_wait(key(), 8).target == 16
    assert p.capacity(key(), 16) == 16
    p.observe_wave(key(), 16, 2 * tiny_sd_like(8))  # no gain over 8 (so far)
    assert p.capacity(key(), 16) == 8  # one trial wave per hold


def test_a_wave_measured_too_few_times_is_held_for_until_it_is_known():
    """One slow wave of 16 (dearer per image than the 15s beside it) must not keep a
    loop of 16 at waves of 1 and 15 for good: until 16 is measured `MIN_SAMPLES`
    times the loop holds for it; measured that slow every time, it does not."""
    def plan(num_slow_waves: int):
        clock = ManualClock()
        p = policy(clock, max_num_seqs=16)
        teach(p, sizes=(1, 2, 4, 8, 15) * 4)
        for _ in range(num_slow_waves):
            p.cost.observe(p.default_shape, 16, 4, 16 * 20.0)  # 20 ms per image
        serve_loop(p, clock)
        return first_back(p, clock)

    assert plan(num_slow_waves=1).target == 16
    assert plan(num_slow_waves=MIN_SAMPLES).max_wait_ms == 0.0


def test_the_admission_wait_merges_a_split_loop():
    """The two cohorts of a 16-client loop at capacity 16 under a sustained load (the
    wait rule itself starts at once): after the wave of 12, the 4 waiting do not start
    alone but wait for the 12 on their way back, one wave of 16 (with the engine's
    counts at its answers; without them the split goes on)."""
    def plan(counted: bool):
        clock = ManualClock()
        p = policy(clock, max_num_seqs=16, overlaps=False)
        teach(p, sizes=(1, 2, 4, 8, 16) * MIN_SAMPLES)
        clock.now += 60.0
        for _ in range(3):  # three seconds of the split loop
            two_cohorts(lambda size, in_engine: p.observe_answers(
                size, in_engine if counted else None),
                lambda: p.observe_arrivals(1, busy=True), clock, turns=24)
        p.observe_answers(12, 16 if counted else None)
        clock.now += 0.001
        return p.plan_wait(key(), 4)

    held = plan(counted=True)
    assert held.target == 16 and held.max_wait_ms > 0.0
    assert plan(counted=False).max_wait_ms == 0.0
