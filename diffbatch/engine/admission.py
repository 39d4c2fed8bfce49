"""The bounded admission wait that lets a burst coalesce into one wave.

Before a wave is scheduled, the engine may wait a little for more compatible
requests. The wait runs only when request batching can use it (the pipeline
supports request batches, a wait > 0, capacity > 1) and nothing is running. Its
numbers come from the engine's `BatchPolicy` for the next wave: a fixed
`request_batch_max_wait_ms` and `max_num_seqs`, or the plan the "auto" rule made
(`diffbatch.engine.batch_policy`). It ends at the first of:

- `capacity`: the waiting queue holds `capacity` requests (`max_num_seqs`, or the
  planned target);
- `stable`: the waiting count has not grown for a stable window (for a fixed wait
  `min(50 ms, max_wait / 5)`; the plan's own otherwise; only growth resets the
  window, an abort does not), and no request is on its way in (a front end has begun
  to receive it: requests sent together arrive whole, however slowly the server
  parses them); a request on its way in holds the window open for at most
  `INCOMING_GRACE_MS` more, so a slow upload holds nobody's wave;
- `deadline`: `start + max_wait` passed;
- `stopped`: the engine is stopping.

It sleeps on the engine's condition variable, which every arrival notifies, so it
never busy-polls. Clock and wait primitive are injectable so tests drive time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_STABLE_WINDOW_MS = 50.0
# How much longer a request on its way in (announced, body not yet parsed) may keep
# the stable window open: enough to parse a body sent with the others, never the wait.
INCOMING_GRACE_MS = MAX_STABLE_WINDOW_MS


@dataclass
class AdmissionWait:
    """Policy and loop of the admission wait; see the module docstring."""

    max_wait_ms: float  # request_batch_max_wait_ms (or the planned wait); 0 = no wait
    capacity: int  # max_num_seqs (or the planned target)
    # the stable window; None: min(50 ms, max_wait_ms / 5), the fixed wait's window
    window_ms: float | None = None

    @property
    def stable_window_ms(self) -> float:
        if self.window_ms is not None:
            return self.window_ms
        return min(MAX_STABLE_WINDOW_MS, self.max_wait_ms / 5.0)

    def should_wait(self, *, supports_request_batch: bool, num_running: int) -> bool:
        """Whether a wait can help before the next wave."""
        return (
            supports_request_batch
            and self.max_wait_ms > 0
            and self.capacity > 1
            and num_running == 0
        )

    def wait(
        self,
        num_waiting: Callable[[], int],
        is_stopped: Callable[[], bool],
        wait_s: Callable[[float], object],
        clock: Callable[[], float] = time.monotonic,
        num_incoming: Callable[[], int] = lambda: 0,
    ) -> str:
        """Wait until one of the exit conditions holds; return its name.

        Args:
            num_waiting: current number of waiting requests (read under the lock).
            is_stopped: whether the engine is stopping.
            wait_s: blocks up to the given seconds or until notified, e.g. the bound
                `Condition.wait` of the engine's condition (called with its lock held).
            clock: monotonic seconds.
            num_incoming: requests on their way in, not yet waiting.
        """
        start = clock()
        deadline = start + self.max_wait_ms / 1000.0
        window_s = self.stable_window_ms / 1000.0
        last_count = num_waiting()
        last_growth = start
        while True:
            if is_stopped():
                return "stopped"
            count = num_waiting()
            if count >= self.capacity:
                return "capacity"
            now = clock()
            if count > last_count:
                last_count, last_growth = count, now
            if now >= deadline:
                return "deadline"
            window_end = last_growth + window_s
            if now >= window_end:
                held_until = window_end + INCOMING_GRACE_MS / 1000.0
                if not num_incoming() or now >= held_until:
                    return "stable"
                window_end = held_until  # one is on its way in: wait for it, briefly
            wait_s(min(deadline, window_end) - now)
