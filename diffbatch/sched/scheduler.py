"""The FIFO wave scheduler of the design note.

A wave starts at the head of the waiting queue and keeps taking requests from the
head while their key equals the wave's key and capacity remains.

NOTE: this is deliberately conservative. An incompatible request at the head ends
the wave even if compatible requests wait behind it (head-of-line blocking), so
FIFO order is kept exactly and no request is ever overtaken.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from diffbatch.outputs import DiffusionOutput, RequestError
from diffbatch.request import DiffusionRequest, RequestStatus
from diffbatch.sched.interface import SchedulerInterface
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.outputs import BatchRunnerOutput
    from diffbatch.sampling_params import SamplingParamsKey

logger = logging.getLogger(__name__)


class Scheduler(SchedulerInterface):
    """FIFO scheduler with waves of equal-key requests up to `max_num_seqs`."""

    def __init__(self, max_num_seqs: int) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) \
                or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, DiffusionRequest] = {}  # every active (unfinished) request
        # NOTE: aborted requests stay in the deque and are skipped at the head, so an
        # abort is O(1); `_num_waiting` counts only the live ones.
        self.waiting: deque[DiffusionRequest] = deque()
        self.running: dict[str, DiffusionRequest] = {}
        self._num_waiting = 0
        self._next_wave_id = 1

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_request(self, request: DiffusionRequest) -> None:
        if request.key is None:
            raise ValueError(f"request {request.request_id!r} has no key; resolve it first")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already active")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._num_waiting += 1

    def _pop_finished_heads(self) -> None:
        while self.waiting and self.waiting[0].is_finished:
            self.waiting.popleft()

    def schedule(self) -> SchedulerOutput:
        self._pop_finished_heads()
        if not self.waiting:
            return SchedulerOutput.make_empty()
        key = self.waiting[0].key
        wave: list[DiffusionRequest] = []
        close_reason = "queue_empty"
        while True:
            self._pop_finished_heads()
            if not self.waiting:
                close_reason = "queue_empty"
                break
            if len(wave) >= self.max_num_seqs:
                close_reason = "capacity"
                break
            if self.waiting[0].key != key:
                close_reason = "key"  # head-of-line blocking, see the module NOTE
                break
            request = self.waiting.popleft()
            self._num_waiting -= 1
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request
            wave.append(request)
        wave_id = self._next_wave_id
        self._next_wave_id += 1
        return SchedulerOutput(wave_id=wave_id, requests=wave, key=key, close_reason=close_reason)

    def has_full_wave(self) -> bool:
        """`max_num_seqs` equal-key requests at the head, or fewer and another key behind
        them (which ends the wave however many more arrive). O(max_num_seqs)."""
        key, count = None, 0
        for request in self.waiting:
            if request.is_finished:
                continue
            if key is None:
                key = request.key
            elif request.key != key:
                return True
            count += 1
            if count >= self.max_num_seqs:
                return True
        return False

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: BatchRunnerOutput
    ) -> list[tuple[DiffusionRequest, DiffusionOutput]]:
        finished: list[tuple[DiffusionRequest, DiffusionOutput]] = []
        for request in scheduler_output.requests:
            if request.is_finished:  # aborted while running: discard its result
                continue
            output = runner_output.outputs.get(request.request_id)
            if output is None:
                output = DiffusionOutput.from_error(
                    request.request_id,
                    RequestError(f"the runner returned no output for request "
                                 f"{request.request_id!r}"),
                )
                output.batch_size = scheduler_output.num_requests
            if output.aborted:
                status = RequestStatus.FINISHED_ABORTED
            elif output.error is not None:
                status = RequestStatus.FINISHED_ERROR
            else:
                status = RequestStatus.FINISHED_COMPLETED
            self._finish(request, status)
            finished.append((request, output))
        return finished

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus
    ) -> list[DiffusionRequest]:
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status.name}")
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING:
                self._num_waiting -= 1  # the deque entry is skipped lazily
            self._finish(request, status)
            done.append(request)
        if self._num_waiting == 0:
            self.waiting.clear()  # only finished entries are left: drop them now
        else:
            self._pop_finished_heads()
        return done

    def num_waiting_by_key(self) -> dict[SamplingParamsKey, int]:
        """Waiting requests per key (O(active requests); for metrics, not the hot path)."""
        counts: dict[SamplingParamsKey, int] = {}
        for request in self.requests.values():
            if request.status == RequestStatus.WAITING and request.key is not None:
                counts[request.key] = counts.get(request.key, 0) + 1
        return counts

    def _finish(self, request: DiffusionRequest, status: RequestStatus) -> None:
        request.status = status
        self.requests.pop(request.request_id, None)
        self.running.pop(request.request_id, None)
