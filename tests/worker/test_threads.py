"""The worker's thread choice at start-up, on synthetic machines and user overrides."""

from __future__ import annotations

from diffbatch.worker.threads import (
    MAX_CONTENTION,
    choose_threads,
    cpu_contention,
    shares_cpus_with_this_process,
    usable_cpu_count,
)


def test_the_worker_gets_a_thread_per_cpu_it_may_use_and_openmps_default_wait():
    choice = choose_threads(usable_cpus=8, env={})
    assert (choice.num_threads, choice.wait_policy) == (8, None)
    env: dict[str, str] = {}
    choice.apply(env)
    assert env == {"OMP_NUM_THREADS": "8"}
    assert "8 torch threads: the CPUs the worker may use" in choice.reason


def test_a_users_thread_count_beyond_the_usable_cpus_waits_passively():
    choice = choose_threads(usable_cpus=2, env={}, torch_num_threads=4)
    assert (choice.num_threads, choice.wait_policy) == (4, "PASSIVE")
    assert "4 threads on 2 CPUs" in choice.reason
    assert choose_threads(usable_cpus=2, env={"OMP_NUM_THREADS": "3"}).wait_policy == "PASSIVE"
    assert choose_threads(usable_cpus=2, env={"OMP_NUM_THREADS": "2"}).wait_policy is None


def test_the_users_settings_win():
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    choice = choose_threads(usable_cpus=2, env=env)
    assert (choice.num_threads, choice.wait_policy) == (None, None)
    out = dict(env)
    choice.apply(out)
    assert out == env
    explicit = choose_threads(usable_cpus=16, env=env, torch_num_threads=4)
    assert explicit.num_threads == 4 and "torch_num_threads" in explicit.reason


def test_one_cpu_machine():
    choice = choose_threads(usable_cpus=1, env={})
    assert (choice.num_threads, choice.wait_policy) == (1, None)


def test_machine_probes_answer_sane_numbers():
    assert usable_cpu_count() >= 1
    assert usable_cpu_count(frozenset({0})) == 1


def test_cpu_contention_is_the_load_per_cpu_between_one_and_its_cap():
    assert cpu_contention(0.3, 2) == 1.0  # an idle machine: work runs at full speed
    assert cpu_contention(2.0, 2) == 1.0  # every CPU busy, nothing waiting
    assert cpu_contention(7.0, 2) == 3.5  # 7 runnable processes on 2 CPUs
    assert cpu_contention(40.0, 2) == MAX_CONTENTION  # e.g. a container seeing its host's load
    assert 1.0 <= cpu_contention() <= MAX_CONTENTION  # this machine, now


def test_a_worker_sharing_its_cpus_with_the_front_end_leaves_it_one():
    """Two shared CPUs: one torch thread, so no parallel region waits on a thread whose
    core the front end or a neighbour took; more CPUs: all but one."""
    two = choose_threads(usable_cpus=2, env={}, shares_front_end=True)
    assert (two.num_threads, two.wait_policy) == (1, None)
    assert "less one left to the server's front end" in two.reason
    assert choose_threads(usable_cpus=16, env={}, shares_front_end=True).num_threads == 15
    assert choose_threads(usable_cpus=1, env={}, shares_front_end=True).num_threads == 1
    # pinned apart from the front end: every CPU it was given
    assert choose_threads(usable_cpus=2, env={}, shares_front_end=False).num_threads == 2
    # the user's count wins
    assert choose_threads(usable_cpus=2, env={}, torch_num_threads=2,
                          shares_front_end=True).num_threads == 2
    assert choose_threads(usable_cpus=2, env={"OMP_NUM_THREADS": "2"},
                          shares_front_end=True).num_threads is None


def test_sharing_is_read_from_the_pinned_cpus_and_ours():
    import os

    ours = os.sched_getaffinity(0)
    assert shares_cpus_with_this_process(None)
    assert shares_cpus_with_this_process(frozenset(ours))
    assert not shares_cpus_with_this_process(frozenset({max(ours) + 1}))
