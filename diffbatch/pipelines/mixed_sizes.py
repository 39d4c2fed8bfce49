"""A request-mode wave of several sizes: one pipeline call per size, module calls fused.

With `--mixed-resolution` a transformer pipeline's wave may hold requests of
different sizes (the size left their key). A diffusers call generates one size, so
`MixedSizes.forward` runs one ordinary call per size, each a task of the interception
layer's coordinator with a pipeline copy and scheduler of its own (as step mode runs
one per request), and resolves the module calls they wait on together, per fusion
point: the text encoders as one call, the transformer as ONE packed call over every
size (`FusionPoint.pack`, `interception/packed_tokens.py`), each scheduler step and
VAE decode per size where the shapes differ. Each request's images are those of its
solo run: every size's call is the one a wave of that size alone would make, with
its own rows (`interception/rows.py`).

A call that raises ends the whole wave with that exception (the others are unwound),
so the runner's bisection isolates the failing request as for any other wave.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from diffbatch.outputs import DiffusionOutput
from diffbatch.pipelines.interception import Coordinator, FusionPoint, ModuleCall, install
from diffbatch.pipelines.interception.packed_tokens import TokenPacker, packing_layout
from diffbatch.pipelines.interception.scheduler_fusion import scheduler_point
from diffbatch.pipelines.interface import DiffusionRequestBatch


def request_size(request: Any) -> tuple[int | None, int | None]:
    params = request.sampling_params
    return params.height, params.width


def packable(pipe: Any) -> bool:
    """Whether requests of different sizes can share a forward: a transformer
    `TokenPacker` can pack (a UNet's convolutions would see the padding)."""
    return getattr(pipe, "unet", None) is None \
        and packing_layout(getattr(pipe, "transformer", None)) is not None


def split_by_size(batch: DiffusionRequestBatch) -> list[tuple[list[int], DiffusionRequestBatch]]:
    """The wave's requests grouped by size (first appearance order): each group's
    request indices in the wave and its own batch (its generators, n per request, and
    its LoRA stacks)."""
    n = batch.num_outputs_per_prompt
    groups: dict[tuple[int | None, int | None], list[int]] = {}
    for i, request in enumerate(batch.requests):
        groups.setdefault(request_size(request), []).append(i)
    parts = []
    for indices in groups.values():
        generators = [g for i in indices for g in batch.generators[i * n:(i + 1) * n]]
        stacks = None if batch.lora_stacks is None else [batch.lora_stacks[i] for i in indices]
        parts.append((indices, replace(batch, requests=[batch.requests[i] for i in indices],
                                       generators=generators, lora_stacks=stacks)))
    return parts


# one diffusers call for a batch of one size, its scheduler steps through the point
ForwardCall = Callable[[DiffusionRequestBatch, FusionPoint], list[DiffusionOutput]]


class MixedSizes:
    """Waves of several sizes for one pipeline; see the module docstring."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self._packer: TokenPacker | None = None  # made at the first packed call
        self._point: FusionPoint | None = None  # the per-size calls' scheduler point

    def packing(self) -> bool:
        """Whether a packed call of several sizes runs now."""
        return self._packer is not None and self._packer.layout is not None

    def pack_calls(self, calls: Sequence[ModuleCall]) -> list[Any]:
        """The transformer's calls for requests of different sizes, as one call."""
        if self._packer is None:
            self._packer = TokenPacker(self.pipe.transformer)
        return self._packer.pack_calls(calls)

    def forward(self, batch: DiffusionRequestBatch, points: Callable[[], list[FusionPoint]],
                forward_call: ForwardCall) -> list[DiffusionOutput]:
        """The wave's outputs, in order: one `forward_call` per size, run together
        (`points()`: the pipeline's fusion points, installed at the first such wave)."""
        if self._point is None:
            install(points())
            self._point = scheduler_point()
        parts = split_by_size(batch)
        results = Coordinator().run_together([
            functools.partial(forward_call, part, self._point) for _, part in parts])
        outputs: list[DiffusionOutput | None] = [None] * len(batch)
        for (indices, _), part_outputs in zip(parts, results, strict=True):
            for i, output in zip(indices, part_outputs, strict=True):
                outputs[i] = output
        return [o for o in outputs if o is not None]
