"""The engine core: one background loop from waiting queue to delivered outputs.

`EngineCore.step()` is the whole loop body. It blocks until one of two things can
happen, then does it:

- dispatch: run the admission wait (only when nothing is in flight; its target and
  deadline come from the `BatchPolicy`, fixed or learned), `schedule()` a wave (each
  key's capacity from the same policy) and hand it to the executor (`submit_batch`:
  one fused forward; a pipeline that cannot batch gets waves of one);
- finish: the oldest wave in flight is done: feed its forward time to the policy's
  cost model, `update_from_output()`, and hand every finished request to the
  `deliver` callback.

Up to `max_concurrent_waves` of the executor's waves are in flight (the config's
`max_waves_in_flight`). While one runs, the next is dispatched only when it is full
(`scheduler.has_full_wave()`: waiting could not make it bigger), so it waits at the
worker and starts the moment the running one ends, without a round trip through
this loop; a wave that could still grow waits here as before, so queuing ahead
never shrinks a wave. Everything that touches the scheduler holds `self.cond`'s
lock; executor calls run without it, so requests can arrive and abort meanwhile.

Outputs are delivered on a thread of their own, so the loop is free for the next
wave while the last wave's outputs are converted and handed to their callers.

Start-up and serving: the engine hands the core its `metrics` and `wave_log` when it
builds it, and runs its warm-up request through this same loop before it serves.
Those start-up waves are not served traffic (a cold first forward, a request
nobody sent), so the core records waves in the metrics and the wave log, and lets
them teach the batch policy, only after `start_serving()`, which the engine calls
once start-up (warm-up, then calibration, which drives the executor directly) is
over. One switch, in one place: whatever the core records, it records from the same
moment on.

Failures of the worker, not of the pipeline:

- while the executor restarts a dead worker (`executor.is_restarting`), nothing is
  dispatched: the queue waits for the replacement (its ready listener wakes the loop);
- each wave is handed over with its stall bound (`BatchPolicy.stall_bound_s`: a
  multiple of its learned expected time); an executor that watches a worker treats
  a wave running past it like a silent heartbeat: the worker is killed and replaced;
- a wave whose worker died under it (`WorkerDiedError`, `started`) is re-run on the
  replacement split in halves, as bisect isolation does, so only a request that
  kills the worker again on its own fails (naming the crash); a wave that was only
  queued behind it, or refused while the replacement started, is re-run as it was.
  Re-runs go before anything new, their requests stay RUNNING meanwhile;
- a wave none of whose requests is wanted any more (all aborted: disconnect,
  timeout, stop) is cancelled in the executor, which stops it at its next denoising
  step or drops it before it starts; `num_running` counts its requests until it
  has stopped, since the worker is still busy with them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diffbatch.engine.admission import MAX_NOTICE_HOLD_MS, AdmissionWait
from diffbatch.errors import DiffbatchError, EngineClosedError, WorkerDiedError
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput, RequestError
from diffbatch.request import DiffusionRequest, RequestStatus
from diffbatch.sched.policy import make_scheduler

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.engine.batch_policy import BatchPolicy
    from diffbatch.engine.wave_log import WaveLog
    from diffbatch.executor.abstract import Executor
    from diffbatch.metrics import EngineMetrics
    from diffbatch.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

Deliver = Callable[[DiffusionRequest, DiffusionOutput], None]
INTERNAL_ERROR = RequestError("internal engine error")


@dataclass
class InFlightWave:
    """A wave handed to the executor whose outputs are not back yet."""

    wave: SchedulerOutput
    future: Future[BatchRunnerOutput]
    dispatched: float  # time.monotonic() when it was handed to the executor
    admission_reason: str  # why its admission wait ended ("" = no wait)
    crashed_before: bool = False  # its requests were in a wave the worker died under
    cancelled: bool = False  # the executor was told nobody waits for it


@dataclass
class _Rerun:
    """A wave to dispatch again, before anything new: see the module docstring."""

    wave: SchedulerOutput
    crashed_before: bool  # its requests were already in a wave the worker died under


class ArrivalNotice:
    """A request announced to the engine before it is added, e.g. while HTTP parses it.

    Entering announces it; the engine closes it when the request is added, and
    leaving the `with` block closes it in any case (rejected, failed, disconnected).
    For `MAX_NOTICE_HOLD_MS` after it opened, the admission wait does not call the
    queue stable; a body slower than that (a slow client) no longer holds anyone.
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
        policy: BatchPolicy,
        deliver: Deliver,
        metrics: EngineMetrics | None = None,
        wave_log: WaveLog | None = None,
    ) -> None:
        self.config = config
        self.executor = executor
        self.policy = policy
        self.deliver = deliver
        self.metrics = metrics
        self.wave_log = wave_log  # each recorded wave is appended
        # NOTE: start-up waves (the engine's warm-up) run like any other but are not
        # served traffic: `metrics` and `wave_log` record waves only once the engine
        # calls `start_serving()`.
        self.serving = False
        self.scheduler = make_scheduler(config, capacity_of=policy.capacity)
        self.cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        # finished (request, output) pairs for the delivery thread; None stops it
        self._outbox: queue.SimpleQueue[tuple[DiffusionRequest, DiffusionOutput] | None] = (
            queue.SimpleQueue()
        )
        self._deliverer: threading.Thread | None = None
        self.last_admission_reason = ""  # why the last admission wait ended ("" = none)
        self.max_waves_in_flight = max(1, executor.max_concurrent_waves)
        self.in_flight: deque[InFlightWave] = deque()  # oldest first; only the loop changes it
        self._reruns: deque[_Rerun] = deque()  # waves to dispatch again, oldest first
        # `drain`: what a wave the worker dies under fails with once shutting down
        self._drain_error: Exception | None = None
        self.num_incoming = 0  # announced requests not yet added (see ArrivalNotice)
        self._open_notices: dict[int, float] = {}  # id(notice) -> opened, oldest first
        executor.set_ready_listener(self._notify)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._deliverer = threading.Thread(
            target=self._deliver_loop, name="diffbatch-deliver", daemon=True
        )
        self._deliverer.start()
        self._thread = threading.Thread(target=self._run, name="diffbatch-engine", daemon=True)
        self._thread.start()

    def start_serving(self) -> None:
        """End start-up: waves from now on are recorded in `metrics` and `wave_log`, and
        teach the batch policy's cost model (whose cold first waves would skew it)."""
        self.serving = True
        self.policy.serving = True

    def stop(self) -> list[DiffusionRequest]:
        """Tell the loop to stop; return the requests still open (for the caller to fail).

        Waves in flight finish in the background and their results are discarded;
        `join()` waits for them.
        """
        with self.cond:
            self._stopped = True
            open_ids = self.scheduler.request_ids()
            open_requests = self.scheduler.finish_requests(open_ids, RequestStatus.FINISHED_ERROR)
            self._reruns.clear()
            unwanted = self._unwanted_waves()
            self.cond.notify_all()
        self._cancel(unwanted)
        return open_requests

    def threads(self) -> list[threading.Thread]:
        """The loop's and the delivery's threads (once started)."""
        return [t for t in (self._thread, self._deliverer) if t is not None]

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
            self._open_notices[id(notice)] = time.monotonic()
            self.cond.notify_all()

    def retract(self, notice: ArrivalNotice | None) -> None:
        """Close an announcement (the request arrived, failed or went away); idempotent."""
        if notice is None:
            return
        with self.cond:
            if notice.open:
                notice.open = False
                self.num_incoming -= 1
                del self._open_notices[id(notice)]
                self.cond.notify_all()

    def _num_recent_incoming(self) -> int:
        """(Holding `cond`.) Open notices younger than `MAX_NOTICE_HOLD_MS` (a slow
        upload older than that is not part of the burst)."""
        since = time.monotonic() - MAX_NOTICE_HOLD_MS / 1000.0
        count = 0
        for opened in reversed(self._open_notices.values()):  # newest first
            if opened < since:
                break
            count += 1
        return count

    def _incoming_hold_until(self) -> float:
        """(Holding `cond`.) Until when announced requests may hold the admission wait:
        the newest open notice's opening plus `MAX_NOTICE_HOLD_MS` (0.0: none open)."""
        if not self._open_notices:
            return 0.0
        return next(reversed(self._open_notices.values())) + MAX_NOTICE_HOLD_MS / 1000.0

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
            self.policy.observe_arrivals(len(requests), busy=not self._idle())
            added = []
            try:
                for request in requests:
                    self.scheduler.add_request(request)
                    added.append(request.request_id)
            except Exception:
                self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
                raise
            self.cond.notify_all()

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> list[DiffusionRequest]:
        """Finish waiting or running requests (aborted, or `status`); returns those this
        call finished. A wave in flight none of whose requests is left is cancelled."""
        with self.cond:
            aborted = self.scheduler.finish_requests(request_ids, status)
            unwanted = self._unwanted_waves()
            self.cond.notify_all()
        self._cancel(unwanted)
        return aborted

    def drain(self, error: Exception) -> None:
        """Shutting down: no wave runs again after a worker death (no replacement will
        start); the requests of a wave the worker dies under fail with `error`."""
        with self.cond:
            self._drain_error = error

    def finish_waiting(self, status: RequestStatus) -> list[DiffusionRequest]:
        """Finish every request that is not running: those queued here, those held to
        run again on a replacement worker, and those handed to the executor that it
        has not started (a wave queued behind the running one at the worker; in step
        mode, requests not in its running batch yet), which it drops. Running ones
        keep running."""
        with self.cond:
            held = {r.request_id for rerun in self._reruns for r in rerun.wave.requests}
            running = set(self.scheduler.running_request_ids()) - held
            waiting = [rid for rid in self.scheduler.request_ids() if rid not in running]
            finished = self.scheduler.finish_requests(waiting, status)
            in_flight = [record for record in self.in_flight if not record.future.done()]
        # (asked without `cond`: the executor takes its own locks)
        queued = [request.request_id for record in in_flight
                  if not self.executor.has_started(record.future)
                  for request in record.wave.requests]
        with self.cond:
            finished += self.scheduler.finish_requests(queued, status)
            unwanted = self._unwanted_waves()
            self.cond.notify_all()
        self._cancel(unwanted)
        return finished

    def open_request_ids(self) -> list[str]:
        with self.cond:
            return self.scheduler.request_ids()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing waits, runs or is in flight; False if `timeout_s` passed."""
        with self.cond:
            return self.cond.wait_for(self._idle, timeout_s)

    def _idle(self) -> bool:
        """(Holding `cond`.) Whether nothing waits, runs, is in flight or is to run again."""
        return (not self.in_flight and not self._reruns
                and self.scheduler.num_waiting == 0 and self.scheduler.num_running == 0)

    def _unwanted_waves(self) -> list[InFlightWave]:
        """(Holding `cond`.) Waves in flight none of whose requests is open any more, not
        cancelled yet; marks them cancelled (the caller tells the executor)."""
        unwanted = [w for w in self.in_flight if not w.cancelled and not w.future.done()
                    and all(r.is_finished for r in w.wave.requests)]
        for record in unwanted:
            record.cancelled = True
        return unwanted

    def _cancel(self, records: list[InFlightWave]) -> None:
        """(Without `cond`.) Tell the executor nobody waits for these waves."""
        for record in records:
            logger.info("wave %d: none of its %d request(s) is wanted any more; stopping it",
                        record.wave.wave_id, record.wave.num_requests)
            if self.metrics is not None and self.serving:
                self.metrics.waves_cancelled.inc()
            self.executor.cancel(record.future)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """Requests the executor works on: running ones, and aborted ones whose wave has
        not stopped yet (the worker is still busy with them)."""
        with self.cond:
            stopping = sum(1 for w in self.in_flight if not w.future.done()
                           for r in w.wave.requests if r.is_finished)
            return self.scheduler.num_running + stopping

    def num_waiting_by_key(self) -> dict[str, int]:
        """Waiting requests per key, keys in short form (for metrics)."""
        with self.cond:
            counts = self.scheduler.num_waiting_by_key()
        return {key.short(): n for key, n in counts.items()}

    # -- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self.step():
                    return
            except Exception:  # a bug in the loop must not leave callers hanging forever
                logger.exception("engine loop step failed; failing its requests")
                with self.cond:
                    running = self.scheduler.running_request_ids()
                    failed = self.scheduler.finish_requests(
                        running, RequestStatus.FINISHED_ERROR
                    )
                    self.in_flight.clear()  # their late results have no one left to go to
                for request in failed:
                    self._outbox.put((request, DiffusionOutput.from_error(
                        request.request_id, INTERNAL_ERROR)))

    def step(self) -> bool:
        """Dispatch one wave or finish one; False once stopped with nothing in flight."""
        with self.cond:
            action = self._next_action()
        if action is None:
            return False
        if isinstance(action, InFlightWave):
            self._finish(action)
        elif isinstance(action, _Rerun):
            self._dispatch(action.wave, crashed_before=action.crashed_before)
        else:
            self._dispatch(action)
        return True

    def _next_action(self) -> InFlightWave | _Rerun | SchedulerOutput | None:
        """Block (holding `cond`) until the oldest wave is done or a wave can go."""
        while True:
            if self.in_flight and self.in_flight[0].future.done():
                return self.in_flight.popleft()
            if self._stopped:
                if not self.in_flight:
                    return None
            elif len(self.in_flight) < self.max_waves_in_flight \
                    and not self.executor.is_restarting:
                wave = self._next_rerun() or self._schedule()
                if wave is not None:
                    return wave
            self.cond.wait()

    def _notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _next_rerun(self) -> _Rerun | None:
        """(Holding `cond`.) The oldest wave to run again, without requests finished since."""
        while self._reruns:
            rerun = self._reruns.popleft()
            live = [r for r in rerun.wave.requests if not r.is_finished]
            if live:
                self.last_admission_reason = ""
                return _Rerun(replace(rerun.wave, requests=live), rerun.crashed_before)
        return None

    def _schedule(self) -> SchedulerOutput | None:
        """(Holding `cond`.) The next wave to dispatch now, if any.

        Idle: wait for the burst to coalesce (maybe), then take what is there. Busy:
        only a wave that waiting could not grow goes ahead of the running one.
        """
        if self.scheduler.num_waiting == 0:
            return None
        self.last_admission_reason = ""
        if self.in_flight:
            if not self.scheduler.has_full_wave():
                return None
        elif self.scheduler.num_running == 0:
            num_waiting = self.scheduler.num_waiting
            key = self.scheduler.next_key()
            plan = self.policy.plan_wait(key, num_waiting, self._num_recent_incoming())
            target = plan.target
            limit = None if key is None else self.scheduler.wave_size_limit(key)
            if limit is not None:  # e.g. max_wave_pixels: no wave would take more
                target = min(target, limit)
            admission = AdmissionWait(plan.max_wait_ms, target, plan.stable_window_ms)
            if admission.should_wait(supports_request_batch=self.policy.batching,
                                     num_running=0):
                self.last_admission_reason = admission.wait(
                    lambda: self.scheduler.num_waiting,
                    lambda: self._stopped,
                    self.cond.wait,
                    incoming_hold_until=self._incoming_hold_until,
                )
                if self._stopped:
                    return None
        wave = self.scheduler.schedule()
        return None if wave.is_empty else wave

    def _dispatch(self, wave: SchedulerOutput, *, crashed_before: bool = False) -> None:
        """Hand the wave to the executor (outside the lock) and track it."""
        dispatched = time.monotonic()
        stall_after_s = self.policy.stall_bound_s(wave.key, wave.num_requests)
        future = self.executor.submit_batch(wave, stall_after_s=stall_after_s)
        record = InFlightWave(wave, future, dispatched, self.last_admission_reason,
                              crashed_before=crashed_before)
        with self.cond:
            self.in_flight.append(record)
            unwanted = self._unwanted_waves()  # aborted while it was being handed over
        self._cancel(unwanted)
        future.add_done_callback(self._wake)  # runs at once if the call already ran

    def _wake(self, _future: Future[BatchRunnerOutput]) -> None:
        with self.cond:
            self.cond.notify_all()

    def _executor_error(self, wave: SchedulerOutput, exc: Exception) -> RequestError:
        """The error outputs carry when the executor itself failed (not the pipeline)."""
        if isinstance(exc, EngineClosedError):  # the engine's own shutdown cut it short
            logger.info("wave %d ended by the shutdown: %s", wave.wave_id, exc.message)
            return RequestError.from_exception(exc)
        if isinstance(exc, DiffbatchError):  # e.g. the worker process died mid-wave
            logger.error("wave %d failed in the executor: %s", wave.wave_id, exc.message)
            return RequestError.from_exception(exc)
        logger.error("wave %d failed in the executor", wave.wave_id, exc_info=exc)
        return INTERNAL_ERROR

    def _result_of(self, record: InFlightWave) -> BatchRunnerOutput | None:
        """A done wave's runner output: its own, or failed outputs when the executor
        failed; None when a worker death queued it to run again."""
        wave = record.wave
        try:
            return record.future.result()
        except WorkerDiedError as exc:
            if self._drain_error is not None:
                logger.warning("wave %d: %s during shutdown; not re-run", wave.wave_id,
                               exc.message)
                return BatchRunnerOutput.failed(
                    wave.req_ids, RequestError.from_exception(self._drain_error))
            return self._after_death(record, exc)
        except Exception as exc:
            return BatchRunnerOutput.failed(wave.req_ids, self._executor_error(wave, exc))

    def _after_death(self, record: InFlightWave, exc: WorkerDiedError) -> BatchRunnerOutput | None:
        """The worker died under (or before) the wave: re-run it (None), or fail it."""
        if self._rerun_after_death(record, exc):
            return None
        return BatchRunnerOutput.failed(record.wave.req_ids, RequestError(
            "the worker process died while running this request, and again when it "
            f"was re-run on its own on a replacement ({exc.message})"))

    def _finish(self, record: InFlightWave) -> None:
        """Finish a done wave's requests and deliver their outputs."""
        wave = record.wave
        runner_output = self._result_of(record)
        if runner_output is None:
            return
        # A wave queued at the worker started when the one before it ended, not when it
        # was dispatched: take the later of the two.
        started = max(record.dispatched,
                      time.monotonic() - runner_output.forward_time_ms / 1000.0)
        self.policy.observe_wave(wave.key, wave.num_requests, runner_output.forward_time_ms,
                                 runner_output.num_forwards)
        with self.cond:
            finished = self.scheduler.update_from_output(wave, runner_output)
            try:
                # (requests in the engine right before these answers: a closed loop's
                # population shows in them, `diffbatch.engine.returning`)
                self.policy.observe_answers(
                    len(finished), in_engine=len(finished) + self.scheduler.num_waiting
                    + self.scheduler.num_running + self._num_recent_incoming())
            except Exception:  # finished above: a policy bug must not cost their answers
                logger.exception("the batch policy failed to observe a wave's answers")
            self.cond.notify_all()  # for wait_idle
        self._log_wave(wave, started, runner_output, record.admission_reason)
        for request, output in finished:
            output.queue_time_ms = (started - request.arrival_time) * 1000.0
            self._outbox.put((request, output))

    def _rerun_after_death(self, record: InFlightWave, exc: WorkerDiedError) -> bool:
        """Queue the wave's open requests to run again on the replacement worker; False
        if its one request already killed a worker before (it fails instead)."""
        wave = record.wave
        with self.cond:
            live = [r for r in wave.requests if not r.is_finished]
            if not exc.started:  # it never ran: again as it was
                if live:
                    self._reruns.append(_Rerun(replace(wave, requests=live),
                                               record.crashed_before))
                self.cond.notify_all()
                return True
            if record.crashed_before and len(live) == 1:
                return False
            mid = len(live) // 2  # as `ModelRunner._isolate` splits
            halves = [part for part in (live[:mid], live[mid:]) if part]
            for part in halves:
                self._reruns.append(_Rerun(replace(wave, requests=part, close_reason="rerun"),
                                           crashed_before=True))
            self.cond.notify_all()
        logger.warning("wave %d: %s; re-running its %d open request(s) in %d wave(s) on the "
                       "replacement", wave.wave_id, exc.message, len(live), len(halves))
        if self.metrics is not None and self.serving and live:
            self.metrics.waves_rerun.inc(len(halves))
        return True

    def _log_wave(
        self, wave: SchedulerOutput, wave_start: float, runner_output: BatchRunnerOutput,
        admission_reason: str,
    ) -> None:
        queue_wait_ms = max((wave_start - r.arrival_time) * 1000.0 for r in wave.requests)
        forward_ms = runner_output.forward_time_ms
        logger.info(
            "wave %d: %d request(s) key=%s closed=%s admission=%s max_queue_wait=%.1fms "
            "forward=%.1fms",
            wave.wave_id, wave.num_requests, wave.key.short() if wave.key else "-",
            wave.close_reason, admission_reason or "none", queue_wait_ms, forward_ms,
        )
        if not self.serving:
            return
        if self.metrics is not None:
            self.metrics.observe_wave(wave.num_requests, wave.close_reason,
                                      admission_reason, forward_ms / 1000.0)
            self.metrics.observe_loras(runner_output.num_lora_adapters,
                                       runner_output.num_lora_loads,
                                       runner_output.num_lora_evictions)
        if self.wave_log is not None:
            statuses = [r.status for r in wave.requests]  # final: update_from_output ran
            self.wave_log.record(
                wave_id=wave.wave_id, num_requests=wave.num_requests,
                key=wave.key.short() if wave.key else "-", close_reason=wave.close_reason,
                admission=admission_reason, max_queue_wait_ms=queue_wait_ms,
                forward_ms=forward_ms,
                num_errors=statuses.count(RequestStatus.FINISHED_ERROR),
                num_aborted=statuses.count(RequestStatus.FINISHED_ABORTED),
            )
