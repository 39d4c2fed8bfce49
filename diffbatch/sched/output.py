"""What the scheduler hands to the executor, and the pipeline-facing view of a wave."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey

if TYPE_CHECKING:
    import torch


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


@dataclass
class DiffusionRequestBatch:
    """The pipeline-facing view of one wave.

    A pipeline written for one request reads `prompts`, `sampling_params` and
    `generators` the same way; a batch-capable pipeline reads the lists. The runner
    fills `generators` with one torch.Generator per output image, B*n in request
    order (request 0's n generators first).
    """

    requests: list[DiffusionRequest]
    generators: list[torch.Generator] = field(default_factory=list)  # [B * n]
    extras: dict[str, Any] = field(default_factory=dict)  # runner-to-pipeline hints

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a DiffusionRequestBatch needs at least one request")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def request_id(self) -> str:
        """The request id of a single-request batch (compatibility with per-request code)."""
        return self._single("request_id").request_id

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.requests]

    @property
    def negative_prompts(self) -> list[str | None]:
        return [r.sampling_params.negative_prompt for r in self.requests]

    @property
    def sampling_params_list(self) -> list[SamplingParams]:
        return [r.sampling_params for r in self.requests]

    @property
    def sampling_params(self) -> SamplingParams:
        """The params of a single-request batch; a multi-request batch has no one params."""
        return self._single("sampling_params").sampling_params

    @property
    def key(self) -> SamplingParamsKey | None:
        return self.requests[0].key

    @property
    def num_outputs_per_prompt(self) -> int:
        return self.requests[0].sampling_params.num_outputs_per_prompt

    def _single(self, name: str) -> DiffusionRequest:
        if len(self.requests) != 1:
            raise ValueError(
                f"`{name}` is only defined for a batch of one request, this batch has "
                f"{len(self.requests)}; read `{name}s` / `sampling_params_list` instead"
            )
        return self.requests[0]
