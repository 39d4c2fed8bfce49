"""The `fifo` scheduler: FIFO waves of equal-key requests.

A wave starts at the head of the waiting queue and keeps taking requests from the
head while their key equals the wave's key and capacity remains (the wave size, and
`max_wave_pixels` output pixels when that is set).

NOTE: this is deliberately conservative. An incompatible request at the head ends
the wave even if compatible requests wait behind it (head-of-line blocking), so
FIFO order is kept exactly and no request is ever overtaken. In step mode the same
holds for joiners: the running batch takes no more once the head has another key.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from diffbatch.request import DiffusionRequest
from diffbatch.sched.base import SchedulerBase, WaveCapacity
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.sampling_params import SamplingParamsKey

logger = logging.getLogger(__name__)


class FifoScheduler(SchedulerBase):
    """FIFO scheduler with waves of equal-key requests up to `max_num_seqs`."""

    def __init__(self, max_num_seqs: int, capacity_of: WaveCapacity | None = None, *,
                 max_wave_pixels: int | None = None) -> None:
        super().__init__(max_num_seqs, capacity_of, max_wave_pixels=max_wave_pixels)
        # NOTE: aborted requests stay in the deque and are skipped at the head, so an
        # abort is O(1); `num_waiting` counts only the live ones.
        self.waiting: deque[DiffusionRequest] = deque()

    def _enqueue(self, request: DiffusionRequest) -> None:
        self.waiting.append(request)

    def _pop_finished_heads(self) -> None:
        while self.waiting and self.waiting[0].is_finished:
            self.waiting.popleft()

    def _drop_finished_waiting(self) -> None:
        if self.num_waiting == 0:
            self.waiting.clear()  # only finished entries are left: drop them now
        else:
            self._pop_finished_heads()

    def schedule(self) -> SchedulerOutput:
        self._pop_finished_heads()
        if not self.waiting:
            return SchedulerOutput.make_empty()
        key = self.waiting[0].key
        assert key is not None  # add_request rejects a request without a key
        wave: list[DiffusionRequest] = []
        close_reason = "queue_empty"
        limit, limit_reason = self.wave_limit(key)
        while True:
            self._pop_finished_heads()
            if not self.waiting:
                close_reason = "queue_empty"
                break
            if self.wave_is_full(wave, self.waiting[0], key, limit):
                close_reason = limit_reason
                break
            if self.waiting[0].key != key:
                close_reason = "key"  # head-of-line blocking, see the module NOTE
                break
            request = self.waiting.popleft()
            self._start(request)
            wave.append(request)
        return self._make_wave(wave, key, close_reason)

    def schedule_joiners(self, key: SamplingParamsKey, limit: float) -> SchedulerOutput:
        """Joiners come from the head while its key is the running batch's: a request
        of another key at the head stops them at once (strict FIFO, no overtaking)."""
        joiners: list[DiffusionRequest] = []
        while True:
            self._pop_finished_heads()
            if not self.waiting or self.waiting[0].key != key \
                    or self.wave_is_full(joiners, self.waiting[0], key, limit):
                break
            request = self.waiting.popleft()
            self._start(request)
            joiners.append(request)
        return self._make_wave(joiners, key, "join") if joiners else SchedulerOutput.make_empty()

    def next_key(self) -> SamplingParamsKey | None:
        self._pop_finished_heads()
        return self.waiting[0].key if self.waiting else None

    def has_full_wave(self) -> bool:
        """A wave's capacity of equal-key requests at the head, or fewer and another key
        behind them (which ends the wave however many more arrive). O(capacity)."""
        key, wave, capacity = None, [], self.max_num_seqs
        for request in self.waiting:
            if request.is_finished:
                continue
            if key is None:
                key = request.key
                assert key is not None
                capacity, _ = self.wave_limit(key)
            elif request.key != key:
                return True
            wave.append(request)
            # (full: it could not take another request like the last one)
            if self.wave_is_full(wave, request, key, capacity):
                return True
        return False


__all__ = ["FifoScheduler"]
