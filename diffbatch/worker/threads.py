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
by the worker's `ThreadGovernor`, which measures the other processes' load while the
worker computes (their CPU time during its waves or ticks) and every
`GOVERN_INTERVAL_S` moves torch's thread count to the CPUs they leave free: down at
once, up after two intervals in a row say so, or at once after the worker sat idle on
a quiet machine. A thread count the user set is never changed.

The choice is logged, and the start-up calibration then measures the wave times it
gives (`diffbatch.engine.calibration`). On CUDA the forward runs on the GPU and
these settings only affect the CPU work around it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

LOAD_WINDOW_S = 0.2  # how long the executor watches the machine before starting a worker
GOVERN_INTERVAL_S = 1.0  # how often a serving worker re-measures the machine's load
# A decision waits until the worker's calls since the last one ran this share of an
# interval: their load is what it goes by.
MIN_BUSY_SHARE = 0.25
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
    fixed = threads if threads is not None else omp_num_threads(env)
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


def omp_num_threads(env: Mapping[str, str]) -> int | None:
    """The thread count `env`'s `OMP_NUM_THREADS` sets: a positive number, else None
    (unset, or a value OpenMP ignores too)."""
    try:
        value = int(env["OMP_NUM_THREADS"])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


class ThreadGovernor:
    """Torch's thread count, following the other processes' load (module docstring).

    The worker runs each call (or tick) inside `running()`. What counts is what other
    processes take while the worker computes: that is what slows its threads down. Their
    load while it sits idle says nothing about that, and on a server it is mostly the
    server's own front end: a closed loop of clients is answered, encodes and sends its
    next requests while the worker waits for them, one after the other (measured on 2
    CPUs, tiny-sd 64x64, 16 clients: averaged over each second, the front end and the
    clients kept 0.6 CPUs busy and the count flapped between 2 and 1 every second or
    two, though nothing ran beside the waves).

    At most once per `interval_s`, and once the calls since the last decision ran
    `MIN_BUSY_SHARE` of an interval, the other processes' CPU time during those calls
    over their length gives the load, and the thread count is set with `set_threads`
    where it should change: down at once, up after two decisions in a row say so
    (however long the gaps between them; after one where the count is still the
    start-up's). A gap of more than two intervals between calls (the worker had
    nothing to do) is measured too, and can only give threads back, at once.
    """

    def __init__(self, max_threads: int, current: int, *,
                 set_threads: Callable[[int], None],
                 others_cpu_s: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 interval_s: float = GOVERN_INTERVAL_S,
                 log: Callable[[str], None] | None = None) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = max(1, min(current, self.max_threads))
        self._set = set_threads
        self._others_cpu_s = others_cpu_s or others_cpu_seconds
        self._clock = clock
        self._interval_s = interval_s
        self._log = log
        self._last = clock()  # the last decision
        self._idle_since = (self._last, self._others_cpu_s())  # the last call's end
        self._busy_s = 0.0  # time in calls since the last decision
        self._busy_others_s = 0.0  # other processes' CPU time during them
        # decisions in a row that asked for more threads; a count below the most at
        # start-up counts as one (it is one reading of the machine, often while other
        # servers load beside it), so the first decision that asks gives it back
        self._ups = 1 if self.threads < self.max_threads else 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one call (or tick): decide first, then measure while it runs."""
        now, others = self._clock(), self._others_cpu_s()
        self._decide(now, others)
        try:
            yield
        finally:
            end, end_others = self._clock(), self._others_cpu_s()
            self._busy_s += end - now
            self._busy_others_s += end_others - others
            self._idle_since = (end, end_others)

    def _decide(self, now: float, others: float) -> None:
        idle_since, idle_others = self._idle_since
        idle_s = now - idle_since
        if idle_s > 2 * self._interval_s:
            # The worker sat idle. A busy stretch says little about the next calls (a
            # benchmark's plain loop, say), so it takes no thread away. A quiet one
            # gives back what the load took: bursts shorter than an interval with quiet
            # between never make two decisions in a row, and a count set low at
            # start-up beside a busy process stayed low for them (tiny-sd 64x64, bursts
            # of 64: 72 against 98 requests/s). A load that comes back takes them at
            # the next decision.
            target = threads_for(self.max_threads, max(0.0, others - idle_others) / idle_s)
            if target > self.threads:
                self._change(target, (others - idle_others) / idle_s, "while it was idle")
                self._ups = 0
            # (a busy gap leaves the decisions in a row as they were: bursts of calls
            # about an interval long with other work between them, as when a served
            # benchmark takes turns with a plain loop, each make one decision; with the
            # row broken at every gap, a count set low at start-up never came back:
            # tiny-sd3 64x64 served 41 images/s on 1 thread where 2 served 58-65)
            self._restart(now)
            return
        if now - self._last < self._interval_s or \
                self._busy_s < MIN_BUSY_SHARE * self._interval_s:
            return
        other = max(0.0, self._busy_others_s / self._busy_s)
        self._restart(now)
        target = threads_for(self.max_threads, other)
        if target > self.threads:
            self._ups += 1
            if self._ups < 2:
                return
        self._ups = 0
        if target != self.threads:
            self._change(target, other, "while it computed")

    def _restart(self, now: float) -> None:
        self._last = now
        self._busy_s = self._busy_others_s = 0.0

    def _change(self, target: int, other: float, when: str) -> None:
        if self._log is not None:
            self._log(f"torch threads {self.threads} -> {target}: other processes kept "
                      f"{other:.1f} of {self.max_threads} CPUs busy {when}")
        self.threads = target
        self._set(target)


def others_cpu_seconds() -> float:
    """CPU seconds the machine's other processes have used (all processes' non-idle
    time from /proc/stat, less this process's own); only differences mean anything.
    0 where /proc/stat cannot be read (the load then reads as none)."""
    try:
        return _busy_ticks() / os.sysconf("SC_CLK_TCK") - time.process_time()
    except (OSError, ValueError, AttributeError):
        return 0.0


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
    before, start = others_cpu_seconds(), time.monotonic()
    time.sleep(window_s)  # a measurement window, not a synchronisation
    return max(0.0, (others_cpu_seconds() - before) / (time.monotonic() - start))


def _busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


__all__ = ["AUTO_THREADS_ENV", "ThreadChoice", "ThreadGovernor", "choose_threads",
           "cpu_contention", "other_cpu_load", "others_cpu_seconds", "threads_for",
           "usable_cpu_count"]
