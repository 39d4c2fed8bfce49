"""The model runner: turns one scheduler wave into one pipeline forward.

Per request it makes the generators from the request's seed and maps the output,
error or abort back to the request id. Once per wave it refreshes the pipeline's
caches, activates the wave's single LoRA (adapter, scale), and calls
`pipeline.forward(batch)`. It checks the pipeline's side of the contract (exactly
one `DiffusionOutput` per request, in order) and never raises for a failing
pipeline: every request of the wave gets an output, with `error` set if need be.

Partial images a pipeline sends while the wave runs (requests that asked for them,
`SamplingParams.partial_images`) go to the caller's `on_partial_image` at once,
converted like the outputs (`to_output_type`).

A wave nobody waits for any more (`should_stop`: the worker's cancel flag, or, in
process, every request of the wave finished) is not started, and a pipeline that
checks `batch.check_interrupt()` between steps stops at the next one; either way
its requests come back aborted.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from diffbatch.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    PipelineError,
    WaveInterrupted,
)
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput, PartialImage, RequestError
from diffbatch.pipelines.interface import DiffusionRequestBatch
from diffbatch.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.pipelines.interface import BasePipeline, PipelineInfo
    from diffbatch.request import DiffusionRequest

logger = logging.getLogger(__name__)


def make_generators(
    requests: list[DiffusionRequest], device: str | torch.device = "cpu"
) -> list[torch.Generator]:
    """One generator per output image, B*n in request order.

    Image i of a request with seed s uses seed s + i, so a request's images depend
    only on its own seed, never on its batch mates.
    """
    generators = []
    for request in requests:
        params = request.sampling_params
        if params.seed is None:  # an engine invariant, not the caller's mistake
            raise RuntimeError(
                f"request {request.request_id} has no seed; the engine assigns one on add"
            )
        for i in range(params.num_outputs_per_prompt):
            generators.append(torch.Generator(device=device).manual_seed(params.seed + i))
    return generators


def check_outputs(pipeline_name: str, batch: DiffusionRequestBatch, outputs: Any) -> None:
    """Raise `PipelineError` unless `outputs` is one DiffusionOutput per request, in order."""
    expected = len(batch)
    if not isinstance(outputs, list | tuple):
        raise PipelineError(
            f"pipeline {pipeline_name}.forward must return a list of {expected} "
            f"DiffusionOutput, got {type(outputs).__name__}"
        )
    if len(outputs) != expected:
        raise PipelineError(
            f"pipeline {pipeline_name}.forward doesn't preserve batch size: the batch has "
            f"{expected} requests but it returned {len(outputs)} outputs"
        )
    for i, (request_id, out) in enumerate(zip(batch.request_ids, outputs, strict=True)):
        if not isinstance(out, DiffusionOutput):
            raise PipelineError(
                f"pipeline {pipeline_name}.forward must return DiffusionOutput objects, "
                f"got {type(out).__name__} at position {i}"
            )
        if out.request_id != request_id:
            raise PipelineError(
                f"pipeline {pipeline_name}.forward returned outputs out of order: position "
                f"{i} should be request {request_id!r}, got {out.request_id!r}"
            )


def memory_usage(device: str) -> tuple[int, int]:
    """(peak bytes used so far, bytes still free) of this process on `device`; 0 = unknown.

    CUDA: peak allocated device memory and the device's free memory. CPU: peak RSS
    (`ru_maxrss`) and the machine's MemAvailable.
    """
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(torch.cuda.max_memory_allocated()), int(free)
    peak = free = 0
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (ImportError, OSError, ValueError):
        pass
    return peak, free


def to_output_type(images: Any, output_type: str) -> Any:
    """Convert a float tensor [n, C, H, W] in [0, 1] into what crosses to the engine.

    "pt" stays a float tensor; "np" becomes a float tensor [n, H, W, C]; "pil"
    becomes a uint8 tensor [n, H, W, C] (cheap to ship; the engine makes PIL images).
    Anything that is not a tensor (a pipeline returning PIL images itself) passes through.
    """
    if not isinstance(images, torch.Tensor):
        return images
    images = images.detach().to("cpu", torch.float32)
    if output_type == "pt":
        return images.contiguous()
    images = images.clamp(0, 1).permute(0, 2, 3, 1)
    if output_type == "np":
        return images.contiguous()
    return (images * 255).round().to(torch.uint8).contiguous()


class ModelRunner:
    """Loads the pipeline once and runs waves on it; see the module docstring."""

    def __init__(self, config: EngineConfig, pipeline: BasePipeline | None = None) -> None:
        self.config = config
        if pipeline is None:
            from diffbatch.pipelines.registry import load_pipeline

            pipeline = load_pipeline(
                config.model,
                config.pipeline_class,
                device=config.device,
                dtype=config.dtype,
                **config.pipeline_kwargs,
            )
        self.pipeline = pipeline
        self._info = pipeline.info()
        self._loaded_loras: set[str] = set()
        # (adapter, scale) now active; None: not known (after a load that failed)
        self._active_lora: tuple[str | None, float | None] | None = (None, None)
        self._num_forwards = 0  # forwards run for the current wave (bisection adds some)
        self._should_stop: Callable[[], bool] = lambda: False  # the current wave's
        # where the current wave's partial images go; None: nobody listens
        self._on_partial_image: Callable[[PartialImage], None] | None = None

    def info(self) -> PipelineInfo:
        return self._info

    # -- the entry -------------------------------------------------------------------
    def execute_batch(
        self, scheduler_output: SchedulerOutput, *,
        should_stop: Callable[[], bool] | None = None,
        on_partial_image: Callable[[PartialImage], None] | None = None,
    ) -> BatchRunnerOutput:
        """Run one wave with one forward; every request gets exactly one output.

        `should_stop` says when nobody waits for the wave any more; None: when every
        request of the wave is finished (aborted), which only an in-process caller
        sees (a worker's requests are copies). `on_partial_image` gets the partial
        images the pipeline sends while it runs (None: the pipeline makes none).
        """
        requests = scheduler_output.requests
        if not requests:
            return BatchRunnerOutput(outputs={}, forward_time_ms=0.0, num_forwards=0)
        if should_stop is None:
            def should_stop() -> bool:
                return all(r.is_finished for r in requests)
        if should_stop():  # dropped before it started: no forward at all
            return BatchRunnerOutput.aborted(scheduler_output.req_ids)
        self._should_stop = should_stop
        self._on_partial_image = partial_image_sender(on_partial_image, requests)
        start = time.perf_counter()
        self._num_forwards = 0
        try:
            outputs = self._run(requests)
        except WaveInterrupted:
            logger.info("wave %d (%d requests) stopped early: none of its requests is wanted "
                        "any more", scheduler_output.wave_id, len(requests))
            aborted = BatchRunnerOutput.aborted(scheduler_output.req_ids)
            aborted.forward_time_ms = (time.perf_counter() - start) * 1000.0
            return aborted  # num_forwards 0: no forward finished, nothing for the cost model
        except Exception as exc:  # the pipeline failed: the wave's requests fail, we don't
            logger.warning(
                "wave %d (%d requests) failed: %s: %s",
                scheduler_output.wave_id, len(requests), type(exc).__name__, exc,
            )
            # NOTE: a broken output contract (PipelineError) is the pipeline's bug at any
            # batch size; bisecting would only hide it, so only exceptions are isolated.
            # An adapter that does not load fails every request of the wave alike (the
            # LoRA is in the key): re-running halves would only load it again.
            isolate = not isinstance(exc, PipelineError | LoraLoadError) and len(requests) > 1
            if self.config.batch_error_isolation == "bisect" and isolate:
                outputs = self._isolate(requests, exc)
                logger.warning(
                    "wave %d: isolated %d failing request(s) with %d extra forwards",
                    scheduler_output.wave_id, sum(o.error is not None for o in outputs),
                    self._num_forwards - 1,
                )
            else:
                error = RequestError.from_exception(exc)
                outputs = [DiffusionOutput.from_error(r.request_id, error) for r in requests]
        forward_ms = (time.perf_counter() - start) * 1000.0
        for out in outputs:
            out.execute_time_ms = forward_ms
            out.batch_size = len(requests)
        peak, free = memory_usage(self._info.device)
        return BatchRunnerOutput(
            outputs={out.request_id: out for out in outputs}, forward_time_ms=forward_ms,
            num_forwards=self._num_forwards, peak_memory_bytes=peak, free_memory_bytes=free,
        )

    def _isolate(
        self, requests: list[DiffusionRequest], exc: Exception
    ) -> list[DiffusionOutput]:
        """Re-run a failed wave in halves until the failing requests are found.

        A half that runs fine keeps its outputs (equal to what the wave would have
        produced: every image has its own generator); a failing half is split
        again. One failing request in a wave of B costs about 2*log2(B) forwards.
        """
        if len(requests) == 1:
            return [DiffusionOutput.from_error(requests[0].request_id, exc)]
        mid = len(requests) // 2
        outputs: list[DiffusionOutput] = []
        for half in (requests[:mid], requests[mid:]):
            try:
                outputs.extend(self._run(half))
            except WaveInterrupted:
                raise
            except Exception as half_exc:
                outputs.extend(self._isolate(half, half_exc))
        return outputs

    # -- stages ----------------------------------------------------------------------
    def _run(self, requests: list[DiffusionRequest]) -> list[DiffusionOutput]:
        return self.run_forward(requests, should_stop=self._should_stop,
                                on_partial_image=self._on_partial_image)

    def run_forward(
        self, requests: list[DiffusionRequest], *, should_stop: Callable[[], bool],
        on_partial_image: Callable[[PartialImage], None] | None = None,
    ) -> list[DiffusionOutput]:
        """One pipeline forward over `requests` (a wave, or step mode's single request)
        and the per-request mapping of its outputs; raises what the forward raises."""
        # 1. Per-request set-up: generators from each request's own seed.
        generators = make_generators(requests, self._info.device)
        batch = DiffusionRequestBatch(requests=requests, generators=generators,
                                      should_stop=should_stop,
                                      on_partial_image=on_partial_image)
        # 2. Once per wave: cache refresh and the wave's single LoRA.
        self.pipeline.refresh_cache()
        params = requests[0].sampling_params
        self.activate_lora(params.lora, params.lora_scale)
        # 3. One forward for the whole wave, checked against the contract.
        self._num_forwards += 1
        with torch.inference_mode():
            outputs = self.pipeline.forward(batch)
        check_outputs(self._info.name, batch, outputs)
        # 4. Per-request output mapping.
        for request, out in zip(requests, outputs, strict=True):
            out.seed = request.sampling_params.seed
            if out.error is None and not out.aborted:
                out.images = to_output_type(out.images, request.sampling_params.output_type)
        return list(outputs)

    def activate_lora(self, lora: str | None, scale: float) -> None:
        """Load (once) and activate the wave's adapter; no LoRA disables adapters."""
        wanted = (lora, scale if lora is not None else None)
        if wanted == self._active_lora:
            return
        if lora is not None and lora not in self._loaded_loras:
            path = lora
            if not os.path.exists(path):
                raise ModelNotFoundError(f"LoRA adapter {lora!r} not found", param="lora")
            try:
                self.pipeline.load_lora(_adapter_name(lora), path)
            except Exception as exc:
                # whatever part of it did load is not active any more: the next wave sets
                # its own adapter (or none) again
                self._active_lora = None
                if not _is_the_adapters_fault(exc):
                    raise
                raise LoraLoadError(
                    f"LoRA adapter {os.path.basename(os.path.normpath(lora))!r} could not be "
                    f"loaded into this model: {type(exc).__name__}: {exc}", param="lora",
                ) from exc
            self._loaded_loras.add(lora)
        self.pipeline.set_lora(_adapter_name(lora) if lora is not None else None, scale)
        self._active_lora = wanted


class LoraLoadError(InvalidRequestError):
    """The request's LoRA adapter does not load into this model (the caller's 400)."""


def _is_the_adapters_fault(exc: BaseException) -> bool:
    """Whether a failed LoRA load is the adapter's fault (a corrupt file, weights for
    another model), not the server's (no LoRA support, memory, file permissions)."""
    return not isinstance(exc, NotImplementedError | MemoryError | PermissionError) \
        and "OutOfMemory" not in type(exc).__name__


def partial_image_sender(
    on_partial_image: Callable[[PartialImage], None] | None, requests: list[DiffusionRequest]
) -> Callable[[PartialImage], None] | None:
    """`on_partial_image`, handed each partial image of `requests` converted as its
    request's outputs are (`to_output_type`); None for None."""
    if on_partial_image is None:
        return None
    output_types = {r.request_id: r.sampling_params.output_type for r in requests}

    def send(partial: PartialImage) -> None:
        image = partial.image
        if isinstance(image, torch.Tensor):  # [C, H, W] in [0, 1]
            output_type = output_types.get(partial.request_id, "pil")
            partial.image = to_output_type(image.unsqueeze(0), output_type)[0]
        on_partial_image(partial)

    return send


def _adapter_name(path: str) -> str:
    """A stable adapter name for a LoRA path (peft names may not contain dots)."""
    name = os.path.basename(os.path.normpath(path)) or "adapter"
    return "".join(c if c.isalnum() else "_" for c in name) + f"_{zlib.crc32(path.encode()):08x}"
