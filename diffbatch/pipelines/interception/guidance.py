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
    from diffbatch.pipelines.interface import DiffusionRequestBatch, PipelineInfo


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


def wave_guidance_scale(batch: DiffusionRequestBatch, info: PipelineInfo) -> float | None:
    """The wave's `guidance_scale` argument: a float, one scale per sample, or None.

    NOTE: per-request guidance is a value passed as `guidance_scale`, not a
    subclass of the diffusers pipelines. Overriding the CFG step would mean copying
    each pipeline's whole `__call__` (the combine sits inside the denoising loop,
    and PixArt reads the argument, not a property), to drift with every diffusers
    release. The listed pipelines use the scale only as `guidance_scale > 1` and in
    `uncond + guidance_scale * (text - uncond)`; `PerSampleGuidance` is a float for
    the first and a per-sample [B*n, 1, 1, 1] scale for the second, so the loop,
    guidance rescale (per-sample std) and every other option run unchanged, and a
    use it does not expect raises instead of mixing scales. A wave whose requests
    all share one scale gets a plain float: the path a solo run takes.
    """
    if not info.uses_guidance_scale:  # ignored by this pipeline (Qwen-Image): not passed
        return None
    scales = [p.guidance_scale for p in batch.sampling_params_list]
    key = batch.key
    if key is not None and key.guidance_scale is not None:
        return key.guidance_scale
    if len(set(scales)) == 1:  # None: unresolved params, the pipeline's default
        return scales[0]
    # The key left the scale out: the engine trusts this pipeline with per-request
    # guidance, and every request of the wave has CFG on.
    if key is None or not info.supports_per_request_guidance \
            or not key.cfg_enabled:
        raise ValueError(
            f"the wave mixes guidance scales {list(dict.fromkeys(scales))} but "
            f"{info.name} cannot apply per-request guidance here "
            "(supports_per_request_guidance="
            f"{info.supports_per_request_guidance}, "
            f"cfg_enabled={key.cfg_enabled if key is not None else None})"
        )
    return PerSampleGuidance.from_batch(batch)
