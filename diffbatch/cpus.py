"""CPU lists in `taskset -c` syntax ("1", "0-3", "0,2,4-7"), for pinning the worker.

On a CPU-only host the worker's forward shares the cores with the server process
(HTTP, PNG encoding) and whatever else runs there. `EngineConfig.worker_cpus` pins
the worker, and the torch threads it starts, to the CPUs given. Pinning removed the
gap between an unpinned worker and the same wave in-process, but did not change
served throughput on a 2-core host (measured in docs/benchmarks.md, "Measured
reasons in the code"), so it is a deployment option, off by default.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPU ids of a list like "0-3,6"; ValueError naming what is wrong."""

    def bad(why: str = "") -> ValueError:
        return ValueError(f"expected a CPU list such as '1' or '0-3,6', got {text!r}{why}")

    if not isinstance(text, str) or not text.strip():
        raise bad()
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if sep else low
        except ValueError:
            raise bad(f" ({part!r} is not a CPU id or a range of them)") from None
        if low < 0 or high < low:
            raise bad(f" ({part!r} is not an increasing range of ids >= 0)")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def existing_cpus() -> frozenset[int] | None:
    """The CPU ids of this machine; None where the OS cannot pin processes.

    Not this process's own mask: a server started under `taskset -c 0` may still
    give its worker CPU 1.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    return frozenset(range(os.cpu_count() or 1))


def pin_to_cpus(cpus: frozenset[int]) -> None:
    """Pin the calling thread, and every thread it starts from now on, to `cpus`.

    Call it before torch starts its thread pool (threads inherit the mask).
    """
    os.sched_setaffinity(0, cpus)
