"""What a pipeline returns per request, and what a runner returns per wave.

These cross from the worker process to the engine; tensors in them travel through
shared memory (see `diffbatch.ipc.shm`), everything else is pickled, so fields stay
plain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffbatch.errors import DiffbatchError


@dataclass
class RequestError:
    """Why one request failed, in a form that crosses processes and maps to HTTP."""

    message: str
    status_code: int = 500
    type: str = "server_error"
    param: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> RequestError:
        if isinstance(exc, DiffbatchError):
            return cls(exc.message, exc.status_code, exc.type, exc.param)
        return cls(f"{type(exc).__name__}: {exc}")


@dataclass
class DiffusionOutput:
    """The result of one request.

    `images` is what the request's `output_type` asks for once the engine delivers it:
    a list of PIL images ("pil"), a float tensor [n, C, H, W] ("pt") or a float array
    [n, H, W, C] ("np"). Inside the worker a pipeline may return a float tensor
    [n, C, H, W] in [0, 1] for any output type; the runner converts it.
    """

    request_id: str
    images: Any = None  # see the class docstring; None on error or abort
    error: RequestError | None = None
    aborted: bool = False
    queue_time_ms: float = 0.0  # arrival -> start of the wave's forward
    execute_time_ms: float = 0.0  # the wave's forward (and per-request post-processing)
    total_time_ms: float = 0.0  # arrival -> delivered
    batch_size: int = 0  # number of requests in the wave this request ran in
    seed: int | None = None  # the seed its generators were made from
    # step cache (`SamplingParams.step_cache`): denoiser forwards whose tail blocks ran
    # for this request, and those that reused its cached residual; None: no caching
    computed_steps: int | None = None
    cached_steps: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.aborted

    @classmethod
    def from_error(cls, request_id: str, exc: BaseException | RequestError) -> DiffusionOutput:
        error = exc if isinstance(exc, RequestError) else RequestError.from_exception(exc)
        return cls(request_id=request_id, error=error)

    @classmethod
    def make_aborted(cls, request_id: str) -> DiffusionOutput:
        return cls(
            request_id=request_id,
            aborted=True,
            error=RequestError("request was aborted", 499, "request_aborted"),
        )


@dataclass
class PartialImage:
    """One preview of one of a request's images, taken while its wave still runs.

    It is the image the sample's predicted clean latents (x0) decode to after `step` of
    `num_steps` denoising steps. A request asks for up to `partial_images` of them per
    image (`SamplingParams.partial_images`), taken at evenly spaced steps before the
    last. Like `DiffusionOutput.images`, `image` is what the request's `output_type`
    asks for once the engine hands it out: a PIL image ("pil"), a float tensor
    [C, H, W] ("pt") or a float array [H, W, C] ("np"), in [0, 1]; in between it
    crosses processes as the runner ships it (a uint8 tensor [H, W, C] for "pil").
    """

    request_id: str
    index: int  # 0-based, per image of the request: OpenAI's `partial_image_index`
    image_index: int  # which of the request's n images it previews (0-based)
    step: int  # denoising steps done when it was taken (1-based)
    num_steps: int  # denoising steps the wave runs
    image: Any = None  # see the class docstring


@dataclass
class TickStats:
    """One tick of the running batch (crosses to the engine for metrics); a record
    with `batch_size` 0 ran no step: a request cancelled between ticks left."""

    batch_size: int  # requests in the fused denoiser call
    step_ms: float  # the tick's wall time (boundaries included)
    forward_ms: float  # the fused denoiser module call(s) alone (no fusing, no resuming)
    joins: int  # requests that entered the batch this tick
    leaves: int  # requests that left it (finished, failed or cancelled)
    # the fused call's size in capacity units (`diffbatch.capacity_units`: pixels at the
    # model's default size under mixed resolution); None: `batch_size`
    batch_units: int | None = None
    num_lora_adapters: int = 0  # distinct LoRA adapters in the fused denoiser call
    num_lora_loads: int = 0  # adapters loaded (and evicted) for this tick's joiners
    num_lora_evictions: int = 0


@dataclass
class BatchRunnerOutput:
    """The outputs of one wave, keyed by request id, in the wave's order."""

    outputs: dict[str, DiffusionOutput]  # request_id -> output, insertion = wave order
    forward_time_ms: float = 0.0  # time spent in the pipeline forward(s) of this wave
    num_forwards: int = 1  # how many pipeline forwards served this wave
    # The runner's memory after the wave: its peak so far (process RSS on CPU, allocated
    # device memory on CUDA) and what is still free (MemAvailable / free device memory),
    # in bytes; 0 when unknown. The start-up calibration bounds wave sizes with them.
    peak_memory_bytes: int = 0
    free_memory_bytes: int = 0
    # LoRA: distinct adapters the wave's requests use, and the adapters loaded and
    # evicted (least recently used) to make them resident.
    num_lora_adapters: int = 0
    num_lora_loads: int = 0
    num_lora_evictions: int = 0
    # Step mode: the running batch's ticks since the worker last replied (`TickStats`).
    ticks: list[TickStats] = field(default_factory=list)

    @classmethod
    def failed(cls, request_ids: list[str], error: RequestError) -> BatchRunnerOutput:
        """A wave none of whose requests ran: each gets `error`, no forward counted."""
        return cls(outputs={rid: DiffusionOutput.from_error(rid, error) for rid in request_ids},
                   num_forwards=0)

    @classmethod
    def aborted(cls, request_ids: list[str]) -> BatchRunnerOutput:
        """A wave stopped because nobody waits for it: each request comes back aborted."""
        return cls(outputs={rid: DiffusionOutput.make_aborted(rid) for rid in request_ids},
                   num_forwards=0)

    @property
    def req_ids(self) -> list[str]:
        return list(self.outputs)


def finalize_images(images: Any, output_type: str) -> Any:
    """Turn what the runner shipped ([n, ...] tensors, see `DiffusionOutput`) into the
    requested output type, in the engine's process."""
    import torch

    if not isinstance(images, torch.Tensor):
        return images
    if output_type == "pt":
        return images
    if output_type == "np":
        return images.numpy()
    from PIL import Image

    if images.ndim == 5:  # videos: one list of frames each, as diffusers returns them
        return [[Image.fromarray(frame) for frame in video] for video in images.numpy()]
    return [Image.fromarray(img) for img in images.numpy()]  # uint8 [n, H, W, C]
