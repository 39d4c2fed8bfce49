"""The worker's thread choice, on synthetic machines and user overrides."""

from __future__ import annotations

from diffbatch.worker.threads import (
    AUTO_THREADS_ENV,
    MAX_CONTENTION,
    LoadMeter,
    ThreadGovernor,
    choose_threads,
    cpu_contention,
    other_cpu_load,
    threads_for,
    usable_cpu_count,
)


def test_an_idle_machine_keeps_openmps_default_wait_and_uses_every_cpu():
    choice = choose_threads(usable_cpus=8, other_load=0.3, env={})
    assert (choice.num_threads, choice.wait_policy) == (8, None)
    env: dict[str, str] = {}
    choice.apply(env)
    assert env == {"OMP_NUM_THREADS": "8", AUTO_THREADS_ENV: "8"}


def test_a_busy_machine_gets_the_threads_the_other_processes_leave_free():
    choice = choose_threads(usable_cpus=2, other_load=1.0, env={})
    assert (choice.num_threads, choice.wait_policy, choice.auto_max) == (1, None, 2)
    assert "other processes keep 1.0 busy" in choice.reason
    assert choose_threads(usable_cpus=2, other_load=1.8, env={}).num_threads == 1
    assert choose_threads(usable_cpus=8, other_load=2.6, env={}).num_threads == 5
    env: dict[str, str] = {}
    choice.apply(env)
    assert env == {"OMP_NUM_THREADS": "1", AUTO_THREADS_ENV: "2"}


def test_a_users_thread_count_beyond_the_free_cpus_waits_passively():
    choice = choose_threads(usable_cpus=2, other_load=1.8, env={}, torch_num_threads=2)
    assert (choice.num_threads, choice.wait_policy, choice.auto_max) == (2, "PASSIVE", None)
    assert "leave 1 of 2 CPUs free" in choice.reason
    env = {"OMP_NUM_THREADS": "2"}
    assert choose_threads(usable_cpus=2, other_load=1.2, env=env).wait_policy == "PASSIVE"
    assert choose_threads(usable_cpus=2, other_load=0.2, env=env).wait_policy is None


def test_the_users_settings_win():
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    choice = choose_threads(usable_cpus=2, other_load=5.0, env=env)
    assert (choice.num_threads, choice.wait_policy) == (None, None)
    out = {**env, AUTO_THREADS_ENV: "2"}  # e.g. inherited from an engine's own worker
    choice.apply(out)
    assert out == env
    explicit = choose_threads(usable_cpus=16, other_load=0.0, env=env, torch_num_threads=4)
    assert explicit.num_threads == 4 and "torch_num_threads" in explicit.reason


def test_one_cpu_machine():
    assert choose_threads(usable_cpus=1, other_load=0.0, env={}).num_threads == 1
    busy = choose_threads(usable_cpus=1, other_load=0.6, env={})
    assert (busy.num_threads, busy.wait_policy) == (1, None)  # one thread spins on nothing


def test_machine_probes_answer_sane_numbers():
    assert usable_cpu_count() >= 1
    assert usable_cpu_count(frozenset({0})) == 1
    assert other_cpu_load(0.05) >= 0.0


class Machine:
    """A driven clock and the other processes' load the governor will measure."""

    def __init__(self) -> None:
        self.now = 0.0
        self.load = 0.0
        self.set_to: list[int] = []

    def governor(self, max_threads: int = 2, current: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, current, set_threads=self.set_to.append,
                              load_since=lambda: self.load, clock=lambda: self.now)

    def after(self, seconds: float, governor: ThreadGovernor) -> int:
        self.now += seconds
        governor.poll()
        return governor.threads


def test_the_governor_gives_up_threads_at_once_and_takes_them_back_slowly():
    m = Machine()
    g = m.governor()
    assert m.after(0.5, g) == 2  # not due yet
    m.load = 1.0  # a busy process appears
    assert m.after(0.6, g) == 1 and m.set_to == [1]
    m.load = 0.1  # it is gone: two intervals in a row must say so
    assert m.after(1.5, g) == 1
    m.load = 0.9  # back for a moment: the count of intervals starts again
    assert m.after(1.5, g) == 1
    m.load = 0.1
    assert m.after(1.5, g) == 1
    assert m.after(1.5, g) == 2 and m.set_to == [1, 2]
    assert m.after(1.5, g) == 2 and m.set_to == [1, 2]  # no call without a change


def test_a_busy_idle_stretch_takes_no_thread_away():
    m = Machine()
    g = m.governor()
    m.load = 1.5  # busy while the worker had nothing to do
    assert m.after(30.0, g) == 2 and m.set_to == []
    assert m.after(1.5, g) == 1  # still busy over the interval that followed


def test_a_quiet_idle_stretch_gives_threads_back_at_once():
    """Bursts shorter than an interval, with quiet between, never make two intervals in
    a row: a count set low beside a busy process must come back between them."""
    m = Machine()
    g = m.governor(current=1)  # chosen at start-up beside a busy process
    m.load = 0.1  # it is gone; bursts of under a second, 6 s apart
    assert m.after(6.0, g) == 2 and m.set_to == [2]
    m.load = 1.2  # a busy idle stretch after that: no change
    assert m.after(6.0, g) == 2 and m.set_to == [2]
    assert m.after(1.2, g) == 1  # busy over an interval of serving: down at once


def test_the_governor_never_goes_past_its_bounds():
    m = Machine()
    g = m.governor(max_threads=4, current=4)
    m.load = 9.0
    assert m.after(1.5, g) == 1
    m.load = -3.0
    m.after(1.5, g)
    assert m.after(1.5, g) == 4
    assert [threads_for(4, load) for load in (0.0, 0.4, 0.6, 2.5, 3.6)] == [4, 4, 3, 2, 1]


def test_the_load_meter_reads_this_machine():
    meter = LoadMeter()
    assert meter.other_load_since_last() == 0.0  # the first reading starts an interval
    assert meter.other_load_since_last() >= 0.0


def test_cpu_contention_is_the_load_per_cpu_between_one_and_its_cap():
    assert cpu_contention(0.3, 2) == 1.0  # an idle machine: work runs at full speed
    assert cpu_contention(2.0, 2) == 1.0  # every CPU busy, nothing waiting
    assert cpu_contention(7.0, 2) == 3.5  # 7 runnable processes on 2 CPUs
    assert cpu_contention(40.0, 2) == MAX_CONTENTION  # e.g. a container seeing its host's load
    assert 1.0 <= cpu_contention() <= MAX_CONTENTION  # this machine, now
