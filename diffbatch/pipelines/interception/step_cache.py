"""Per-request step caching inside one fused transformer forward: `StepCache`.

diffusers' `FirstBlockCache` runs the first transformer block, compares its residual
(output - input) with the one of the last fully computed step, and when the relative
mean absolute change is at most a threshold, skips the other blocks and adds the
cached residual of the remaining blocks instead. It decides once for the whole
batch, from every sample's residual: a request's image would depend on its batch
mates, and a request joining a running batch would inherit another's cache.

`StepCache` applies the same rule per request, through the layer's hooks
(`hooks.route_forward` on every transformer block) and its row plan
(`rows.current_rows()`: each row's request):

1. the head block runs for all rows; each caching request takes its own rows (its
   CFG copies and `n` images decide together) and compares their residual with its
   own previous one; a request that does not cache always computes;
2. rows of requests that skip get head output + their own cached tail residual, and
   pass through every other block unchanged (as diffusers' `FBCBlockHook` does);
3. the other blocks run on the gathered rows that compute only (each per-sample
   argument cut to them, the rows' LoRA stacks with them), and their outputs are
   scattered back;
4. at the last block, each computing request stores its new tail residual.

Cache state (`RequestCache`) belongs to the request: the pipeline adapter opens it
for the length of the request's diffusers call (`StepCache.open`), so it is new when
a request starts (or joins, in step mode; or re-runs after a crash) and gone when it
leaves. It is kept per diffusers cache context ("cond", "uncond": the name a
pipeline gives with `transformer.cache_context`), as diffusers' `StateManager` does.

NOTE: in a packed forward of several sizes (`packed_tokens.py`) every request
computes, and its cache starts again after it: the padded carrier would put padding
tokens into a request's residual.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from diffbatch.pipelines.interception.hooks import route_forward
from diffbatch.pipelines.interception.rows import CallRows, call_rows, current_rows, track_rows
from diffbatch.step_cache import StepCacheConfig

logger = logging.getLogger(__name__)

_HEAD_HOOK = "diffbatch.step_cache.head"
_BLOCK_HOOK = "diffbatch.step_cache.block"
_CONTEXT_HOOK = "diffbatch.step_cache.context"
# Block arguments never cut to the computing rows although their first dimension may
# equal the batch size: position embeddings shared by all samples.
_SHARED_NAMES = ("rotary", "freqs", "pos_embed", "position")


class UnsupportedStepCache(ValueError):
    """The denoiser has no transformer blocks the step cache knows how to skip."""


@dataclass
class _ContextState:
    """A request's cache in one diffusers cache context."""

    forwards: int = 0  # forwards seen in this context
    cached_in_a_row: int = 0
    head_residual: torch.Tensor | None = None  # [rows, ...] at the last computed step
    tail_residuals: tuple[torch.Tensor, torch.Tensor | None] | None = None  # hs, ehs
    tail_at: int = 0  # the forward (index in this context) that computed them
    # the computed step before that one, for the "taylorseer" forecast
    previous_tails: tuple[torch.Tensor, torch.Tensor | None] | None = None
    previous_at: int = 0

    def cached_tails(self, taylor: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tail residuals a cached forward adds: the last computed ones, or with
        `taylor` their first-order forecast to this forward from the last two."""
        assert self.tail_residuals is not None
        if not taylor or self.previous_tails is None:
            return self.tail_residuals
        ratio = (self.forwards - self.tail_at) / (self.tail_at - self.previous_at)
        return tuple(  # type: ignore[return-value]
            None if now is None or before is None else now + ratio * (now - before)
            for now, before in zip(self.tail_residuals, self.previous_tails, strict=True))


@dataclass
class RequestCache:
    """One request's step cache: its settings, per-context state and counts."""

    config: StepCacheConfig
    contexts: dict[str | None, _ContextState] = field(default_factory=dict)
    computed_steps: int = 0  # forwards whose tail blocks ran for this request
    cached_steps: int = 0  # forwards that reused its cached tail residual


@dataclass
class _Decision:
    """What the head block decided for one caching request in one forward."""

    cache: RequestCache
    state: _ContextState
    computes: bool
    rows: torch.Tensor  # its row indices in the call
    head_residual: torch.Tensor  # [rows, ...] its residual of this forward

    def apply(self, head: tuple[torch.Tensor, torch.Tensor | None],
              out: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Update the request's state after the forward's last block (`head`: the
        hidden states after the head block; `out`: after the last block)."""
        state, cache = self.state, self.cache
        state.forwards += 1
        if not self.computes:
            state.cached_in_a_row += 1
            cache.cached_steps += 1
            return
        state.cached_in_a_row = 0
        cache.computed_steps += 1
        state.head_residual = self.head_residual
        (head_hs, head_ehs), (out_hs, out_ehs) = head, out
        tail_ehs = None if out_ehs is None or head_ehs is None else \
            out_ehs.index_select(0, self.rows) - head_ehs.index_select(0, self.rows)
        if state.tail_residuals is not None:
            state.previous_tails, state.previous_at = state.tail_residuals, state.tail_at
        state.tail_at = state.forwards - 1
        state.tail_residuals = (
            out_hs.index_select(0, self.rows) - head_hs.index_select(0, self.rows), tail_ehs)


@dataclass
class _Forward:
    """What the head block decided for the forward running now."""

    batch_size: int
    rows: CallRows
    compute: torch.Tensor | None  # row indices that run the tail blocks; None: all
    # each caching request's decision, applied to its state once the last block ran
    decisions: list[_Decision]
    head_output: tuple[torch.Tensor, torch.Tensor | None]  # hs, ehs after the head block
    compute_rows: CallRows | None = None  # the computing rows' per-row data


class StepCache:
    """The per-request step cache of one transformer; see the module docstring."""

    def __init__(self, transformer: torch.nn.Module, name: str = "transformer",
                 packed: Callable[[], bool] = lambda: False) -> None:
        self.transformer = transformer
        self._name = name
        self._packed = packed
        self._blocks = _blocks(transformer)  # raises UnsupportedStepCache
        self._requests: dict[str, RequestCache] = {}
        self._forward: _Forward | None = None
        self._installed = False
        self._context = _ContextListener()

    # -- the requests ------------------------------------------------------------------
    @contextlib.contextmanager
    def open(self, configs: dict[str, StepCacheConfig]) -> Iterator[dict[str, RequestCache]]:
        """Within: the requests `configs` names cache with those settings (their state new).

        Yields each request's `RequestCache`, to read its counts after the call.
        """
        caches = {rid: RequestCache(config) for rid, config in configs.items()
                  if config.enabled}
        if caches:
            self._install()
        clash = caches.keys() & self._requests.keys()
        if clash:
            raise RuntimeError(f"requests {sorted(clash)} already hold a step cache")
        self._requests.update(caches)
        try:
            yield caches
        finally:
            for rid in caches:
                self._requests.pop(rid, None)

    def caches_any(self, requests: tuple[str, ...]) -> bool:
        """Whether any of `requests` caches steps now."""
        return bool(self._requests) and any(r in self._requests for r in requests)

    def _install(self) -> None:
        if self._installed:
            return
        track_rows(self.transformer, "images", self._name)
        _listen_to_contexts(self.transformer, self._context)
        head, *rest = self._blocks
        route_forward(head[0], _HEAD_HOOK, self._run_head)
        for index, (block, metadata) in enumerate(rest):
            tail = index == len(rest) - 1
            route_forward(block, _BLOCK_HOOK, _bound(self._run_block, metadata, tail))
        self._installed = True

    # -- the hooks ---------------------------------------------------------------------
    def _run_head(self, original: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        self._forward = None
        metadata = self._blocks[0][1]
        rows = current_rows()
        if rows is None or rows.requests is None or not self._requests \
                or not any(r in self._requests for r in rows.requests):
            return original(*args, **kwargs)
        requests = rows.requests
        if self._packed():  # every request computes; its cache starts again after
            for rid in dict.fromkeys(requests):
                cache = self._requests.get(rid)
                if cache is not None:
                    cache.computed_steps += 1
                    cache.contexts.pop(self._context.name(), None)
            return original(*args, **kwargs)
        hidden = metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        output = original(*args, **kwargs)
        out_hs, out_ehs = _split_output(output, metadata)
        residual = out_hs - hidden
        context = self._context.name()
        by_request: dict[str, list[int]] = {}
        for i, rid in enumerate(requests):
            by_request.setdefault(rid, []).append(i)
        # NOTE: states change only once the last block ran (`_Decision.apply`): a forward
        # that raises (and is re-run in parts, `fusion.run_fused`) leaves them as they were.
        compute: list[int] = []
        cached: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]] = []
        decisions: list[_Decision] = []
        for rid, indices in by_request.items():
            cache = self._requests.get(rid)
            if cache is None:
                compute.extend(indices)
                continue
            index = torch.tensor(indices, device=out_hs.device)
            state = cache.contexts.setdefault(context, _ContextState())
            own = residual.index_select(0, index)
            computes = _should_compute(cache.config, state, own)
            decisions.append(_Decision(cache, state, computes, index, own))
            if computes:
                compute.extend(indices)
            else:
                cached.append((index, state.cached_tails(
                    cache.config.policy == "taylorseer")))
        if not cached:  # every row computes: the blocks run as they would without us
            self._forward = _Forward(len(requests), rows, None, decisions, (out_hs, out_ehs))
            return output
        new_hs, new_ehs = out_hs.clone(), None if out_ehs is None else out_ehs.clone()
        for index, (tail_hs, tail_ehs) in cached:
            new_hs.index_copy_(0, index, out_hs.index_select(0, index) + tail_hs)
            if new_ehs is not None and tail_ehs is not None:
                assert out_ehs is not None
                new_ehs.index_copy_(0, index, out_ehs.index_select(0, index) + tail_ehs)
        compute.sort()
        self._forward = _Forward(
            len(requests), rows, torch.tensor(compute, dtype=torch.long, device=out_hs.device),
            decisions, (out_hs, out_ehs), _subset(rows, compute))
        return _join_output(output, metadata, new_hs, new_ehs)

    def _run_block(self, metadata: Any, tail: bool, original: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        forward = self._forward
        if forward is None:
            return original(*args, **kwargs)
        if forward.compute is None:
            output = original(*args, **kwargs)
        else:
            output = self._run_rows(forward, metadata, original, args, kwargs)
        if tail:
            self._forward = None
            out = _split_output(output, metadata)
            for decision in forward.decisions:
                decision.apply(forward.head_output, out)
        return output

    def _run_rows(self, forward: _Forward, metadata: Any, original: Callable[..., Any],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A block on the computing rows only; the other rows pass through unchanged."""
        hidden = metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        encoder = None
        if metadata.return_encoder_hidden_states_index is not None:
            encoder = metadata._get_parameter_from_args_kwargs(
                "encoder_hidden_states", args, kwargs)
        compute = forward.compute
        assert compute is not None
        if compute.numel() == 0:
            return _pass_through(metadata, hidden, encoder)
        size = forward.batch_size
        sub_args = tuple(_cut(a, compute, size, "") for a in args)
        sub_kwargs = {k: _cut(v, compute, size, k) for k, v in kwargs.items()}
        with call_rows(forward.compute_rows):
            output = original(*sub_args, **sub_kwargs)
        out_hs, out_ehs = _split_output(output, metadata)
        new_hs = hidden.index_copy(0, compute, out_hs)
        new_ehs = None
        if encoder is not None and out_ehs is not None:
            new_ehs = encoder.index_copy(0, compute, out_ehs)
        if metadata.return_encoder_hidden_states_index is None:
            return new_hs
        return _join_output(output, metadata, new_hs, new_ehs)


def _subset(rows: CallRows, indices: list[int]) -> CallRows:
    """The per-row data of the rows `indices` (a sub-batch of the call)."""
    requests = rows.requests
    return CallRows(tuple(rows.stacks[i] for i in indices),
                    None if requests is None else tuple(requests[i] for i in indices))


def _should_compute(config: StepCacheConfig, state: _ContextState,
                    residual: torch.Tensor) -> bool:
    """diffusers' `FBCHeadBlockHook._should_compute_remaining_blocks`, on one request's
    rows, with the warm-up and the cap on consecutive cached forwards."""
    if state.head_residual is None or state.tail_residuals is None \
            or state.forwards < config.warmup_steps:
        return True
    if config.max_cached_steps is not None and state.cached_in_a_row >= config.max_cached_steps:
        return True
    previous = state.head_residual
    absmean = (residual - previous).abs().mean()
    diff = (absmean / previous.abs().mean()).item()
    return bool(diff > config.threshold)


# -- blocks and their outputs ----------------------------------------------------------
def step_cache_blocks(transformer: torch.nn.Module) -> int:
    """How many blocks the step cache would hook (raises `UnsupportedStepCache`)."""
    return len(_blocks(transformer))


def _blocks(transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """The transformer's blocks in call order, as diffusers' `apply_first_block_cache`
    finds them, each with diffusers' metadata of where its outputs are."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    blocks = []
    for name, child in transformer.named_children():
        if name not in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS \
                or not isinstance(child, torch.nn.ModuleList):
            continue
        for block in child:
            try:
                metadata = TransformerBlockRegistry.get(type(block))
            except ValueError:
                raise UnsupportedStepCache(
                    f"step caching does not know where {type(block).__name__} returns its "
                    "hidden states (diffusers has no block metadata for it); leave out "
                    "`step_cache` / --step-cache for this model") from None
            blocks.append((block, metadata))
    if len(blocks) < 2:
        raise UnsupportedStepCache(
            f"step caching needs a transformer with at least two blocks; "
            f"{type(transformer).__name__} has {len(blocks)}: leave out `step_cache` / "
            "--step-cache for this model")
    return blocks


def _split_output(output: Any, metadata: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(output, tuple):
        ehs_index = metadata.return_encoder_hidden_states_index
        return (output[metadata.return_hidden_states_index],
                None if ehs_index is None else output[ehs_index])
    return output, None


def _join_output(output: Any, metadata: Any, hs: torch.Tensor,
                 ehs: torch.Tensor | None) -> Any:
    """`output` with its hidden states replaced (a block returns a tensor or a tuple)."""
    if not isinstance(output, tuple):
        return hs
    parts = list(output)
    parts[metadata.return_hidden_states_index] = hs
    if metadata.return_encoder_hidden_states_index is not None:
        parts[metadata.return_encoder_hidden_states_index] = ehs
    return tuple(parts)


def _pass_through(metadata: Any, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    """A skipped block's output: its inputs, shaped as its outputs (`FBCBlockHook`)."""
    if encoder is None:
        return hidden
    parts: list[Any] = [None, None]
    parts[metadata.return_hidden_states_index] = hidden
    parts[metadata.return_encoder_hidden_states_index] = encoder
    return tuple(parts)


def _cut(value: Any, index: torch.Tensor, size: int, name: str) -> Any:
    """A block argument for the computing rows: per-sample tensors (first dimension
    the batch size) cut to `index`; shared position embeddings and anything else as
    they are; dicts, lists and tuples element by element."""
    if any(part in name for part in _SHARED_NAMES):
        return value
    if isinstance(value, torch.Tensor):
        if value.ndim >= 1 and value.shape[0] == size:
            return value.index_select(0, index)
        return value
    if isinstance(value, dict):
        return {k: _cut(v, index, size, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_cut(v, index, size, name) for v in value)
    return value


def _bound(run: Callable[..., Any], metadata: Any, tail: bool) -> Callable[..., Any]:
    def forward(original: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        return run(metadata, tail, original, args, kwargs)
    return forward


# -- the cache context -------------------------------------------------------------------
class _ContextListener:
    """The diffusers cache context in effect ("cond", "uncond"; None outside one), as a
    pipeline sets it with `transformer.cache_context(name)`."""

    def __init__(self) -> None:
        self.manager: Any = None

    def name(self) -> str | None:
        context = getattr(self.manager, "_context", None)
        return None if context is None else context.name


def _listen_to_contexts(transformer: torch.nn.Module, listener: _ContextListener) -> None:
    """Register a diffusers hook that only receives the cache context: diffusers sets
    it on every stateful hook's `StateManager` under the transformer."""
    from diffusers.hooks import HookRegistry, ModelHook
    from diffusers.hooks.hooks import StateManager

    class _Nothing:
        def reset(self) -> None:
            pass

    class ContextHook(ModelHook):
        _is_stateful = True  # so that diffusers hands it the context

        def __init__(self) -> None:
            super().__init__()
            self.contexts = StateManager(_Nothing)

        def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
            return module  # the state is the requests' own, not the hook's

    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(_CONTEXT_HOOK) is None:
        hook = ContextHook()
        registry.register_hook(hook, _CONTEXT_HOOK)
        listener.manager = hook.contexts


def step_cache_unsupported(pipe: Any) -> str | None:
    """Why `pipe` cannot cache steps (`PipelineInfo.step_cache_unsupported`); None if it can."""
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        return (f"{type(pipe).__name__} denoises with a UNet; step caching skips the blocks of "
                "a diffusion transformer: leave out `step_cache` / --step-cache for this model")
    try:
        step_cache_blocks(transformer)
    except UnsupportedStepCache as exc:
        return str(exc)
    return None
