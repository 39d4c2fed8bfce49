"""The worker's thread choice, on synthetic machines and user overrides."""

from __future__ import annotations

from diffbatch.worker.threads import choose_threads, other_cpu_load, usable_cpu_count


def test_an_idle_machine_keeps_openmps_default_wait_and_uses_every_cpu():
    choice = choose_threads(usable_cpus=8, other_load=0.3, env={})
    assert (choice.num_threads, choice.wait_policy) == (8, None)
    env: dict[str, str] = {}
    choice.apply(env)
    assert env == {"OMP_NUM_THREADS": "8"}


def test_a_busy_machine_makes_openmp_wait_passively():
    choice = choose_threads(usable_cpus=2, other_load=1.8, env={})
    assert (choice.num_threads, choice.wait_policy) == (2, "PASSIVE")
    assert "other processes keep 1.8 of 2 CPUs busy" in choice.reason


def test_the_users_settings_win():
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    choice = choose_threads(usable_cpus=2, other_load=5.0, env=env)
    assert (choice.num_threads, choice.wait_policy) == (None, None)
    out = dict(env)
    choice.apply(out)
    assert out == env
    explicit = choose_threads(usable_cpus=16, other_load=0.0, env=env, torch_num_threads=4)
    assert explicit.num_threads == 4 and "torch_num_threads" in explicit.reason


def test_one_cpu_machine():
    assert choose_threads(usable_cpus=1, other_load=0.0, env={}).num_threads == 1
    assert choose_threads(usable_cpus=1, other_load=0.6, env={}).wait_policy == "PASSIVE"


def test_machine_probes_answer_sane_numbers():
    assert usable_cpu_count() >= 1
    assert usable_cpu_count(frozenset({0})) == 1
    assert other_cpu_load(0.05) >= 0.0
