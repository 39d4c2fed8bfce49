"""A bounded record of the waves the engine ran, for clients that watch batching live.

The engine core logs one line per wave (`EngineCore._log_wave`); the same call appends
a `WaveEvent` here. The log keeps the last `capacity` events in a ring buffer, each
with an increasing `id`, so a poller asks for what it has not seen yet
(`since(after=last_id)`) and never gets an event twice; one that fell behind by more
than the buffer gets the newest `capacity` and can tell from the ids that it missed
some. It holds no prompts, only what the log line holds (sizes, the key's short form,
why the wave closed, timings).

Served as `GET /v1/waves?after=N` (the playground's live strip).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_CAPACITY = 256  # waves kept; a poller once a second keeps up with 256 waves/s


@dataclass(frozen=True)
class WaveEvent:
    """One finished wave, as the engine logged it."""

    id: int  # increasing per log, from 1
    wave_id: int  # the scheduler's wave id
    num_requests: int  # requests in the wave
    key: str  # the wave's batch key, short form (`SamplingParamsKey.short()`)
    close_reason: str  # why the wave stopped growing (capacity, key, queue_empty, ...)
    admission: str  # why its admission wait ended ("none": no wait)
    max_queue_wait_ms: float  # longest a request of it waited before the wave started
    forward_ms: float  # the wave's forward time
    num_errors: int  # requests of the wave that failed (aborted ones are not failures)
    num_aborted: int  # requests of the wave aborted (a caller gone, a timeout) before its end
    finished_at: float  # time.time() when it was logged

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WaveLog:
    """The last `capacity` waves, safe to append from the engine loop and read from any
    thread."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[WaveEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._last_id = 0

    def record(
        self, *, wave_id: int, num_requests: int, key: str, close_reason: str, admission: str,
        max_queue_wait_ms: float, forward_ms: float, num_errors: int = 0, num_aborted: int = 0,
    ) -> WaveEvent:
        """Append one wave; returns its event."""
        with self._lock:
            self._last_id += 1
            event = WaveEvent(
                id=self._last_id, wave_id=wave_id, num_requests=num_requests, key=key,
                close_reason=close_reason or "none", admission=admission or "none",
                max_queue_wait_ms=round(max_queue_wait_ms, 3), forward_ms=round(forward_ms, 3),
                num_errors=num_errors, num_aborted=num_aborted, finished_at=time.time(),
            )
            self._events.append(event)
        return event

    def since(self, after: int = 0, limit: int | None = None) -> list[WaveEvent]:
        """Events with `id > after`, oldest first; at most the newest `limit` of them."""
        with self._lock:
            events = [e for e in self._events if e.id > after]
        return events[-limit:] if limit else events

    @property
    def last_id(self) -> int:
        """The id of the newest event (0 before the first)."""
        with self._lock:
            return self._last_id
