"""The worker's thread choice, on synthetic machines and user overrides."""

from __future__ import annotations

from diffbatch.worker.threads import (
    AUTO_THREADS_ENV,
    MAX_CONTENTION,
    ThreadGovernor,
    choose_threads,
    cpu_contention,
    other_cpu_load,
    others_cpu_seconds,
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
    """A driven clock and the CPU time the other processes use, as the governor reads
    them; `work` runs one call inside the governor, `wait` passes time between calls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.others_s = 0.0
        self.set_to: list[int] = []

    def governor(self, max_threads: int = 2, current: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, current, set_threads=self.set_to.append,
                              others_cpu_s=lambda: self.others_s, clock=lambda: self.now)

    def pass_time(self, seconds: float, load: float) -> None:
        self.now += seconds
        self.others_s += load * seconds

    def work(self, governor: ThreadGovernor, seconds: float, load: float = 0.0,
             gap_s: float = 0.0, gap_load: float = 0.0, calls: int = 1) -> int:
        """`calls` calls of `seconds` each with `load` beside them, after a gap of
        `gap_s` with `gap_load`; the thread count after them."""
        for _ in range(calls):
            self.pass_time(gap_s, gap_load)
            with governor.running():
                self.pass_time(seconds, load)
        return governor.threads


def test_the_governor_gives_up_threads_at_once_and_takes_them_back_slowly():
    m = Machine()
    g = m.governor()

    def second(load: float) -> int:
        """One second of calls with `load` beside them; the count the next call finds."""
        m.work(g, 0.25, load=load, calls=4)
        return m.work(g, 0.0)  # a call takes its decision before it runs

    assert second(0.0) == 2
    assert second(1.0) == 1 and m.set_to == [1]  # a busy process appears: down at once
    assert second(0.1) == 1  # it is gone: two decisions in a row must say so
    assert second(0.9) == 1  # back for a moment: counted afresh
    assert second(0.1) == 1
    assert second(0.1) == 2 and m.set_to == [1, 2]
    assert second(0.1) == 2 and m.set_to == [1, 2]  # no change, no call


def test_load_between_calls_takes_no_thread_away_and_load_during_them_does():
    """A closed loop's front end and clients work while the worker waits for their next
    requests: averaged over a second they keep 0.8 CPUs busy, beside the waves none."""
    m = Machine()
    g = m.governor()
    assert m.work(g, 0.15, load=0.0, gap_s=0.1, gap_load=2.0, calls=40) == 2
    assert m.set_to == []
    assert m.work(g, 0.15, load=0.8, gap_s=0.1, gap_load=0.0, calls=10) == 1
    assert m.set_to == [1]


def test_a_decision_waits_for_enough_time_in_calls():
    m = Machine()
    g = m.governor()
    # short calls far apart (but not idle): less than a quarter interval in calls
    assert m.work(g, 0.01, load=2.0, gap_s=0.5, calls=20) == 2
    assert m.set_to == []
    # they add up: enough calls since the last decision decide
    assert m.work(g, 0.1, load=2.0, gap_s=0.1, calls=8) == 1


def test_a_busy_idle_stretch_takes_no_thread_away():
    m = Machine()
    g = m.governor()
    m.pass_time(30.0, load=1.5)  # busy while the worker had nothing to do
    assert m.work(g, 0.2) == 2 and m.set_to == []
    assert m.work(g, 0.2, load=1.5, calls=6) == 1  # busy beside its calls: down at once


def test_a_quiet_idle_stretch_gives_threads_back_at_once():
    """Bursts shorter than an interval, with quiet between, never make two decisions in
    a row: a count set low beside a busy process must come back between them."""
    m = Machine()
    g = m.governor(current=1)  # chosen at start-up beside a busy process
    m.pass_time(6.0, load=0.1)  # it is gone; bursts of under a second, 6 s apart
    assert m.work(g, 0.2) == 2 and m.set_to == [2]
    m.pass_time(6.0, load=1.2)  # a busy idle stretch after that: no change
    assert m.work(g, 0.2) == 2 and m.set_to == [2]
    assert m.work(g, 0.2, load=1.2, calls=6) == 1  # busy beside its calls: down at once


def test_short_bursts_between_other_work_take_their_threads_back():
    """Down to 1 thread beside a busy process, then bursts of calls 1.2 s long with
    little beside them, taking turns with 3 s of other work (a served benchmark
    alternating with a plain loop): each burst makes one decision, and two of them in a
    row give the thread back, the busy gaps between them notwithstanding."""
    m = Machine()
    g = m.governor()
    assert m.work(g, 0.1, load=1.5, calls=12) == 1
    threads = []
    for _ in range(3):
        m.pass_time(3.0, load=2.0)  # the other work, while the worker waits
        threads.append(m.work(g, 0.1, load=0.1, calls=12))
    assert threads == [1, 2, 2] and m.set_to == [1, 2]


def test_a_count_set_low_at_start_up_comes_back_at_the_first_decision():
    """The start-up count is one reading of the machine (other servers loading beside
    it, say): the first decision that finds CPUs free gives them back."""
    m = Machine()
    g = m.governor(current=1)

    def second(load: float) -> int:
        """One second of calls with `load` beside them; the count the next call finds."""
        m.work(g, 0.25, load=load, calls=4)
        return m.work(g, 0.0)

    assert second(0.1) == 2 and m.set_to == [2]
    assert second(1.5) == 1  # the governor's own down: two decisions to undo
    assert second(0.1) == 1
    assert second(0.1) == 2 and m.set_to == [2, 1, 2]


def test_the_governor_never_goes_past_its_bounds():
    m = Machine()
    g = m.governor(max_threads=4, current=4)
    assert m.work(g, 0.3, load=9.0, calls=5) == 1
    m.work(g, 0.3, load=-3.0, calls=4)  # (a reading's rounding: no load below none)
    assert m.work(g, 0.3, load=-3.0, calls=4) == 4
    assert [threads_for(4, load) for load in (0.0, 0.4, 0.6, 2.5, 3.6)] == [4, 4, 3, 2, 1]


def test_the_machine_reads_its_other_processes_cpu_time():
    before = others_cpu_seconds()
    assert isinstance(before, float)
    assert other_cpu_load(0.05) >= 0.0


def test_cpu_contention_is_the_load_per_cpu_between_one_and_its_cap():
    assert cpu_contention(0.3, 2) == 1.0  # an idle machine: work runs at full speed
    assert cpu_contention(2.0, 2) == 1.0  # every CPU busy, nothing waiting
    assert cpu_contention(7.0, 2) == 3.5  # 7 runnable processes on 2 CPUs
    assert cpu_contention(40.0, 2) == MAX_CONTENTION  # e.g. a container seeing its host's load
    assert 1.0 <= cpu_contention() <= MAX_CONTENTION  # this machine, now
