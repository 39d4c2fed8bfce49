"""Compiled module forwards that keep batching: `CompiledForward`, per wave-size bucket.

A compiled graph is specialised to its input shapes, so a server whose waves change
size would recompile at each new size. `CompiledForward` routes a module's `forward`
(`hooks.route_forward`, inside the fusion hook: a fused step-mode call reaches it as
one call) so that a call of `rows` rows runs padded to the smallest compiled bucket
holding it, and its result is cut back to `rows`. Padding rows repeat the last real
row: every row of these models is computed on its own, so they never change a real
row's values, only add work. With `dynamic` buckets there is no padding: one graph
has a symbolic batch dimension instead.

The compiled graph is traced from a *structural twin* of the module: new module
objects holding the same parameter and buffer tensors, with no hooks. What diffbatch
changes in the original module at run time (PEFT LoRA layers injected and evicted,
the step cache's block hooks, packed attention) never reaches the twin, so it never
invalidates the compiled graphs. The calls that need those changes run the original
module eagerly, counted by reason and logged once per reason (`eager_reason`):

- "lora": a row carries a LoRA adapter (the mixer's per-row deltas live in hooks the
  twin does not have);
- "step_cache": a row's request caches steps (data-dependent block skipping);
- "packed": a call packing requests of several sizes;
- "above_buckets": more rows than the largest bucket.

`warm` compiles every bucket at start-up from the arguments of one real call
(`capture`), logging each; a compile that fails turns compiling off for the module
with one log line, and the original module serves eagerly. A compile after warm-up
(a new image size, say) is a recompile: counted, logged once per shape.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from diffbatch.compile import CompileSettings
from diffbatch.pipelines.interception.fusion import split_result
from diffbatch.pipelines.interception.hooks import route_forward
from diffbatch.pipelines.interception.rows import CallRows, current_rows

logger = logging.getLogger(__name__)

_HOOK = "diffbatch.compile"
# Why a call runs the original module eagerly (None: it runs compiled).
EagerReason = Callable[[CallRows | None], str | None]


@dataclass
class CompileStats:
    """What compiling did in one worker, for logs and `/metrics`."""

    buckets: dict[str, list[int]] = field(default_factory=dict)  # module -> compiled rows
    graphs: int = 0  # graphs compiled (a graph break makes several per bucket)
    compiles: int = 0  # compiled calls that made graphs during warm-up
    recompiles: int = 0  # compiled calls that made graphs after warm-up
    compile_s: float = 0.0  # seconds spent in calls that compiled
    compiled_forwards: int = 0
    eager_forwards: dict[str, int] = field(default_factory=dict)  # by reason
    failures: int = 0  # compiles or compiled calls that raised (then eager)
    cache_hits: int = 0  # inductor FX graph cache hits (artefacts read from disk)
    cache_misses: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat numbers (`eager_forwards:<reason>` per reason) for crossing processes."""
        numbers = {name: float(getattr(self, name)) for name in (
            "graphs", "compiles", "recompiles", "compile_s", "compiled_forwards", "failures",
            "cache_hits", "cache_misses")}
        # (read from the heartbeat thread while the worker counts: copies, made at once)
        eager, buckets = dict(self.eager_forwards), dict(self.buckets)
        numbers.update({f"eager_forwards:{r}": float(n) for r, n in eager.items()})
        numbers["buckets"] = float(sum(len(b) for b in buckets.values()))
        return numbers


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]), \
        int(counters["inductor"]["fxgraph_cache_miss"])


def configure_dynamo(settings: CompileSettings, num_graphs: int) -> None:
    """Room for every bucket's graph, and the on-disk caches under the cache dir."""
    import os

    import torch._dynamo
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # NOTE: inductor writes its default into the variable the first time it looks, so
    # a value equal to the default is inductor's own, not a user's choice.
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if settings.cache_dir and (given is None
                               or os.path.abspath(given) == os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = settings.cache_dir
    config = torch._dynamo.config
    limit = max(int(config.recompile_limit), 4 * num_graphs + 8)
    config.recompile_limit = limit
    config.accumulated_recompile_limit = max(int(config.accumulated_recompile_limit), 4 * limit)


def structural_twin(module: torch.nn.Module) -> torch.nn.Module:
    """New module objects over the same parameter and buffer tensors, without hooks.

    The parameters are frozen first (serving never trains): a graph guards on their
    `requires_grad`, which PEFT flips on the base weights when it injects an adapter.
    """
    module.requires_grad_(False)
    tensors = itertools.chain(module.parameters(), module.buffers())
    memo: dict[int, Any] = {id(t): t for t in tensors}
    for sub in module.modules():
        if hasattr(sub, "_diffusers_hook"):
            raise RuntimeError(f"{type(sub).__name__} already has a diffusers hook; compile "
                               "before anything hooks the module")
    twin = copy.deepcopy(module, memo)
    for sub in twin.modules():
        for hooks in (sub._forward_hooks, sub._forward_pre_hooks,
                      sub._forward_hooks_with_kwargs, sub._forward_hooks_always_called,
                      sub._forward_pre_hooks_with_kwargs):
            hooks.clear()
    return twin


class CompiledForward:
    """One module's forward, compiled per bucket; see the module docstring."""

    def __init__(self, module: torch.nn.Module, name: str, settings: CompileSettings,
                 stats: CompileStats, *, eager_reason: EagerReason | None = None,
                 shared: frozenset[str] = frozenset()) -> None:
        self.module = module
        self.name = name
        self.settings = settings
        self.stats = stats
        self._eager_reason = eager_reason or (lambda rows: None)
        self._shared = shared  # keyword arguments with no batch dimension
        self._twin = structural_twin(module)
        self._compiled: Callable[..., Any] | None = torch.compile(
            self._twin, backend=settings.resolved_backend(),
            dynamic=None if settings.dynamic else False,
            mode=None if settings.mode == "default" else settings.mode)
        self._warm = False  # warm-up over: a compile from now on is a recompile
        self._captured: tuple[tuple[Any, ...], dict[str, Any], int] | None = None
        self._capturing = False
        self._recompiled_shapes: set[tuple[Any, ...]] = set()
        route_forward(module, _HOOK, self._forward)

    @property
    def active(self) -> bool:
        return self._compiled is not None

    # -- start-up --------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Within: the first call's arguments are kept (it runs eagerly) for `warm`."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def warm(self) -> None:
        """Compile each bucket (or the dynamic graph) from the captured call; on a
        failure, log it once and serve eagerly."""
        if self._captured is None:
            self._disable("no call was captured to compile from")
            return
        args, kwargs, rows = self._captured
        # dynamic: a graph for 2 rows and more (its batch dimension symbolic), and one
        # for a single row (dynamo specialises sizes 0 and 1)
        sizes = [2, 1] if self.settings.dynamic else list(self.settings.buckets)
        done: list[int] = []
        for k, size in enumerate(sizes, 1):
            start = time.perf_counter()
            hits, misses = _cache_counts()
            graphs = _graph_count()
            try:
                with torch.inference_mode():
                    self._call(*self._resized(args, kwargs, rows, size))
            except Exception as exc:
                self._disable(f"compiling {size} rows failed: {_one_line(exc)}")
                return
            seconds = time.perf_counter() - start
            new_hits, new_misses = _cache_counts()
            self.stats.cache_hits += new_hits - hits
            self.stats.cache_misses += new_misses - misses
            self.stats.compiles += 1
            self.stats.graphs += _graph_count() - graphs
            self.stats.compile_s += seconds
            done.append(size)
            logger.info("compiling %s bucket %d of %d (%s rows): %.1f s (inductor cache: "
                        "%d hits, %d misses)", self.name, k, len(sizes),
                        "dynamic" if self.settings.dynamic else size, seconds,
                        new_hits - hits, new_misses - misses)
        self.stats.buckets[self.name] = done
        self._warm = True

    def disable_quietly(self) -> None:
        """Serve eagerly from now on (the caller says why)."""
        self._compiled = None

    def _disable(self, why: str) -> None:
        self.stats.failures += 1
        self._compiled = None
        logger.warning("%s runs eagerly: %s", self.name, why)

    # -- each call -------------------------------------------------------------------
    def _forward(self, original: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        rows = _leading_size(args, kwargs)
        if self._capturing and self._captured is None and rows is not None:
            self._captured = (args, kwargs, rows)
            return original(*args, **kwargs)
        reason = "off" if self._compiled is None else \
            "no_batch" if rows is None else self._eager_reason(current_rows())
        size = rows
        if reason is None and not self.settings.dynamic:
            size = self.settings.bucket_for(rows)  # type: ignore[arg-type]
            if size is None:
                reason = "above_buckets"
        if reason is not None:
            count = self.stats.eager_forwards.get(reason, 0)
            if count == 0 and reason != "off":
                logger.info("%s: calls with reason %r run the original module (logged "
                            "once; counted in diffbatch_compile_eager_forwards_total)",
                            self.name, reason)
            self.stats.eager_forwards[reason] = count + 1
            return original(*args, **kwargs)
        assert rows is not None and size is not None
        graphs = _graph_count()
        start = time.perf_counter()
        try:
            result = self._call(*self._resized(args, kwargs, rows, size))
        except Exception as exc:  # a compile (or compiled call) failing: eager from now on
            self._disable(f"a compiled call of {size} rows failed: {_one_line(exc)}")
            return original(*args, **kwargs)
        self.stats.compiled_forwards += 1
        if _graph_count() != graphs:
            self.stats.graphs += _graph_count() - graphs
            self._count_recompile(args, kwargs, size, time.perf_counter() - start)
        if size == rows:
            return result
        return split_result(result, [rows, size - rows])[0]

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._compiled is not None
        result = self._compiled(*args, **kwargs)
        if self.settings.mode == "reduce-overhead":  # CUDA graphs reuse output memory
            result = _cloned(result)
        return result

    def _count_recompile(self, args: tuple[Any, ...], kwargs: dict[str, Any], size: int,
                         seconds: float) -> None:
        if not self._warm:
            return
        self.stats.recompiles += 1
        self.stats.compile_s += seconds
        shape = tuple(getattr(v, "shape", None) for v in (*args, *kwargs.values()))
        if shape not in self._recompiled_shapes:
            self._recompiled_shapes.add(shape)
            logger.warning("%s recompiled for a call of %d rows with new shapes (%.1f s); "
                           "compiled buckets cover the start-up image size", self.name,
                           size, seconds)

    def _resized(self, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int,
                 size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with `size` rows: cut, or padded with the last row.
        A 0-d tensor (a timestep) becomes one per row, as in a fused call."""
        def resize(value: Any, shared: bool = False) -> Any:
            if isinstance(value, torch.Tensor):
                if value.ndim == 0 and not shared:
                    value = value.reshape(1).repeat(rows)  # (a real row each: stride 1)
                elif shared or value.shape[0] != rows:
                    return value
                if size < rows:
                    value = value[:size]
                elif size > rows:
                    value = torch.cat([value, value[-1:].expand(size - rows, *value.shape[1:])])
                value = value.contiguous()  # (strides are part of what a graph is for)
                if self.settings.dynamic and size >= 2:  # (size 1 is its own graph)
                    torch._dynamo.mark_dynamic(value, 0)
                return value
            if isinstance(value, dict):
                return {k: resize(v, shared) for k, v in value.items()}
            return value

        return (tuple(resize(v) for v in args),
                {k: resize(v, k in self._shared) for k, v in kwargs.items()})


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one log line (dynamo's messages span many)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + "..."


def _leading_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[0])
    return None


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return type(value)(**{k: _cloned(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return value
