"""What happens to the requests a worker was running when it died: one rule, both modes.

Request mode re-runs a crashed wave from the engine (`engine/wave_dispatch.py`), step
mode re-runs a crashed running batch from the executor (`executor/multiproc.py`),
because that is where each mode's work waits; both decide with `rerun_groups`:

- the running requests are re-run on the replacement in halves, as bisect isolation
  splits a failing wave, so a request that kills the worker ends up alone;
- a request that was alone in a re-run group and kills the worker again fails, with
  `failed_again(reason)` as its error; nothing else does.

Requests that had not started (queued behind the crash) are sent again as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from diffbatch.outputs import RequestError

T = TypeVar("T")


def rerun_groups(running: Sequence[T], crashed_before: bool) -> list[list[T]] | None:
    """The groups to re-run, in order; None when `running` is one request that had
    already crashed a worker before (it fails: `failed_again`)."""
    if crashed_before and len(running) == 1:
        return None
    mid = len(running) // 2
    return [list(part) for part in (running[:mid], running[mid:]) if part]


def failed_again(reason: str) -> RequestError:
    """The error of a request that killed the worker again when re-run on its own."""
    return RequestError("the worker process died while running this request, and again "
                        f"when it was re-run on its own on a replacement ({reason})")
