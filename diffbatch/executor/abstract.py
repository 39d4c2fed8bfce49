"""The executor seam: how the engine runs a scheduled wave, in-process or in a worker.

One entry runs work: `execute_batch(scheduler_output)`, one fused forward for the
whole wave (a pipeline that cannot batch simply gets waves of one), and its
non-blocking twin `submit_batch`, which returns a `concurrent.futures.Future`. An
executor whose runner lives elsewhere (a worker process) starts the call and
returns at once, so the engine can queue the next wave behind a running one
(`max_concurrent_waves` > 1); the base class runs the call in the caller's thread
and returns a finished future.

Partial images (previews a request asked for) come back while their wave still runs:
the executor hands each to its partial-image listener (`set_partial_image_listener`),
before the wave's output.

Implementations sit beside this file: `inproc.py` (the runner in this process) and
`multiproc.py` (the runner in a worker process, results through shared memory).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from diffbatch.errors import ConfigError
from diffbatch.imports import import_by_name

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.outputs import BatchRunnerOutput, PartialImage
    from diffbatch.pipelines.interface import PipelineInfo
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
    and `check_health` (`WorkerDiedError` when a runner died under a wave and a
    replacement is starting: `is_restarting`; the ready listener is called when the
    replacement serves or the restart failed).
    """

    info: PipelineInfo  # set once the pipeline is loaded
    # Waves this executor can hold at once (one running, the rest queued behind it);
    # 1 for an executor whose submit calls run the wave before returning.
    max_concurrent_waves: int = 1

    _ready_listener: Callable[[], None] | None = None
    _partial_image_listener: Callable[[PartialImage], object] | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Run one wave with one fused pipeline forward."""

    def submit_batch(
        self, scheduler_output: SchedulerOutput, *, stall_after_s: float | None = None,
    ) -> Future[BatchRunnerOutput]:
        """Start `execute_batch`; the future holds its output or its exception.

        `stall_after_s`: once the wave has run this long, its runner counts as stuck
        (an executor that can replace its runner does so, as for a silent heartbeat);
        None = no bound. An executor that runs the wave in the caller's thread cannot
        watch it and ignores the bound.
        """
        future: Future[BatchRunnerOutput] = Future()
        try:
            future.set_result(self.execute_batch(scheduler_output))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def submit_join(self, wave: SchedulerOutput, capacity: int, *,
                    stall_after_s: float | None = None) -> list[Future[BatchRunnerOutput]]:
        """Step mode: add the wave's requests to the running batch (at most `capacity`
        requests run at once); one future per request, done when it leaves the batch.
        `stall_after_s`: while they are in it, a batch that finishes no step for this
        long means a stuck runner (an executor that can replace its worker does so)."""
        raise ConfigError(f"the {type(self).__name__} executor does not run step mode")

    def load_lora(self, key: str) -> str:
        """Read, check and load a LoRA adapter in the runner (`LoraRef.key` names it);
        returns the key of the version read. Raises `InvalidRequestError` naming the
        client's adapter name and the reason when the adapter is refused."""
        raise ConfigError(f"the {type(self).__name__} executor does not load LoRA adapters")

    def unload_lora(self, key: str) -> None:  # noqa: B027 - optional
        """Drop the weights of adapter `key` in the runner (once no wave uses them);
        never blocks. An executor without `load_lora` ignores it."""

    def has_started(self, future: Future[BatchRunnerOutput]) -> bool:
        """Whether the runner started the call behind `future` (a wave queued behind
        the running one has not; in step mode, a request not yet in the running batch
        has not); an executor that cannot tell says True."""
        return True

    def cancel(self, future: Future[BatchRunnerOutput]) -> None:  # noqa: B027 - optional
        """Nobody waits for the wave behind `future` any more: stop it at its next
        denoising step, or drop it if it has not started; its requests then come back
        aborted. Never blocks; a finished or unknown future is ignored. An executor
        that runs waves in the caller's thread lets the runner see the aborts itself."""

    def stop_restarting(self) -> None:  # noqa: B027 - optional
        """From now on a runner that dies is not replaced (the engine is shutting down:
        a replacement would load the model for nobody); its pending work fails as it
        would otherwise. An executor without restarts ignores it."""

    @property
    def is_restarting(self) -> bool:
        """Whether the runner died and a replacement is starting (work can wait)."""
        return False

    def set_ready_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` (from any thread, without locks held) whenever a restart
        ends: a replacement serves, or starting it failed."""
        self._ready_listener = listener

    def _notify_ready(self) -> None:
        if self._ready_listener is not None:
            self._ready_listener()

    def set_partial_image_listener(self, listener: Callable[[PartialImage], object]) -> None:
        """Call `listener` with each partial image a running wave sends, from the thread
        that receives it (it must not block), before that wave's output is returned."""
        self._partial_image_listener = listener

    def _notify_partial_image(self, partial: PartialImage) -> None:
        if self._partial_image_listener is not None:
            self._partial_image_listener(partial)

    def health_stats(self) -> dict[str, float]:
        """Numbers for /metrics: `up` (1 or 0), `heartbeat_age_s`, and the counts
        `deaths`, `frozen` (killed as stalled), `stuck_waves` (of those, for a wave past
        its stall bound) and `restarts`; an executor reports what it has."""
        return {}

    def compile_stats(self) -> dict[str, float]:
        """The runner's compile counts (`CompileStats.as_dict`; empty: not compiling)."""
        return {}

    @abstractmethod
    def check_health(self) -> None:
        """Raise `EngineDeadError` if the runner cannot take work."""

    @abstractmethod
    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the runner and free its resources; safe to call twice. `timeout_s`
        bounds each stage of stopping a runner that does not stop on its own."""

    @staticmethod
    def get_class(kind: str | type[Executor]) -> type[Executor]:
        """Pick an executor class from "inproc", "mp", a class, or a dotted name."""
        if isinstance(kind, type):
            cls = kind
        else:
            try:
                cls = import_by_name(_BACKENDS.get(kind, kind), what="executor")
            except ConfigError as exc:
                raise ConfigError(
                    f"executor must be one of {sorted(_BACKENDS)} or a dotted class name, "
                    f"got {kind!r} ({exc.message})"
                ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"executor {kind!r} must name an Executor subclass, got {cls!r}")
        return cls
