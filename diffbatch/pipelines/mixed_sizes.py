"""A request-mode wave of several sizes: one pipeline call per size, module calls fused.

With `--mixed-resolution` a transformer pipeline's wave may hold requests of
different sizes (the size left their key). A diffusers call generates one size, so
`run_by_size` runs one ordinary call per size, each in its own `TaskGreenlet` with a
pipeline copy and scheduler of its own (as step mode runs one per request), and
resolves the module calls they wait on together, per fusion point (`run_fused`):
the text encoders as one call, the transformer as ONE packed call over every size
(`FusionPoint.pack`, `packed_tokens.TokenPacker`), each scheduler step and VAE
decode per size where the shapes differ. Each request's images are those of its
solo run: every size's call is the one a wave of that size alone would make.

A call that raises ends the whole wave with that exception (the others are unwound),
so the runner's bisection isolates the failing request as for any other wave.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from diffbatch.errors import WaveInterrupted
from diffbatch.pipelines.interface import DiffusionRequestBatch
from diffbatch.pipelines.step_fusion import ModuleCall, TaskGreenlet, run_fused


def request_size(request: Any) -> tuple[int | None, int | None]:
    params = request.sampling_params
    return params.height, params.width


def split_by_size(batch: DiffusionRequestBatch) -> list[tuple[list[int], DiffusionRequestBatch]]:
    """The wave's requests grouped by size (first appearance order): each group's
    request indices in the wave and its own batch (its generators, n per request)."""
    n = batch.num_outputs_per_prompt
    groups: dict[tuple[int | None, int | None], list[int]] = {}
    for i, request in enumerate(batch.requests):
        groups.setdefault(request_size(request), []).append(i)
    parts = []
    for indices in groups.values():
        generators = [g for i in indices for g in batch.generators[i * n:(i + 1) * n]]
        parts.append((indices, replace(batch, requests=[batch.requests[i] for i in indices],
                                       generators=generators)))
    return parts


def run_together(tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each task in its own greenlet, fusing the module calls they wait on.

    Returns each task's result, in order. The first exception a task raises is
    raised here after the other tasks were unwound.
    """
    greenlets = [TaskGreenlet(task) for task in tasks]
    pending: dict[int, ModuleCall] = {}
    results: dict[int, Any] = {}

    def advance(i: int, resume: Callable[..., Any], *value: Any) -> None:
        outcome = resume(*value)
        if greenlets[i].dead:
            results[i] = outcome
        else:
            pending[i] = outcome

    try:
        for i, g in enumerate(greenlets):
            advance(i, g.switch)
        while pending:
            groups: dict[int, list[int]] = {}
            for i, call in pending.items():
                groups.setdefault(id(call.point), []).append(i)
            for members in groups.values():
                outcomes = run_fused([pending.pop(i) for i in members])
                for i, (ok, value) in zip(members, outcomes, strict=True):
                    advance(i, greenlets[i].switch if ok else greenlets[i].throw, value)
    finally:
        for g in greenlets:  # after an exception: stop the calls still running
            if not g.dead:
                # (whatever it raises while unwinding: the wave fails with the first error)
                with contextlib.suppress(Exception):
                    g.throw(WaveInterrupted("a call of the same wave failed"))
    return [results[i] for i in range(len(tasks))]
