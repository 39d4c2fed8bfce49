"""Step mode's dispatch: requests join and leave a running batch in the worker.

`StepDispatch` is the `Dispatch` of step mode: `EngineCore` keeps its lock, request
table, delivery thread, aborts and shutdown, and this decides what a dispatch is.
The worker owns the running batch and runs its ticks back to back
(`diffbatch.worker.step_runner`); the engine loop is never in the per-step path.
This only decides who may join:

- the batch's key is the key of the requests in flight (all share one); with none
  in flight, the scheduler's next key starts a new batch;
- up to twice the key's capacity may be in flight (`policy.step_capacity`: fixed,
  or learned by "auto"), so the worker always holds the next joiners and a slot that
  frees is filled at the next tick, without a round trip through this loop; the
  worker itself never runs more than the capacity at once. Capacity counts
  `diffbatch.capacity_units` here, in the scheduler and in the worker alike: requests,
  or under a size-free key (mixed resolution) pixels at the model's default size;
- joiners of the running key come from `scheduler.schedule_joiners`, which stops
  them once a request of another key should run (fifo: at once; grouped: once it
  waited `max_head_wait_ms`), so the batch drains and the other key goes next;
- each request is its own entry in flight, finished the moment the worker says it
  left the batch; an abort cancels it in the worker, which takes it out at the next
  step boundary.

Joiners are handed over with the batch's stall bound (`StallBounds.step_s`):
while they are in it, the batch finishing no step for that long means a stuck worker,
which the executor kills like a frozen one (the heartbeat carries the tick count).
The worker dying under the batch is the executor's to handle: it re-runs the
batch's requests on the replacement in halves (`diffbatch.executor.multiproc`), so
their futures stay pending here; requests refused while a replacement starts are
queued again. Every tick's statistics come
back with the outputs and feeds the step metrics. With "auto", the batch's capacity
is learned from the ticks (`BatchPolicy.step_capacity`: the start-up calibration's
capacity first, then the tick curve, trying the next doubling while more requests
want the batch than it holds).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from diffbatch.capacity_units import batch_units
from diffbatch.engine.dispatch import Dispatch, InFlightWave
from diffbatch.outputs import BatchRunnerOutput, RequestError

if TYPE_CHECKING:
    from diffbatch.errors import WorkerDiedError
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParamsKey
    from diffbatch.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

PREFETCH_FACTOR = 2  # requests in flight per slot of the running batch (see above)


class StepDispatch(Dispatch):
    """Step mode; see the module docstring."""

    def next_done(self) -> InFlightWave | None:
        """A request that left the batch (any of those in flight)."""
        for record in self.core.in_flight:
            if record.future.done():
                self.core.in_flight.remove(record)
                return record
        return None

    def can_dispatch(self) -> bool:
        return True  # (`schedule` bounds the requests in flight)

    def num_running(self) -> int:
        """Requests in the worker's running batch (cancelled ones still leaving it
        included); those handed ahead into its queue are waiting (`handed_ahead`)."""
        core = self.core
        with core.cond:
            records = [record for record in core.in_flight if not record.future.done()]
        return sum(len(record.wave.requests) for record in records
                   if core.executor.has_started(record.future))

    def handed_ahead(self) -> list[DiffusionRequest]:
        """The open requests in the worker's queue, not in its batch."""
        core = self.core
        with core.cond:
            records = [record for record in core.in_flight if not record.future.done()]
        return [request for record in records if not core.executor.has_started(record.future)
                for request in record.wave.requests if not request.is_finished]

    def _running_key(self) -> SamplingParamsKey | None:
        """(Holding `cond`.) The key of the batch in the worker, None when it is empty."""
        for record in self.core.in_flight:
            if not record.future.done():
                return record.wave.key
        return None

    def schedule(self) -> SchedulerOutput | None:
        """Joiners for the running batch, or the first of a new one."""
        core, scheduler = self.core, self.core.scheduler
        if scheduler.num_waiting == 0:
            return None
        core.last_admission_reason = ""
        key = self._running_key()
        capacity = core.policy.step_capacity(key or scheduler.next_key(), self._demand())
        room = PREFETCH_FACTOR * capacity - self._units_in_flight()
        if room <= 1e-9:
            return None
        # (no running batch: the scheduler's next wave starts a new one)
        wave = scheduler.schedule() if key is None else scheduler.schedule_joiners(key, room)
        return None if wave.is_empty else wave

    def _units_in_flight(self) -> float:
        """(Holding `cond`.) Capacity units of the requests in flight: their count, or
        under a size-free key their pixels at its reference size, as the worker counts
        its running batch (`diffbatch.capacity_units`)."""
        return sum(batch_units((r.sampling_params for r in record.wave.requests),
                               record.wave.key) for record in self.core.in_flight)

    def _demand(self) -> int:
        """(Holding `cond`.) Requests in flight and waiting: what the running batch
        could hold if its capacity allowed."""
        return sum(not record.future.done() for record in self.core.in_flight) \
            + self.core.scheduler.num_waiting

    def dispatch(self, wave: SchedulerOutput, *, crashed_before: bool = False) -> None:
        """Send the joiners to the worker; each becomes its own entry in flight."""
        core = self.core
        dispatched = time.monotonic()
        with core.cond:
            capacity = core.policy.step_capacity(wave.key, self._demand() + len(wave.requests))
        futures = core.executor.submit_join(
            wave, capacity, stall_after_s=core.policy.stalls.step_s(wave.key, capacity))
        records = [InFlightWave(replace(wave, requests=[request]), future, dispatched, "join")
                   for request, future in zip(wave.requests, futures, strict=True)]
        with core.cond:
            core.in_flight.extend(records)
            unwanted = core.unwanted_waves()  # aborted while being handed over
        self.cancel(unwanted)
        for record in records:
            record.future.add_done_callback(core.wake)

    def cancel(self, records: list[InFlightWave]) -> None:
        """Take requests nobody waits for out of the running batch: a leave (the step
        metrics count it when the worker confirms), not a stopped wave."""
        for record in records:
            logger.debug("request %s: not wanted any more; leaving the running batch",
                         record.wave.req_ids[0])
            self.core.executor.cancel(record.future)

    def finish(self, record: InFlightWave) -> None:
        """A request left the batch: finish it and deliver its output."""
        core, wave = self.core, record.wave
        runner_output = core.result_of(record)
        if runner_output is None:
            return
        self._observe_ticks(wave.key, runner_output)
        with core.cond:
            finished = core.scheduler.update_from_output(wave, runner_output)
            core.cond.notify_all()
        now = time.monotonic()
        for request, output in finished:
            started = max(record.dispatched, now - output.execute_time_ms / 1000.0)
            output.queue_time_ms = (started - request.arrival_time) * 1000.0
            core.emit(request, output)

    def after_death(self, record: InFlightWave,
                    exc: WorkerDiedError) -> BatchRunnerOutput | None:
        """A request the worker held, which the executor could not re-run (no
        replacement), fails; one refused while a replacement started is queued again
        (None)."""
        core, wave = self.core, record.wave
        if not exc.started:
            with core.cond:
                if any(not r.is_finished for r in wave.requests):
                    core.rerun(wave, crashed_before=False)
                core.cond.notify_all()
            return None
        return BatchRunnerOutput.failed(wave.req_ids, RequestError(
            "the worker process died while this request was in the running batch "
            f"({exc.message}) and could not be re-run"))

    def _observe_ticks(self, key: SamplingParamsKey | None,
                       runner_output: BatchRunnerOutput) -> None:
        """Tick statistics feed the metrics and the running batch's stall bound."""
        core = self.core
        for tick in runner_output.ticks:
            core.policy.observe_tick(key, tick)
            if core.metrics is not None and core.serving:
                core.metrics.observe_tick(tick)


__all__ = ["StepDispatch"]
