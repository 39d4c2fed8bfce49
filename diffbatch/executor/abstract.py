"""The executor seam: how the engine runs scheduled work, in-process or in a worker.

Two request-mode entries, as in the design note:

- `execute_request(request)`: one call per scheduled request (per-request path);
- `execute_batch(scheduler_output)`: one call for the whole wave (batch path).

Implementations sit beside this file: `inproc.py` (the runner in this process) and
`multiproc.py` (the runner in a worker process, results through shared memory).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

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


class Executor(ABC):
    """Runs waves on a `ModelRunner`; see the module docstring.

    `__init__` starts the runner (loading the pipeline) and sets `info`; it raises
    if the pipeline cannot be loaded. Every execute call returns exactly one output
    per request; a request whose run fails gets an output with `error` set. An
    executor whose runner is gone raises `EngineDeadError` from the execute calls
    and `check_health`.
    """

    info: PipelineInfo  # set once the pipeline is loaded

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def execute_request(self, request: DiffusionRequest) -> DiffusionOutput:
        """Run one request on its own (the per-request path)."""

    @abstractmethod
    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Run one wave with one fused pipeline forward (the batch path)."""

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
