"""The engine core: one background loop from waiting queue to delivered outputs.

`EngineCore.step()` is the whole loop body. It blocks until one of two things can
happen, then does it:

- finish: a record in flight is done: its `Dispatch` finishes its requests and the
  outputs go to the `deliver` callback;
- dispatch: a wave may go (a re-run first): its `Dispatch` hands it to the executor.

What a dispatch is belongs to the execution mode, behind one seam
(`diffbatch.engine.dispatch.Dispatch`): `WaveDispatch` (request mode: admission wait,
one fused forward per wave) or `StepDispatch` (step mode: requests join and leave a
batch running in the worker). Everything that touches the scheduler holds
`self.cond`'s lock; executor calls run without it, so requests can arrive and abort
meanwhile.

Outputs are delivered on a thread of their own, so the loop is free for the next
wave while the last wave's outputs are converted and handed to their callers.

Start-up and serving: the engine hands the core its `metrics` and `wave_log` when it
builds it, and runs its warm-up request through this same loop before it serves.
Those start-up waves are not served traffic (a cold first forward, a request
nobody sent), so the core records waves in the metrics and the wave log, and lets
them teach the batch policy, only after `start_serving()`, which the engine calls
once start-up (warm-up, then calibration, which drives the executor directly) is
over.

Failures of the worker, not of the pipeline:

- while the executor restarts a dead worker (`executor.is_restarting`), nothing is
  dispatched: the queue waits for the replacement (its ready listener wakes the loop);
- each wave is handed over with its stall bound (`StallBounds`); an
  executor that watches a worker treats a wave running past it like a silent
  heartbeat: the worker is killed and replaced;
- a wave the worker died under is re-run or failed as its dispatch says
  (`Dispatch.after_death`); re-runs go before anything new, their requests stay
  RUNNING meanwhile;
- a wave none of whose requests is wanted any more (all aborted: disconnect,
  timeout, stop) is cancelled in the executor, which stops it at its next denoising
  step or drops it before it starts.

The public surface a dispatch uses: `config`, `executor`, `policy`, `scheduler`,
`cond`, `in_flight`, `metrics`, `wave_log`, `serving`, `stopped`,
`max_waves_in_flight`, `last_admission_reason`, `result_of`, `rerun`, `emit`,
`unwanted_waves` and `wake`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diffbatch.engine.dispatch import Dispatch, InFlightWave
from diffbatch.engine.wave_dispatch import WaveDispatch
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
class _Rerun:
    """A wave to dispatch again, before anything new: see the module docstring."""

    wave: SchedulerOutput
    crashed_before: bool  # its requests were already in a wave the worker died under


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
        dispatch: Dispatch | None = None,
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
        # requests a front end has begun to receive and not yet added (or dropped): the
        # admission wait does not call a burst complete while any is on its way
        self._incoming = 0
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
        self.dispatch = dispatch or WaveDispatch()  # what a dispatch is: the mode's
        self.dispatch.bind(self)
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
            unwanted = self.unwanted_waves()
            self.cond.notify_all()
        self.dispatch.cancel(unwanted)
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
    def add_requests(self, requests: list[DiffusionRequest]) -> None:
        """Queue requests together, so the loop sees them all at its next schedule."""
        with self.cond:
            if self._stopped:
                raise EngineClosedError("engine is closed")
            self.policy.observe_arrivals(len(requests))
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
            unwanted = self.unwanted_waves()
            self.cond.notify_all()
        self.dispatch.cancel(unwanted)
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
            unwanted = self.unwanted_waves()
            self.cond.notify_all()
        self.dispatch.cancel(unwanted)
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

    def unwanted_waves(self) -> list[InFlightWave]:
        """(Holding `cond`.) Waves in flight none of whose requests is open any more, not
        cancelled yet; marks them cancelled (the caller tells the executor)."""
        unwanted = [w for w in self.in_flight if not w.cancelled and not w.future.done()
                    and all(r.is_finished for r in w.wave.requests)]
        for record in unwanted:
            record.cancelled = True
        return unwanted

    @property
    def stopped(self) -> bool:
        """Whether `stop()` was called."""
        return self._stopped

    @property
    def num_incoming(self) -> int:
        """Requests a front end announced (`announce_incoming`) and has not added."""
        return self._incoming

    def announce_incoming(self, delta: int) -> None:
        """A front end began (+1) or ended (-1: added, refused, gone) receiving a
        request. An arrival wakes the loop; an end does not (the add that follows it
        does), so a wait never ends in the moment between the two."""
        with self.cond:
            self._incoming = max(0, self._incoming + delta)
            if delta > 0:
                self.cond.notify_all()

    @property
    def num_waiting(self) -> int:
        """Requests queued here and those handed to the executor that it has not
        started (what `--max-queue-size` bounds)."""
        with self.cond:
            waiting = self.scheduler.num_waiting
        return waiting + len(self.dispatch.handed_ahead())

    @property
    def num_running(self) -> int:
        """Requests the executor works on (`Dispatch.num_running`)."""
        return self.dispatch.num_running()

    def num_waiting_by_key(self) -> dict[str, int]:
        """Waiting requests per key, keys in short form (for metrics)."""
        with self.cond:
            counts = {key.short(): n for key, n in self.scheduler.num_waiting_by_key().items()}
        for request in self.dispatch.handed_ahead():
            assert request.key is not None
            counts[request.key.short()] = counts.get(request.key.short(), 0) + 1
        return counts

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
            self.dispatch.finish(action)
        elif isinstance(action, _Rerun):
            self.dispatch.dispatch(action.wave, crashed_before=action.crashed_before)
        else:
            self.dispatch.dispatch(action)
        return True

    def _next_action(self) -> InFlightWave | _Rerun | SchedulerOutput | None:
        """Block (holding `cond`) until a record in flight is done or a wave can go."""
        while True:
            done = self.dispatch.next_done()
            if done is not None:
                return done
            if self._stopped:
                if not self.in_flight:
                    return None
            elif self.dispatch.can_dispatch() and not self.executor.is_restarting:
                wave = self._next_rerun() or self.dispatch.schedule()
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

    def wake(self, _future: Future[BatchRunnerOutput] | None = None) -> None:
        """Wake the loop (e.g. a future in flight is done)."""
        with self.cond:
            self.cond.notify_all()

    def rerun(self, wave: SchedulerOutput, crashed_before: bool) -> None:
        """(Holding `cond`.) Queue `wave` to run again before anything new;
        `crashed_before`: its requests were in a wave the worker died under."""
        self._reruns.append(_Rerun(wave, crashed_before))

    def emit(self, request: DiffusionRequest, output: DiffusionOutput) -> None:
        """Hand a finished request's output to the delivery thread."""
        self._outbox.put((request, output))

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

    def result_of(self, record: InFlightWave) -> BatchRunnerOutput | None:
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
            return self.dispatch.after_death(record, exc)
        except Exception as exc:
            return BatchRunnerOutput.failed(wave.req_ids, self._executor_error(wave, exc))


__all__ = ["EngineCore", "InFlightWave"]
