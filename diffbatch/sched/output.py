"""What the scheduler hands to the executor: one wave of compatible requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParamsKey


@dataclass
class SchedulerOutput:
    """One scheduler wave: the requests to run together, all with the same key."""

    wave_id: int  # increasing per scheduler; 0 for the empty output
    requests: list[DiffusionRequest]  # in wave (FIFO) order; never finished ones
    key: SamplingParamsKey | None  # the wave's shared key; None when empty
    close_reason: str = ""  # why the wave stopped growing (capacity, key, queue_empty, ...)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls(wave_id=0, requests=[], key=None)

    @property
    def req_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
