"""The engine core: one background loop from waiting queue to delivered outputs.

`EngineCore.step()` is the whole loop body: wait for work, run the admission wait,
`schedule()` a wave, execute it (one fused forward on the batch path, one call per
request otherwise), `update_from_output()`, and hand every finished request to the
`deliver` callback. Everything that touches the scheduler holds `self.cond`'s lock;
the forward itself runs without it, so requests can arrive and abort meanwhile.

Outputs are delivered on a thread of their own, so the loop hands the worker its
next wave while the last wave's outputs are converted and handed to their callers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffbatch.engine.admission import AdmissionWait
from diffbatch.errors import DiffbatchError, EngineClosedError
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput, RequestError
from diffbatch.request import DiffusionRequest, RequestStatus
from diffbatch.sched.policy import make_scheduler

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.executor.abstract import Executor
    from diffbatch.metrics import EngineMetrics
    from diffbatch.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

Deliver = Callable[[DiffusionRequest, DiffusionOutput], None]


class ArrivalNotice:
    """A request announced to the engine before it is added, e.g. while HTTP parses it.

    Entering announces it; the engine closes it when the request is added, and
    leaving the `with` block closes it in any case (rejected, failed, disconnected).
    While it is open, the admission wait does not call the queue stable.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.open = False  # guarded by core.cond

    def __enter__(self) -> ArrivalNotice:
        self.core.announce(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.core.retract(self)


class EngineCore:
    """Owns the scheduler and the loop thread; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        supports_request_batch: bool,
        deliver: Deliver,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.config = config
        self.executor = executor
        self.supports_request_batch = supports_request_batch
        self.deliver = deliver
        self.metrics = metrics
        self.scheduler = make_scheduler(config)
        self.admission = AdmissionWait(config.request_batch_max_wait_ms, config.max_num_seqs)
        self.cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        # finished (request, output) pairs for the delivery thread; None stops it
        self._outbox: queue.SimpleQueue[tuple[DiffusionRequest, DiffusionOutput] | None] = (
            queue.SimpleQueue()
        )
        self._deliverer: threading.Thread | None = None
        self.last_admission_reason = ""  # why the last admission wait ended ("" = none)
        self.num_incoming = 0  # announced requests not yet added (see ArrivalNotice)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._deliverer = threading.Thread(
            target=self._deliver_loop, name="diffbatch-deliver", daemon=True
        )
        self._deliverer.start()
        self._thread = threading.Thread(target=self._run, name="diffbatch-engine", daemon=True)
        self._thread.start()

    def stop(self) -> list[DiffusionRequest]:
        """Tell the loop to stop; return the requests still open (for the caller to fail).

        A wave that is running finishes in the background and its results are
        discarded; `join()` waits for it.
        """
        with self.cond:
            self._stopped = True
            open_ids = list(self.scheduler.requests)
            open_requests = self.scheduler.finish_requests(open_ids, RequestStatus.FINISHED_ERROR)
            self.cond.notify_all()
        return open_requests

    def join(self, timeout_s: float = 60.0) -> None:
        """Wait for the loop (and its last wave) to end, then for the last deliveries."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._outbox.put(None)
        if self._deliverer is not None and self._deliverer is not threading.current_thread():
            self._deliverer.join(timeout_s)

    def _deliver_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                self.deliver(*item)
            except Exception:  # one caller's failure must not stop the others' deliveries
                logger.exception("delivering the output of request %s failed",
                                 item[0].request_id)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # -- requests --------------------------------------------------------------------
    def announce(self, notice: ArrivalNotice) -> None:
        """Count a request that is on its way (its caller still parses it)."""
        with self.cond:
            notice.open = True
            self.num_incoming += 1
            self.cond.notify_all()

    def retract(self, notice: ArrivalNotice | None) -> None:
        """Close an announcement (the request arrived, failed or went away); idempotent."""
        if notice is None:
            return
        with self.cond:
            if notice.open:
                notice.open = False
                self.num_incoming -= 1
                self.cond.notify_all()

    def add_requests(
        self, requests: list[DiffusionRequest], notice: ArrivalNotice | None = None
    ) -> None:
        """Queue requests together, so the loop sees them all at its next schedule.

        `notice`, when given, is closed in the same critical section, so an announced
        request is never counted twice nor missing from the admission wait's view.
        """
        with self.cond:
            if self._stopped:
                raise EngineClosedError("engine is closed")
            self.retract(notice)  # re-entrant: cond is an RLock-backed Condition
            added = []
            try:
                for request in requests:
                    self.scheduler.add_request(request)
                    added.append(request.request_id)
            except Exception:
                self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
                raise
            self.cond.notify_all()

    def abort_requests(self, request_ids: list[str]) -> list[DiffusionRequest]:
        """Abort waiting or running requests; returns those this call finished."""
        with self.cond:
            aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
            self.cond.notify_all()
        return aborted

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def num_waiting_by_key(self) -> dict[str, int]:
        """Waiting requests per key, keys in short form (for metrics)."""
        with self.cond:
            counts = self.scheduler.num_waiting_by_key()
        return {key.short(): n for key, n in counts.items()}

    # -- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            try:
                self.step()
            except Exception:  # a bug in the loop must not leave callers hanging forever
                logger.exception("engine loop step failed; failing its requests")
                with self.cond:
                    running = list(self.scheduler.running)
                    failed = self.scheduler.finish_requests(
                        running, RequestStatus.FINISHED_ERROR
                    )
                for request in failed:
                    self._outbox.put((request, DiffusionOutput.from_error(
                        request.request_id, RequestError("internal engine error"))))

    def step(self) -> bool:
        """Run at most one wave; return whether one ran."""
        # 1. Wait for work, then (maybe) for the burst to coalesce, then schedule.
        with self.cond:
            while not self._stopped and self.scheduler.num_waiting == 0:
                self.cond.wait()
            if self._stopped:
                return False
            self.last_admission_reason = ""
            if self.admission.should_wait(
                supports_request_batch=self.supports_request_batch,
                step_execution=self.config.step_execution,
                num_running=self.scheduler.num_running,
            ):
                self.last_admission_reason = self.admission.wait(
                    lambda: self.scheduler.num_waiting,
                    lambda: self._stopped,
                    self.cond.wait,
                    num_incoming=lambda: self.num_incoming,
                )
            if self._stopped:
                return False
            wave = self.scheduler.schedule()
        if wave.is_empty:
            return False
        # 2. Execute outside the lock: arrivals and aborts go on meanwhile.
        wave_start = time.monotonic()
        runner_output = self._execute(wave)
        # 3. Finish the wave's requests and deliver their outputs.
        with self.cond:
            finished = self.scheduler.update_from_output(wave, runner_output)
        self._log_wave(wave, wave_start, runner_output)
        for request, output in finished:
            output.queue_time_ms = (wave_start - request.arrival_time) * 1000.0
            self._outbox.put((request, output))
        return True

    def _execute(self, wave: SchedulerOutput) -> BatchRunnerOutput:
        """Run the wave on the batch path or the per-request path."""
        if self.supports_request_batch:
            try:
                return self.executor.execute_batch(wave)
            except DiffbatchError as exc:  # e.g. the worker process died mid-wave
                return self._failed(wave, wave.requests, exc)
        outputs: dict[str, DiffusionOutput] = {}
        for request in wave.requests:  # one call each: a failure fails only that request
            try:
                outputs[request.request_id] = self.executor.execute_request(request)
            except DiffbatchError as exc:
                outputs.update(self._failed(wave, [request], exc).outputs)
        return BatchRunnerOutput(
            outputs=outputs,
            forward_time_ms=sum(o.execute_time_ms for o in outputs.values()),
            num_forwards=len(outputs),
        )

    def _failed(
        self, wave: SchedulerOutput, requests: list[DiffusionRequest], exc: DiffbatchError
    ) -> BatchRunnerOutput:
        logger.error("wave %d failed in the executor: %s", wave.wave_id, exc.message)
        error = RequestError.from_exception(exc)
        return BatchRunnerOutput(
            outputs={r.request_id: DiffusionOutput.from_error(r.request_id, error)
                     for r in requests},
            num_forwards=0,
        )

    def _log_wave(
        self, wave: SchedulerOutput, wave_start: float, runner_output: BatchRunnerOutput
    ) -> None:
        queue_wait_ms = max((wave_start - r.arrival_time) * 1000.0 for r in wave.requests)
        forward_ms = runner_output.forward_time_ms
        logger.info(
            "wave %d: %d request(s) key=%s closed=%s admission=%s max_queue_wait=%.1fms "
            "forward=%.1fms",
            wave.wave_id, wave.num_requests, wave.key.short() if wave.key else "-",
            wave.close_reason, self.last_admission_reason or "none", queue_wait_ms, forward_ms,
        )
        if self.metrics is not None:
            self.metrics.observe_wave(wave.num_requests, wave.close_reason,
                                      self.last_admission_reason, forward_ms / 1000.0)
