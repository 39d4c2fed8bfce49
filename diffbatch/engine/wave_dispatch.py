"""Request mode's dispatch: one fused forward per wave (`WaveDispatch`).

- schedule: with nothing in flight, run the admission wait (its target and deadline
  from the `BatchPolicy`, fixed or learned), then `schedule()` a wave (each key's
  capacity from the same policy). Up to `max_waves_in_flight` waves are in flight:
  while one runs, the next goes only when it is full (`scheduler.has_full_wave()`:
  waiting could not make it bigger), so it waits at the worker and starts the moment
  the running one ends; a wave that could still grow waits in the engine, so queuing
  ahead never shrinks a wave.
- dispatch: hand the wave to the executor (`submit_batch`) with its stall bound
  (`StallBounds.wave_s`).
- finish: the oldest wave in flight is done: feed its forward time to the policy,
  `update_from_output()`, log it and emit every finished request.
- a wave whose worker died under it (`WorkerDiedError`, `started`) is re-run on the
  replacement split in halves, as bisect isolation does, so only a request that kills
  the worker again on its own fails (naming the crash); a wave that was only queued
  behind it, or refused while the replacement started, is re-run as it was.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from diffbatch.crash_reruns import failed_again, rerun_groups
from diffbatch.engine.admission import AdmissionWait
from diffbatch.engine.dispatch import Dispatch, InFlightWave
from diffbatch.outputs import BatchRunnerOutput
from diffbatch.request import RequestStatus
from diffbatch.sched.base import wave_units

if TYPE_CHECKING:
    from diffbatch.errors import WorkerDiedError
    from diffbatch.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


class WaveDispatch(Dispatch):
    """Request mode; see the module docstring."""

    def next_done(self) -> InFlightWave | None:
        in_flight = self.core.in_flight
        return in_flight.popleft() if in_flight and in_flight[0].future.done() else None

    def can_dispatch(self) -> bool:
        return len(self.core.in_flight) < self.core.max_waves_in_flight

    def schedule(self) -> SchedulerOutput | None:
        """Idle: wait for the burst to coalesce (maybe), then take what is there. Busy:
        only a wave that waiting could not grow goes ahead of the running one."""
        core, scheduler, policy = self.core, self.core.scheduler, self.core.policy
        if scheduler.num_waiting == 0:
            return None
        core.last_admission_reason = ""
        if core.in_flight:
            if not scheduler.has_full_wave():
                return None
        elif scheduler.num_running == 0:
            key = scheduler.next_key()
            plan = policy.plan_wait(key, scheduler.num_waiting)
            target = plan.target
            limit = None if key is None else scheduler.wave_size_limit(key)
            if limit is not None:  # e.g. max_wave_pixels: no wave would take more
                target = min(target, limit)
            admission = AdmissionWait(plan.max_wait_ms, target, plan.stable_window_ms)
            if admission.should_wait(supports_request_batch=policy.batching, num_running=0):
                core.last_admission_reason = admission.wait(
                    lambda: scheduler.num_waiting, lambda: core.stopped, core.cond.wait)
                if core.stopped:
                    return None
        policy.observe_backlog(scheduler.next_key(), scheduler.num_waiting)
        wave = scheduler.schedule()
        return None if wave.is_empty else wave

    def dispatch(self, wave: SchedulerOutput, *, crashed_before: bool = False) -> None:
        core = self.core
        dispatched = time.monotonic()
        stall_after_s = core.policy.stalls.wave_s(wave.key, wave.num_requests)
        future = core.executor.submit_batch(wave, stall_after_s=stall_after_s)
        record = InFlightWave(wave, future, dispatched, core.last_admission_reason,
                              crashed_before=crashed_before)
        with core.cond:
            core.in_flight.append(record)
            unwanted = core.unwanted_waves()  # aborted while it was being handed over
        self.cancel(unwanted)
        future.add_done_callback(core.wake)  # runs at once if the call already ran

    def cancel(self, records: list[InFlightWave]) -> None:
        core = self.core
        for record in records:
            logger.info("wave %d: none of its %d request(s) is wanted any more; stopping it",
                        record.wave.wave_id, record.wave.num_requests)
            if core.metrics is not None and core.serving:
                core.metrics.waves_cancelled.inc()
            core.executor.cancel(record.future)

    def num_running(self) -> int:
        """Running requests, and aborted ones whose wave has not stopped yet (the worker
        is still busy with them)."""
        core = self.core
        with core.cond:
            stopping = sum(1 for w in core.in_flight if not w.future.done()
                           for r in w.wave.requests if r.is_finished)
            return core.scheduler.num_running + stopping

    def finish(self, record: InFlightWave) -> None:
        core, wave = self.core, record.wave
        runner_output = core.result_of(record)
        if runner_output is None:
            return
        # A wave queued at the worker started when the one before it ended, not when it
        # was dispatched: take the later of the two.
        started = max(record.dispatched,
                      time.monotonic() - runner_output.forward_time_ms / 1000.0)
        # (a wave of mixed sizes counts in the units its capacity is counted in)
        core.policy.observe_wave(wave.key, wave_units(wave), runner_output.forward_time_ms,
                                 runner_output.num_forwards)
        with core.cond:
            finished = core.scheduler.update_from_output(wave, runner_output)
            core.cond.notify_all()  # for wait_idle
        self._log_wave(wave, started, runner_output, record.admission_reason)
        for request, output in finished:
            output.queue_time_ms = (started - request.arrival_time) * 1000.0
            core.emit(request, output)

    def after_death(self, record: InFlightWave,
                    exc: WorkerDiedError) -> BatchRunnerOutput | None:
        """Re-run the wave (None), or fail it: its one request killed a worker before."""
        if self._rerun_after_death(record, exc):
            return None
        return BatchRunnerOutput.failed(record.wave.req_ids, failed_again(exc.message))

    def _rerun_after_death(self, record: InFlightWave, exc: WorkerDiedError) -> bool:
        """Queue the wave's open requests to run again on the replacement worker; False
        if its one request already killed a worker before (it fails instead)."""
        core, wave = self.core, record.wave
        with core.cond:
            live = [r for r in wave.requests if not r.is_finished]
            if not exc.started:  # it never ran: again as it was
                if live:
                    core.rerun(replace(wave, requests=live), record.crashed_before)
                core.cond.notify_all()
                return True
            halves = rerun_groups(live, record.crashed_before)  # (crash_reruns.py)
            if halves is None:
                return False
            for part in halves:
                core.rerun(replace(wave, requests=part, close_reason="rerun"),
                           crashed_before=True)
            core.cond.notify_all()
        logger.warning("wave %d: %s; re-running its %d open request(s) in %d wave(s) on the "
                       "replacement", wave.wave_id, exc.message, len(live), len(halves))
        if core.metrics is not None and core.serving and live:
            core.metrics.waves_rerun.inc(len(halves))
        return True

    def _log_wave(
        self, wave: SchedulerOutput, wave_start: float, runner_output: BatchRunnerOutput,
        admission_reason: str,
    ) -> None:
        core = self.core
        queue_wait_ms = max((wave_start - r.arrival_time) * 1000.0 for r in wave.requests)
        forward_ms = runner_output.forward_time_ms
        closed = wave.close_reason
        if closed in ("capacity", "pixel_cap"):  # the wave is as big as its bound allowed
            closed = f"{closed} (a wave of this key may hold {wave.num_requests})"
        logger.info(
            "wave %d: %d request(s) key=%s closed=%s admission=%s max_queue_wait=%.1fms "
            "forward=%.1fms",
            wave.wave_id, wave.num_requests, wave.key.short() if wave.key else "-",
            closed, admission_reason or "none", queue_wait_ms, forward_ms,
        )
        if not core.serving:
            return
        if core.metrics is not None:
            core.metrics.observe_wave(wave.num_requests, wave.close_reason,
                                      admission_reason, forward_ms / 1000.0)
            core.metrics.observe_loras(runner_output.num_lora_adapters,
                                       runner_output.num_lora_loads,
                                       runner_output.num_lora_evictions)
        if core.wave_log is not None:
            statuses = [r.status for r in wave.requests]  # final: update_from_output ran
            core.wave_log.record(
                wave_id=wave.wave_id, num_requests=wave.num_requests,
                key=wave.key.short() if wave.key else "-", close_reason=wave.close_reason,
                admission=admission_reason, max_queue_wait_ms=queue_wait_ms,
                forward_ms=forward_ms,
                num_errors=statuses.count(RequestStatus.FINISHED_ERROR),
                num_aborted=statuses.count(RequestStatus.FINISHED_ABORTED),
            )


__all__ = ["WaveDispatch"]
