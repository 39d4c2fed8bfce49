"""Workers forked from a fork server (`diffbatch.executor.forkserver`): who forks them,
what a replacement costs, and what happens when the fork server itself is gone.

Each test starts an executor on the fake pipeline of `test_multiproc.py` (by dotted
name, as a user's pipeline class is given) with a start-up environment of its own, so
it gets a fork server of its own too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from diffbatch.errors import EngineDeadError
from diffbatch.executor import forkserver
from diffbatch.executor.multiproc import MultiprocExecutor
from tests.executor.test_multiproc import (
    DEADLINE_S,
    FakeWorkerPipeline,
    make_config,
    run_one,
)
from tests.executor.test_multiproc import request as fake_request
from tests.process_utils import wait_gone
from tests.process_utils import wait_until as poll_until

pytestmark = pytest.mark.slow

SETTING = "FORKED_WORKER_SETTING"  # read by the worker at run time, not at import


class SettingPipeline(FakeWorkerPipeline):
    """Reports the worker's `$FORKED_WORKER_SETTING` in each output's metadata."""

    def _one(self, request, index):
        output = super()._one(request, index)
        output.metadata["setting"] = os.environ.get(SETTING)
        return output


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.fixture
def own_fork_server(monkeypatch, request):
    """An environment no other test's executor has: a fork server of this test's own."""
    monkeypatch.setenv("DIFFBATCH_TEST_FORK_SERVER", request.node.name)


def test_a_worker_and_its_replacement_are_forked_by_one_fork_server(own_fork_server):
    ex = MultiprocExecutor(make_config())
    try:
        first = ex.worker_pid
        server = parent_of(first)
        assert server != os.getpid()
        assert b"diffbatch.worker.forkserver" in cmdline(server)
        assert parent_of(server) == os.getpid()
        # `ps` shows the forked child as a worker, not as a second fork server
        assert b"-m diffbatch.worker --conn-fd" in cmdline(first)
        os.kill(first, signal.SIGKILL)
        assert wait_gone(first)
        with pytest.raises(EngineDeadError, match=r"exit code -9 \(SIGKILL\)"):
            ex.check_health()  # the exit code came through the fork server
        assert ex.wait_healthy(DEADLINE_S)
        assert parent_of(ex.worker_pid) == server
        assert run_one(ex, fake_request("after")).ok
    finally:
        ex.shutdown()


def test_a_worker_gets_its_engines_environment_from_a_shared_fork_server(
        own_fork_server, monkeypatch):
    """Two engines whose environments differ only in a variable no library reads
    while it loads share one fork server, and each worker sees its engine's value."""
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv(SETTING, value)
        ex = MultiprocExecutor(make_config(f"{__name__}.SettingPipeline"))
        try:
            seen.append((parent_of(ex.worker_pid),
                         run_one(ex, fake_request(value)).metadata["setting"]))
        finally:
            ex.shutdown()
    (first_server, first), (second_server, second) = seen
    assert (first, second) == ("first", "second")
    assert first_server == second_server


def test_spawn_starts_each_worker_as_its_own_program(own_fork_server, monkeypatch):
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "spawn")
    ex = MultiprocExecutor(make_config())
    try:
        assert parent_of(ex.worker_pid) == os.getpid()
        assert run_one(ex, fake_request("spawned")).ok
    finally:
        ex.shutdown()


def test_a_killed_fork_server_costs_no_request(own_fork_server):
    """Its worker serves on; when that worker dies, its exit code is unknown (its
    parent is gone) and the replacement comes from a new fork server."""
    ex = MultiprocExecutor(make_config())
    try:
        worker = ex.worker_pid
        server = parent_of(worker)
        os.kill(server, signal.SIGKILL)
        assert wait_gone(server)
        assert run_one(ex, fake_request("served")).ok
        os.kill(worker, signal.SIGKILL)
        assert wait_gone(worker)
        with pytest.raises(EngineDeadError,
                           match=f"exit code {forkserver.UNKNOWN_EXIT_CODE}"):
            ex.check_health()
        assert ex.wait_healthy(DEADLINE_S)
        assert parent_of(ex.worker_pid) not in (server, os.getpid())
        assert run_one(ex, fake_request("replaced")).ok
    finally:
        ex.shutdown()


def test_idle_fork_servers_close_and_take_nothing_else_with_them(own_fork_server,
                                                                 monkeypatch):
    """An idle fork server is closed when the next one starts, and a fork server
    closes itself once its last worker is gone. Closing one must not close the
    descriptors the next one reuses (its lifeline: it would exit at once)."""
    ex = MultiprocExecutor(make_config())
    first = parent_of(ex.worker_pid)
    ex.shutdown()
    monkeypatch.setattr(forkserver, "IDLE_CLOSE_S", 0.1)
    (handle,) = [s for s in forkserver._servers.values() if s.process.pid == first]
    poll_until(lambda: handle.idle_for(time.monotonic()) >= 0.1,
               what="the first fork server to be idle")
    monkeypatch.setenv("DIFFBATCH_TEST_FORK_SERVER", "another environment")
    ex = MultiprocExecutor(make_config())
    try:
        second = parent_of(ex.worker_pid)
        assert b"diffbatch.worker.forkserver" in cmdline(second)
        assert wait_gone(first, 30.0), "the idle fork server was not closed"
        assert run_one(ex, fake_request("served")).ok
    finally:
        ex.shutdown()
    assert wait_gone(second, 30.0), "the fork server outlived its last worker"


@pytest.mark.parametrize(("device", "method", "forked"), [
    ("cpu", "", True),
    ("cuda", "", False),  # a library in the fork server could have initialised CUDA
    ("cuda:1", "forkserver", True),
    ("cpu", "spawn", False),
])
def test_workers_are_forked_on_the_cpu_unless_told(monkeypatch, device, method, forked):
    monkeypatch.setenv(forkserver.START_METHOD_ENV, method)
    assert forkserver.fork_allowed(device) is forked
