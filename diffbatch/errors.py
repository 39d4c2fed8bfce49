"""Errors that diffbatch raises, one class per outcome a caller can act on.

Each carries the HTTP `status_code`, the OpenAI error `type` and, where a single
input is to blame, the `param` that caused it, so the HTTP layer maps them without
guessing.

    DiffbatchError                      500 server_error
    ├── InvalidRequestError             400 invalid_request_error
    │   ├── ModelNotFoundError          404 not_found_error
    │   └── PayloadTooLargeError        413 invalid_request_error
    ├── ConfigError                     (start-up; never reaches HTTP)
    │   └── ModelLoadError              (the model does not load)
    ├── QueueFullError                  503 server_overloaded
    ├── RequestAbortedError             499 request_aborted
    │   └── WaveInterrupted             (a wave nobody waits for stopped between steps)
    ├── RequestTimeoutError             504 timeout_error
    ├── EngineDeadError                 503 engine_unavailable
    │   ├── EngineClosedError
    │   └── WorkerDiedError             (the worker process died before answering a wave)
    └── PipelineError                   500 server_error  (a forward raised or broke the contract)
"""

from __future__ import annotations


class DiffbatchError(Exception):
    """Base class of every diffbatch error."""

    status_code: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status_code={self.status_code}, message={self.message!r})"


class InvalidRequestError(DiffbatchError, ValueError):
    """A request or parameter is invalid; the message says what was expected and given."""

    status_code = 400
    type = "invalid_request_error"


class ModelNotFoundError(InvalidRequestError):
    """The model (or LoRA adapter) named by a request is not served here."""

    status_code = 404
    type = "not_found_error"


class PayloadTooLargeError(InvalidRequestError):
    """A request asks for more pixels or bytes than the server allows."""

    status_code = 413


class ConfigError(DiffbatchError, ValueError):
    """An engine or server option is invalid; raised at start-up."""


class ModelLoadError(ConfigError):
    """The model named at start-up exists but does not load (a broken or incomplete
    folder, weights that do not match their config); the message names the model and
    the loader's own error."""


class QueueFullError(DiffbatchError):
    """The waiting queue is at `max_queue_size`; retry later."""

    status_code = 503
    type = "server_overloaded"


class RequestAbortedError(DiffbatchError):
    """The request was aborted (by its caller, a disconnect or a timeout)."""

    status_code = 499
    type = "request_aborted"


class WaveInterrupted(RequestAbortedError):
    """A wave was stopped between denoising steps because none of its requests is
    wanted any more; raised inside the worker, never seen by a caller."""


class RequestTimeoutError(DiffbatchError):
    """The request did not finish within the configured timeout."""

    status_code = 504
    type = "timeout_error"


class EngineDeadError(DiffbatchError):
    """The engine or its worker process is not running."""

    status_code = 503
    type = "engine_unavailable"


class EngineClosedError(EngineDeadError):
    """The engine was closed while the request was open."""


class WorkerDiedError(EngineDeadError):
    """The worker process died (or was killed as frozen) before it answered a wave.

    `started` says whether the wave was running when it died (it may be what killed
    the worker) or only queued behind the running one, or refused because a
    replacement worker was still starting (it never ran).
    """

    def __init__(self, message: str, *, started: bool, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.started = started


class PipelineError(DiffbatchError):
    """The pipeline raised or broke its output contract while running a request."""
