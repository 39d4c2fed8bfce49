"""Several diffusers calls meet at one fused module call: `Coordinator`.

Each diffusers call runs as a `Task` (a greenlet) of one coordinator: step mode runs
one per request and lets them join and leave between ticks (`worker/step_runner.py`);
a request-mode wave of several sizes runs one per size (`mixed_sizes.py`). A task
calling a fused method (`install`) does not run it: it hands a `ModuleCall` (with its
rows, `rows.py`) to the coordinator and waits. `Coordinator.resolve` runs the calls
the given tasks wait on, fused per point (`fusion.run_fused`), and resumes each task
with its own result (or raises its own exception in it), until its next module call
or its end. Outside a task (request mode, the coordinator's own fused call) a fused
method runs as it would without diffbatch.

Fused methods: a module's `forward` goes through a diffusers hook (`hooks.py`, the
mechanism diffusers' own caches use); any other method (the VAE's `decode`, each
request's scheduler copy's `step`) is wrapped on its instance (`wrap_method`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import greenlet
import torch

from diffbatch.errors import WaveInterrupted
from diffbatch.pipelines.interception.fusion import FusionPoint, ModuleCall, run_fused
from diffbatch.pipelines.interception.hooks import route_forward
from diffbatch.pipelines.interception.rows import current_rows

_HOOK = "diffbatch.fusion"


class _TaskGreenlet(greenlet.greenlet):
    """The greenlet a task's diffusers call runs in."""


class Task:
    """One diffusers call run by a `Coordinator`: pending at a module call, or done."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._greenlet = _TaskGreenlet(run)
        self.pending: ModuleCall | None = None  # the module call it waits on
        self.result: Any = None  # what the call returned, once done
        self.started = False

    @property
    def done(self) -> bool:
        return self.started and self._greenlet.dead

    def _resume(self, resume: Callable[..., Any], *value: Any) -> None:
        outcome = resume(*value)
        self.started = True
        if self._greenlet.dead:
            self.pending, self.result = None, outcome
        else:
            self.pending = outcome


class Coordinator:
    """Runs tasks, fusing the module calls they wait on; see the module docstring."""

    def start(self, run: Callable[[], Any]) -> Task:
        """A new task running `run()`, advanced to its first module call (or its end)."""
        task = Task(run)
        task._resume(task._greenlet.switch)
        return task

    def resolve(self, tasks: Sequence[Task], module_ms: list[float] | None = None) -> None:
        """Run the tasks' pending calls, fused per fusion point, and resume each
        (`module_ms` gets the module calls' wall times)."""
        groups: dict[int, list[Task]] = {}
        for task in tasks:
            assert task.pending is not None
            groups.setdefault(id(task.pending.point), []).append(task)
        for group in groups.values():
            outcomes = run_fused([t.pending for t in group],  # type: ignore[misc]
                                 module_ms)
            for task, (ok, value) in zip(group, outcomes, strict=True):
                task._resume(task._greenlet.switch if ok else task._greenlet.throw, value)

    @staticmethod
    def unwind(task: Task, reason: str) -> None:
        """Stop a task's call (its `finally` blocks run) with `WaveInterrupted(reason)`;
        what else it raises while unwinding is dropped."""
        if task.started and not task._greenlet.dead:
            with contextlib.suppress(Exception):
                task._greenlet.throw(WaveInterrupted(reason))

    def run_together(self, runs: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run each of `runs` as a task until all are done; their results, in order.

        The first exception a task raises is raised here after the others were unwound.
        """
        tasks: list[Task] = []
        try:
            for run in runs:
                tasks.append(self.start(run))
            while pending := [t for t in tasks if not t.done]:
                self.resolve(pending)
        finally:
            for task in tasks:
                self.unwind(task, "a call of the same wave failed")
        return [task.result for task in tasks]


# -- installing the fusion points -------------------------------------------------------
def install(points: Sequence[FusionPoint]) -> None:
    """Route each point's method through the coordinator (once per owner)."""
    for point in points:
        wrap_method(point, point.owner)


def wrap_method(point: FusionPoint, owner: Any) -> None:
    """Route `owner`'s `point.method` through the coordinator: a module's `forward`
    by a diffusers hook, anything else by wrapping the method on the instance (so
    several objects, e.g. each request's own scheduler, can share one point)."""
    if isinstance(owner, torch.nn.Module) and point.method == "forward":
        route_forward(owner, _HOOK, functools.partial(_hand_over, point))
        return
    current = getattr(owner, point.method)
    if getattr(current, "_diffbatch_fusion_point", None) is None:
        setattr(owner, point.method, _wrap(point, current))


def _hand_over(point: FusionPoint, run: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    """Inside a task: hand the call to the coordinator and return its result."""
    current = greenlet.getcurrent()
    if isinstance(current, _TaskGreenlet):
        return current.parent.switch(ModuleCall(point, run, args, kwargs, current_rows()))
    return run(*args, **kwargs)


def _wrap(point: FusionPoint, original: Callable[..., Any]) -> Callable[..., Any]:
    # functools.wraps: `inspect.signature` of the wrapper is the method's own (pipelines
    # read it, e.g. to decide whether to pass a scheduler's `step` a generator)
    @functools.wraps(original)
    def fused(*args: Any, **kwargs: Any) -> Any:
        return _hand_over(point, original, args, kwargs)

    fused._diffbatch_fusion_point = point  # type: ignore[attr-defined]
    fused._diffbatch_original = original  # type: ignore[attr-defined]
    return fused
