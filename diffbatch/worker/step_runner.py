"""The running batch of step mode: requests join and leave between denoising steps.

`StepRunner` sits beside the `ModelRunner` (whose pipeline, LoRA handling and output
conversion it uses) and owns the worker's running batch. Each request runs its own
pipeline call as a task of the interception layer's coordinator
(`diffbatch.pipelines.interception`), and `tick()` advances the whole batch by one
denoising step:

1. admit: joined requests enter while there is room (`capacity`, in capacity units:
   requests, or under a size-free key pixels at the model's default size, as the
   scheduler counts them; `diffbatch.capacity_units`) and their key is
   the running batch's (a request of another key waits until the batch drained; the
   engine stops sending joiners of the old key once it wants to switch), and while
   the batch's distinct LoRA adapters stay within `--max-loras`; a joiner's adapters
   are made resident (pinned until it leaves), and one whose adapter does not load
   fails alone. Requests of an isolated join (re-run after the worker died under
   them) form a group that enters only an empty batch and that nothing else joins,
   as a re-run wave of request mode runs on its own;
2. boundary: the calls joiners make before their first step (text encoders) run,
   fused across the joiners, until every request waits at the denoiser;
3. step: ONE fused denoiser call for every running request, each at its own timestep
   and with its own LoRA stack (each request's call carries its rows);
4. boundary again: requests past their last step decode, fused across the leavers,
   and leave at once (returned by `tick()`); their slots are free for the next tick.

A request that asks for partial images gets them as in request mode, from its own
pipeline call (the preview's VAE decode is a boundary call, fused like the others),
handed to `send_partial_images_to`'s callback with the request's call id.

`cancel(call_id)` takes a request out at the next step boundary (its task is
unwound with `WaveInterrupted`, so its compute stops). A module call that raises is
bisected by `run_fused`: only the request whose own call raises errors, its mates go
on from the same step.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diffbatch.capacity_units import may_take, rounded_units
from diffbatch.errors import ConfigError, InvalidRequestError, WaveInterrupted
from diffbatch.outputs import DiffusionOutput, PartialImage, TickStats
from diffbatch.pipelines.interception import Coordinator, Task, install
from diffbatch.worker.model_runner import partial_image_sender

if TYPE_CHECKING:
    from diffbatch.ipc.messages import StepJoin
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParamsKey
    from diffbatch.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class _Task:
    call_id: int
    request: DiffusionRequest
    key: SamplingParamsKey | None
    group: int | None = None  # an isolated join's first call id; None: ordinary traffic
    joined: float = field(default_factory=time.perf_counter)
    call: Task | None = None  # its pipeline call, once started
    output: DiffusionOutput | None = None
    max_batch: int = 1  # the largest denoiser batch this request was part of
    pinned: list[str] = field(default_factory=list)  # adapter paths it holds resident

    @property
    def done(self) -> bool:
        return self.output is not None

    @property
    def pending(self) -> Any:
        """The module call its pipeline call waits on (None: not started, or done)."""
        return None if self.call is None else self.call.pending


def _never() -> bool:
    """A request in the running batch is taken out by `cancel`, not by its pipeline."""
    return False


class StepRunner:
    """The worker's running batch in step mode; see the module docstring."""

    def __init__(self, runner: ModelRunner) -> None:
        pipeline = runner.pipeline
        if not getattr(pipeline, "supports_step_execution", False):
            raise ConfigError(
                f"pipeline {runner.info().name} cannot run in step mode "
                "(supports_step_execution=False); serve it without step execution, or "
                "implement the step contract (see diffbatch.pipelines.interface)"
            )
        self.runner = runner
        self.pipeline = pipeline
        install(pipeline.step_fusion_points())
        self._coordinator = Coordinator()
        self.ready: deque[_Task] = deque()  # joined, not admitted yet
        self.running: list[_Task] = []
        self.capacity = 1
        self.key: SamplingParamsKey | None = None  # the running batch's key
        self.group: int | None = None  # the running batch's isolated group, if any
        self.ticks: list[TickStats] = []  # since the caller last took them
        self.num_ticks = 0  # ticks that did work, ever (the heartbeat reports it)
        # where partial images go: (the request's call id, the image); None: nowhere
        self._send_partial: Callable[[int, PartialImage], None] | None = None
        # told the call ids of the requests entering the batch; None: nobody
        self._on_join: Callable[[list[int]], object] | None = None

    def send_partial_images_to(self, send: Callable[[int, PartialImage], None]) -> None:
        """Hand the running requests' partial images to `send(call_id, partial)`."""
        self._send_partial = send

    def report_joins_to(self, report: Callable[[list[int]], object]) -> None:
        """Call `report(call_ids)` when requests enter the running batch, before any of
        their code runs (the engine then knows which requests had started)."""
        self._on_join = report

    # -- the engine's side -----------------------------------------------------------
    def join(self, join: StepJoin) -> None:
        self.capacity = max(1, join.capacity)
        group = join.call_ids[0] if join.isolated else None
        for call_id, request in zip(join.call_ids, join.wave.requests, strict=True):
            self.ready.append(_Task(call_id, request, join.wave.key, group))

    def call_ids(self) -> set[int]:
        return {t.call_id for t in self.ready} | {t.call_id for t in self.running}

    def cancel(self, call_id: int) -> DiffusionOutput | None:
        """Take a request out now (between ticks); its aborted output, or None if unknown."""
        for task in self.ready:
            if task.call_id == call_id:
                self.ready.remove(task)
                return DiffusionOutput.make_aborted(task.request.request_id)
        for task in self.running:
            if task.call_id == call_id:
                self.running.remove(task)
                self._unwind(task)
                self._release(task)
                # a leave between ticks: a record with no step (batch size 0)
                self.ticks.append(TickStats(0, 0.0, 0.0, 0, 1))
                return DiffusionOutput.make_aborted(task.request.request_id)
        return None

    @property
    def idle(self) -> bool:
        return not self.ready and not self.running

    def take_ticks(self) -> list[TickStats]:
        ticks, self.ticks = self.ticks, []
        return ticks

    # -- one tick --------------------------------------------------------------------
    def tick(self) -> list[tuple[int, DiffusionOutput]]:
        """Advance the batch by one step; returns (call id, output) of those that left."""
        start = time.perf_counter()
        loads, evictions = self.runner.loras.num_loads, self.runner.loras.num_evictions
        with torch.inference_mode():
            joins = self._admit()
            self._run_boundaries()
            batch = [t for t in self.running if t.pending is not None]
            module_ms: list[float] = []
            if batch:
                size = len(batch)
                for task in batch:
                    task.max_batch = max(task.max_batch, size)
                self._resolve(batch, module_ms)
                self._run_boundaries()
        left = [t for t in self.running if t.done]
        self.running = [t for t in self.running if not t.done]
        for task in left:
            self._release(task)
        if not self.running:
            self.key = self.group = None
        finished = []
        for task in left:
            output = task.output
            assert output is not None
            output.batch_size = task.max_batch
            output.execute_time_ms = (time.perf_counter() - task.joined) * 1000.0
            finished.append((task.call_id, output))
        if batch or left or joins:
            self.num_ticks += 1
            adapters = {p for t in batch for p in self.runner.loras.paths(t.request)}
            self.ticks.append(TickStats(
                len(batch), (time.perf_counter() - start) * 1000.0, sum(module_ms), joins,
                len(left), batch_units=self._units(batch), num_lora_adapters=len(adapters),
                num_lora_loads=self.runner.loras.num_loads - loads,
                num_lora_evictions=self.runner.loras.num_evictions - evictions))
        return finished

    def _admit(self) -> int:
        admitted: list[_Task] = []
        loras = self.runner.loras
        in_use = {p for t in self.running for p in t.pinned}
        max_requests = self.runner.config.capacity_limit
        while self.ready:
            task = self.ready[0]
            if (self.running or admitted) and (task.key, task.group) != (self.key, self.group):
                break  # another key (or group) waits for the running batch to drain
            held = (t.request.sampling_params for t in itertools.chain(self.running, admitted))
            if not may_take(len(self.running) + len(admitted), held,
                            task.request.sampling_params, task.key, self.capacity,
                            max_requests):
                break  # the batch is full (in capacity units)
            own = set(loras.paths(task.request))
            if (self.running or admitted) and len(in_use | own) > loras.max_loras:
                break  # its adapters wait for room among the resident ones
            self.ready.popleft()
            if not self.running and not admitted:
                self.key, self.group = task.key, task.group
            admitted.append(task)
            in_use |= own
        if not admitted:
            return 0
        if self._on_join is not None:  # before any of their code runs
            self._on_join([task.call_id for task in admitted])
        for task in admitted:
            error = self._acquire(task)
            if error is not None:
                task.output = DiffusionOutput.from_error(task.request.request_id, error)
            else:
                self._start(task)
            self.running.append(task)
        return len(admitted)

    @staticmethod
    def _units(batch: list[_Task]) -> int:
        """The fused call's size in capacity units, rounded, at least 1 (0: no call)."""
        return rounded_units([t.request.sampling_params for t in batch],
                             batch[0].key if batch else None)

    def _acquire(self, task: _Task) -> Exception | None:
        """Make the task's adapters resident and pinned; the error if one fails."""
        loras = self.runner.loras
        paths = loras.paths(task.request)
        if len(set(paths)) > loras.max_loras:
            return InvalidRequestError(
                f"the request stacks {len(set(paths))} LoRA adapters, more than this server "
                f"loads at once (--max-loras {loras.max_loras})", param="lora")
        try:
            errors = loras.acquire(paths)
        except Exception as exc:
            return exc
        if errors:
            loras.release(p for p in paths if p not in errors)
            return next(iter(errors.values()))
        task.pinned = list(paths)
        return None

    def _release(self, task: _Task) -> None:
        self.runner.loras.release(task.pinned)
        task.pinned = []

    def _start(self, task: _Task) -> None:
        task.call = self._coordinator.start(functools.partial(self._task_main, task))
        self._settle(task)

    def _task_main(self, task: _Task) -> DiffusionOutput:
        """A request's whole pipeline call (runs as its coordinator task)."""
        request = task.request
        send = None if self._send_partial is None else \
            functools.partial(self._send_partial, task.call_id)
        try:
            # its adapters are resident (`_admit`); its calls carry its stack's rows
            return self.runner.run_forward(
                [request], should_stop=_never, set_lora_wave=False,
                on_partial_image=partial_image_sender(send, [request]))[0]
        except WaveInterrupted:
            return DiffusionOutput.make_aborted(request.request_id)
        except Exception as exc:
            logger.warning("request %s failed in step mode: %s: %s", request.request_id,
                           type(exc).__name__, exc)
            return DiffusionOutput.from_error(request.request_id, exc)

    @staticmethod
    def _settle(task: _Task) -> None:
        """Take a task's output once its call is done."""
        if task.call is not None and task.call.done:
            task.output = task.call.result

    def _run_boundaries(self) -> None:
        """Run the boundary calls (encoders, decoders), fused per point, until every
        running request waits at the denoiser or is done."""
        while True:
            calls = [t for t in self.running if t.pending is not None
                     and t.pending.point.kind == "boundary"]
            if not calls:
                return
            self._resolve(calls)

    def _resolve(self, tasks: list[_Task], module_ms: list[float] | None = None) -> None:
        """Run the tasks' pending calls, fused per fusion point, and resume each
        (`module_ms` gets the module calls' wall times)."""
        self._coordinator.resolve([t.call for t in tasks if t.call is not None], module_ms)
        for task in tasks:
            self._settle(task)

    def _unwind(self, task: _Task) -> None:
        """Stop a running task's pipeline call (its `finally` blocks run)."""
        if task.call is not None:
            self._coordinator.unwind(task.call, "request cancelled")
