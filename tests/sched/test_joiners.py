"""Step mode's joiners: who may join the running batch, and when it must drain."""

from __future__ import annotations

from diffbatch.sched.grouped import GroupedScheduler
from diffbatch.sched.scheduler import FifoScheduler
from tests.clock import ManualClock
from tests.sched.test_grouped import make_request


def test_fifo_joiners_come_from_the_head_until_another_key_heads_the_queue():
    sched = FifoScheduler(8)
    for rid, size in [("A", 64), ("B", 64), ("C", 128), ("D", 64)]:
        sched.add_request(make_request(rid, size))
    key = sched.next_key()
    assert sched.schedule_joiners(key, 1).req_ids == ["A"]  # the limit holds
    assert sched.schedule_joiners(key, 8).req_ids == ["B"]  # C's key stops them: no overtaking
    assert sched.schedule_joiners(key, 8).is_empty
    assert sched.num_waiting == 2


def test_grouped_joiners_pass_another_key_until_it_waited_max_head_wait_ms():
    clock = ManualClock(1000.0)
    sched = GroupedScheduler(8, max_head_wait_ms=100, clock=clock)
    sched.add_request(make_request("big", 128, arrival=clock.now))
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 64, arrival=clock.now))
    small = make_request("x", 64).key
    assert sched.schedule_joiners(small, 2).req_ids == ["a", "b"]
    clock.now += 0.2  # the 128x128 request has now waited 200 ms > 100 ms
    assert sched.schedule_joiners(small, 8).is_empty  # the running batch drains
    assert sched.next_key() == make_request("y", 128).key
    assert sched.num_waiting == 2


def test_joiners_of_a_key_nobody_waits_for_are_none():
    sched = GroupedScheduler(8, clock=ManualClock(1000.0))
    sched.add_request(make_request("a", 64))
    assert sched.schedule_joiners(make_request("x", 256).key, 4).is_empty
    assert sched.num_waiting == 1
