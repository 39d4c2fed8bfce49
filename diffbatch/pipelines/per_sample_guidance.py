"""Per-request guidance scales inside one diffusers call: `PerSampleGuidance`.

A wave's requests may ask for different `guidance_scale`s. The listed diffusers
pipelines use the scale only as `guidance_scale > 1` (CFG on) and in the CFG combine
`uncond + guidance_scale * (text - uncond)`, so a value that is a float to the
pipeline and one scale per sample to the tensor it multiplies gives each request its
own guidance in one fused call (`DiffusersT2IPipeline._guidance_scale` decides when).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffbatch.pipelines.interface import DiffusionRequestBatch


class PerSampleGuidance(float):
    """A guidance scale that is one float to the pipeline and one scale per sample to tensors.

    As a float it is the wave's smallest scale, so the pipelines' `guidance_scale > 1`
    check (CFG on) holds exactly when it holds for every request. Multiplied with a
    tensor whose first dimension is the wave's B*n samples, it scales sample i by
    `scales[i]`: `guidance_scale * (noise_pred_text - noise_pred_uncond)` in the CFG
    combine becomes per-request guidance. Any other tensor op with it (`tensor + g`,
    `torch.add(t, g)`) raises TypeError via `__torch_function__` instead of silently
    using one scale; plain-number uses (`float(g)`, `g - 1`) see the smallest scale.
    """

    scales: torch.Tensor  # [B*n] float32, one guidance scale per output image

    def __new__(cls, scales: Sequence[float]) -> PerSampleGuidance:
        if not scales:
            raise ValueError("PerSampleGuidance needs at least one scale")
        self = super().__new__(cls, min(scales))
        self.scales = torch.tensor([float(s) for s in scales], dtype=torch.float32)
        return self

    @classmethod
    def from_batch(cls, batch: DiffusionRequestBatch) -> PerSampleGuidance:
        """One scale per output image: each request's scale repeated n times, in order."""
        n = batch.num_outputs_per_prompt
        scales: list[float] = []
        for params in batch.sampling_params_list:
            if params.guidance_scale is None:
                raise ValueError("per-sample guidance needs resolved guidance scales, got None")
            scales += [float(params.guidance_scale)] * n
        return cls(scales)

    def __mul__(self, other: Any) -> Any:
        if not isinstance(other, torch.Tensor):
            return float(self) * other
        if other.ndim == 0 or other.shape[0] != self.scales.shape[0]:
            raise ValueError(
                f"per-sample guidance has {self.scales.shape[0]} scales but was multiplied "
                f"with a tensor of shape {tuple(other.shape)}; this pipeline uses "
                "guidance_scale outside the CFG combine and cannot take per-request guidance"
            )
        scales = self.scales.to(other.device).view(-1, *([1] * (other.ndim - 1)))
        # float32 product, then the tensor's dtype: what `float * tensor` computes too
        return (other * scales).to(other.dtype)

    __rmul__ = __mul__

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # `tensor * self` lands here first; NotImplemented sends Python to __rmul__,
        # and any other torch op with this value fails loudly instead of using one scale.
        return NotImplemented

    def __repr__(self) -> str:
        return f"PerSampleGuidance({[round(s, 6) for s in self.scales.tolist()]})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.scales.tolist(),))
