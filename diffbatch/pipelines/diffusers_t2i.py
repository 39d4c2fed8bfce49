"""The batch-capable adapter over real diffusers text-to-image pipelines.

`DiffusersT2IPipeline` runs a whole wave as ONE diffusers call: the wave's prompts as
a list, per-request negative prompts, `num_images_per_prompt = n` and one generator
per output image (B*n, request 0's n first). Every sample draws its noise from its
own generator, so a request's images do not depend on its batch mates (batch
invariance, checked in tests/pipelines/test_diffusers_t2i.py for SD, SD3, Flux and
PixArt-Sigma).

For pipelines whose CFG combine is `uncond + guidance_scale * (text - uncond)`
(StableDiffusion, SD3, PixArt-Sigma) the adapter also applies each request's own
`guidance_scale` per sample (`PerSampleGuidance`), so requests that differ only in
their guidance scale share a wave (tests/pipelines/test_per_request_guidance.py).

Partial images (previews of requests that asked for them, `SamplingParams.partial_images`)
are taken from the per-step callback the adapter installs anyway, inside the same call
(`diffusers_previews.py`).

Edits (image-to-image and inpainting) run on pipelines built from the loaded one's
own components (`diffusers_edit.py`), one call per wave as well, on the pipeline of
the wave's task.

`DiffusersPerRequestPipeline` is the same adapter restricted to one request per
forward; the registry binds it to a raw diffusers class given as `pipeline_class`.

Loading lives in `diffusers_loading.py`, the `PipelineInfo` in `diffusers_info.py`,
LoRA adapters in `diffusers_lora.py`, what particular pipelines need in
`diffusers_quirks.py`, waves of several sizes in `mixed_sizes.py`, and every change to
what a diffusers module does in `interception/`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch

from diffbatch.compile import CompileSettings
from diffbatch.outputs import DiffusionOutput
from diffbatch.pipelines import family_rules
from diffbatch.pipelines.diffusers_compile import compile_pipe
from diffbatch.pipelines.diffusers_edit import (
    at_least_one_step,
    call_parameters,
    edit_inputs,
    edit_pipes,
)
from diffbatch.pipelines.diffusers_info import call_default, image_info
from diffbatch.pipelines.diffusers_loading import (
    load_diffusers_pipe,
    resolve_device,
    resolve_dtype,
)
from diffbatch.pipelines.diffusers_lora import DENOISERS, TEXT_ENCODERS, DiffusersLoras
from diffbatch.pipelines.diffusers_previews import DiffusersPreviews, step_callbacks
from diffbatch.pipelines.diffusers_quirks import apply_quirks, cfg_copies, uses_negative_prompt
from diffbatch.pipelines.interception import (
    FusionPoint,
    RowPlan,
    pin_execution_device,
    pinned_device,
    row_plan,
)
from diffbatch.pipelines.interception.compiled import CompileStats
from diffbatch.pipelines.interception.guidance import wave_guidance_scale
from diffbatch.pipelines.interception.rows import CallRows
from diffbatch.pipelines.interception.scheduler_fusion import scheduler_point, wrap_scheduler
from diffbatch.pipelines.interception.step_cache import StepCache
from diffbatch.pipelines.interface import BasePipeline, DiffusionRequestBatch, PipelineInfo
from diffbatch.pipelines.mixed_sizes import MixedSizes, packable, request_size
from diffbatch.sampling_params import LoraStack

__all__ = ["DiffusersPerRequestPipeline", "DiffusersT2IPipeline", "resolve_device",
           "resolve_dtype"]

logger = logging.getLogger(__name__)

# Denoiser keyword arguments without a batch dimension (Flux's position ids).
_SHARED_ARGUMENTS = frozenset({"txt_ids", "img_ids"})


class DiffusersT2IPipeline(BasePipeline):
    """Runs waves of text-to-image requests through one diffusers pipeline call each."""

    supports_request_batch: ClassVar[bool] = True
    supports_step_execution: ClassVar[bool] = True
    # The diffusers class to load with; None auto-detects it from model_index.json.
    diffusers_class: ClassVar[type | None] = None

    def __init__(self, pipe: Any, *, device: str = "cpu",
                 defaults: dict[str, Any] | None = None) -> None:
        pin_execution_device(pipe)  # found once, not at every call (execution_device.py)
        self.pipe = pipe
        self.device = device
        self.defaults = dict(defaults or {})
        self._call_params = inspect.signature(type(pipe).__call__).parameters
        self.loras = DiffusersLoras(pipe)
        self._wave_stacks: list[LoraStack] | None = None  # `set_lora_wave`'s, if given
        # task -> the diffusers pipeline that runs it; edits share `pipe`'s modules
        self.task_pipes: dict[str, Any] = {"text-to-image": pipe}
        self.task_pipes.update(edit_pipes(pipe, self._make_info().size_multiple))
        self._info = self._make_info()
        # Step mode runs forward() of many requests interleaved: each call then gets a
        # copy of its pipeline with a scheduler of its own, whose `step` is fused with
        # the other requests' at this point (set by step_fusion_points).
        self._scheduler_point: FusionPoint | None = None
        # Waves of several sizes (transformers only, `mixed_sizes.py`).
        self._sizes = MixedSizes(pipe)
        # Per-request step caching (transformers only), made at the first caching request.
        self._step_cache: StepCache | None = None

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, model: str, *, device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None, diffusers_class: type | None = None,
        **kwargs: Any,
    ) -> DiffusersT2IPipeline:
        """Load a diffusers pipeline from a local folder or a hub id.

        Args:
            model: a diffusers folder (with model_index.json) or a hub id; resolve
                built-in names first with `registry.resolve_model_path`.
            device: where to run; None picks "cuda" when available, else "cpu".
            dtype: weights dtype (torch.dtype or "float32"/"bf16"/...); None = float32.
            diffusers_class: the diffusers class to load with; None reads it from
                model_index.json (`DiffusionPipeline.from_pretrained`).
            **kwargs: passed on to diffusers' `from_pretrained`.
        """
        pipe, device, defaults = load_diffusers_pipe(
            model, device, dtype, diffusers_class or cls.diffusers_class, **kwargs)
        return cls(pipe, device=device, defaults=defaults)

    # -- info ------------------------------------------------------------------------
    def info(self) -> PipelineInfo:
        return self._info

    def _make_info(self) -> PipelineInfo:
        return image_info(self.pipe, call_params=self._call_params, defaults=self.defaults,
                          device=self.device, task_pipes=self.task_pipes,
                          supports_step_execution=self.supports_step_execution)

    def _call_default(self, name: str, fallback: Any) -> Any:
        return call_default(self._call_params, name, fallback)

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """Run the wave as one diffusers call and split the images per request.

        Args:
            batch: the wave; all requests share one `SamplingParamsKey`, and
                `batch.generators` holds B*n generators (request 0's n first).

        Returns:
            One `DiffusionOutput` per request, in order, with `images` a CPU float32
            tensor [n, C, H, W] in [0, 1].
        """
        # 1. Check the wave.
        n = batch.num_outputs_per_prompt
        keys = {r.key for r in batch.requests}
        if len(keys) != 1:
            raise ValueError(f"a wave must share one SamplingParamsKey, got {len(keys)} keys")
        if batch.generators and len(batch.generators) != len(batch) * n:
            raise ValueError(
                f"the wave has {len(batch)} requests x {n} images but "
                f"{len(batch.generators)} generators; pass one generator per image"
            )
        batch.check_interrupt()
        if batch.lora_stacks is None and self._wave_stacks is not None:
            batch = replace(batch, lora_stacks=list(self._wave_stacks))
        if batch.lora_stacks is not None:
            if len(batch.lora_stacks) != len(batch):
                raise ValueError(f"the wave has {len(batch)} requests but "
                                 f"{len(batch.lora_stacks)} LoRA stacks")
            self.loras.check(batch.lora_stacks)
        if len({request_size(r) for r in batch.requests}) > 1:
            if not packable(self.pipe) or \
                    batch.requests[0].sampling_params.task != "text-to-image":
                raise ValueError(
                    f"{self._info.name} cannot run requests of different sizes in one "
                    "wave (supports_mixed_resolution is False, or an edit wave)")
            return self._sizes.forward(batch, self._fusion_points, functools.partial(
                self._forward_call, interrupt=True))
        # step mode takes a cancelled request out itself
        return self._forward_call(batch, self._scheduler_point,
                                  interrupt=self._scheduler_point is None)

    def _forward_call(self, batch: DiffusionRequestBatch, point: FusionPoint | None, *,
                      interrupt: bool) -> list[DiffusionOutput]:
        """One diffusers call for the wave (one size), on the pipeline of its task,
        stopped between steps once nobody waits for it (with `interrupt`). With a
        scheduler `point`, the call runs on a pipeline copy whose own scheduler's
        steps go through that point (step mode; several sizes in one wave). Its row
        plan states each row's LoRA stack (`interception/rows.py`)."""
        n = batch.num_outputs_per_prompt
        pipe = self._task_pipe(batch)
        if point is not None:
            pipe = copy.copy(pipe)
            pipe.scheduler = copy.deepcopy(pipe.scheduler)
            wrap_scheduler(point, pipe.scheduler)
        previews = DiffusersPreviews.for_wave(batch, pipe)
        kwargs = {**self.call_kwargs(batch),
                  **self._step_hooks(batch, pipe, previews, interrupt=interrupt)}
        caching = self._caching(batch)
        stacks = batch.lora_stacks if batch.lora_stacks and any(batch.lora_stacks) else None
        # The row plan says each row's request and adapters; the step cache reads the
        # requests of every call (a non-caching request's too: in step mode a caching
        # request may join a call that started before any request cached).
        plan = None if stacks is None and self._info.step_cache_unsupported else RowPlan(
            tuple(batch.request_ids), tuple(stacks or [()] * len(batch)), n,
            cfg_copies(call_parameters(pipe), kwargs.get("guidance_scale")))
        with previews.capturing() if previews is not None else contextlib.nullcontext(), \
                pinned_device(), row_plan(plan), caching as caches:
            images = pipe(**kwargs).images  # [B*n, C, H, W] in [0, 1]
        if not isinstance(images, torch.Tensor) or images.shape[0] != len(batch) * n:
            raise ValueError(
                f"{self._info.name} returned {getattr(images, 'shape', type(images))}, "
                f"expected a tensor with {len(batch) * n} images"
            )
        # Split per request (clone: a view would carry the whole wave's storage).
        images = images.detach().to("cpu", torch.float32)
        outputs = [
            DiffusionOutput(request_id=r.request_id, images=images[i * n:(i + 1) * n].clone())
            for i, r in enumerate(batch.requests)
        ]
        for output in outputs:
            cache = caches.get(output.request_id)
            if cache is not None:
                output.computed_steps = cache.computed_steps
                output.cached_steps = cache.cached_steps
        return outputs

    def _caching(self, batch: DiffusionRequestBatch) -> Any:
        """The step caches of the batch's caching requests, open for its call
        (a context yielding request id -> `RequestCache`)."""
        configs = {r.request_id: r.sampling_params.step_cache for r in batch.requests
                   if r.sampling_params.step_cache is not None
                   and r.sampling_params.step_cache.enabled}
        if not configs:
            return contextlib.nullcontext({})
        if self._step_cache is None:
            reason = self._info.step_cache_unsupported
            if reason is not None:  # the engine refuses these at admission
                raise ValueError(reason)
            sizes = self._sizes
            self._step_cache = StepCache(self.pipe.transformer, packed=sizes.packing)
        return self._step_cache.open(configs)

    def compile(self, settings: CompileSettings, run_once: Callable[[], Any]) -> CompileStats:
        """Compile the denoiser (and VAE decoder) per bucket (`diffusers_compile.py`)."""
        return compile_pipe(self.pipe, settings, run_once, eager_reason=self._eager_reason,
                            shared=_SHARED_ARGUMENTS)

    def _eager_reason(self, rows: CallRows | None) -> str | None:
        """Why a denoiser call must run the original module (None: compiled)."""
        if self._sizes.packing():
            return "packed"
        if rows is None:
            return None
        if any(rows.stacks):
            return "lora"
        if self._step_cache is not None and rows.requests is not None \
                and self._step_cache.caches_any(rows.requests):
            return "step_cache"
        return None

    def step_fusion_points(self) -> list[FusionPoint]:
        """Step mode: fuse the denoiser and the scheduler steps per tick, the text
        encoders and the VAE decoder at joins and leaves (see
        `diffbatch.pipelines.interception`)."""
        points = self._fusion_points()
        self._scheduler_point = scheduler_point()
        return points

    def _fusion_points(self) -> list[FusionPoint]:
        """The denoiser (packing sizes where `TokenPacker` can), the text encoders
        and the VAE decoder."""
        pipe, points = self.pipe, []
        pack = self._sizes.pack_calls if packable(pipe) else None
        for name in DENOISERS:
            module = getattr(pipe, name, None)
            if module is not None:
                points.append(FusionPoint(module, "forward", "step", name, _SHARED_ARGUMENTS,
                                          pack=pack if name == "transformer" else None))
        for name in TEXT_ENCODERS:
            module = getattr(pipe, name, None)
            if module is not None:
                points.append(FusionPoint(module, "forward", "boundary", name))
        vae = getattr(pipe, "vae", None)
        if vae is not None and hasattr(vae, "decode"):
            points.append(FusionPoint(vae, "decode", "boundary", "vae.decode"))
        if not any(p.kind == "step" for p in points):
            raise ValueError(f"{self._info.name} has no unet or transformer to run step-wise")
        return points

    def _task_pipe(self, batch: DiffusionRequestBatch) -> Any:
        task = batch.requests[0].sampling_params.task
        pipe = self.task_pipes.get(task)
        if pipe is None:  # the engine refuses these at admission (PipelineInfo)
            raise ValueError(f"{self._info.name} has no {task} pipeline")
        return pipe

    def call_kwargs(self, batch: DiffusionRequestBatch) -> dict[str, Any]:
        """The keyword arguments of the wave's one diffusers call (without running it)."""
        params = batch.requests[0].sampling_params
        key = batch.key
        extra = dict(params.extra)
        call_params = call_parameters(self._task_pipe(batch))
        kwargs: dict[str, Any] = {
            "prompt": batch.prompts,
            "num_images_per_prompt": batch.num_outputs_per_prompt,
            "generator": list(batch.generators) or None,
            "output_type": "pt",
            "return_dict": True,
        }
        # 1. Shape and schedule from the requests' resolved params (the wave key holds
        #    them too, but step mode's key leaves the schedule out). SD's image-to-image
        #    takes no height/width: its size is the image's.
        for name in ("height", "width", "num_inference_steps"):
            value = getattr(params, name)
            if value is not None and name in call_params:
                kwargs[name] = value
        guidance_scale = wave_guidance_scale(batch, self._info)
        if guidance_scale is not None:
            kwargs["guidance_scale"] = guidance_scale
        # NOTE: the engine checked the size multiple (Flux would silently resize, PixArt
        # crash), sigmas/timesteps and the extras against `info().call_arguments` at
        # admission; a wave never carries anything else.
        for name in ("sigmas", "timesteps"):
            value = getattr(params, name)
            if value is not None:
                kwargs[name] = list(value)
        # 2. Model-specific extras (names this pipeline's __call__ takes; the engine
        #    checked them against the text-to-image pipeline's).
        unknown = sorted(set(extra) - set(call_params))
        if unknown:
            raise ValueError(f"{type(self._task_pipe(batch)).__name__} does not take the "
                             f"`extra` argument(s) {unknown}")
        kwargs.update(extra)
        # 3. Per-request negative prompts, a list like the prompts (SD rejects a string
        #    negative prompt beside a list prompt). A wave without any passes none,
        #    as the plain call would (SDXL's zero embeddings, Qwen-Image's true CFG
        #    off); a wave that mixes them fills in what "none" means on this pipeline
        #    (the key keeps them apart where none and "" differ).
        negatives = batch.negative_prompts
        if "negative_prompt" in call_params and self._uses_negative_prompt(extra, key) \
                and any(p is not None for p in negatives):
            kwargs["negative_prompt"] = family_rules.negative_prompts(
                self.pipe, self._info, negatives)
        # 4. Edits: each request's image (and mask), its strength.
        if params.task != "text-to-image":
            kwargs.update(edit_inputs(batch))
            strength = params.strength
            if strength is None and key is not None:
                strength = key.strength
            steps = kwargs.get("num_inference_steps", params.num_inference_steps)
            kwargs["strength"] = at_least_one_step(strength, steps)
        # 5. Pipeline quirks.
        apply_quirks(self.pipe, kwargs, extra, call_params)
        return kwargs

    def _step_hooks(self, batch: DiffusionRequestBatch, pipe: Any,
                    previews: DiffusersPreviews | None, *, interrupt: bool = True,
                    ) -> dict[str, Any]:
        """The call's per-step callback arguments (`diffusers_previews.step_callbacks`)."""
        return step_callbacks(batch, pipe, previews, interrupt=interrupt)

    def _uses_negative_prompt(self, extra: dict[str, Any], key: Any = None) -> bool:
        return uses_negative_prompt(self._call_params, self._true_cfg_default(), extra, key)

    def _true_cfg_default(self) -> float:
        """The call's own `true_cfg_scale` (1.0 for Flux: off; 4.0 for QwenImage: on)."""
        return float(self._call_default("true_cfg_scale", 1.0))

    # -- LoRA ------------------------------------------------------------------------
    def load_lora(self, name: str, weights: str | dict[str, torch.Tensor]) -> int | None:
        """Load the adapter `weights` (a path, or the tensors of one already read) under
        `name` (once); returns the layers it touches. See `diffusers_lora.py`."""
        return self.loras.load(name, weights)

    def unload_lora(self, name: str) -> None:
        """Take adapter `name` out of the model (its memory is freed)."""
        self.loras.unload(name)

    def set_lora_wave(self, stacks: list[LoraStack] | None, num_outputs_per_prompt: int) -> None:
        """The next forwards' per-request adapter stacks, in wave order, for batches
        that do not carry their own (`DiffusionRequestBatch.lora_stacks`)."""
        if stacks is None or not any(stacks):
            self._wave_stacks = None
            return
        self.loras.check(stacks)
        self._wave_stacks = list(stacks)


class DiffusersPerRequestPipeline(DiffusersT2IPipeline):
    """The diffusers adapter for a class that cannot batch: one request per forward."""

    supports_request_batch: ClassVar[bool] = False
    supports_step_execution: ClassVar[bool] = False  # fusing its calls would batch them

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        if len(batch) != 1:
            raise ValueError(
                f"{type(self).__name__} runs one request per forward "
                f"(supports_request_batch=False), got a batch of {len(batch)}; use "
                "DiffusersT2IPipeline or max_num_seqs=1"
            )
        return super().forward(batch)

