"""Finding and waiting on worker processes from tests: /proc and pidfds, no sleep loops."""

from __future__ import annotations

import os
import select
from pathlib import Path


def worker_pids(parent_pid: int) -> set[int]:
    """Pids of the live (not zombie) `python -m diffbatch.worker` children of a process."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, ...
        if int(fields[1]) == parent_pid and b"diffbatch.worker" in cmdline \
                and fields[0] != "Z":
            found.add(int(entry.name))
    return found


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
