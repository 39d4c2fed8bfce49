"""The seam between the engine loop and an execution mode: `Dispatch`.

`EngineCore` owns what every mode shares: the lock, the scheduler, the requests in
flight, aborts, re-runs after a worker death, delivery and shutdown. A `Dispatch`
decides what a dispatch is: when the next wave may go and how big it is, how it is
handed to the executor, and what its finished record means. Two implement it:
`WaveDispatch` (request mode: one fused forward per wave,
`diffbatch.engine.wave_dispatch`) and `StepDispatch` (step mode: requests join and
leave a running batch in the worker, `diffbatch.engine.step_dispatch`).

A dispatch uses only the core's public surface (`EngineCore` lists it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.engine.core import EngineCore
    from diffbatch.errors import WorkerDiedError
    from diffbatch.outputs import BatchRunnerOutput
    from diffbatch.request import DiffusionRequest
    from diffbatch.sched.output import SchedulerOutput


@dataclass
class InFlightWave:
    """A wave handed to the executor whose outputs are not back yet."""

    wave: SchedulerOutput
    future: Future[BatchRunnerOutput]
    dispatched: float  # time.monotonic() when it was handed to the executor
    admission_reason: str  # why its admission wait ended ("" = no wait)
    crashed_before: bool = False  # its requests were in a wave the worker died under
    cancelled: bool = False  # the executor was told nobody waits for it


class Dispatch(ABC):
    """How waves go to the executor and come back, for one execution mode.

    Methods marked "(holding `cond`)" are called with the core's lock held and must
    not call the executor; the others are called without it.
    """

    core: EngineCore

    def bind(self, core: EngineCore) -> None:
        """Called once by the core that uses this dispatch."""
        self.core = core

    @abstractmethod
    def next_done(self) -> InFlightWave | None:
        """(Holding `cond`.) A record in flight whose future is done, taken out of
        `core.in_flight`, to finish next; None if none is."""

    @abstractmethod
    def can_dispatch(self) -> bool:
        """(Holding `cond`.) Whether anything (a re-run or a new wave) may go now."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput | None:
        """(Holding `cond`.) The next wave to hand over now, if any (the scheduler's
        requests in it are RUNNING)."""

    @abstractmethod
    def dispatch(self, wave: SchedulerOutput, *, crashed_before: bool = False) -> None:
        """Hand `wave` to the executor and track it in `core.in_flight`."""

    @abstractmethod
    def finish(self, record: InFlightWave) -> None:
        """A done record: finish its requests and hand their outputs to `core.emit`."""

    @abstractmethod
    def after_death(self, record: InFlightWave,
                    exc: WorkerDiedError) -> BatchRunnerOutput | None:
        """The worker died under (or before) `record`: its failed outputs, or None
        where it is queued to run again (`core.rerun`)."""

    @abstractmethod
    def cancel(self, records: list[InFlightWave]) -> None:
        """Tell the executor nobody waits for these records any more."""

    @abstractmethod
    def num_running(self) -> int:
        """Requests the executor works on now."""

    def handed_ahead(self) -> list[DiffusionRequest]:
        """Open requests handed to the executor that it has not started (they count as
        waiting); none where only full waves are queued ahead."""
        return []


__all__ = ["Dispatch", "InFlightWave"]
