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
  cores, so the default is kept unless other processes already keep the CPUs busy
  when the worker starts (measured over `LOAD_WINDOW_S` from /proc/stat, this
  process's own time left out): with less than half a CPU to spare, `PASSIVE` is
  chosen. The user's own `OMP_WAIT_POLICY` wins.

The choice is logged, and the start-up calibration then measures the wave times it
gives (`diffbatch.engine.calibration`). On CUDA the forward runs on the GPU and
these settings only affect the CPU work around it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

LOAD_WINDOW_S = 0.2  # how long the executor watches the machine before starting a worker


@dataclass(frozen=True)
class ThreadChoice:
    """What the worker's environment gets, and why (for the start-up log)."""

    num_threads: int | None  # OMP_NUM_THREADS to set; None: leave it as it is
    wait_policy: str | None  # OMP_WAIT_POLICY to set; None: leave it as it is
    reason: str

    def apply(self, env: dict[str, str]) -> None:
        if self.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        if self.wait_policy is not None:
            env["OMP_WAIT_POLICY"] = self.wait_policy


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
    reasons = []
    if torch_num_threads is not None:
        threads: int | None = torch_num_threads
        reasons.append(f"{torch_num_threads} torch threads (torch_num_threads)")
    elif "OMP_NUM_THREADS" in env:
        threads = None
        reasons.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (yours)")
    else:
        threads = usable
        reasons.append(f"{usable} torch threads ({usable} usable CPUs)")
    if "OMP_WAIT_POLICY" in env:
        policy = None
        reasons.append(f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} (yours)")
    elif other_load > usable - 0.5:
        policy = "PASSIVE"
        reasons.append(f"OpenMP waits passively: other processes keep {other_load:.1f} of "
                       f"{usable} CPUs busy, spinning threads would fight them")
    else:
        policy = None
        reasons.append(f"OpenMP's default wait (other processes use {other_load:.1f} of "
                       f"{usable} CPUs)")
    return ThreadChoice(threads, policy, "; ".join(reasons))


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
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        busy0, own0 = _busy_ticks(), time.process_time()
        time.sleep(window_s)  # a measurement window, not a synchronisation
        busy1, own1 = _busy_ticks(), time.process_time()
    except (OSError, ValueError, AttributeError):
        return 0.0
    others = (busy1 - busy0) / ticks - (own1 - own0)
    return max(0.0, others / window_s)


def _busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


__all__ = ["ThreadChoice", "choose_threads", "other_cpu_load", "usable_cpu_count"]
