"""The worker's lifeline: exit the moment the engine process is gone.

The engine holds the write end of a pipe and never writes to it, so a read of the
worker's end returns only at EOF, when the engine exited or was killed. `watch`
starts a thread that blocks on that read and then ends the process at once (the main
thread may be deep inside a forward, or still importing torch: nothing there is worth
finishing for nobody), after the cleanups registered with `on_exit` (the worker
sweeps the shared-memory segments it created).

This module imports nothing heavy: `python -m diffbatch.worker` starts the watch
before it imports torch, which takes seconds, so a worker whose engine is killed
during start-up does not linger through its imports.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

_cleanups: list[Callable[[], None]] = []
_watched: set[int] = set()
_lock = threading.Lock()


def watch(fd: int) -> None:
    """Watch the lifeline `fd` from a daemon thread (once per fd; again is harmless)."""
    with _lock:
        if fd in _watched:
            return
        _watched.add(fd)
    threading.Thread(target=_wait_for_eof, args=(fd,), daemon=True,
                     name="diffbatch-lifeline").start()


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` before the process exits because the engine is gone."""
    with _lock:
        _cleanups.append(cleanup)


def _wait_for_eof(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    with _lock:
        cleanups = list(_cleanups)
    for cleanup in cleanups:
        # exiting anyway: a failed cleanup must not keep the process
        with contextlib.suppress(Exception):
            cleanup()
    os._exit(0)
