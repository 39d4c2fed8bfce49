"""The admission wait, driven by a fake clock (no real sleeping)."""

from __future__ import annotations

import threading

import pytest

from diffbatch import ConfigError, EngineConfig
from diffbatch.engine.admission import INCOMING_GRACE_MS, AdmissionWait


class Sim:
    """A fake clock whose `wait_s` advances time and applies scheduled arrivals."""

    def __init__(self, arrivals_ms=(), waiting=1, stop_at_ms=None):
        self.now = 0.0
        self.waiting = waiting
        self.arrivals = sorted(arrivals_ms)
        self.stop_at = None if stop_at_ms is None else stop_at_ms / 1000.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def wait_s(self, timeout: float) -> None:
        assert timeout > 0, "the wait must never busy-loop with a zero timeout"
        self.waits.append(timeout)
        target = self.now + timeout
        # Wake early at the next arrival, as a notify would.
        if self.arrivals and self.arrivals[0] / 1000.0 <= target:
            self.now = max(self.now, self.arrivals.pop(0) / 1000.0)
            self.waiting += 1
        else:
            self.now = target

    def stopped(self) -> bool:
        return self.stop_at is not None and self.now >= self.stop_at

    def run(self, wait: AdmissionWait) -> str:
        return wait.wait(lambda: self.waiting, self.stopped, self.wait_s, self.clock)


def test_should_wait_only_when_batching_can_use_it():
    wait = AdmissionWait(max_wait_ms=20, capacity=4)
    kwargs = dict(supports_request_batch=True, num_running=0)
    assert wait.should_wait(**kwargs)
    assert not AdmissionWait(0, 4).should_wait(**kwargs)  # off at 0 ms
    assert not AdmissionWait(20, 1).should_wait(**kwargs)  # capacity 1
    assert not wait.should_wait(**{**kwargs, "num_running": 1})  # a wave runs
    assert not wait.should_wait(**{**kwargs, "supports_request_batch": False})


def test_ends_at_capacity_as_soon_as_the_queue_fills():
    sim = Sim(arrivals_ms=[1, 2, 3], waiting=1)
    assert sim.run(AdmissionWait(max_wait_ms=100, capacity=4)) == "capacity"
    assert sim.now == pytest.approx(0.003)


def test_ends_when_queue_is_stable_for_the_window():
    # window = min(50, 100/5) = 20 ms; arrivals at 5 and 15 ms reset it.
    sim = Sim(arrivals_ms=[5, 15], waiting=1)
    assert sim.run(AdmissionWait(max_wait_ms=100, capacity=8)) == "stable"
    assert sim.now == pytest.approx(0.035)


def test_stable_window_is_capped_at_50ms():
    assert AdmissionWait(1000, 8).stable_window_ms == 50
    assert AdmissionWait(20, 8).stable_window_ms == 4


def test_ends_at_the_deadline_under_a_steady_trickle():
    # An arrival every 3 ms keeps resetting the 4 ms window; the 20 ms deadline ends it.
    sim = Sim(arrivals_ms=list(range(3, 60, 3)), waiting=1)
    assert sim.run(AdmissionWait(max_wait_ms=20, capacity=100)) == "deadline"
    assert sim.now == pytest.approx(0.020, abs=1e-9)


def test_shrinking_queue_does_not_reset_the_window():
    sim = Sim(waiting=3)
    wait = AdmissionWait(max_wait_ms=100, capacity=8)
    calls = iter([3, 2, 2, 2, 2, 2])
    reason = wait.wait(lambda: next(calls), lambda: False, sim.wait_s, sim.clock)
    assert reason == "stable" and sim.now == pytest.approx(0.020)


def test_a_request_on_its_way_in_holds_the_stable_window_open():
    """A front end is still parsing a request sent with the others (announced, not yet
    added): the window does not end until it is added, up to the deadline."""
    sim = Sim(arrivals_ms=[9], waiting=1)  # it is added 9 ms in, long after the window
    incoming = lambda: 1 if sim.now < 0.009 else 0  # noqa: E731
    wait = AdmissionWait(max_wait_ms=20, capacity=8, window_ms=2)
    assert wait.wait(lambda: sim.waiting, sim.stopped, sim.wait_s, sim.clock,
                     num_incoming=incoming) == "stable"
    assert sim.waiting == 2 and sim.now == pytest.approx(0.011)  # added, then 2 ms stable
    stuck = Sim(waiting=1)  # one that never comes (a refused body): the deadline ends it
    assert wait.wait(lambda: stuck.waiting, stuck.stopped, stuck.wait_s, stuck.clock,
                     num_incoming=lambda: 1) == "deadline"
    assert stuck.now == pytest.approx(0.020)
    # a body that keeps arriving (a slow upload) holds a long wait only briefly
    slow = Sim(waiting=1)
    long_wait = AdmissionWait(max_wait_ms=2000, capacity=8, window_ms=2)
    assert long_wait.wait(lambda: slow.waiting, slow.stopped, slow.wait_s, slow.clock,
                          num_incoming=lambda: 1) == "stable"
    assert slow.now == pytest.approx((2 + INCOMING_GRACE_MS) / 1000.0)


def test_ends_on_stop():
    sim = Sim(waiting=1, stop_at_ms=7)
    sim.arrivals = [3, 6]
    assert sim.run(AdmissionWait(max_wait_ms=1000, capacity=8)) == "stopped"


def test_real_condition_wakes_on_arrival_not_on_timeout():
    """With a real Condition, an arrival that fills capacity ends the wait at once."""
    cond = threading.Condition()
    state = {"waiting": 1}
    wait = AdmissionWait(max_wait_ms=60_000, capacity=2)  # a minute: must not time out
    result = {}

    in_wait = threading.Event()

    def wait_s(timeout: float) -> None:
        in_wait.set()
        cond.wait(timeout)

    def waiter():
        with cond:
            result["reason"] = wait.wait(lambda: state["waiting"], lambda: False, wait_s)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert in_wait.wait(timeout=30)
    with cond:  # acquirable only once the waiter sleeps inside cond.wait
        state["waiting"] = 2
        cond.notify_all()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result == {"reason": "capacity"}


def test_negative_wait_is_a_config_error():
    with pytest.raises(ConfigError, match="request_batch_max_wait_ms"):
        EngineConfig(request_batch_max_wait_ms=-1)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
