"""Per-sample LoRA adapters in one forward: every sample adds its own adapters' deltas.

Adapters are loaded the usual way (diffusers' `load_lora_weights`, i.e. PEFT layers in
the denoiser and the text encoders), but PEFT's own application stays disabled: a
forward hook on each PEFT LoRA `Linear` adds the deltas itself, per sample, in the
gathered formulation of Punica and S-LoRA. Each resident adapter owns a slot (slot 0
is "no adapter", all zeros); per layer the mixer keeps the slots' weights stacked,
A [S, r, in] and B [S, out, r] (B times PEFT's alpha/r), and a call computes

    A_s = A[idx]   # [N, K*r, in]: each sample's K adapters, concatenated along rank
    B_s = B[idx]   # [N, out, K*r]
    y  += ((x @ A_s^T) * scale) @ B_s^T   # two batched matmuls, whatever the mix

where `idx` [N, K] are the slots of each sample's stack (padded with slot 0) and
`scale` [N, K] its per-request scales. A stack of several adapters is the sum of their
deltas, exactly what PEFT computes for several active adapters.

Which sample carries which stack ("rows") is stated, never inferred: the pipeline
adapter gives each diffusers call a row plan, each root module (denoiser, text
encoders) takes its rows from it, and a fused call of several tasks runs with their
rows concatenated (`rows.py`). Each layer's hook reads the current call's rows.

Once an adapter's weights are stacked, PEFT's own copy of them is freed: its
`lora_A`/`lora_B` weights keep their shape but no storage (PEFT's application is
off, so nothing reads them; unloading deletes them the PEFT way).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffbatch.pipelines.interception.rows import CallRows, RowLayout, current_rows, track_rows
from diffbatch.sampling_params import LoraStack

logger = logging.getLogger(__name__)


class UnsupportedAdapterError(ValueError):
    """The adapter has layers the gathered path cannot apply (DoRA, conv, embedding)."""


@dataclass
class _Rows:
    """Which adapters each row of the current module call carries."""

    idx: torch.Tensor  # [N, K] int64 slots (0: none)
    scale: torch.Tensor  # [N, K] float32
    slots: frozenset[int]  # the nonzero slots used
    _on: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = None

    def on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._on is None:
            self._on = {}
        cached = self._on.get((device, dtype))
        if cached is None:
            cached = self._on[(device, dtype)] = (self.idx.to(device),
                                                  self.scale.to(device, dtype))
        return cached


class _LayerWeights:
    """One PEFT LoRA Linear's adapters, stacked by slot."""

    def __init__(self, layer: Any) -> None:
        base = layer.get_base_layer()
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.device, self.dtype = base.weight.device, base.weight.dtype
        self.rank = 0
        self.A = torch.zeros(1, 0, self.in_features, device=self.device, dtype=self.dtype)
        self.B = torch.zeros(1, self.out_features, 0, device=self.device, dtype=self.dtype)
        self.slots: set[int] = set()

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Store adapter weights a [r, in], b [out, r] (already scaled) at `slot`."""
        r = int(a.shape[0])
        self.grow(slot + 1, r)
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.A[slot, :r] = a.to(self.device, self.dtype)
        self.B[slot, :, :r] = b.to(self.device, self.dtype)
        self.slots.add(slot)

    def grow(self, size: int, rank: int = 0) -> None:
        """Room for slots 0..size-1 of rank `rank` (new room is zeros: no delta)."""
        size = max(self.A.shape[0], size)
        rank = max(self.rank, rank)
        if size != self.A.shape[0] or rank != self.rank:
            A = torch.zeros(size, rank, self.in_features, device=self.device, dtype=self.dtype)
            B = torch.zeros(size, self.out_features, rank, device=self.device, dtype=self.dtype)
            A[: self.A.shape[0], : self.rank] = self.A
            B[: self.B.shape[0], :, : self.rank] = self.B
            self.A, self.B, self.rank = A, B, rank

    def clear(self, slot: int) -> None:
        if slot in self.slots:
            self.A[slot].zero_()
            self.B[slot].zero_()
            self.slots.discard(slot)


class LoraMixer:
    """The per-sample adapter state of one pipeline; see the module docstring."""

    def __init__(self, roots: dict[str, tuple[torch.nn.Module, RowLayout]]) -> None:
        self._roots = roots
        self._slots: dict[str, int] = {}  # adapter name -> slot (>= 1)
        self._layers: dict[torch.nn.Module, _LayerWeights] = {}
        self._version = 0  # bumped when slots change: rows made before are stale
        for name, (module, layout) in roots.items():
            track_rows(module, layout, name)

    # -- adapters --------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        return list(self._slots)

    def add(self, name: str) -> None:
        """Take adapter `name` (just loaded into the roots by PEFT) into the gathered
        weights; raises `UnsupportedAdapterError` for layers it cannot apply."""
        from peft.tuners.lora import LoraLayer

        found: list[Any] = []  # PEFT LoRA layers holding the adapter
        for root, _layout in self._roots.values():
            for module in root.modules():
                if isinstance(module, LoraLayer) and name in module.lora_A:
                    found.append(module)
        for module in found:
            if module.use_dora.get(name, False):
                raise UnsupportedAdapterError(f"DoRA layers are not supported (adapter {name!r})")
            if not isinstance(module.lora_A[name], torch.nn.Linear) or \
                    not isinstance(module.get_base_layer(), torch.nn.Linear):
                raise UnsupportedAdapterError(
                    f"only LoRA on Linear layers is supported; adapter {name!r} has a "
                    f"{type(module.get_base_layer()).__name__} layer")
            if getattr(module, "lora_bias", {}).get(name, False):
                raise UnsupportedAdapterError(f"LoRA bias is not supported (adapter {name!r})")
        used = set(self._slots.values())
        slot = next(i for i in range(1, len(used) + 2) if i not in used)
        for module in found:
            weights = self._layers.get(module)
            if weights is None:
                weights = self._layers[module] = _LayerWeights(module)
                module.register_forward_hook(self._layer_hook)
            a = module.lora_A[name].weight.detach()  # [r, in]
            b = module.lora_B[name].weight.detach() * float(module.scaling[name])  # [out, r]
            weights.put(slot, a, b)
        for weights in self._layers.values():  # every layer gathers any slot
            weights.grow(slot + 1)
        for module in found:  # stacked: PEFT's copy is no longer read
            for weight in (module.lora_A[name].weight, module.lora_B[name].weight):
                weight.data = weight.data.new_empty(()).expand(weight.shape)
        self._slots[name] = slot
        self._version += 1

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name, None)
        if slot is not None:
            for weights in self._layers.values():
                weights.clear(slot)
            self._version += 1

    # -- rows ------------------------------------------------------------------------
    def _check(self, stacks: Sequence[LoraStack]) -> None:
        missing = sorted({name for stack in stacks for name, _ in stack} - set(self._slots))
        if missing:
            raise KeyError(f"LoRA adapter(s) {missing} are not loaded")

    def check(self, stacks: Sequence[LoraStack]) -> None:
        """Raise `KeyError` naming the adapters of `stacks` that are not loaded."""
        self._check(stacks)

    def _tensor_rows(self, rows: CallRows) -> _Rows | None:
        """`rows` as slot and scale tensors (made once per rows and slot layout)."""
        key = (id(self), self._version)
        if key not in rows.cache:
            self._check(rows.stacks)
            rows.cache[key] = self._make_rows(rows.stacks)
        return rows.cache[key]

    def _make_rows(self, stacks: Sequence[LoraStack]) -> _Rows | None:
        if not any(stacks):
            return None
        width = max(len(s) for s in stacks)
        idx = torch.zeros(len(stacks), width, dtype=torch.int64)
        scale = torch.zeros(len(stacks), width, dtype=torch.float32)
        for row, stack in enumerate(stacks):
            for k, (name, s) in enumerate(stack):
                idx[row, k] = self._slots[name]
                scale[row, k] = s
        return _Rows(idx, scale, frozenset(int(i) for i in idx.unique().tolist()) - {0})

    # -- the delta -------------------------------------------------------------------
    def _layer_hook(self, module: Any, args: tuple[Any, ...], output: Any) -> Any:
        call = current_rows()
        if call is None:
            return output
        rows = self._tensor_rows(call)
        weights = self._layers[module]
        if rows is None or not (rows.slots & weights.slots):
            return output
        x = args[0]
        if x.shape[0] != rows.idx.shape[0]:
            raise RuntimeError(
                f"a LoRA layer got {x.shape[0]} rows, the call's per-sample adapters "
                f"{rows.idx.shape[0]}")
        idx, scale = rows.on(weights.device, weights.dtype)
        n, k = idx.shape
        r = weights.rank
        A = weights.A[idx].reshape(n, k * r, weights.in_features)  # [N, K*r, in]
        B = weights.B[idx].permute(0, 2, 1, 3).reshape(n, weights.out_features, k * r)
        h = torch.bmm(x.reshape(n, -1, weights.in_features).to(weights.dtype),
                      A.transpose(1, 2))  # [N, L, K*r]
        h = h * scale.repeat_interleave(r, dim=1).unsqueeze(1)
        delta = torch.bmm(h, B.transpose(1, 2))  # [N, L, out]
        return output + delta.reshape(output.shape).to(output.dtype)
