"""The worker's CPU threads: how many torch threads, and how OpenMP's idle threads wait.

Both must be settled before the worker imports torch (OpenMP reads its environment
once), so the executor chooses them at start-up and puts them in the worker's
environment:

- **threads**: the CPUs the worker may use (its affinity, `worker_cpus`, and a cgroup
  CPU quota), less one left to the server's front end (HTTP, image encoding) when the
  two share those CPUs. Torch's OpenMP threads spin while they wait for each other;
  a front end or any other busy process on their cores takes a spinning thread's
  core away, and every parallel region then waits for it (on two shared cores under
  a co-tenant, a wave ran 10 to 30 times slower). With one core left over, the front
  end and a neighbour have somewhere to run; on two CPUs the worker runs one thread
  and no region waits for another thread at all. `torch_num_threads` /
  `--torch-threads` or the user's `OMP_NUM_THREADS` win;
- **wait policy**: OpenMP's default (threads spin a little after a parallel region,
  then sleep) is what makes a small model fast on free cores. Spinning threads only
  hurt when there are more of them than CPUs, so a user's thread count above the
  usable CPUs gets `PASSIVE`. The user's own `OMP_WAIT_POLICY` wins.

The choice is logged, and the start-up calibration measures the wave times it gives
(`diffbatch.engine.calibration`). It is made once, from the CPUs, not from what else
runs: the count stays as chosen while the worker serves. On CUDA the forward runs on
the GPU and these settings only affect the CPU work around it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


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


def choose_threads(*, usable_cpus: int, env: Mapping[str, str],
                   torch_num_threads: int | None = None,
                   shares_front_end: bool = False) -> ThreadChoice:
    """The rule of the module docstring, on the numbers given (so tests can drive it).

    Args:
        usable_cpus: CPUs the worker may use (affinity, pinning and quota applied).
        env: the environment the worker would inherit.
        torch_num_threads: the config's explicit thread count, if any.
        shares_front_end: whether the server process (HTTP, encoding) may run on the
            worker's CPUs too.
    """
    usable = max(1, usable_cpus)
    if torch_num_threads is not None:
        threads: int | None = torch_num_threads
        reasons = [f"{torch_num_threads} torch threads (torch_num_threads)"]
    elif "OMP_NUM_THREADS" in env:
        threads = None
        reasons = [f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (yours)"]
    elif shares_front_end and usable > 1:
        threads = usable - 1
        reasons = [f"{threads} torch thread{'s' * (threads > 1)}: the {usable} CPUs the "
                   "worker may use, less one left to the server's front end, which "
                   "shares them"]
    else:
        threads = usable
        reasons = [f"{usable} torch threads: the CPUs the worker may use"]
    count = threads if threads is not None else omp_num_threads(env)
    if "OMP_WAIT_POLICY" in env:
        policy = None
        reasons.append(f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} (yours)")
    elif count is not None and count > usable:
        policy = "PASSIVE"
        reasons.append(f"OpenMP waits passively: {count} threads on {usable} CPUs would "
                       "spin against each other")
    else:
        policy = None
        reasons.append("OpenMP's default wait")
    return ThreadChoice(threads, policy, "; ".join(reasons))


def omp_num_threads(env: Mapping[str, str]) -> int | None:
    """The thread count `env`'s `OMP_NUM_THREADS` sets: a positive number, else None
    (unset, or a value OpenMP ignores too)."""
    try:
        value = int(env["OMP_NUM_THREADS"])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


def shares_cpus_with_this_process(pinned: frozenset[int] | None) -> bool:
    """Whether a worker pinned to `pinned` (None: not pinned, this process's CPUs) may
    run on a CPU this process may run on too."""
    if pinned is None:
        return True
    try:
        return bool(pinned & os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS): nothing is pinned either
        return True


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


__all__ = ["ThreadChoice", "choose_threads", "cpu_contention", "omp_num_threads",
           "shares_cpus_with_this_process", "usable_cpu_count"]
