"""One transformer forward for requests of different sizes: `TokenPacker`.

A diffusion transformer (SD3, Flux, PixArt) treats tokens independently everywhere
but in attention: projections, MLPs, norms and the per-sample modulation (AdaLN) act
on each token, with each sample's own conditioning. Requests of different sizes can
therefore share one forward as long as

- each request's tokens come from its own patch embedding, with its own positions
  (sincos position embedding for SD3 and PixArt, RoPE ids for Flux);
- attention runs per request: the token-wise layers see all requests' tokens, and
  each attention module attends within one size group at a time (one call per size,
  its requests batched), never across requests;
- each request's output is cut back to its own size.

`TokenPacker` does this around the transformer's own `forward`, which runs unchanged
on a padded carrier (SD3, PixArt: a latent canvas as large as the largest request,
each request's tokens at its own grid positions; Flux: a token sequence as long as
the longest request's). Two diffusers hooks (`hooks.route_forward`), which pass
through unchanged outside a packed call, do the rest: the position embedding's embeds
each size group on its own (`_group_embedding`), and each attention module's runs
the module once per size group (`_segmented_attention`). Padding tokens are computed
on by the token-wise layers and dropped; no operation mixes them into a request's
tokens.

NOTE: padding, not a ragged layout, because the diffusers blocks modulate per sample
along the batch dimension; a ragged layout would mean rewriting every block.
UNets are never packed: their convolutions see neighbouring pixels, so padding
would change the images.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffbatch.pipelines.interception.fusion import (
    ModuleCall,
    Unfusable,
    fuse_arguments,
    split_result,
)
from diffbatch.pipelines.interception.hooks import route_forward

# diffusers transformer classes (by name: subclasses may change forward) and how their
# image tokens arrive: "latent" [B, C, H, W] patch-embedded by `pos_embed`, or
# "sequence" [B, N, C] with position ids `img_ids` (Flux packs 2x2 patches itself).
_LAYOUTS = {
    "SD3Transformer2DModel": "latent",
    "PixArtTransformer2DModel": "latent",
    "FluxTransformer2DModel": "sequence",
}
# Keyword arguments a packed call may carry with a value other than None; any other
# (controlnet residuals, IP-adapter inputs, ...) makes the calls run separately.
_PACKABLE_ARGUMENTS = frozenset({
    "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
    "img_ids", "txt_ids", "guidance", "encoder_attention_mask", "added_cond_kwargs",
    "return_dict", "joint_attention_kwargs", "cross_attention_kwargs", "attention_mask",
})


@dataclass
class SizeGroup:
    """The samples of one size inside a packed call."""

    rows: torch.Tensor  # [b] long: the samples' rows in the packed batch
    tokens: torch.Tensor  # [n] long: their image tokens' positions in the carrier
    height: int  # latent rows (SD3, PixArt) or tokens (Flux) of this size
    width: int  # latent columns; for a token sequence, which position ids it has
    rotary: Any = None  # Flux: this size's RoPE (cos, sin) over text + image tokens


@dataclass
class PackedLayout:
    """Where each size group's tokens sit in a packed call's carrier."""

    groups: list[SizeGroup]
    num_tokens: int  # image tokens per row of the carrier


def packing_layout(transformer: Any) -> str | None:
    """"latent" or "sequence" for a transformer `TokenPacker` can pack, else None."""
    return _LAYOUTS.get(type(transformer).__name__)


class TokenPacker:
    """Runs calls of one transformer's `forward` on different sizes as one call."""

    def __init__(self, transformer: Any) -> None:
        layout = packing_layout(transformer)
        if layout is None:
            raise ValueError(f"{type(transformer).__name__} cannot pack requests of "
                             f"different sizes; packable: {sorted(_LAYOUTS)}")
        self.transformer = transformer
        self.kind = layout
        self.layout: PackedLayout | None = None  # set only during a packed call
        for name in transformer.attn_processors:  # "<attention module>.processor"
            module = transformer.get_submodule(name.rsplit(".", 1)[0])
            route_forward(module, _ATTENTION_HOOK, self._segmented_attention)
        if layout == "latent":
            route_forward(transformer.pos_embed, _EMBEDDING_HOOK, self._group_embedding)

    # -- the fusion entry --------------------------------------------------------------
    def pack_calls(self, calls: Sequence[ModuleCall]) -> list[Any]:
        """One result per call, as each call's own `forward` would return it.

        Raises `Unfusable` when the calls cannot share a forward (arguments other than
        the packable ones, options that differ).
        """
        calls = [_by_name(call) for call in calls]
        for call in calls:
            if any(v is not None and k not in _PACKABLE_ARGUMENTS
                   for k, v in call.kwargs.items()):
                raise Unfusable("packed calls take the packable arguments only")
            for name in ("joint_attention_kwargs", "cross_attention_kwargs"):
                if call.kwargs.get(name):
                    raise Unfusable(f"packed calls take no {name}")
            if call.kwargs.get("attention_mask") is not None:  # over image tokens
                raise Unfusable("packed calls take no attention_mask")
        if self.kind == "latent":
            return self._pack_latents(calls)
        return self._pack_sequences(calls)

    def _pack_latents(self, calls: Sequence[ModuleCall]) -> list[Any]:
        latents = [c.kwargs["hidden_states"] for c in calls]  # [b_i, C, H_i, W_i]
        if any(x.ndim != 4 for x in latents):
            raise Unfusable("expected latents [B, C, H, W]")
        height = max(int(x.shape[2]) for x in latents)
        width = max(int(x.shape[3]) for x in latents)
        patch = int(self.transformer.config.patch_size)
        carriers = [torch.nn.functional.pad(x, (0, width - x.shape[3], 0, height - x.shape[2]))
                    for x in latents]
        groups = self._groups(calls, [(int(x.shape[2]), int(x.shape[3])) for x in latents],
                              lambda h, w: _grid_tokens(h // patch, w // patch, width // patch,
                                                        latents[0].device),
                              latents[0].device)
        layout = PackedLayout(groups, (height // patch) * (width // patch))
        results = self._run(calls, carriers, layout)
        return [_map_tensors(r, lambda t, x=x: _crop_latent(t, x))  # type: ignore[misc]
                for r, x in zip(results, latents, strict=True)]

    def _pack_sequences(self, calls: Sequence[ModuleCall]) -> list[Any]:
        tokens = [c.kwargs["hidden_states"] for c in calls]  # [b_i, N_i, C]
        img_ids: list[Any] = [c.kwargs.get("img_ids") for c in calls]  # checked below
        txt_ids = calls[0].kwargs.get("txt_ids")
        if any(x.ndim != 3 for x in tokens) or txt_ids is None or txt_ids.ndim != 2 \
                or any(i is None or i.ndim != 2 or i.shape[0] != x.shape[1]
                       for i, x in zip(img_ids, tokens, strict=True)):
            raise Unfusable("expected tokens [B, N, C] with 2-d img_ids and txt_ids")
        longest = max(range(len(calls)), key=lambda i: tokens[i].shape[1])
        length = int(tokens[longest].shape[1])
        carriers = [torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[1])) for x in tokens]
        # a group per length and position ids (64x128 and 128x64 have equal lengths)
        variants = [next(j for j in range(i + 1) if torch.equal(img_ids[j], img_ids[i]))
                    for i in range(len(calls))]
        groups = self._groups(calls, [(int(x.shape[1]), v) for x, v in zip(tokens, variants,
                                                                            strict=True)],
                              lambda n, _w: torch.arange(n, device=tokens[0].device),
                              tokens[0].device)
        for group, call in zip(groups, self._group_calls(calls, groups), strict=True):
            ids = torch.cat((txt_ids, call.kwargs["img_ids"]), dim=0)
            group.rotary = self.transformer.pos_embed(ids)
        layout = PackedLayout(groups, length)
        # every call passes the longest call's ids: the carrier's (ignored) RoPE
        overrides = {"img_ids": img_ids[longest]}
        results = self._run(calls, carriers, layout, overrides)
        return [_map_tensors(r, lambda t, n=x.shape[1]: t[:, :n])  # type: ignore[misc]
                for r, x in zip(results, tokens, strict=True)]

    # -- shared steps ------------------------------------------------------------------
    @staticmethod
    def _groups(calls: Sequence[ModuleCall], sizes: list[tuple[int, int]],
                positions: Callable[[int, int], torch.Tensor],
                device: torch.device) -> list[SizeGroup]:
        """One group per distinct size, with the rows of its samples (call order)."""
        rows: dict[tuple[int, int], list[int]] = {}
        start = 0
        for call, size in zip(calls, sizes, strict=True):
            rows.setdefault(size, []).extend(range(start, start + call.batch_size))
            start += call.batch_size
        return [SizeGroup(torch.tensor(r, device=device), positions(h, w), h, w)
                for (h, w), r in rows.items()]

    @staticmethod
    def _group_calls(calls: Sequence[ModuleCall], groups: list[SizeGroup]) -> list[ModuleCall]:
        """A call of each group (the first whose rows start the group)."""
        firsts: dict[int, ModuleCall] = {}
        start = 0
        for call in calls:
            firsts.setdefault(start, call)
            start += call.batch_size
        return [firsts[int(g.rows[0])] for g in groups]

    def _run(self, calls: Sequence[ModuleCall], carriers: list[torch.Tensor],
             layout: PackedLayout, overrides: dict[str, Any] | None = None) -> list[Any]:
        padded = [ModuleCall(c.point, c.run, (), {**c.kwargs, "hidden_states": x,
                                                   **(overrides or {})})
                  for c, x in zip(calls, carriers, strict=True)]
        args, kwargs = fuse_arguments(padded)
        with self._packed(layout):
            result = calls[0].run(*args, **kwargs)
        return split_result(result, [c.batch_size for c in calls])

    @contextlib.contextmanager
    def _packed(self, layout: PackedLayout) -> Iterator[None]:
        """Within: attention runs per size group, and (latent layouts) the patch
        embedding embeds each size group on its own."""
        if self.layout is not None:
            raise RuntimeError("a packed call is already running on this transformer")
        self.layout = layout
        try:
            yield
        finally:
            self.layout = None

    # -- the hooks ---------------------------------------------------------------------
    def _group_embedding(self, embed: Callable[..., torch.Tensor], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> torch.Tensor:
        """The patch embedding of the canvas: each size group's own latents embedded
        (its own positions), placed at the group's token positions; padding stays 0."""
        layout = self.layout
        if layout is None:
            return embed(*args, **kwargs)
        (canvas,) = args
        out: torch.Tensor | None = None
        for group in layout.groups:
            own = embed(canvas[group.rows][:, :, :group.height, :group.width])
            if out is None:
                out = own.new_zeros(canvas.shape[0], layout.num_tokens, own.shape[-1])
            out[group.rows.unsqueeze(1), group.tokens.unsqueeze(0)] = own
        assert out is not None
        return out

    def _segmented_attention(self, attend: Callable[..., Any], args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> Any:
        """An attention module's forward: once per size group during a packed call."""
        layout = self.layout
        if layout is None:
            return attend(*args, **kwargs)
        signature = inspect.signature(attend)
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
                arguments.update(arguments.pop(name))
        return _per_group(attend, layout, arguments)


_ATTENTION_HOOK = "diffbatch.segmented_attention"
_EMBEDDING_HOOK = "diffbatch.group_embedding"


def _by_name(call: ModuleCall) -> ModuleCall:
    """`call` with its positional arguments passed by name (PixArt's pipeline passes
    the latents positionally)."""
    if not call.args:
        return call
    try:
        bound = inspect.signature(call.run).bind(*call.args, **call.kwargs)
    except TypeError as exc:
        raise Unfusable(f"the call's arguments do not fit its forward: {exc}") from None
    return ModuleCall(call.point, call.run, (), dict(bound.arguments))


def _grid_tokens(rows: int, cols: int, canvas_cols: int, device: torch.device) -> torch.Tensor:
    """Token positions of a rows x cols patch grid inside a canvas canvas_cols wide."""
    r = torch.arange(rows, device=device).unsqueeze(1) * canvas_cols
    return (r + torch.arange(cols, device=device)).reshape(-1)


def _crop_latent(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if t.ndim == 4 and t.shape[2:] != like.shape[2:]:
        return t[:, :, :like.shape[2], :like.shape[3]]
    return t


def _map_tensors(result: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`result` with `fn` applied to each tensor (in tuples, lists and ModelOutputs)."""
    if isinstance(result, torch.Tensor):
        return fn(result)
    if isinstance(result, dict):  # ModelOutput: rebuilt with the same class
        values = {k: _map_tensors(v, fn) for k, v in result.items()}
        return values if type(result) is dict else type(result)(**values)
    if isinstance(result, list | tuple):
        return type(result)(_map_tensors(v, fn) for v in result)
    return result


# -- attention per size group -----------------------------------------------------------
def _per_group(attend: Callable[..., Any], layout: PackedLayout,
               arguments: dict[str, Any]) -> Any:
    """Attention over each size group's rows and tokens alone (image tokens are the
    last `num_tokens` of `hidden_states`: Flux's single-stream blocks put the text
    tokens in front), each with its own RoPE; outputs go back to the same places,
    zeros at padding."""
    hidden = arguments["hidden_states"]  # [B, prefix + num_tokens, D]
    batch, length = hidden.shape[0], hidden.shape[1]
    prefix = length - layout.num_tokens
    if prefix < 0:
        raise RuntimeError(f"attention over {length} tokens in a packed call of "
                           f"{layout.num_tokens} image tokens per row")
    context = arguments.get("encoder_hidden_states")
    mask = arguments.get("attention_mask")
    if mask is not None and context is None:
        raise RuntimeError("a self-attention mask cannot be split per size group")
    image_out: torch.Tensor | None = None
    context_out: torch.Tensor | None = None
    for group in layout.groups:
        index = group.tokens + prefix
        if prefix:
            index = torch.cat((torch.arange(prefix, device=index.device), index))
        call = dict(arguments)
        call["hidden_states"] = hidden[group.rows][:, index]
        if context is not None:
            call["encoder_hidden_states"] = context[group.rows]
        if mask is not None and mask.shape[0] == batch:
            call["attention_mask"] = mask[group.rows]
        if group.rotary is not None and "image_rotary_emb" in call:
            call["image_rotary_emb"] = group.rotary
        result = attend(**call)
        own, own_context = (result if isinstance(result, tuple) else (result, None))
        if image_out is None:
            image_out = own.new_zeros(batch, length, *own.shape[2:])
            if own_context is not None:
                context_out = own_context.new_empty(batch, *own_context.shape[1:])
        image_out[group.rows.unsqueeze(1), index.unsqueeze(0)] = own
        if own_context is not None:
            assert context_out is not None
            context_out[group.rows] = own_context
    assert image_out is not None
    return image_out if context_out is None else (image_out, context_out)
