"""The `grouped` scheduler: waves from the best compatible group, without head-of-line blocking.

Waiting requests are kept in one group per `SamplingParamsKey`. A wave is formed
from a single group, so it stays homogeneous, but an incompatible request at the
head of the queue no longer stops compatible requests behind it. Rules, in order:

1. No starvation: once the oldest waiting request has waited longer than
   `max_head_wait_ms`, its group goes next (`close_reason` "starvation" marks it).
2. Otherwise the group of the best waiting request goes next, best meaning lowest
   `priority`, then earliest arrival. With equal priorities that is arrival order.
3. Inside the group, requests are taken best first, up to `max_num_seqs`, and while
   the wave's total output pixels (B*n*H*W) stay within `max_wave_pixels` (a wave
   always takes at least one request).

Every structure is a heap or deque with lazy deletion of finished requests, so one
`schedule()` costs O(wave size * log(queue)) and never sorts the whole queue.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffbatch.request import DiffusionRequest, RequestStatus
from diffbatch.sched.base import SchedulerBase, WaveCapacity
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.sampling_params import SamplingParamsKey

_Entry = tuple[int, int, DiffusionRequest]  # (priority, arrival seq, request)


class GroupedScheduler(SchedulerBase):
    """Groups by key, picks groups by priority and age; see the module docstring."""

    def __init__(
        self,
        max_num_seqs: int,
        *,
        max_head_wait_ms: float = 2000.0,
        max_wave_pixels: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        capacity_of: WaveCapacity | None = None,
    ) -> None:
        super().__init__(max_num_seqs, capacity_of, max_wave_pixels=max_wave_pixels)
        if max_head_wait_ms < 0:
            raise ValueError(f"max_head_wait_ms must be >= 0, got {max_head_wait_ms}")
        self.max_head_wait_ms = max_head_wait_ms
        self.clock = clock
        self._seq = itertools.count()
        self._arrivals: deque[DiffusionRequest] = deque()  # arrival order, for starvation
        self._best: list[_Entry] = []  # every waiting request, best first
        self._groups: dict[SamplingParamsKey, list[_Entry]] = {}  # key -> its best-first heap
        self.num_heap_ops = 0  # work counter: heap pushes and pops (tests count work with it)

    def _enqueue(self, request: DiffusionRequest) -> None:
        assert request.key is not None  # add_request rejects a request without a key
        self._arrivals.append(request)
        entry = (request.priority, next(self._seq), request)
        heapq.heappush(self._best, entry)
        heapq.heappush(self._groups.setdefault(request.key, []), entry)
        self.num_heap_ops += 2

    def _pop_finished(self, heap: list[_Entry]) -> None:
        while heap and heap[0][2].status != RequestStatus.WAITING:
            heapq.heappop(heap)
            self.num_heap_ops += 1

    def _pop_finished_arrivals(self) -> None:
        """Drop scheduled or finished requests from the head of the arrival deque."""
        while self._arrivals and self._arrivals[0].status != RequestStatus.WAITING:
            self._arrivals.popleft()

    def _drop_finished_waiting(self) -> None:
        if self.num_waiting == 0:
            self._arrivals.clear()  # only scheduled or finished entries are left
            self._best.clear()
            self._groups.clear()
        else:
            self._pop_finished_arrivals()

    def _pick_key(self) -> tuple[SamplingParamsKey, str] | None:
        """The key of the next wave, and "starvation" when that rule overrode priority."""
        self._pop_finished_arrivals()
        if not self._arrivals:
            return None
        self._pop_finished(self._best)
        best = self._best[0][2].key
        oldest = self._arrivals[0]
        assert best is not None and oldest.key is not None
        waited_ms = (self.clock() - oldest.arrival_time) * 1000.0
        if waited_ms > self.max_head_wait_ms and oldest.key != best:
            return oldest.key, "starvation"
        return best, ""

    def schedule(self) -> SchedulerOutput:
        picked = self._pick_key()
        if picked is None:
            return SchedulerOutput.make_empty()
        key, forced = picked
        group = self._groups[key]
        wave: list[DiffusionRequest] = []
        close_reason = "group_empty"
        limit, limit_reason = self.wave_limit(key)
        while True:
            self._pop_finished(group)
            if not group:
                break
            if self.wave_is_full(wave, group[0][2], key, limit):
                close_reason = limit_reason
                break
            request = heapq.heappop(group)[2]
            self.num_heap_ops += 1
            self._start(request)
            wave.append(request)
        if not group:
            del self._groups[key]
        self._drop_finished_waiting()
        return self._make_wave(wave, key, forced or close_reason)

    def schedule_joiners(self, key: SamplingParamsKey, limit: float) -> SchedulerOutput:
        """Joiners of the running key, best first, until the oldest waiting request of
        another key has waited `max_head_wait_ms` (then the batch drains and its group
        goes next: no key starves)."""
        self._pop_finished_arrivals()
        if not self._arrivals:
            return SchedulerOutput.make_empty()
        oldest = self._arrivals[0]
        if oldest.key != key and \
                (self.clock() - oldest.arrival_time) * 1000.0 > self.max_head_wait_ms:
            return SchedulerOutput.make_empty()
        group = self._groups.get(key, [])
        joiners: list[DiffusionRequest] = []
        while True:
            self._pop_finished(group)
            if not group or self.wave_is_full(joiners, group[0][2], key, limit):
                break
            request = heapq.heappop(group)[2]
            self.num_heap_ops += 1
            self._start(request)
            joiners.append(request)
        if not group:
            self._groups.pop(key, None)
        self._drop_finished_waiting()
        return self._make_wave(joiners, key, "join") if joiners else SchedulerOutput.make_empty()

    def next_key(self) -> SamplingParamsKey | None:
        picked = self._pick_key()
        return None if picked is None else picked[0]

    def has_full_wave(self) -> bool:
        """The next group holds a wave's worth: its capacity of requests, or as many as
        the pixel cap lets in. O(group size) at worst; it stops at the wave's size."""
        picked = self._pick_key()
        if picked is None:
            return False
        key = picked[0]
        limit, _ = self.wave_limit(key)
        wave: list[DiffusionRequest] = []
        for _, _, request in self._groups[key]:
            if request.status == RequestStatus.WAITING:
                wave.append(request)
                # (full: it could not take another request like the last one)
                if self.wave_is_full(wave, request, key, limit):
                    return True
        return False


__all__ = ["GroupedScheduler"]
