"""One logical request: one prompt, one request id, its own params, status and key."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from diffbatch.errors import InvalidRequestError
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey, check_text

# Prompts longer than this (in characters) are rejected; pipelines truncate tokens anyway.
MAX_PROMPT_CHARS = 10_000


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; everything after RUNNING is finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_COMPLETED = 2
    FINISHED_ABORTED = 3
    FINISHED_ERROR = 4

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.RUNNING


def validate_prompt(prompt: object, *, param: str = "prompt") -> str:
    """Check that `prompt` is one non-empty string of valid Unicode text and return it.

    A lone surrogate (a JSON `"\\ud800"` escape) is refused here: the tokenizer would
    fail on it inside the forward, failing the request's whole wave with a 500.
    """
    if isinstance(prompt, list | tuple):
        raise InvalidRequestError(
            f"`{param}` must be a single string, got a list of {len(prompt)}; batching "
            "is across requests, so send one request per prompt",
            param=param,
        )
    if not isinstance(prompt, str):
        raise InvalidRequestError(
            f"`{param}` must be a string, got {type(prompt).__name__}", param=param
        )
    if not prompt.strip():
        raise InvalidRequestError(f"`{param}` must be a non-empty string", param=param)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequestError(
            f"`{param}` must be at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}",
            param=param,
        )
    check_text(param, prompt)
    return prompt


@dataclass
class DiffusionRequest:
    """One prompt and one request id, with its sampling params.

    `sampling_params` are resolved (pipeline defaults and seed filled in) and `key`
    is set by the engine when the request is added. The object crosses to the worker
    process pickled, an edit's input image and mask (uint8 tensors in its params) too.
    """

    request_id: str
    prompt: str
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)  # time.monotonic() seconds
    priority: int = 0  # lower runs first (used by priority-aware policies)
    key: SamplingParamsKey | None = None  # set once by the engine on add
    status: RequestStatus = RequestStatus.WAITING

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError(
                f"`request_id` must be a non-empty string, got {self.request_id!r}",
                param="request_id",
            )
        validate_prompt(self.prompt)
        if not isinstance(self.sampling_params, SamplingParams):
            raise InvalidRequestError(
                "`sampling_params` must be a SamplingParams, got "
                f"{type(self.sampling_params).__name__}",
                param="sampling_params",
            )

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def anon_repr(self) -> str:
        """A log-safe description: the id and prompt length, never the prompt."""
        key = self.key.short() if self.key is not None else "?"
        return f"DiffusionRequest(id={self.request_id}, prompt_len={len(self.prompt)}, key={key})"
