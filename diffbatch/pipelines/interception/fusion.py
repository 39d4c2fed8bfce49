"""Fused module calls: several diffusers calls' module calls run as one.

A *fusion point* (`FusionPoint`) is a module method whose calls may be fused: the
denoiser's `forward` (kind "step": one fused call of it is one tick of step mode), the
text encoders' `forward` and the VAE's `decode` (kind "boundary": what runs when a
request joins or leaves), and the schedulers' `step` (`scheduler_fusion.py`). The
coordinator (`coordinator.py`) runs each diffusers call in a task of its own; a task
calling a fused method hands a `ModuleCall` to the coordinator instead of running it,
and `run_fused` runs the calls waiting at one point as few module calls as possible.

Fusing the arguments (`fuse_arguments`): the first tensor argument's first dimension
is a call's batch size b_i (2 for a CFG request: the pipeline doubled it itself).
Tensors whose first dimension is b_i are concatenated; 0-d tensors (a timestep
`t`) are expanded to b_i, so the fused call gets one timestep per sample; lists of
length b_i (generators) are concatenated; dicts are fused key by key; anything else
must be equal across the calls (names in `FusionPoint.shared`, e.g. Flux's position
ids, are always taken from the first call after checking they are equal). Calls that
cannot be fused (other shapes, other option values) run in smaller groups: results
stay right, only slower; a point with a `pack` (the transformer over requests of
different sizes, `packed_tokens.py`) first tries that. Outputs are split the same
way (`split_result`): tensors, tuples, dicts and `ModelOutput`s whose batch
dimension is the fused size.

Each call carries its rows' own per-row data (`ModuleCall.rows`, see `rows.py`: each
row's LoRA stack), captured when the task made the call; a fused call runs with the
calls' rows concatenated in the same order as their arguments.

Correctness rests on the modules treating samples independently (as batching in
request mode already does): a request's image in a fused call equals its solo run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from diffbatch.pipelines.interception.rows import CallRows, call_rows

FusionKind = Literal["step", "boundary"]


@dataclass(frozen=True)
class FusionPoint:
    """A module method whose calls are fused across the running requests.

    `kind` "step" marks the denoiser: one fused call of it is one tick. "boundary"
    marks what runs when a request joins or leaves (text encoders, VAE decode);
    those calls are fused among the requests that reach them at the same boundary.
    """

    owner: Any  # the module (or any object) whose method is wrapped; None: per call
    method: str  # "forward", "decode", ...
    kind: FusionKind
    name: str  # for logs and metrics, e.g. "unet", "text_encoder", "vae.decode"
    shared: frozenset[str] = frozenset()  # keyword arguments with no batch dimension
    # How to run several calls as one, if not by concatenating their arguments: one
    # result per call, or `Unfusable` (then each call runs alone).
    fuse: Callable[[Sequence[ModuleCall]], list[Any]] | None = None
    # How to run calls whose arguments cannot be concatenated (e.g. a transformer over
    # requests of different sizes, `packed_tokens.TokenPacker`) as one: one result
    # per call, or an exception (then the calls are split as without it).
    pack: Callable[[Sequence[ModuleCall]], list[Any]] | None = None


@dataclass
class ModuleCall:
    """A call a task waits on: `run(*args, **kwargs)` at `point`."""

    point: FusionPoint
    run: Callable[..., Any]  # the original (unwrapped) method
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rows: CallRows | None = None  # the call's per-row data, as the task made it
    batch_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.batch_size = _leading_size(self.args, self.kwargs)


class Unfusable(Exception):
    """The calls' arguments cannot be fused into one call (shapes or options differ)."""


def _leading_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[0])
    raise Unfusable("a fused module call needs a tensor argument with a batch dimension")


# -- fusing arguments ------------------------------------------------------------------
def fuse_arguments(calls: Sequence[ModuleCall]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One call's (args, kwargs) for all `calls` (same point); raises `Unfusable`."""
    first = calls[0]
    sizes = [c.batch_size for c in calls]
    if any(len(c.args) != len(first.args) or c.kwargs.keys() != first.kwargs.keys()
           for c in calls):
        raise Unfusable("the calls pass different arguments")
    args = tuple(_fuse([c.args[i] for c in calls], sizes, shared=False)
                 for i in range(len(first.args)))
    kwargs = {name: _fuse([c.kwargs[name] for c in calls], sizes,
                          shared=name in first.point.shared)
              for name in first.kwargs}
    return args, kwargs


def _fuse(values: list[Any], sizes: list[int], *, shared: bool) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise Unfusable("a tensor argument is not a tensor in every call")
        if not shared:
            if all(v.ndim == 0 for v in values):  # a per-call scalar (timestep)
                return _per_sample(values, sizes)
            if [v.shape[0] if v.ndim else -1 for v in values] == sizes:
                try:  # (`cat` checks the other dimensions: cheaper than comparing here)
                    return torch.cat(values)
                except RuntimeError:  # they differ: not a per-sample argument
                    pass
        if all(v.shape == first.shape and torch.equal(v, first) for v in values[1:]):
            return first  # the same for every call (e.g. position ids)
        raise Unfusable("tensor arguments differ in shape beyond the batch dimension")
    if first is None:
        if any(v is not None for v in values):
            raise Unfusable("an argument is None in some calls only")
        return None
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise Unfusable("dict arguments have different keys")
        return {k: _fuse([v[k] for v in values], sizes, shared=shared) for k in first}
    if isinstance(first, list | tuple) and not shared \
            and all(isinstance(v, list | tuple) and len(v) == n
                    for v, n in zip(values, sizes, strict=True)) \
            and not any(isinstance(x, torch.Tensor) for x in first):
        return [x for v in values for x in v]  # per-sample objects, e.g. generators
    if all(_equal(v, first) for v in values[1:]):
        return first
    raise Unfusable(f"a {type(first).__name__} argument differs between the calls")


def _per_sample(scalars: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Call i's 0-d tensor repeated sizes[i] times, as one 1-d tensor."""
    if any(v.dtype != scalars[0].dtype or v.device != scalars[0].device for v in scalars):
        raise Unfusable("per-call scalars differ in dtype or device")
    # one op: each call's scalar listed once per sample
    return torch.stack([v for v, n in zip(scalars, sizes, strict=True) for _ in range(n)])


def _equal(a: Any, b: Any) -> bool:
    if a is b:  # the common case (flags, None-free options, shared tensors): no compare
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a plain bool
        return a is b


# -- splitting results -----------------------------------------------------------------
def split_result(result: Any, sizes: list[int]) -> list[Any]:
    """Cut one fused call's result into one result per call (batch sizes `sizes`)."""
    total = sum(sizes)
    if isinstance(result, torch.Tensor):
        if result.ndim >= 1 and result.shape[0] == total:
            return list(torch.split(result, sizes))
        return [result] * len(sizes)
    if isinstance(result, dict):  # ModelOutput is an OrderedDict too
        parts = {k: split_result(v, sizes) for k, v in result.items()}
        return [_rebuild(result, {k: p[i] for k, p in parts.items()}) for i in range(len(sizes))]
    if isinstance(result, list | tuple):
        parts_list = [split_result(v, sizes) for v in result]
        return [type(result)(p[i] for p in parts_list) for i in range(len(sizes))]
    return [result] * len(sizes)


def _rebuild(template: dict[str, Any], values: dict[str, Any]) -> Any:
    if type(template) is dict:
        return values
    try:
        return type(template)(**values)  # ModelOutput dataclasses
    except TypeError:
        rebuilt = type(template)()
        rebuilt.update(values)
        return rebuilt


def run_fused(calls: Sequence[ModuleCall],
              module_ms: list[float] | None = None) -> list[tuple[bool, Any]]:
    """Run calls of one point as few module calls as possible; one (ok, value) each.

    Fusable calls run as one; calls that cannot be concatenated run as one through
    the point's `pack` if it has one; otherwise, or if that fails, a group is split
    in halves until it can (one call always can). A fused call that raises is bisected the same way
    (error isolation): the calls whose own run raises get (False, exception), the
    others their result, exactly as if they had run without the failing ones.
    `module_ms`, if given, gets the wall time of each module call made. Each module
    call runs with the rows of the calls it serves (`rows.call_rows`).
    """
    def within(group: Sequence[ModuleCall]) -> contextlib.AbstractContextManager[Any]:
        return call_rows(CallRows.concat([(c.rows, c.batch_size) for c in group]))

    if len(calls) == 1:
        call = calls[0]
        try:
            with within(calls):
                return [(True, _timed(call.run, call.args, call.kwargs, module_ms))]
        except Exception as exc:
            return [(False, exc)]
    fuse = calls[0].point.fuse
    if fuse is not None:
        try:
            with within(calls):
                return [(True, result) for result in fuse(calls)]
        except Exception:  # Unfusable, or a call that fails: each runs alone
            return [outcome for call in calls
                    for outcome in run_fused([call], module_ms)]
    try:
        args, kwargs = fuse_arguments(calls)
    except Exception as exc:
        pack = calls[0].point.pack
        if isinstance(exc, Unfusable) and pack is not None:
            try:
                with within(calls):
                    return [(True, r) for r in _timed(pack, (calls,), {}, module_ms)]
            except Exception:  # Unfusable, or a call that fails: split as below
                pass
    else:
        try:
            with within(calls):
                result = _timed(calls[0].run, args, kwargs, module_ms)
            return [(True, part) for part in split_result(result, [c.batch_size for c in calls])]
        except Exception:
            pass
    mid = len(calls) // 2
    return run_fused(calls[:mid], module_ms) + run_fused(calls[mid:], module_ms)


def _timed(run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           module_ms: list[float] | None) -> Any:
    if module_ms is None:
        return run(*args, **kwargs)
    start = time.perf_counter()
    try:
        return run(*args, **kwargs)
    finally:
        module_ms.append((time.perf_counter() - start) * 1000.0)
