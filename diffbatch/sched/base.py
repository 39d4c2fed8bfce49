"""The bookkeeping every scheduling policy shares: who is active, who runs, who finished.

`SchedulerBase` owns the request table, the running set, the waiting count and the
wave ids, and implements the policy-free half of `SchedulerInterface`: admission
checks, finishing (abort, error, completion from the runner's outputs) and the
counts. A policy subclass owns its waiting structures and implements four things:

- `_enqueue(request)`: put a newly added (WAITING) request in its queue;
- `schedule()`: pick a wave, starting each request with `_start()` and numbering
  the wave with `_make_wave()`;
- `has_full_wave()`;
- `_drop_finished_waiting()`: forget queue entries of requests that no longer wait
  (called by `finish_requests` after it finished some).

Subclasses read the base's state through its methods and properties and never
touch each other's queues.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffbatch.capacity_units import may_take, rounded_units
from diffbatch.outputs import DiffusionOutput, RequestError
from diffbatch.request import DiffusionRequest, RequestStatus
from diffbatch.sched.interface import SchedulerInterface
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.outputs import BatchRunnerOutput
    from diffbatch.sampling_params import SamplingParamsKey

WaveCapacity = Callable[["SamplingParamsKey", int], int]  # (key, num waiting) -> capacity


def wave_pixels(key: SamplingParamsKey, num_requests: int) -> int:
    """Output pixels of a wave of `num_requests` requests with `key`: B*n*H*W."""
    return num_requests * key.num_outputs_per_prompt * key.height * key.width


def wave_units(wave: SchedulerOutput) -> int:
    """A wave's size in capacity units (`diffbatch.capacity_units.rounded_units`)."""
    return rounded_units([r.sampling_params for r in wave.requests], wave.key)


class SchedulerBase(SchedulerInterface):
    """Request table, running set and waiting count; the policy lives in subclasses."""

    def __init__(
        self, max_num_seqs: int, capacity_of: WaveCapacity | None = None, *,
        max_wave_pixels: int | None = None,
    ) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) \
                or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if max_wave_pixels is not None and max_wave_pixels < 1:
            raise ValueError(f"max_wave_pixels must be >= 1 or None, got {max_wave_pixels}")
        self.max_num_seqs = max_num_seqs
        # Most output pixels (B*n*H*W) in one wave; a wave always takes one request.
        self.max_wave_pixels = max_wave_pixels
        # Per-key capacity (e.g. learned: `BatchPolicy.capacity`), given the key and the
        # number waiting; never above `max_num_seqs`. None: `max_num_seqs` for every key.
        self.capacity_of = capacity_of
        self.requests: dict[str, DiffusionRequest] = {}  # every active (unfinished) request
        self.running: dict[str, DiffusionRequest] = {}  # scheduled, not yet finished
        # NOTE: a request finished while waiting may stay in the subclass's queue until
        # it is skipped there (lazy deletion keeps an abort O(1)); this counts only the
        # live ones.
        self._num_waiting = 0
        self._next_wave_id = 1

    def wave_capacity(self, key: SamplingParamsKey) -> int:
        """Most requests a wave of `key` may take now (1 <= it <= `max_num_seqs`)."""
        if self.capacity_of is None:
            return self.max_num_seqs
        return max(1, min(self.max_num_seqs, self.capacity_of(key, self.num_waiting)))

    def wave_limit(self, key: SamplingParamsKey) -> tuple[int, str]:
        """Most requests a wave of `key` may take now, and the close reason once it has
        them: "capacity", or "pixel_cap" when `max_wave_pixels` is the tighter bound."""
        capacity = self.wave_capacity(key)
        if self.max_wave_pixels is None:
            return capacity, "capacity"
        by_pixels = max(1, self.max_wave_pixels // wave_pixels(key, 1))
        return (by_pixels, "pixel_cap") if by_pixels < capacity else (capacity, "capacity")

    def wave_size_limit(self, key: SamplingParamsKey) -> int | None:
        return self.wave_limit(key)[0]

    def wave_is_full(self, wave: list[DiffusionRequest], candidate: DiffusionRequest,
                     key: SamplingParamsKey, limit: float) -> bool:
        """Whether a wave (or joiners) of `key` holding `wave` may not take `candidate`
        too: it has `limit` requests, or under a size-free key `limit` capacity units
        or `max_num_seqs` requests (`diffbatch.capacity_units.may_take`)."""
        return not may_take(len(wave), (r.sampling_params for r in wave),
                            candidate.sampling_params, key, limit, self.max_num_seqs)

    # -- policy hooks ----------------------------------------------------------------
    @abstractmethod
    def _enqueue(self, request: DiffusionRequest) -> None:
        """Put a newly added, WAITING request in the policy's waiting structures."""

    @abstractmethod
    def _drop_finished_waiting(self) -> None:
        """Forget queue entries of requests that no longer wait (finished, or already
        scheduled where the policy keeps such entries).

        When `num_waiting` is 0 no entry left waits, so all may go.
        """

    # -- helpers for schedule() ------------------------------------------------------
    def _start(self, request: DiffusionRequest) -> None:
        """Move a waiting request into the running set (it joins the wave being formed)."""
        request.status = RequestStatus.RUNNING
        self.running[request.request_id] = request
        self._num_waiting -= 1

    def _make_wave(
        self, requests: list[DiffusionRequest], key: SamplingParamsKey, close_reason: str
    ) -> SchedulerOutput:
        wave_id = self._next_wave_id
        self._next_wave_id += 1
        return SchedulerOutput(wave_id=wave_id, requests=requests, key=key,
                               close_reason=close_reason)

    def _finish(self, request: DiffusionRequest, status: RequestStatus) -> None:
        request.status = status
        self.requests.pop(request.request_id, None)
        self.running.pop(request.request_id, None)

    # -- SchedulerInterface ----------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def running_request_ids(self) -> list[str]:
        return list(self.running)

    def add_request(self, request: DiffusionRequest) -> None:
        if request.key is None:
            raise ValueError(f"request {request.request_id!r} has no key; resolve it first")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already active")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._num_waiting += 1
        self._enqueue(request)

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
                self._num_waiting -= 1  # its queue entry is dropped lazily
            self._finish(request, status)
            done.append(request)
        self._drop_finished_waiting()
        return done

    def num_waiting_by_key(self) -> dict[SamplingParamsKey, int]:
        """Waiting requests per key (O(active requests); for metrics, not the hot path)."""
        counts: dict[SamplingParamsKey, int] = {}
        for request in self.requests.values():
            if request.status == RequestStatus.WAITING and request.key is not None:
                counts[request.key] = counts.get(request.key, 0) + 1
        return counts


__all__ = ["SchedulerBase"]
