"""The batch-capable adapter over diffusers text-to-video pipelines (Wan, LTX-Video).

`DiffusersVideoPipeline` runs a wave of video requests that share a key (size,
frames, steps, guidance) as ONE diffusers call, like `DiffusersT2IPipeline` does for
images: the prompts as a list, per-request negative prompts, `num_videos_per_prompt
= n` and one generator per output video (B*n, request 0's n first). Wan draws each
sample's latent noise from its own generator and treats samples independently in its
text encoder, transformer and VAE, so a request's clip does not depend on its batch
mates (tests/pipelines/test_diffusers_video.py); LTX-Video likewise.

A request's frame count is `extra["num_frames"]` (the engine fills in the model's
default); it is part of the batch key, so clips of different lengths never share a
call. Outputs are float tensors [n, F, C, H, W] in [0, 1].

Step mode (joins and leaves between denoising steps) uses the same fusion points as
images: the transformer's calls of all running requests are fused per tick (Wan calls
it once for the conditional and once for the unconditional half, each fused), the
text encoder and the VAE decoder at joins and leaves.

Video families are chosen by `video_family`: the ones listed in `SUPPORTED_FAMILIES`
are served, the other video pipelines diffusers ships are refused at load with a
message that says why (see docs/serving.md, "Video models").
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from diffbatch.errors import ModelLoadError
from diffbatch.outputs import DiffusionOutput, PartialImage
from diffbatch.pipelines.diffusers_info import CALLBACK_ARGUMENTS, RESERVED_ARGUMENTS
from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interception.scheduler_fusion import wrap_scheduler
from diffbatch.pipelines.interface import DiffusionRequestBatch, PipelineInfo
from diffbatch.pipelines.schedule_limits import schedulable_steps

# diffusers text-to-video classes served by this adapter (tested with `tiny-wan` and
# `tiny-ltx`).
SUPPORTED_FAMILIES = frozenset({"WanPipeline", "LTXPipeline"})
# Video classes diffusers ships that this adapter does not serve, with the reason.
REFUSED_FAMILIES: dict[str, str] = {
    "WanImageToVideoPipeline": "image-to-video is not served yet: diffusers' call encodes "
                               "one conditioning image for its whole batch, so requests "
                               "with different images cannot share a call",
    "LTXImageToVideoPipeline": "image-to-video is not served yet",
    "CogVideoXPipeline": "not validated with the video adapter yet (no tiny CogVideoX "
                         "model)",
    "CogVideoXImageToVideoPipeline": "image-to-video is not served yet",
    "HunyuanVideoPipeline": "not validated with the video adapter yet; its true CFG and "
                            "two text encoders need their own checks",
    "HunyuanVideoImageToVideoPipeline": "image-to-video is not served yet",
}
# Most frames one request may ask for, whatever the model: Wan 2.1 is trained on 81.
MAX_NUM_FRAMES = 257
# Call arguments the adapter fills in itself (besides the image adapter's).
_VIDEO_RESERVED = frozenset({"num_videos_per_prompt", "num_frames", "output_type"})


def video_family(model_index: dict[str, Any]) -> str | None:
    """The diffusers class a model_index.json names when it is a video pipeline this
    module knows (served or refused); None for anything else (images)."""
    name = model_index.get("_class_name")
    if name in SUPPORTED_FAMILIES or name in REFUSED_FAMILIES:
        return str(name)
    return None


def check_video_family(name: str) -> None:
    """Raise `ModelLoadError` for a video family that is refused, saying why."""
    if name in REFUSED_FAMILIES:
        raise ModelLoadError(
            f"{name} models are not served by diffbatch: {REFUSED_FAMILIES[name]}; "
            f"served video families: {', '.join(sorted(SUPPORTED_FAMILIES))}")


class DiffusersVideoPipeline(DiffusersT2IPipeline):
    """Runs waves of text-to-video requests through one diffusers pipeline call each."""

    supports_request_batch: ClassVar[bool] = True
    supports_step_execution: ClassVar[bool] = True

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> DiffusersVideoPipeline:
        pipeline = super().from_pretrained(model, **kwargs)
        assert isinstance(pipeline, DiffusersVideoPipeline)
        check_video_family(type(pipeline.pipe).__name__)
        if type(pipeline.pipe).__name__ not in SUPPORTED_FAMILIES:
            raise ModelLoadError(
                f"{type(pipeline.pipe).__name__} is not a video pipeline diffbatch serves; "
                f"served video families: {', '.join(sorted(SUPPORTED_FAMILIES))}")
        return pipeline

    # -- info ------------------------------------------------------------------------
    def _make_info(self) -> PipelineInfo:
        pipe, d = self.pipe, self.defaults
        # Wan names the VAE's compression `vae_scale_factor_*`, LTX
        # `vae_*_compression_ratio`; Wan's patch is (t, h, w), LTX's one spatial side.
        spatial = int(getattr(pipe, "vae_scale_factor_spatial", None)
                      or getattr(pipe, "vae_spatial_compression_ratio", 8))  # type: ignore[arg-type]
        temporal = int(getattr(pipe, "vae_scale_factor_temporal", None)
                       or getattr(pipe, "vae_temporal_compression_ratio", 4))  # type: ignore[arg-type]
        patch = pipe.transformer.config.get("patch_size", 1)
        multiple = spatial * int(patch[-1] if isinstance(patch, list | tuple) else patch)
        call_arguments = frozenset(
            name for name in self._call_params
            if name not in _VIDEO_RESERVED and name not in RESERVED_ARGUMENTS
        ) - CALLBACK_ARGUMENTS - {"max_sequence_length"}
        max_tokens = int(self._max_sequence_length())
        tokenizer = getattr(pipe, "tokenizer", None)
        folder = getattr(tokenizer, "name_or_path", None)
        return PipelineInfo(
            name=type(pipe).__name__,
            default_height=int(d.get("height", self._call_default("height", 480))),
            default_width=int(d.get("width", self._call_default("width", 832))),
            default_num_inference_steps=int(d.get(
                "num_inference_steps", self._call_default("num_inference_steps", 50))),
            default_guidance_scale=float(d.get(
                "guidance_scale", self._call_default("guidance_scale", 5.0))),
            size_multiple=int(d.get("size_multiple", multiple)),
            device=self.device,
            cfg_threshold=1.0,
            supports_step_execution=self.supports_step_execution,
            model_max_pixels=int(d["model_max_pixels"]) if "model_max_pixels" in d else None,
            max_inference_steps=schedulable_steps(pipe.scheduler),
            call_arguments=call_arguments | {"num_frames"},
            negative_prompt="yes",
            prompt_tokenizer=folder if isinstance(folder, str) else None,
            max_prompt_tokens=max_tokens if isinstance(folder, str) else None,
            default_num_frames=int(d.get("num_frames", self._call_default("num_frames", 81))),
            frame_multiple=temporal,
            max_num_frames=int(d.get("max_num_frames", MAX_NUM_FRAMES)),
            # LTX takes the frame rate (its positions scale with it): its default
            default_fps=int(d.get("fps", self._call_default("frame_rate", 16))),
        )

    def _max_sequence_length(self) -> int:
        """The prompt tokens the text encoder reads (the model folder's serving default,
        else the call's own); the server refuses a longer prompt instead of cutting it."""
        return int(self.defaults.get("max_sequence_length",
                                     self._call_default("max_sequence_length", 512)))

    # -- forward ---------------------------------------------------------------------
    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """Run the wave as one diffusers call and split the clips per request.

        Returns:
            One `DiffusionOutput` per request, in order, with `images` a CPU float32
            tensor [n, F, C, H, W] in [0, 1].
        """
        n = batch.num_outputs_per_prompt
        keys = {r.key for r in batch.requests}
        if len(keys) != 1:
            raise ValueError(f"a wave must share one SamplingParamsKey, got {len(keys)} keys")
        if batch.generators and len(batch.generators) != len(batch) * n:
            raise ValueError(
                f"the wave has {len(batch)} requests x {n} videos but "
                f"{len(batch.generators)} generators; pass one generator per video")
        if batch.requests[0].sampling_params.task != "text-to-image":
            raise ValueError(f"{self._info.name} runs text-to-video requests only")
        batch.check_interrupt()
        point = self._scheduler_point
        pipe = self.pipe
        if point is not None:  # step mode: a scheduler of its own, stepped fused
            pipe = copy.copy(pipe)
            pipe.scheduler = copy.deepcopy(pipe.scheduler)
            wrap_scheduler(point, pipe.scheduler)
        kwargs = {**self.call_kwargs(batch),
                  **self._progress_hook(batch, interrupt=point is None)}
        frames = pipe(**kwargs).frames  # [B*n, F, C, H, W] in [0, 1]
        if not isinstance(frames, torch.Tensor) or frames.ndim != 5 \
                or frames.shape[0] != len(batch) * n:
            raise ValueError(
                f"{self._info.name} returned {getattr(frames, 'shape', type(frames))}, "
                f"expected a tensor of {len(batch) * n} videos [F, C, H, W]")
        frames = frames.detach().to("cpu", torch.float32)
        return [DiffusionOutput(request_id=r.request_id,
                                images=frames[i * n:(i + 1) * n].clone())
                for i, r in enumerate(batch.requests)]

    def _progress_hook(self, batch: DiffusionRequestBatch, *, interrupt: bool
                       ) -> dict[str, Any]:
        """The per-step hook: it stops the loop once nobody waits for the wave (with
        `interrupt`, as the image adapter's does), and tells each request that asked for
        previews (`partial_images` > 0) how many steps are done, as a `PartialImage`
        without an image: a video's progress, cheap where decoding a preview clip is
        not: one with `step` 0 when the call starts (the request runs), then one after
        each step but the last (the finished clip follows)."""
        send = batch.on_partial_image
        listeners = [r.request_id for r in batch.requests
                     if r.sampling_params.partial_images > 0] if send is not None else []
        num_steps = int(batch.requests[0].sampling_params.num_inference_steps or 0)

        def tell(done: int) -> None:
            if send is None:
                return
            for request_id in listeners:
                send(PartialImage(request_id=request_id, index=done, image_index=0,
                                  step=done, num_steps=num_steps, image=None))

        def on_step_end(pipe: Any, step: int, timestep: Any,
                        callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            if interrupt:
                batch.check_interrupt()
            if step + 1 < num_steps:
                tell(step + 1)
            return callback_kwargs

        tell(0)

        return {"callback_on_step_end": on_step_end}

    def call_kwargs(self, batch: DiffusionRequestBatch) -> dict[str, Any]:
        """The image adapter's arguments, in the video call's names: `n` is
        `num_videos_per_prompt`, the frames come from the request's extras."""
        params = batch.requests[0].sampling_params
        kwargs = super().call_kwargs(batch)
        kwargs["num_videos_per_prompt"] = kwargs.pop("num_images_per_prompt")
        frames = params.extra.get("num_frames", self._info.default_num_frames)
        assert frames is not None  # a video pipeline's info always has a default
        kwargs["num_frames"] = int(frames)
        kwargs.setdefault("max_sequence_length", self._max_sequence_length())
        return kwargs
