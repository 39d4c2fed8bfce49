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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import os
import warnings
from typing import Any, ClassVar, Literal

import torch

from diffbatch.errors import ConfigError, ModelNotFoundError
from diffbatch.outputs import DiffusionOutput
from diffbatch.pipelines import family_rules, library_logs
from diffbatch.pipelines.diffusers_edit import (
    at_least_one_step,
    call_parameters,
    edit_inputs,
    edit_pipes,
)
from diffbatch.pipelines.diffusers_previews import DiffusersPreviews
from diffbatch.pipelines.execution_device import pin_execution_device
from diffbatch.pipelines.interface import BasePipeline, DiffusionRequestBatch, PipelineInfo
from diffbatch.pipelines.lora_mixing import LoraMixer, RootLayout, Stack
from diffbatch.pipelines.mixed_sizes import request_size, run_together, split_by_size
from diffbatch.pipelines.model_folder import DEFAULTS_FILE, check_component_folders
from diffbatch.pipelines.packed_tokens import TokenPacker, packing_layout
from diffbatch.pipelines.per_sample_guidance import PerSampleGuidance
from diffbatch.pipelines.schedule_limits import schedulable_steps
from diffbatch.pipelines.scheduler_fusion import scheduler_point, wrap_scheduler
from diffbatch.pipelines.step_fusion import FusionPoint, ModuleCall, install

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Call arguments the adapter fills in itself; `SamplingParams.extra` may not set them.
_RESERVED = frozenset({
    "prompt", "negative_prompt", "num_images_per_prompt", "generator", "output_type",
    "return_dict", "height", "width", "num_inference_steps", "guidance_scale", "sigmas",
    "timesteps", "latents", "prompt_embeds", "negative_prompt_embeds", "image", "mask_image",
    "strength", "masked_image_latents",
})
# diffusers classes (exact, not subclasses: those may override __call__) whose only
# uses of `guidance_scale` in __call__ are a `> 1` check and the CFG combine
# `noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)`; read
# in diffusers 0.42 and tested with the tiny models. Add a class only after doing both.
_PER_SAMPLE_GUIDANCE_CLASSES = (
    "StableDiffusionPipeline", "StableDiffusion3Pipeline", "PixArtSigmaPipeline",
)
# The components step mode fuses: the denoiser once per tick, the rest at joins/leaves.
_DENOISERS = ("unet", "transformer")
_TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# Denoiser keyword arguments without a batch dimension (Flux's position ids).
_SHARED_ARGUMENTS = frozenset({"txt_ids", "img_ids"})


def resolve_device(device: str | torch.device | None) -> str:
    """None picks "cuda" when available, else "cpu"; a device this machine's torch
    cannot use is a `ConfigError` naming it (not torch's own assertion)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    name = str(device).strip().lower()
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ConfigError(
            f"device {name!r} is not available here (torch {torch.__version__}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); use "
            "--device cpu, or leave it out to use cuda when available", param="device",
        ) from None
    return name


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """None means float32 (diffusers' own default); strings like "bf16" are accepted."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ConfigError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")


# Installed on import: the builders in tiny.py and `from_pretrained` below both import
# diffusers pipeline modules, and both import this module first.
library_logs.install()


def _unscheduled(scheduler: Any) -> set[str]:
    """Of custom `sigmas` and `timesteps`, those the scheduler cannot take (its
    `set_timesteps` has no such parameter): the pipeline would accept them and then
    fail in the wave, so the engine refuses them when they are submitted."""
    try:
        accepted = inspect.signature(scheduler.set_timesteps).parameters
    except (AttributeError, TypeError, ValueError):
        return set()
    return {name for name in ("sigmas", "timesteps") if name not in accepted}


def _disable_progress_bars() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _load_model_index(model: str) -> dict[str, Any]:
    """Read model_index.json (local folder or hub), as a clear error if there is none."""
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(model))
    except Exception as exc:  # OSError, HF hub errors, offline mode, bad JSON
        if not os.path.isdir(model) and _hub_unreachable(exc):
            raise ModelNotFoundError(
                f"model {model!r} (hub id) could not be loaded: it is not in the local "
                "Hugging Face cache and the hub could not be reached from here; download "
                f"it where the hub is reachable (`hf download {model} --local-dir DIR`) and "
                "serve the folder, or point HF_HOME at a cache that holds it",
                param="model",
            ) from exc
        where = "local folder" if os.path.isdir(model) else "hub id"
        raise ModelNotFoundError(
            f"model {model!r} ({where}) could not be loaded as a diffusers pipeline: no "
            f"readable model_index.json ({type(exc).__name__}: {exc})", param="model",
        ) from exc


def _hub_unreachable(exc: BaseException) -> bool:
    """Whether loading failed because the hub could not be reached (offline, no DNS)
    and the files were not cached, rather than because the repository lacks them."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled",
                                      "ConnectError", "ConnectionError", "ConnectTimeout",
                                      "gaierror"):
            return True
        current = current.__cause__ or current.__context__
    return False


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
        self._loras: dict[str, str] = {}  # adapter name -> path it was loaded from
        self._mixer: LoraMixer | None = None  # per-sample adapters, from the first load
        # task -> the diffusers pipeline that runs it; edits share `pipe`'s modules
        self.task_pipes: dict[str, Any] = {"text-to-image": pipe}
        self.task_pipes.update(edit_pipes(pipe, self._make_info().size_multiple))
        self._info = self._make_info()
        # Step mode runs forward() of many requests interleaved: each call then gets a
        # copy of its pipeline with a scheduler of its own, whose `step` is fused with
        # the other requests' at this point (set by step_fusion_points).
        self._scheduler_point: FusionPoint | None = None
        # Waves of several sizes (transformers only, `mixed_sizes.py`): the packer of
        # the transformer, made at the first packed call; the scheduler point of
        # request mode's per-size calls, set at the first such wave.
        self._packer: TokenPacker | None = None
        self._sizes_point: FusionPoint | None = None

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
        from diffusers import DiffusionPipeline

        device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
        _disable_progress_bars()
        # 1. Read model_index.json: which components the folder leaves out (SD3 without
        #    T5, SD without safety checker) must be passed as None explicitly.
        index = _load_model_index(model)
        check_component_folders(model, index)
        for name, value in index.items():
            if not name.startswith("_") and isinstance(value, list | tuple) \
                    and list(value) == [None, None]:
                kwargs.setdefault(name, None)
        loader = diffusers_class or cls.diffusers_class or DiffusionPipeline
        target = loader if loader is not DiffusionPipeline else _index_class(index)
        init_params = inspect.signature(
            target.__init__).parameters if target else {}  # type: ignore[misc]
        if "safety_checker" in init_params:
            kwargs.setdefault("safety_checker", None)
        if "requires_safety_checker" in init_params:
            kwargs.setdefault("requires_safety_checker", False)
        # 2. Load, move, silence the per-step progress bar.
        pipe = loader.from_pretrained(  # type: ignore[union-attr]
            model, **{_dtype_kwarg(): torch_dtype}, **kwargs)
        pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        defaults: dict[str, Any] = {}
        if os.path.isfile(os.path.join(model, DEFAULTS_FILE)):
            with open(os.path.join(model, DEFAULTS_FILE), encoding="utf-8") as f:
                defaults = json.load(f)
        logger.info("loaded %s from %s on %s (%s)", type(pipe).__name__, model, device,
                    torch_dtype)
        return cls(pipe, device=device, defaults=defaults)

    # -- info ------------------------------------------------------------------------
    def info(self) -> PipelineInfo:
        return self._info

    def _make_info(self) -> PipelineInfo:
        pipe, d = self.pipe, self.defaults
        vae_scale = int(getattr(pipe, "vae_scale_factor", 8))
        unet, transformer = getattr(pipe, "unet", None), getattr(pipe, "transformer", None)
        denoiser = unet if unet is not None else transformer
        if unet is not None:  # every down block but the last halves the latent
            down = 2 ** (len(unet.config.block_out_channels) - 1)
        elif transformer is not None:
            # Z-Image names its patch sizes `all_patch_size`
            down = int(transformer.config.get("patch_size")
                       or max(transformer.config.get("all_patch_size") or [1]))
            if hasattr(type(pipe), "_pack_latents"):  # Flux packs 2x2 latent patches
                down *= 2
        else:
            down = 1
        sample = getattr(pipe, "default_sample_size", None)
        if sample is None and denoiser is not None:
            sample = denoiser.config.get("sample_size")
        size = int(sample) * vae_scale if isinstance(sample, int) else 512
        # A transformer whose rotary table is shorter than the default size needs
        # (Z-Image's `axes_lens`) gets the largest size the table covers.
        size = min(size, family_rules.rotary_size_limit(transformer, vae_scale) or size)
        # NOTE: Flux-style pipelines do CFG only through `true_cfg_scale`; `guidance_scale`
        # is embedded in the model and never doubles the batch.
        embedded = "true_cfg_scale" in self._call_params
        cfg_threshold = d.get("cfg_threshold", None if embedded else 1.0)
        return PipelineInfo(
            name=type(pipe).__name__,
            default_height=int(d.get("height", size)),
            default_width=int(d.get("width", size)),
            default_num_inference_steps=int(d.get(
                "num_inference_steps", self._call_default("num_inference_steps", 50))),
            default_guidance_scale=float(d.get(
                "guidance_scale", self._call_default("guidance_scale", 1.0))),
            size_multiple=int(d.get("size_multiple", vae_scale * down)),
            device=self.device,
            cfg_threshold=cfg_threshold,
            supports_per_request_guidance=self._per_sample_guidance_ok(cfg_threshold),
            supports_step_execution=self.supports_step_execution,
            model_max_pixels=int(d["model_max_pixels"]) if "model_max_pixels" in d else None,
            max_inference_steps=schedulable_steps(pipe.scheduler),
            call_arguments=frozenset(
                name for name in self._call_params
                if name not in _RESERVED or name in ("sigmas", "timesteps")
            ) - {"self", "kwargs", "callback_on_step_end", "callback_on_step_end_tensor_inputs",
                 "callback", "callback_steps"} - _unscheduled(pipe.scheduler),
            default_strengths={
                task: float(call_parameters(task_pipe)["strength"].default)
                for task, task_pipe in self.task_pipes.items() if task != "text-to-image"
            },
            negative_prompt=self._negative_prompt_use(),
            **self._prompt_limit(),
            supports_mixed_resolution=self._packable(),
            uses_guidance_scale=family_rules.uses_guidance_scale(pipe),
            true_cfg_default=family_rules.true_cfg_default(pipe),
            negative_prompt_none_differs=family_rules.negative_none_differs(pipe),
            **self._prompt_padding(),
        )

    def _prompt_padding(self) -> dict[str, Any]:
        """`prompt_pad_*` of a pipeline whose text encoder pads without a mask: a known
        family's multiple (CogView4: 16), else, where encoding a short prompt beside a
        long one changes it (a start-up check), its exact token count."""
        tokenizer = getattr(self.pipe, "tokenizer", None)
        folder = getattr(tokenizer, "name_or_path", None)
        multiple = family_rules.prompt_pad_multiple(self.pipe)
        if multiple is None and family_rules.encoding_depends_on_batch(self.pipe):
            logger.warning(
                "%s: a prompt's text embedding depends on the other prompts encoded with "
                "it (padding without a mask); %s", type(self.pipe).__name__,
                "requests are keyed by their prompts' token counts" if folder
                else "its tokenizer has no folder, so waves may mix prompt lengths")
            multiple = 1
        if multiple is None or not isinstance(folder, str) or not folder:
            return {}
        max_length = self._call_default("max_sequence_length", 1024)
        return {"prompt_pad_multiple": multiple, "prompt_pad_tokenizer": folder,
                "prompt_pad_max_length": int(max_length)}

    def _prompt_limit(self) -> dict[str, Any]:
        """`prompt_tokenizer` and `max_prompt_tokens` of a pipeline with one tokenizer
        loaded from a folder (with several, the longest encoder reads what the others
        cut: nothing is declared)."""
        tokenizers = [c for name, c in self.pipe.components.items()
                      if name.startswith("tokenizer") and c is not None]
        if len(tokenizers) != 1:
            return {}
        folder, length = getattr(tokenizers[0], "name_or_path", None), \
            getattr(tokenizers[0], "model_max_length", None)
        if not (isinstance(folder, str) and os.path.isdir(folder) and isinstance(length, int)
                and 0 < length < 1_000_000):  # transformers' "no limit" is a huge number
            return {}
        return {"prompt_tokenizer": folder, "max_prompt_tokens": length}

    def _packable(self) -> bool:
        """Whether requests of different sizes can share a forward: a transformer
        `TokenPacker` can pack (a UNet's convolutions would see the padding)."""
        return getattr(self.pipe, "unet", None) is None \
            and packing_layout(getattr(self.pipe, "transformer", None)) is not None

    def _per_sample_guidance_ok(self, cfg_threshold: float | None) -> bool:
        """Whether `forward` may pass a `PerSampleGuidance` to this diffusers pipeline.

        Only the listed classes (see `_PER_SAMPLE_GUIDANCE_CLASSES`), only with CFG
        switched on above 1 (the pipelines' own `> 1` check must agree with the key's
        "CFG on"), and not for an SD UNet that embeds the guidance scale
        (`time_cond_proj_dim`, LCM-style), which uses the scale outside the combine.
        """
        import diffusers

        pipe = self.pipe
        if not any(type(pipe) is getattr(diffusers, name, None)
                   for name in _PER_SAMPLE_GUIDANCE_CLASSES):
            return False
        if cfg_threshold is None or cfg_threshold < 1.0:
            return False
        unet = getattr(pipe, "unet", None)
        return unet is None or unet.config.get("time_cond_proj_dim") is None

    def _call_default(self, name: str, fallback: Any) -> Any:
        param = self._call_params.get(name)
        if param is None or param.default is inspect.Parameter.empty or param.default is None:
            return fallback
        return param.default

    # -- forward ---------------------------------------------------------------------
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
        if len({request_size(r) for r in batch.requests}) > 1:
            return self._forward_sizes(batch)
        # step mode takes a cancelled request out itself
        return self._forward_call(batch, self._scheduler_point,
                                  interrupt=self._scheduler_point is None)

    def _forward_call(self, batch: DiffusionRequestBatch, point: FusionPoint | None, *,
                      interrupt: bool) -> list[DiffusionOutput]:
        """One diffusers call for the wave (one size), on the pipeline of its task,
        stopped between steps once nobody waits for it (with `interrupt`). With a
        scheduler `point`, the call runs on a pipeline copy whose own scheduler's
        steps go through that point (step mode; several sizes in one wave)."""
        n = batch.num_outputs_per_prompt
        pipe = self._task_pipe(batch)
        if point is not None:
            pipe = copy.copy(pipe)
            pipe.scheduler = copy.deepcopy(pipe.scheduler)
            wrap_scheduler(point, pipe.scheduler)
        previews = DiffusersPreviews.for_wave(batch, pipe)
        kwargs = {**self.call_kwargs(batch),
                  **self._step_hooks(batch, pipe, previews, interrupt=interrupt)}
        with previews.capturing() if previews is not None else contextlib.nullcontext():
            images = pipe(**kwargs).images  # [B*n, C, H, W] in [0, 1]
        if not isinstance(images, torch.Tensor) or images.shape[0] != len(batch) * n:
            raise ValueError(
                f"{self._info.name} returned {getattr(images, 'shape', type(images))}, "
                f"expected a tensor with {len(batch) * n} images"
            )
        # Split per request (clone: a view would carry the whole wave's storage).
        images = images.detach().to("cpu", torch.float32)
        return [
            DiffusionOutput(request_id=r.request_id, images=images[i * n:(i + 1) * n].clone())
            for i, r in enumerate(batch.requests)
        ]

    def _forward_sizes(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """A wave of several sizes: one call per size, the transformer packed
        (`mixed_sizes.py`)."""
        if not self._packable() or batch.requests[0].sampling_params.task != "text-to-image":
            raise ValueError(
                f"{self._info.name} cannot run requests of different sizes in one wave "
                "(supports_mixed_resolution is False, or an edit wave)")
        if self._sizes_point is None:
            install(self._fusion_points())
            self._sizes_point = scheduler_point()
        parts = split_by_size(batch)
        results = run_together([
            functools.partial(self._forward_call, part, self._sizes_point, interrupt=True)
            for _, part in parts])
        outputs: list[DiffusionOutput | None] = [None] * len(batch)
        for (indices, _), part_outputs in zip(parts, results, strict=True):
            for i, output in zip(indices, part_outputs, strict=True):
                outputs[i] = output
        return [o for o in outputs if o is not None]

    def _pack_calls(self, calls: list[ModuleCall]) -> list[Any]:
        """The transformer's calls for requests of different sizes, as one call."""
        if self._packer is None:
            self._packer = TokenPacker(self.pipe.transformer)
        return self._packer.pack_calls(calls)

    def step_fusion_points(self) -> list[FusionPoint]:
        """Step mode: fuse the denoiser and the scheduler steps per tick, the text
        encoders and the VAE decoder at joins and leaves (see
        `diffbatch.pipelines.step_fusion`)."""
        points = self._fusion_points()
        self._scheduler_point = scheduler_point()
        return points

    def _fusion_points(self) -> list[FusionPoint]:
        """The denoiser (packing sizes where `TokenPacker` can), the text encoders
        and the VAE decoder."""
        pipe, points = self.pipe, []
        pack = self._pack_calls if self._packable() else None
        for name in _DENOISERS:
            module = getattr(pipe, name, None)
            if module is not None:
                points.append(FusionPoint(
                    module, "forward", "step", name, _SHARED_ARGUMENTS,
                    pack=pack if name == "transformer" else None))  # type: ignore[arg-type]
        for name in _TEXT_ENCODERS:
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
        guidance_scale = self._guidance_scale(batch)
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
            if any(p is None for p in negatives) and self._info.negative_prompt_none_differs:
                raise ValueError(f"{self._info.name}: a wave mixes requests with and "
                                 "without a negative prompt, which it cannot share")
            fill = family_rules.negative_prompt_fill(self.pipe)
            kwargs["negative_prompt"] = [fill if p is None else p for p in negatives]
        # 4. Edits: each request's image (and mask), its strength.
        if params.task != "text-to-image":
            kwargs.update(edit_inputs(batch))
            strength = params.strength
            if strength is None and key is not None:
                strength = key.strength
            steps = kwargs.get("num_inference_steps", params.num_inference_steps)
            kwargs["strength"] = at_least_one_step(strength, steps)
        # 5. Pipeline quirks.
        self._apply_quirks(kwargs, extra, call_params)
        return kwargs

    def _step_hooks(self, batch: DiffusionRequestBatch, pipe: Any,
                    previews: DiffusersPreviews | None, *, interrupt: bool = True,
                    ) -> dict[str, Any]:
        """The per-step hook: it stops the diffusers loop once nobody waits for the wave
        (with `interrupt`), and sends the partial images owed after the step
        (`diffusers_previews.py`); none when it has neither to do.

        NOTE: the hook raises `WaveInterrupted` rather than setting the pipeline's
        `_interrupt` flag: with the flag, diffusers skips the remaining steps but still
        decodes the latents and returns images nobody wants; raising stops at once, and
        the runner turns it into aborted outputs (never a bisected error).
        """
        def after_step(step: int) -> None:  # `step`: 0-based, as diffusers counts
            if interrupt:
                batch.check_interrupt()
            if previews is not None:
                previews.after_step(step + 1)

        if not interrupt and previews is None:
            return {}
        call_params = call_parameters(pipe)
        if "callback_on_step_end" in call_params:
            def on_step_end(pipe: Any, step: int, timestep: Any,
                            callback_kwargs: dict[str, Any]) -> dict[str, Any]:
                after_step(step)
                return callback_kwargs

            return {"callback_on_step_end": on_step_end}
        if "callback" in call_params and "callback_steps" in call_params:
            # the older per-step hook (PixArt-Sigma): callback(step, timestep, latents)
            return {"callback": lambda step, *_: after_step(step), "callback_steps": 1}
        return {}

    def _guidance_scale(self, batch: DiffusionRequestBatch) -> float | None:
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
        if not self._info.uses_guidance_scale:  # ignored here (Qwen-Image): not passed
            return None
        scales = [p.guidance_scale for p in batch.sampling_params_list]
        key = batch.key
        if key is not None and key.guidance_scale is not None:
            return key.guidance_scale
        if len(set(scales)) == 1:  # None: unresolved params, the pipeline's default
            return scales[0]
        # The key left the scale out: the engine trusts this pipeline with per-request
        # guidance, and every request of the wave has CFG on.
        if key is None or not self._info.supports_per_request_guidance \
                or not key.cfg_enabled:
            raise ValueError(
                f"the wave mixes guidance scales {list(dict.fromkeys(scales))} but "
                f"{self._info.name} cannot apply per-request guidance here "
                "(supports_per_request_guidance="
                f"{self._info.supports_per_request_guidance}, "
                f"cfg_enabled={key.cfg_enabled if key is not None else None})"
            )
        return PerSampleGuidance.from_batch(batch)

    def _uses_negative_prompt(self, extra: dict[str, Any], key: Any = None) -> bool:
        # NOTE: Flux and Qwen-Image use negative prompts only with true CFG
        # (true_cfg_scale > 1, and a negative prompt: the key's CFG flag); passing
        # them otherwise is wasted encoding at best.
        if "true_cfg_scale" in self._call_params:
            if key is not None and not key.cfg_enabled:
                return False
            return float(extra.get("true_cfg_scale", self._true_cfg_default())) > 1.0
        return True

    def _negative_prompt_use(self) -> Literal["yes", "no", "true_cfg"]:
        """`PipelineInfo.negative_prompt`: what a request's negative prompt does here."""
        if "negative_prompt" not in self._call_params:
            return "no"
        if "true_cfg_scale" in self._call_params and not self._true_cfg_default() > 1.0:
            return "true_cfg"
        return "yes"

    def _true_cfg_default(self) -> float:
        """The call's own `true_cfg_scale` (1.0 for Flux: off; 4.0 for QwenImage: on)."""
        return float(self._call_default("true_cfg_scale", 1.0))

    def _apply_quirks(self, kwargs: dict[str, Any], extra: dict[str, Any],
                      call_params: Any) -> None:
        # PixArt, Sana: resolution binning exists only for the sample sizes in the
        # pipeline's own table and raises "Invalid sample size" for any other (e.g.
        # tiny) transformer; HunyuanDiT's would return another size than asked for.
        if "use_resolution_binning" in call_params and "use_resolution_binning" not in extra \
                and family_rules.resolution_binning(self.pipe) is False:
            kwargs["use_resolution_binning"] = False
        # PixArt: clean_caption=True without bs4/ftfy falls back to False with a
        # warning on every call; pass the fallback explicitly.
        if "clean_caption" in call_params and "clean_caption" not in extra:
            from diffusers.utils import is_bs4_available, is_ftfy_available

            if not (is_bs4_available() and is_ftfy_available()):
                kwargs["clean_caption"] = False

    # -- LoRA ------------------------------------------------------------------------
    def load_lora(self, name: str, weights: str | dict[str, torch.Tensor]) -> int | None:
        """Load the adapter `weights` (a path, or the tensors of one already read) under
        `name`, once per name, into the denoiser and the text encoders it touches; each
        sample of a forward then picks its own adapters (`set_lora_wave`, `lora_rows`;
        see `lora_mixing.py`). Returns the number of layers it touches."""
        source = weights if isinstance(weights, str) else "<tensors>"
        if name in self._loras:
            if self._loras[name] != source:
                raise ValueError(f"LoRA adapter name {name!r} is already loaded")
            return None
        mixer = self._lora_mixer()
        try:
            with warnings.catch_warnings():
                # PEFT warns that a model holding an adapter gets another: the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                if hasattr(self.pipe, "load_lora_weights"):
                    # (a copy: diffusers pops the keys it converts)
                    self.pipe.load_lora_weights(
                        weights if isinstance(weights, str) else dict(weights),
                        adapter_name=name)
                else:  # a pipeline without a loader (PixArt): PEFT into its transformer
                    _inject_lora(self.pipe.transformer, _read_safetensors(weights)
                                 if isinstance(weights, str) else weights, "transformer", name)
            layers = mixer.add(name)
        except Exception:
            # diffusers loads an adapter component by component and cleans up only the
            # one that failed: take out what did load
            mixer.remove(name)
            self._delete_adapter(name)
            raise
        finally:
            self._disable_peft_application()
        self._loras[name] = source
        return layers

    def unload_lora(self, name: str) -> None:
        """Take adapter `name` out of the model (its memory is freed)."""
        if self._loras.pop(name, None) is None:
            return
        self._lora_mixer().remove(name)
        self._delete_adapter(name)

    def set_lora_wave(self, stacks: list[Stack] | None, num_outputs_per_prompt: int) -> None:
        """The next forward's per-request adapter stacks, in wave order."""
        if self._mixer is not None:
            self._mixer.set_wave(stacks, num_outputs_per_prompt)
        elif stacks and any(stacks):
            raise KeyError("no LoRA adapter is loaded")

    def lora_rows(self, calls: list[tuple[Stack, int]]) -> contextlib.AbstractContextManager[None]:
        """Step mode: the fused module calls in this scope hold `calls`' rows."""
        if self._mixer is None:
            return contextlib.nullcontext()
        return self._mixer.rows_for_calls(calls)

    def _lora_mixer(self) -> LoraMixer:
        if self._mixer is None:
            if not hasattr(self.pipe, "load_lora_weights") and \
                    getattr(self.pipe, "transformer", None) is None:
                raise NotImplementedError(f"{self._info.name} does not support LoRA adapters")
            roots: dict[str, tuple[Any, RootLayout]] = {}
            for name in _DENOISERS:
                if getattr(self.pipe, name, None) is not None:
                    roots[name] = (getattr(self.pipe, name), "images")
            for name in _TEXT_ENCODERS:
                if getattr(self.pipe, name, None) is not None:
                    roots[name] = (getattr(self.pipe, name), "prompts")
            self._mixer = LoraMixer(roots)
        return self._mixer

    def _delete_adapter(self, name: str) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module_name in (*_DENOISERS, *_TEXT_ENCODERS):
            module = getattr(self.pipe, module_name, None)
            if module is None:
                continue
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer) and name in getattr(layer, "lora_A", {}):
                    with contextlib.suppress(Exception):
                        layer.delete_adapter(name)
            peft_config = getattr(module, "peft_config", None)
            if isinstance(peft_config, dict):
                peft_config.pop(name, None)

    def _disable_peft_application(self) -> None:
        """PEFT's own adapter application stays off: the mixer adds every delta."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module_name in (*_DENOISERS, *_TEXT_ENCODERS):
            module = getattr(self.pipe, module_name, None)
            if module is None:
                continue
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.enable_adapters(False)


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


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors adapter file, or of the one a folder holds
    (`pytorch_lora_weights.safetensors` first, as `save_lora_weights` names it)."""
    from safetensors.torch import load_file

    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError("the adapter folder holds no .safetensors file")
        preferred = "pytorch_lora_weights.safetensors"
        path = os.path.join(path, preferred if preferred in names else names[0])
    return load_file(path)


def _inject_lora(module: Any, state_dict: dict[str, torch.Tensor], prefix: str,
                 name: str) -> None:
    """Load PEFT-format LoRA weights (`<prefix>.<layer>.lora_A.weight`, ...) into
    `module` as adapter `name`, each layer at its own rank (alpha = rank)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    weights = {k[len(prefix) + 1:]: v for k, v in state_dict.items()
               if k.startswith(prefix + ".")}
    ranks = {k.split(".lora_A.")[0]: int(v.shape[0]) for k, v in weights.items()
             if ".lora_A." in k}
    if not ranks or len(weights) != 2 * len(ranks):
        raise ValueError(f"expected PEFT LoRA weights under `{prefix}.` (lora_A/lora_B "
                         f"pairs), got {len(weights)} tensors for {len(ranks)} layers")
    rank = max(ranks.values())
    pattern = {layer: r for layer, r in ranks.items() if r != rank}
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(ranks),
                        rank_pattern=pattern, alpha_pattern=dict(pattern))
    inject_adapter_in_model(config, module, adapter_name=name)
    result = set_peft_model_state_dict(module, weights, adapter_name=name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the adapter has {len(unexpected)} weights this model lacks, "
                         f"e.g. {unexpected[0]!r}")


def _dtype_kwarg() -> str:
    """diffusers >= 0.36 takes `dtype` and deprecates `torch_dtype`."""
    from diffusers.pipelines import pipeline_utils

    return "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"


def _index_class(index: dict[str, Any]) -> type | None:
    """The diffusers class model_index.json names, or None if diffusers lacks it."""
    import diffusers

    name = index.get("_class_name")
    return getattr(diffusers, name, None) if isinstance(name, str) else None
