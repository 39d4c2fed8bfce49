"""Keep the worker's freed memory in its heap instead of handing it back every wave.

glibc's malloc serves large blocks with `mmap` and gives freed memory at the top of
the heap back to the OS, and it moves both thresholds as the process runs. What a
worker ends up with depends on its allocation history: a worker could take its
every wave's activations from fresh pages, paying page faults and system time per
image and running slower than the same pipeline in another process; with the
thresholds fixed it took none and ran as fast (measured in docs/benchmarks.md,
"Measured reasons in the code"). A worker runs the same shapes over and over, so
keeping its peak heap is what it wants.

`tune_malloc()` fixes both thresholds with `mallopt` (glibc only; elsewhere it does
nothing). A user's own `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or
`GLIBC_TUNABLES` setting wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap and are reused; 32 MiB is the largest
# mmap threshold glibc accepts on 64-bit (and where its own adjustment stops).
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap top kept up to 1 GiB
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True if it did."""
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if user:
        logger.debug("malloc left as configured by %s", ", ".join(user))
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    return ok
