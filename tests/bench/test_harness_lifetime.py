"""A benchmark killed with SIGKILL leaves nothing running: the servers its harness
started, and their workers, die with it (`die_with_this_process` in the harness, then
each worker's lifeline to its server)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.bench.smoke import BENCHMARKS, REPO_ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the parent-death signal is Linux's"),
]

# A benchmark in miniature: one diffbatch server (and its worker) through the harness,
# its pid printed once it is healthy, then nothing until it is killed.
BENCHMARK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {bench_dir!r})
    from peers_servers import harness

    spec = harness.diffbatch_spec("tiny-sd", threads=1, max_num_seqs=2, wait_ms=0)
    with harness.running([spec], startup_timeout_s=120) as servers:
        print(servers["diffbatch"].process.pid, flush=True)
        time.sleep(600)
""")


def children_of(pids: set[int]) -> set[int]:
    """The live processes whose parent is in `pids`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in pids:
            stat = process_stat(int(entry))
            if stat is not None and int(stat[1]) in pids:
                found.add(int(entry))
    return found


def process_stat(pid: int) -> list[str] | None:
    """Fields 3 on of /proc/PID/stat (state, ppid, ...); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def alive(pid: int) -> bool:
    stat = process_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has exited


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The benchmark's first line of output; fails at once if it exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            assert line, f"the benchmark exited ({proc.wait()}) before its servers were up"
            return line
    raise AssertionError(f"no server up after {timeout_s:.0f} s")


def test_sigkill_of_a_benchmark_stops_its_servers_and_workers(tmp_path: Path) -> None:
    script = tmp_path / "benchmark.py"
    script.write_text(BENCHMARK.format(bench_dir=str(BENCHMARKS)))
    bench = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    started: set[int] = set()
    try:
        server = int(read_line(bench, timeout_s=150))
        started = {server} | children_of({server})
        started |= children_of(started)
        assert len(started) >= 2, "expected the server and its worker"
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling other processes' exit
        survivors = sorted(pid for pid in started if alive(pid))
        assert not survivors, f"still running after the benchmark's SIGKILL: {survivors}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in started:  # nothing of a failed run is left to load later tests
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
