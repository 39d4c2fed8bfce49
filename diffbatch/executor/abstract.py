"""The executor seam: how the engine runs scheduled work, in-process or in a worker.

Two request-mode entries, as in the design note:

- `execute_request(request)`: one call per scheduled request (per-request path);
- `execute_batch(scheduler_output)`: one call for the whole wave (batch path).

and their non-blocking twins `submit_request` / `submit_batch`, which return a
`concurrent.futures.Future`. An executor whose runner lives elsewhere (a worker
process) starts the call and returns at once, so the engine can queue the next
wave behind a running one (`max_concurrent_waves` > 1); the base class runs the
call in the caller's thread and returns a finished future.

Implementations sit beside this file: `inproc.py` (the runner in this process) and
`multiproc.py` (the runner in a worker process, results through shared memory).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from diffbatch.errors import ConfigError

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput
    from diffbatch.pipelines.interface import PipelineInfo
    from diffbatch.request import DiffusionRequest
    from diffbatch.sched.output import SchedulerOutput

_BACKENDS = {
    "inproc": "diffbatch.executor.inproc:InprocExecutor",
    "mp": "diffbatch.executor.multiproc:MultiprocExecutor",
}
T = TypeVar("T")


class Executor(ABC):
    """Runs waves on a `ModelRunner`; see the module docstring.

    `__init__` starts the runner (loading the pipeline) and sets `info`; it raises
    if the pipeline cannot be loaded. Every execute call returns exactly one output
    per request; a request whose run fails gets an output with `error` set. An
    executor whose runner is gone raises `EngineDeadError` from the execute calls
    and `check_health`.
    """

    info: PipelineInfo  # set once the pipeline is loaded
    # Waves this executor can hold at once (one running, the rest queued behind it);
    # 1 for an executor whose submit calls run the wave before returning.
    max_concurrent_waves: int = 1

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def execute_request(self, request: DiffusionRequest) -> DiffusionOutput:
        """Run one request on its own (the per-request path)."""

    @abstractmethod
    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Run one wave with one fused pipeline forward (the batch path)."""

    def submit_request(self, request: DiffusionRequest) -> Future[DiffusionOutput]:
        """Start `execute_request`; the future holds its output or its exception."""
        return _run_now(self.execute_request, request)

    def submit_batch(self, scheduler_output: SchedulerOutput) -> Future[BatchRunnerOutput]:
        """Start `execute_batch`; the future holds its output or its exception."""
        return _run_now(self.execute_batch, scheduler_output)

    @abstractmethod
    def check_health(self) -> None:
        """Raise `EngineDeadError` if the runner cannot take work."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the runner and free its resources; safe to call twice."""

    @staticmethod
    def get_class(kind: str | type[Executor]) -> type[Executor]:
        """Pick an executor class from "inproc", "mp", a class, or a dotted name."""
        if isinstance(kind, type):
            if not issubclass(kind, Executor):
                raise TypeError(f"executor class must subclass Executor, got {kind!r}")
            return kind
        target = _BACKENDS.get(kind, kind)
        module_name, sep, attr = target.partition(":")
        if not sep:
            module_name, _, attr = target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(
                f"executor must be one of {sorted(_BACKENDS)} or a dotted class name, "
                f"got {kind!r} ({exc})"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"executor {kind!r} must name an Executor subclass, got {cls!r}")
        return cls


def _run_now(fn: Callable[..., T], arg: object) -> Future[T]:
    """Call `fn(arg)` here and now; return a finished future with its result or error."""
    future: Future[T] = Future()
    try:
        future.set_result(fn(arg))
    except Exception as exc:
        future.set_exception(exc)
    return future
