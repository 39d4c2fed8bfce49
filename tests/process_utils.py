"""Waiting on other processes and threads from tests: worker processes found in /proc
and waited on with pidfds, and a bounded poll for state another thread or process
changes (where there is nothing to wait on)."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diffbatch.ipc import shm

SHM_DIR = Path("/dev/shm")  # where Linux shows POSIX shared memory and named semaphores


def segments_of(pid: int) -> list[str]:
    """Names of the shared-memory segments process `pid` created that still exist."""
    return [p.name for p in SHM_DIR.iterdir() if p.name.startswith(shm.segment_prefix(pid))]


def fork_server_pids(parent_pid: int) -> set[int]:
    """Pids of the live fork servers (`diffbatch.worker.forkserver`) a process started."""
    return {pid for pid, (ppid, cmdline) in _live_processes().items()
            if ppid == parent_pid and b"diffbatch.worker.forkserver" in cmdline}


def _live_processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every live (not zombie) process."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, ...
        if fields[0] != "Z":
            procs[int(entry.name)] = (int(fields[1]), cmdline)
    return procs


def worker_pids(parent_pid: int) -> set[int]:
    """Pids of the live (not zombie) worker processes a process started: its
    `python -m diffbatch.worker` children, and the workers its fork servers forked
    (`diffbatch.executor.forkserver`)."""
    procs = _live_processes()
    servers = {parent_pid} | {pid for pid, (ppid, cmdline) in procs.items()
                              if ppid == parent_pid and b"diffbatch.worker.forkserver" in cmdline}
    return {pid for pid, (ppid, cmdline) in procs.items()
            if ppid in servers and b"diffbatch.worker" in cmdline
            and b"diffbatch.worker.forkserver" not in cmdline}


def wait_gone(pid: int, timeout_s: float = 120.0) -> bool:
    """Wait on the process's pidfd until `pid` has exited; False after `timeout_s`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 30.0,
               what: str = "condition", poll_s: float = 0.01) -> None:
    """Poll `predicate` every `poll_s` until it holds; fail after `timeout_s`.

    A bounded check of state that changes on another thread or process (e.g. an abort
    reaching the engine); the deadline only bounds a broken test, nothing asserts on
    timing.
    """
    idle = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        idle.wait(poll_s)
