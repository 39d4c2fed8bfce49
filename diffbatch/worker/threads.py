"""The worker's CPU threads: how many torch threads, and how OpenMP's idle threads wait.

Both must be settled before the worker imports torch (OpenMP reads its environment
once), so the executor chooses them from the machine it finds and puts them in the
worker's environment:

- **threads**: the CPUs the worker may run on (its affinity, `worker_cpus`, and a
  cgroup CPU quota), which is what a plain script gets from torch on an unshared
  machine; `torch_num_threads` / `--torch-threads` or the user's `OMP_NUM_THREADS`
  win;
- **wait policy**: OpenMP's default (threads spin a little after a parallel region,
  then sleep) is what makes a small model fast: forcing `PASSIVE` makes every
  region pay a thread wake-up, several times slower at batch 1
  (docs/benchmarks.md). Spinning only hurts when other busy processes want the same
  cores: a team thread that the kernel deschedules for another process holds up
  every region it is in, and the others spin meanwhile (`benchmarks/
  threads_under_load.py`, a 64x64 `tiny-sd` forward beside one busy process, batch 1 /
  8: 112 / 366 ms with 2 spinning threads, 31 / 53 ms with 2 passive ones, 20 / 65 ms
  with 1 thread). So the threads are the
  CPUs the other processes leave free: `threads_for(usable, other_load)`, the other
  load measured over `LOAD_WINDOW_S` from /proc/stat with this process's own time
  left out. A user's thread count that is more than the CPUs left free gets
  `PASSIVE`. The user's own `OMP_WAIT_POLICY` wins.

The load changes while the worker serves, so a thread count chosen here is followed
by the worker's `ThreadGovernor`, which measures the other processes' load every
`GOVERN_INTERVAL_S` between waves (or ticks) and moves torch's thread count to the
CPUs they leave free: down at once, up after two intervals in a row say so, or at once
after the worker sat idle on a quiet machine. A thread count the user set is never
changed.

The choice is logged, and the start-up calibration then measures the wave times it
gives (`diffbatch.engine.calibration`). On CUDA the forward runs on the GPU and
these settings only affect the CPU work around it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

LOAD_WINDOW_S = 0.2  # how long the executor watches the machine before starting a worker
GOVERN_INTERVAL_S = 1.0  # how often a serving worker re-measures the machine's load
# Set in the worker's environment when the executor chose its thread count: the most
# threads the worker's `ThreadGovernor` may use (absent: the user's count, left alone).
AUTO_THREADS_ENV = "DIFFBATCH_AUTO_THREADS"


def threads_for(usable_cpus: int, other_load: float) -> int:
    """The torch threads for `usable_cpus` CPUs when other processes keep `other_load`
    of them busy: the CPUs they leave free, rounded (at least 1)."""
    return max(1, min(usable_cpus, int(usable_cpus - other_load + 0.5)))


@dataclass(frozen=True)
class ThreadChoice:
    """What the worker's environment gets, and why (for the start-up log)."""

    num_threads: int | None  # OMP_NUM_THREADS to set; None: leave it as it is
    wait_policy: str | None  # OMP_WAIT_POLICY to set; None: leave it as it is
    reason: str
    auto_max: int | None = None  # chosen here: the most a governor may use (else None)

    def apply(self, env: dict[str, str]) -> None:
        if self.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        if self.wait_policy is not None:
            env["OMP_WAIT_POLICY"] = self.wait_policy
        if self.auto_max is not None:
            env[AUTO_THREADS_ENV] = str(self.auto_max)
        else:
            env.pop(AUTO_THREADS_ENV, None)


def choose_threads(
    *,
    usable_cpus: int,
    other_load: float,
    env: Mapping[str, str],
    torch_num_threads: int | None = None,
) -> ThreadChoice:
    """The rule of the module docstring, on the numbers given (so tests can drive it).

    Args:
        usable_cpus: CPUs the worker may use (affinity, pinning and quota applied).
        other_load: CPUs kept busy by other processes when the worker starts.
        env: the environment the worker would inherit.
        torch_num_threads: the config's explicit thread count, if any.
    """
    usable = max(1, usable_cpus)
    free = threads_for(usable, other_load)
    reasons = []
    auto_max = None
    if torch_num_threads is not None:
        threads: int | None = torch_num_threads
        reasons.append(f"{torch_num_threads} torch threads (torch_num_threads)")
    elif "OMP_NUM_THREADS" in env:
        threads = None
        reasons.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (yours)")
    else:
        threads, auto_max = free, usable
        reasons.append(f"{free} torch threads: {usable} usable CPUs, other processes keep "
                       f"{other_load:.1f} busy (followed while serving)")
    fixed = threads if threads is not None else _int_or_none(env.get("OMP_NUM_THREADS"))
    if "OMP_WAIT_POLICY" in env:
        policy = None
        reasons.append(f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} (yours)")
    elif fixed is not None and fixed > 1 and fixed > free:
        policy = "PASSIVE"
        reasons.append(f"OpenMP waits passively: {fixed} threads where other processes "
                       f"leave {free} of {usable} CPUs free, spinning threads would fight them")
    else:
        policy = None
        reasons.append("OpenMP's default wait")
    return ThreadChoice(threads, policy, "; ".join(reasons), auto_max)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class ThreadGovernor:
    """Torch's thread count, following the other processes' load (module docstring).

    `poll()` is called between waves (or ticks): at most once per `interval_s` it
    measures the load since the last measurement and sets the thread count with
    `set_threads` when it should change. A measurement over more than two intervals
    (the worker had nothing to do) can only give threads back, at once, and starts
    the next interval.
    """

    def __init__(self, max_threads: int, current: int, *,
                 set_threads: Callable[[int], None],
                 load_since: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 interval_s: float = GOVERN_INTERVAL_S,
                 log: Callable[[str], None] | None = None) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = max(1, min(current, self.max_threads))
        self._set = set_threads
        self._load_since = load_since or LoadMeter().other_load_since_last
        self._clock = clock
        self._interval_s = interval_s
        self._log = log
        self._last = clock()
        self._load_since()  # start the first interval now
        self._ups = 0  # intervals in a row that asked for more threads

    def poll(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        if elapsed < self._interval_s:
            return
        self._last = now
        other = self._load_since()
        target = threads_for(self.max_threads, other)
        if elapsed > 2 * self._interval_s:
            # The worker sat idle. A busy stretch says little about now (a benchmark's
            # plain loop, say), so it takes no thread away. A quiet one gives back what
            # the load took: bursts shorter than an interval with quiet between never
            # make two busy intervals in a row, and a count set low at start-up beside
            # a busy process stayed low for them (tiny-sd 64x64, bursts of 64: 72
            # against 98 requests/s). A load that comes back takes them at the next
            # interval.
            if target > self.threads:
                self._change(target, other)
            self._ups = 0
            return
        if target > self.threads:
            self._ups += 1
            if self._ups < 2:
                return
        self._ups = 0
        if target != self.threads:
            self._change(target, other)

    def _change(self, target: int, other: float) -> None:
        if self._log is not None:
            self._log(f"torch threads {self.threads} -> {target}: other processes kept "
                      f"{other:.1f} of {self.max_threads} CPUs busy")
        self.threads = target
        self._set(target)


class LoadMeter:
    """The CPUs other processes kept busy between two readings (this process's own
    CPU time left out), from /proc/stat; 0 where it cannot be read."""

    def __init__(self) -> None:
        self._last: tuple[int, float, float] | None = None

    def other_load_since_last(self) -> float:
        try:
            reading = (_busy_ticks(), time.process_time(), time.monotonic())
            ticks = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError):
            return 0.0
        last, self._last = self._last, reading
        if last is None or reading[2] <= last[2]:
            return 0.0
        others = (reading[0] - last[0]) / ticks - (reading[1] - last[1])
        return max(0.0, others / (reading[2] - last[2]))


def usable_cpu_count(pinned: frozenset[int] | None = None) -> int:
    """CPUs this process (or the pinned set) may use, a cgroup CPU quota applied."""
    try:
        cpus = len(pinned) if pinned else len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota + 0.5)))
    return max(1, cpus)


MAX_CONTENTION = 4.0  # `cpu_contention` never says more than this (see there)


def cpu_contention(load_average: float | None = None, usable_cpus: int | None = None,
                   ) -> float:
    """How many times slower than on an idle machine CPU work may run now: the
    1-minute load average (runnable processes) per usable CPU, between 1 and
    `MAX_CONTENTION`; 1 where the load average cannot be read.

    The cap keeps a host's load average, which a container sees in place of its own,
    from stretching what depends on it without end.
    """
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (OSError, AttributeError):
            return 1.0
    cpus = usable_cpus if usable_cpus is not None else usable_cpu_count()
    return min(MAX_CONTENTION, max(1.0, load_average / max(1, cpus)))


def _cgroup_cpu_quota() -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` quota; None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def other_cpu_load(window_s: float = LOAD_WINDOW_S) -> float:
    """CPUs kept busy by other processes over the next `window_s` (0 where unknown)."""
    meter = LoadMeter()
    meter.other_load_since_last()  # the first reading starts the window
    time.sleep(window_s)  # a measurement window, not a synchronisation
    return meter.other_load_since_last()


def _busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


__all__ = ["AUTO_THREADS_ENV", "LoadMeter", "ThreadChoice", "ThreadGovernor", "choose_threads",
           "cpu_contention", "other_cpu_load", "threads_for", "usable_cpu_count"]
