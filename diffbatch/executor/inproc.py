"""The in-process executor: the runner lives in the engine's own process.

Cheapest path (no IPC); used for tests, notebooks and custom pipelines that hold
objects which cannot cross processes. A pipeline crash here is a crash of the
caller's process, which is why serving defaults to the worker process (`mp`).

In step mode the running batch runs its ticks on a thread of its own, through the
same loop a worker runs (`diffbatch.worker.worker.serve_steps`), with replies
resolving futures instead of crossing a pipe.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from diffbatch.errors import EngineClosedError, EngineDeadError
from diffbatch.executor.abstract import Executor
from diffbatch.ipc.messages import StepJoin, WorkerCall, WorkerMethod, WorkerReply
from diffbatch.outputs import BatchRunnerOutput
from diffbatch.worker.model_runner import ModelRunner
from diffbatch.worker.step_runner import StepRunner
from diffbatch.worker.worker import Inbox, serve_steps

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.sched.output import SchedulerOutput


class InprocExecutor(Executor):
    """Runs the `ModelRunner` directly in the calling thread (step mode: on a thread)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.torch_num_threads is not None:
            import torch

            torch.set_num_threads(config.torch_num_threads)
        self.runner: ModelRunner | None = ModelRunner(config)
        self.info = self.runner.info()
        self._steps: StepRunner | None = None
        self._inbox = Inbox()
        self._call_ids = itertools.count(1)
        # call id -> (its future, its request id): a failed reply names the request
        self._futures: dict[int, tuple[Future[BatchRunnerOutput], str]] = {}
        self._futures_lock = threading.Lock()
        self._step_thread: threading.Thread | None = None
        # call id -> the future of a plain call (a LoRA load) run by the step thread
        self._calls: dict[int, Future[Any]] = {}
        # request mode: a LoRA load from another thread waits for the running wave
        self._run_lock = threading.Lock()
        if config.step_execution:
            self._steps = StepRunner(self.runner)
            self._steps.send_partial_images_to(
                lambda _call_id, partial: self._notify_partial_image(partial))
            self._step_thread = threading.Thread(
                target=self._serve_steps, name="diffbatch-steps", daemon=True)
            self._step_thread.start()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise EngineDeadError("executor is shut down")
        return self.runner

    def compile_stats(self) -> dict[str, float]:
        runner = self.runner
        stats = None if runner is None else runner.compile_stats
        return {} if stats is None else stats.as_dict()

    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        with self._run_lock:
            return self._runner().execute_batch(scheduler_output,
                                                on_partial_image=self._notify_partial_image)

    # -- LoRA adapters -----------------------------------------------------------------
    def load_lora(self, key: str) -> str:
        return self._call("load_lora", key).result()

    def unload_lora(self, key: str) -> None:
        self._call("unload_lora", key)

    def _call(self, method: WorkerMethod, arg: Any) -> Future[Any]:
        """Run a plain runner call: between two ticks on the step thread, or now,
        between two waves, in request mode."""
        future: Future[Any] = Future()
        runner = self._runner()
        if self._steps is None:
            with self._run_lock:
                try:
                    future.set_result(getattr(runner, method)(arg))
                except Exception as exc:
                    future.set_exception(exc)
            return future
        call_id = next(self._call_ids)
        with self._futures_lock:
            self._calls[call_id] = future
        self._inbox.put(WorkerCall(call_id, method, arg))
        return future

    # -- step mode -------------------------------------------------------------------
    def submit_join(self, wave: SchedulerOutput, capacity: int, *,
                    stall_after_s: float | None = None) -> list[Future[BatchRunnerOutput]]:
        # (in process, a stuck batch is the caller's own thread: nothing to replace)
        futures: list[Future[BatchRunnerOutput]] = [Future() for _ in wave.requests]
        if self._steps is None or self.runner is None:
            for future in futures:
                future.set_exception(EngineClosedError("the executor is shut down")
                                     if self.runner is None else
                                     EngineDeadError("this executor was not started in step mode"))
            return futures
        call_ids = [next(self._call_ids) for _ in futures]
        with self._futures_lock:
            self._futures.update(zip(call_ids, zip(futures, wave.req_ids, strict=True),
                                     strict=True))
        self._inbox.put(WorkerCall(call_ids[0], "join", StepJoin(wave, call_ids, capacity)))
        return futures

    def cancel(self, future: Future[BatchRunnerOutput]) -> None:
        with self._futures_lock:
            call_id = next((cid for cid, (f, _) in self._futures.items() if f is future), None)
        if call_id is not None:
            self._inbox.cancel(call_id)

    def _serve_steps(self) -> None:
        assert self._steps is not None and self.runner is not None
        try:
            serve_steps(self._steps, self.runner, self._inbox, self._resolve, None)
        finally:
            with self._futures_lock:
                left = [f for f, _ in self._futures.values()] + list(self._calls.values())
                self._futures, self._calls = {}, {}
            for future in left:
                future.set_exception(EngineClosedError("the executor is shut down"))

    def _resolve(self, reply: WorkerReply) -> bool:
        with self._futures_lock:
            call = self._calls.pop(reply.call_id, None)
            entry = self._futures.pop(reply.call_id, None)
        if call is not None:
            if reply.error is not None:
                call.set_exception(reply.error.to_exception("the runner"))
            else:
                call.set_result(reply.result)
        if entry is not None:
            future, request_id = entry
            if reply.error is not None:
                future.set_result(BatchRunnerOutput.failed([request_id], reply.error.error))
            else:
                future.set_result(reply.result)
        return True

    # -- lifecycle -------------------------------------------------------------------
    def check_health(self) -> None:
        self._runner()

    def shutdown(self, timeout_s: float | None = None) -> None:
        self.runner = None
        if self._step_thread is not None:
            self._inbox.put(WorkerCall(0, "shutdown"))
            self._step_thread.join(timeout_s)
