"""CPU lists for `worker_cpus`: parsing, validation in EngineConfig and the CLI."""

from __future__ import annotations

import os

import pytest

from diffbatch import ConfigError, EngineConfig
from diffbatch.cpus import parse_cpu_list


@pytest.mark.parametrize(("text", "cpus"), [("1", {1}), ("0-3", {0, 1, 2, 3}),
                                             (" 0, 2-3 ,6", {0, 2, 3, 6}), ("4-4", {4})])
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "why"), [("", "got ''"), ("one", "'one' is not a CPU id"),
                                           ("3-1", "not an increasing range"),
                                           ("-1", "'-1' is not a CPU id"),
                                           ("1,,2", "'' is not a CPU id")])
def test_bad_cpu_lists_say_what_was_expected_and_given(text, why):
    with pytest.raises(ValueError, match="expected a CPU list such as '1' or '0-3,6'") as info:
        parse_cpu_list(text)
    assert why in str(info.value)


def test_engine_config_checks_worker_cpus():
    allowed = sorted(os.sched_getaffinity(0))
    assert EngineConfig(worker_cpus=str(allowed[-1])).worker_cpus == str(allowed[-1])
    with pytest.raises(ConfigError, match="`worker_cpus` must be a CPU list"):
        EngineConfig(worker_cpus="x")
    with pytest.raises(ConfigError, match=r"needs executor='mp', got 'inproc'"):
        EngineConfig(worker_cpus=str(allowed[0]), executor="inproc")
    missing = (os.cpu_count() or 1) + 1000
    with pytest.raises(ConfigError, match=rf"does not have: \[{missing}\]"):
        EngineConfig(worker_cpus=f"{missing}")

