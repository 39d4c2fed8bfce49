"""The scheduler contract: what the engine loop may ask of any scheduling policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput
    from diffbatch.request import DiffusionRequest, RequestStatus
    from diffbatch.sampling_params import SamplingParamsKey
    from diffbatch.sched.output import SchedulerOutput


class SchedulerInterface(ABC):
    """Holds waiting and running requests and forms waves of compatible ones.

    Not thread-safe: the engine calls it under its own lock.
    """

    max_num_seqs: int  # capacity: most requests in one wave / running at once

    @abstractmethod
    def add_request(self, request: DiffusionRequest) -> None:
        """Queue a request whose `key` is set; a duplicate active id raises ValueError."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Form one wave from the waiting queue and mark its requests RUNNING.

        Every request in the wave has the same key and the wave holds at most
        `max_num_seqs` requests. Returns `SchedulerOutput.make_empty()` when nothing
        is waiting.
        """

    @abstractmethod
    def schedule_joiners(self, key: SamplingParamsKey, limit: float) -> SchedulerOutput:
        """Step mode: waiting requests of `key` to join the running batch, up to `limit`
        capacity units (`diffbatch.capacity_units`: requests, or pixels under a
        size-free key; at least one), marked RUNNING; or an empty output when none
        may: none waits, or a request of another key should run next (the running
        batch then drains)."""

    @abstractmethod
    def next_key(self) -> SamplingParamsKey | None:
        """The key the next `schedule()` would form a wave of (None: nothing waits)."""

    def wave_size_limit(self, key: SamplingParamsKey) -> int | None:
        """The most requests a wave of `key` could take now (the admission wait need
        not wait for more); None: no bound of the scheduler's own."""
        return None

    def has_full_wave(self) -> bool:
        """Whether `schedule()` would now return a wave that more arrivals could not
        make bigger (the engine then queues it behind a running wave).

        The default, False, means waves are only formed when the executor is idle.
        """
        return False

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: BatchRunnerOutput
    ) -> list[tuple[DiffusionRequest, DiffusionOutput]]:
        """Finish the wave's requests from the runner's outputs.

        Each scheduled request ends COMPLETED, ERROR (its own error, or "no output"
        when the runner returned none for it) or ABORTED. Requests finished while
        the wave ran (aborted) are dropped: their results are discarded. Returns
        the (request, output) pairs to deliver.
        """

    @abstractmethod
    def finish_requests(
        self, request_ids: list[str], status: RequestStatus
    ) -> list[DiffusionRequest]:
        """Finish waiting or running requests with `status` (e.g. ABORTED).

        Returns the requests that this call finished; unknown or already finished
        ids are ignored.
        """

    @abstractmethod
    def request_ids(self) -> list[str]:
        """Ids of every active (unfinished) request, waiting or running."""

    @abstractmethod
    def running_request_ids(self) -> list[str]:
        """Ids of the requests scheduled in a wave and not finished yet."""

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @abstractmethod
    def num_waiting_by_key(self) -> dict[SamplingParamsKey, int]:
        """Waiting requests per key (for metrics; may cost O(active requests))."""

    def has_unfinished_requests(self) -> bool:
        return self.num_waiting + self.num_running > 0
