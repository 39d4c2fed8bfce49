"""The pipeline seam: what the runner calls, and what a pipeline declares about itself.

A pipeline is loaded once per worker with `from_pretrained` and then runs waves
through `forward(batch)`. Capabilities are class attributes, read without loading
anything:

- `supports_request_batch = True`: `forward` takes a `DiffusionRequestBatch` of any
  size and returns one `DiffusionOutput` per request, in order. Otherwise the engine
  only ever passes batches of one request (waves of one).

Which tasks a pipeline runs besides text-to-image (image-to-image, inpainting) is
declared by the loaded pipeline in `PipelineInfo.default_strengths`; the engine refuses
an edit the pipeline does not declare before it reaches a wave.

A pipeline that loops over denoising steps may also stream partial images: it asks
`batch.partial_image_plan(num_steps)` for the previews its requests asked for
(`SamplingParams.partial_images`; None: none in this wave) and, after each step,
decodes the predicted clean image of the rows that owe one and hands it back
(`partial_images.py`). The diffusers adapter does this through its per-step callback.

A pipeline that loops over denoising steps calls `batch.check_interrupt()` between
steps: it raises `WaveInterrupted` once nobody waits for the wave any more (every
request aborted, timed out or disconnected), so the wave stops at the next step
instead of running to its end. A pipeline that never calls it still works; its
aborted waves just run to the end.

Custom pipelines subclass `BasePipeline` (or just provide the same attributes and
methods) and are passed to the engine as a class or a dotted name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from diffbatch.errors import WaveInterrupted
from diffbatch.pipelines.partial_images import PartialImagePlan

if TYPE_CHECKING:
    import torch

    from diffbatch.compile import CompileSettings
    from diffbatch.outputs import DiffusionOutput, PartialImage
    from diffbatch.pipelines.interception import FusionPoint
    from diffbatch.pipelines.interception.compiled import CompileStats
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import LoraStack, SamplingParams, SamplingParamsKey


@dataclass
class DiffusionRequestBatch:
    """The pipeline-facing view of one wave.

    A pipeline written for one request reads `prompts`, `sampling_params` and
    `generators` the same way; a batch-capable pipeline reads the lists. The runner
    fills `generators` with one torch.Generator per output image, B*n in request
    order (request 0's n generators first).
    """

    requests: list[DiffusionRequest]
    generators: list[torch.Generator] = field(default_factory=list)  # [B * n]
    # True once nobody waits for this wave (the runner's view of aborts); cheap to call
    should_stop: Callable[[], bool] = field(default=lambda: False, repr=False)
    # Where the wave's partial images go while it runs (the runner's); None: nowhere
    on_partial_image: Callable[[PartialImage], None] | None = field(default=None, repr=False)
    # Each request's resident LoRA adapters as (name, scale) pairs, in request order;
    # None: not given with the batch (`BasePipeline.set_lora_wave` may give them)
    lora_stacks: list[LoraStack] | None = None

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a DiffusionRequestBatch needs at least one request")

    def check_interrupt(self) -> None:
        """Raise `WaveInterrupted` if nobody waits for this wave any more; call it
        between denoising steps."""
        if self.should_stop():
            raise WaveInterrupted(f"wave of {len(self.requests)} request(s) stopped: "
                                  "none of its requests is wanted any more")

    def partial_image_plan(self, num_steps: int) -> PartialImagePlan | None:
        """Which previews a loop of `num_steps` steps owes to which requests; None when no
        request of the wave asked for one (or nobody listens). See `partial_images.py`."""
        return PartialImagePlan.for_batch(self, num_steps)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def request_id(self) -> str:
        """The request id of a single-request batch (compatibility with per-request code)."""
        return self._single("request_id").request_id

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.requests]

    @property
    def images(self) -> list[torch.Tensor | None]:
        """Each request's input image, uint8 [H, W, 3] (None for text-to-image)."""
        return [r.sampling_params.image for r in self.requests]

    @property
    def masks(self) -> list[torch.Tensor | None]:
        """Each request's inpainting mask, uint8 [H, W], 255 = paint (None without one)."""
        return [r.sampling_params.mask for r in self.requests]

    @property
    def negative_prompts(self) -> list[str | None]:
        return [r.sampling_params.negative_prompt for r in self.requests]

    @property
    def sampling_params_list(self) -> list[SamplingParams]:
        return [r.sampling_params for r in self.requests]

    @property
    def sampling_params(self) -> SamplingParams:
        """The params of a single-request batch; a multi-request batch has no one params."""
        return self._single("sampling_params").sampling_params

    @property
    def key(self) -> SamplingParamsKey | None:
        return self.requests[0].key

    @property
    def num_outputs_per_prompt(self) -> int:
        return self.requests[0].sampling_params.num_outputs_per_prompt

    def _single(self, name: str) -> DiffusionRequest:
        if len(self.requests) != 1:
            raise ValueError(
                f"`{name}` is only defined for a batch of one request, this batch has "
                f"{len(self.requests)}; read `{name}s` / `sampling_params_list` instead"
            )
        return self.requests[0]


@dataclass(frozen=True)
class PipelineInfo:
    """What the engine process needs to know about a loaded pipeline.

    Sent by the worker once the pipeline is loaded, so the engine can resolve
    defaults and build batch keys without loading the model itself.
    """

    name: str  # pipeline class name, for logs and errors
    default_height: int
    default_width: int
    default_num_inference_steps: int
    default_guidance_scale: float
    size_multiple: int  # height and width must be multiples of this
    device: str = "cpu"
    # guidance_scale > this turns classifier-free guidance on; None: guidance is
    # embedded in the model (Flux) and never doubles the batch.
    cfg_threshold: float | None = 1.0
    # forward() applies each request's own guidance_scale (a per-sample scale in the
    # CFG combine), so requests that differ only in guidance_scale may share a wave.
    supports_per_request_guidance: bool = False
    # Largest height * width the model serves (None = no limit of its own), e.g. a model
    # trained at 64x64 whose cost explodes far beyond its training size. Not the
    # server's `--max-image-pixels`, which caps every model alike.
    model_max_pixels: int | None = None
    # Most `num_inference_steps` the model's scheduler can schedule, when it stops short
    # of the global bound (`schedule_limits.py`); None: the global bound holds.
    max_inference_steps: int | None = None
    # Names `SamplingParams.extra` may use, plus "sigmas"/"timesteps" when the
    # pipeline takes custom schedules; None: not declared, anything is passed on.
    call_arguments: frozenset[str] | None = None
    # The edit tasks `forward` runs ("image-to-image", "inpaint"), each with the
    # `strength` a request without one gets; text-to-image is always supported.
    default_strengths: dict[str, float] = field(default_factory=dict, hash=False)
    # The pipeline implements the step contract (`BasePipeline.step_fusion_points`).
    supports_step_execution: bool = False
    # What a request's `negative_prompt` does: "yes" it is used (with CFG on), "no" the
    # pipeline takes none, "true_cfg" only with `extra["true_cfg_scale"]` > 1 (Flux,
    # whose true CFG is off unless asked for; QwenImage's is on by default: "yes").
    # A negative prompt the pipeline would drop is refused at admission.
    negative_prompt: Literal["yes", "no", "true_cfg"] = "yes"
    # The folder of the prompt's tokenizer (`AutoTokenizer.from_pretrained` loads it)
    # and the most tokens its text encoder reads, start and end included; None: not
    # declared (e.g. a pipeline with several text encoders, whose longest one reads a
    # long prompt). The HTTP server refuses a longer prompt instead of cutting it.
    prompt_tokenizer: str | None = None
    max_prompt_tokens: int | None = None
    # `forward` runs text-to-image requests of different sizes in one wave (a
    # transformer packing their tokens); with `mixed_resolution` on, size leaves the key.
    supports_mixed_resolution: bool = False
    # `forward` applies requests' `step_cache` (a diffusion transformer whose blocks the
    # step cache can skip); None: why it cannot, in words, for the refusal.
    step_cache_unsupported: str | None = (
        "this pipeline does not implement step caching: leave out `step_cache` / --step-cache")
    # Whether `guidance_scale` changes the result at all (False: Qwen-Image, whose
    # transformer embeds no guidance; the scale then leaves the key).
    uses_guidance_scale: bool = True
    # The call's own `true_cfg_scale` for a pipeline with true CFG (Qwen-Image 4.0,
    # Flux 1.0): CFG is on when it (or `extra["true_cfg_scale"]`) is > 1 AND the
    # request has a negative prompt, diffusers' own rule. None: no true CFG.
    true_cfg_default: float | None = None
    # A request without a negative prompt computes something else than one with ""
    # (SDXL's zero embeddings): the two are keyed apart. (True CFG's on/off follows
    # the negative prompt through `cfg_enabled`.)
    negative_prompt_none_differs: bool = False
    # An unmasked text encoder pads a wave's prompts to the longest, rounded up to
    # this multiple (CogView4: 16; 1 where only the start-up check found it); requests
    # are keyed by their padded lengths, counted with `prompt_pad_tokenizer` (a
    # folder) up to `prompt_pad_max_length` tokens.
    prompt_pad_multiple: int | None = None
    prompt_pad_tokenizer: str | None = None
    prompt_pad_max_length: int = 1024

    # Video pipelines (`diffusers_video.py`): the frames a request gets without
    # `extra["num_frames"]`, the step its frame count moves in (num_frames - 1 must be
    # a multiple: the VAE's temporal compression), the most frames the model serves and
    # the frame rate its clips are encoded at; None for image pipelines.
    default_num_frames: int | None = None
    frame_multiple: int = 1
    max_num_frames: int | None = None
    default_fps: int | None = None

    @property
    def is_video(self) -> bool:
        """Whether the pipeline makes videos ([n, F, C, H, W] outputs)."""
        return self.default_num_frames is not None

    def supports_task(self, task: str) -> bool:
        """Whether `forward` runs requests of `task` (see `sampling_params.Task`)."""
        return task == "text-to-image" or task in self.default_strengths

    def cfg_enabled(self, params: SamplingParams) -> bool:
        """Whether classifier-free guidance is on for these resolved params."""
        if self.true_cfg_default is not None:
            scale = params.extra.get("true_cfg_scale", self.true_cfg_default)
            return params.negative_prompt is not None and float(scale) > 1.0
        threshold = self.cfg_threshold
        return threshold is not None and (params.guidance_scale or 0.0) > threshold


class BasePipeline(ABC):
    """Base class of diffbatch pipelines; see the module docstring for the contract."""

    supports_request_batch: ClassVar[bool] = False
    supports_step_execution: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> BasePipeline:
        """Load the pipeline from a local folder, a hub id or a built-in model name."""

    @abstractmethod
    def info(self) -> PipelineInfo:
        """Defaults and limits of this pipeline; see `PipelineInfo`."""

    @abstractmethod
    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """Run one wave and return one `DiffusionOutput` per request, in order.

        Args:
            batch: the wave; every request has the same `SamplingParamsKey`, and
                `batch.generators` holds one generator per output image (B*n).

        Returns:
            One `DiffusionOutput` per request with `images` a float tensor
            [n, C, H, W] in [0, 1] (the runner converts it to the requested type).
        """

    def cfg_enabled(self, params: SamplingParams) -> bool:
        """Whether classifier-free guidance is on for these resolved params."""
        return self.info().cfg_enabled(params)

    def step_fusion_points(self) -> Sequence[FusionPoint]:
        """The step contract: which module calls step mode fuses across requests.

        A pipeline with `supports_step_execution = True` returns its heavy module
        methods here, the denoiser's as kind "step" (one fused call of it is one
        tick) and those run when a request joins or leaves (text encoders, VAE
        decode) as "boundary"; see `diffbatch.pipelines.interception`. Called once,
        when the worker starts in step mode; from then on `forward` is called with
        batches of one request, many of them interleaved (each a task of the
        interception layer's coordinator, switching at the fused calls), so a call
        must keep its per-request state (scheduler, timesteps, latents) to itself.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement step execution")

    def compile(self, settings: CompileSettings, run_once: Callable[[], Any]) -> CompileStats:
        """Compile the heavy modules per `settings` and warm them: `run_once()` runs
        one small request through `forward`, whose module calls show the arguments to
        compile for. Pipelines that cannot compile raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not support compiling")

    def load_lora(self, name: str, weights: Any) -> int | None:
        """Load a LoRA adapter (a path, or a dict of its tensors) under `name` (once);
        returns the number of layers it touches (None: not known). Pipelines without
        LoRA raise."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def unload_lora(self, name: str) -> None:  # noqa: B027 - nothing to unload by default
        """Take adapter `name` out of the model; unknown names are ignored."""

    def set_lora_wave(self, stacks: list[LoraStack] | None,
                      num_outputs_per_prompt: int) -> None:
        """Per-sample adapters of the next forward: each request's stack of loaded
        adapter (name, scale) pairs, in wave order; None or all () runs the base model.
        (The runner also hands them with the batch: `DiffusionRequestBatch.lora_stacks`.)"""
        if stacks and any(stacks):
            raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def refresh_cache(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Called once per wave before `forward`; pipelines with step caches reset them."""
