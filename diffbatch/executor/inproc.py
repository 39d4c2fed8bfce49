"""The in-process executor: the runner lives in the engine's own process.

Cheapest path (no IPC); used for tests, notebooks and custom pipelines that hold
objects which cannot cross processes. A pipeline crash here is a crash of the
caller's process, which is why serving defaults to the worker process (`mp`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffbatch.errors import EngineDeadError
from diffbatch.executor.abstract import Executor
from diffbatch.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.outputs import BatchRunnerOutput
    from diffbatch.sched.output import SchedulerOutput


class InprocExecutor(Executor):
    """Runs the `ModelRunner` directly in the calling thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.torch_num_threads is not None:
            import torch

            torch.set_num_threads(config.torch_num_threads)
        self.runner: ModelRunner | None = ModelRunner(config)
        self.info = self.runner.info()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise EngineDeadError("executor is shut down")
        return self.runner

    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        return self._runner().execute_batch(scheduler_output,
                                            on_partial_image=self._notify_partial_image)

    def check_health(self) -> None:
        self._runner()

    def shutdown(self, timeout_s: float | None = None) -> None:
        self.runner = None
