"""Which request, and which LoRA stack, each row of a module call belongs to.

diffbatch never infers a call's row layout from tensor shapes. The pipeline adapter
states it for each diffusers call it makes (`RowPlan`: the call's requests and their
stacks, their n images each, and how many copies of the image rows the denoiser gets: 2 when
the pipeline runs CFG's negative and positive halves as one batch), for the length
of the call (`row_plan`). A root module (the denoiser, a text encoder; `track_rows`)
called within takes its rows from the plan for the length of its forward, checking
the plan against its batch, and the hooks inside it read them (`current_rows`: the
LoRA layers). A fused module call (`fusion.run_fused`) runs with its calls' rows
concatenated in call order (`call_rows`).

Both are context variables, so each task of the coordinator (a greenlet has a
context of its own) keeps its own plan and rows while other tasks run.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from diffbatch.sampling_params import LoraStack

# How a root module's batch relates to the call's requests: a text encoder sees one
# row per prompt, a denoiser one per image (times the CFG copies).
RowLayout = Literal["prompts", "images"]


@dataclass(frozen=True, eq=False)
class CallRows:
    """The per-row data of one module call: each row's request and LoRA stack."""

    stacks: tuple[LoraStack, ...]
    # each row's request id; None where the call's layout did not say (one stack
    # fitted to an unplanned batch of several requests)
    requests: tuple[str, ...] | None = None
    # what the hooks derive from the rows (e.g. LoRA slot tensors), kept with them
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def concat(parts: Sequence[tuple[CallRows | None, int]]) -> CallRows | None:
        """The rows of a fused call: each part's rows (None: `size` rows of no stack)."""
        if all(rows is None for rows, _ in parts):
            return None
        if len(parts) == 1:
            return parts[0][0]
        stacks: list[LoraStack] = []
        requests: list[str] | None = []
        for rows, size in parts:
            if rows is not None and len(rows.stacks) != size:
                raise RuntimeError(f"a module call of {size} rows carries rows for "
                                   f"{len(rows.stacks)}")
            stacks.extend([()] * size if rows is None else rows.stacks)
            if requests is not None and rows is not None and rows.requests is not None:
                requests.extend(rows.requests)
            else:
                requests = None
        return CallRows(tuple(stacks), None if requests is None else tuple(requests))


@dataclass(eq=False)
class RowPlan:
    """The row layout of one diffusers call, as the pipeline adapter makes it."""

    requests: tuple[str, ...]  # the call's request ids, in its order
    stacks: tuple[LoraStack, ...]  # each request's LoRA stack
    num_outputs_per_prompt: int
    cfg_copies: int  # copies of the image rows in one denoiser call (2: batched CFG)
    _made: dict[tuple[str, int], CallRows] = field(default_factory=dict, repr=False)

    def rows(self, layout: RowLayout, num_rows: int, root: str) -> CallRows:
        """The rows of a `root` call of `num_rows` rows.

        Raises when the batch is not the one the plan states and the requests' stacks
        differ (a wrong layout would give a request another's adapters); with one
        stack for all, the rows get it whatever the layout (their requests are known
        only for a call of one request).
        """
        made = self._made.get((layout, num_rows))
        if made is not None:
            return made
        copies = 1 if layout == "prompts" else self.num_outputs_per_prompt
        order = [i for i in range(len(self.requests)) for _ in range(copies)]
        if layout == "images":
            order *= self.cfg_copies
        if num_rows == len(order):
            made = CallRows(tuple(self.stacks[i] for i in order),
                            tuple(self.requests[i] for i in order))
        elif len(set(self.stacks)) == 1:
            one = self.requests * num_rows if len(self.requests) == 1 else None
            made = CallRows((self.stacks[0],) * num_rows, one)
        else:
            planned = len(order)

            raise RuntimeError(
                f"{root} got a batch of {num_rows} rows where the call's row plan states "
                f"{planned} ({len(self.stacks)} requests, {self.num_outputs_per_prompt} "
                f"images each, {self.cfg_copies} CFG copies): this pipeline's batch layout "
                "differs from the plan, so its requests cannot carry different adapters")
        self._made[(layout, num_rows)] = made
        return made


_PLAN: contextvars.ContextVar[RowPlan | None] = contextvars.ContextVar(
    "diffbatch_row_plan", default=None)
_ROWS: contextvars.ContextVar[CallRows | None] = contextvars.ContextVar(
    "diffbatch_call_rows", default=None)


@contextlib.contextmanager
def row_plan(plan: RowPlan | None) -> Iterator[None]:
    """Within: diffusers calls made by this task follow `plan`."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


@contextlib.contextmanager
def call_rows(rows: CallRows | None) -> Iterator[None]:
    """Within: module calls made by this task hold `rows`."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_rows() -> CallRows | None:
    """The rows of the module call running now (None: no per-row data)."""
    return _ROWS.get()


def track_rows(module: torch.nn.Module, layout: RowLayout, name: str) -> None:
    """Make `module` a root: each call of it holds its rows from the current plan.

    A torch forward pre-hook and an always-called forward hook, so the rows hold for
    exactly the root's own forward (also when it raises, or when a fused call stands
    in for it: the task's rows travel with its `ModuleCall`).
    """
    if getattr(module, "_diffbatch_row_layout", None) is not None:
        return

    def enter(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        plan = _PLAN.get()
        size = _leading_size(args, kwargs)
        _ROWS.set(None if plan is None or size is None else plan.rows(layout, size, name))

    def leave(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        _ROWS.set(None)  # roots are not nested: outside one, a task's rows are none

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)
    module._diffbatch_row_layout = layout  # type: ignore[assignment]


def _leading_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The call's batch size: the first tensor argument's first dimension."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[0])
    return None
