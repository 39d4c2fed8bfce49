"""The model runner: turns one scheduler wave into one pipeline forward.

Per request it makes the generators from the request's seed and maps the output,
error or abort back to the request id. Once per wave it refreshes the pipeline's
caches, makes the wave's LoRA adapters resident (`lora_residency.py`; a request whose
adapter does not load fails alone), hands the pipeline each request's adapter stack
(`set_lora_wave`: requests with different adapters share the forward), and calls
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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from diffbatch.errors import InvalidRequestError, PipelineError, WaveInterrupted
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput, PartialImage, RequestError
from diffbatch.pipelines.interface import DiffusionRequestBatch
from diffbatch.sched.output import SchedulerOutput
from diffbatch.worker.lora_files import LoraFileRules
from diffbatch.worker.lora_residency import LoraResidency

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.pipelines.interception.compiled import CompileStats
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
    Videos ([n, F, C, H, W]) likewise keep their frame dimension: [n, F, H, W, C].
    Anything that is not a tensor (a pipeline returning PIL images itself) passes through.
    """
    if not isinstance(images, torch.Tensor):
        return images
    images = images.detach().to("cpu", torch.float32)
    if output_type == "pt":
        return images.contiguous()
    images = images.clamp(0, 1)
    images = images.permute(0, 1, 3, 4, 2) if images.ndim == 5 else images.permute(0, 2, 3, 1)
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
        self.compile_stats: CompileStats | None = None  # set when --compile is on
        self.loras = LoraResidency(pipeline, config.max_loras, lora_file_rules(config))
        self._num_forwards = 0  # forwards run for the current wave (bisection adds some)
        self._should_stop: Callable[[], bool] = lambda: False  # the current wave's
        # where the current wave's partial images go; None: nobody listens
        self._on_partial_image: Callable[[PartialImage], None] | None = None
        if config.compile != "off":
            self._compile()

    def info(self) -> PipelineInfo:
        return self._info

    def _compile(self) -> None:
        """Compile and warm the pipeline's modules (`--compile`) before the worker says
        ready; any failure leaves the pipeline eager, with one log line."""
        from diffbatch.compile import compile_settings
        from diffbatch.request import DiffusionRequest
        from diffbatch.sampling_params import SamplingParams

        settings = compile_settings(self.config)
        info = self._info
        params = SamplingParams(
            height=info.default_height, width=info.default_width, num_inference_steps=1,
            guidance_scale=info.default_guidance_scale, seed=0, output_type="pt")
        request = DiffusionRequest("compile-warm-up", "warm-up", params)
        start = time.perf_counter()
        try:
            stats = self.pipeline.compile(settings, lambda: self._run([request]))
        except Exception as exc:  # (NotImplementedError included) never a dead server
            logger.warning("--compile %s: compiling failed, serving eagerly: %s: %s",
                           settings.target, type(exc).__name__, exc)
            return
        self.compile_stats = stats
        logger.info("compiled %s in %.1f s (backend %s, buckets %s; inductor cache: %d "
                    "hits, %d misses)", ", ".join(stats.buckets) or "nothing",
                    time.perf_counter() - start, settings.backend,
                    "; ".join(f"{name}: {','.join(map(str, rows)) or 'dynamic'}"
                              for name, rows in stats.buckets.items()) or "none",
                    stats.cache_hits, stats.cache_misses)

    # -- LoRA adapters loaded by the engine ------------------------------------------
    def load_lora(self, key: str) -> str:
        """Read, check and load the adapter `key` names (`LoraResidency.load`); returns
        the key of the version read. A refused adapter raises `InvalidRequestError`
        (`lora_path`) naming the client's adapter name and the reason."""
        try:
            return self.loras.load(key)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.message, param="lora_path") from None
        except NotImplementedError:
            raise InvalidRequestError(f"{self._info.name} does not support LoRA adapters",
                                      param="lora_path") from None

    def unload_lora(self, key: str) -> None:
        """Drop the weights of adapter `key` (when the last wave using it ends)."""
        self.loras.forget(key)

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
        loads, evictions = self.loras.num_loads, self.loras.num_evictions
        try:
            outputs = self._run_wave(requests, scheduler_output.wave_id)
        except WaveInterrupted:
            logger.info("wave %d (%d requests) stopped early: none of its requests is wanted "
                        "any more", scheduler_output.wave_id, len(requests))
            aborted = BatchRunnerOutput.aborted(scheduler_output.req_ids)
            aborted.forward_time_ms = (time.perf_counter() - start) * 1000.0
            return aborted  # num_forwards 0: no forward finished, nothing for the cost model
        forward_ms = (time.perf_counter() - start) * 1000.0
        for out in outputs:
            out.execute_time_ms = forward_ms
            out.batch_size = len(requests)
        peak, free = memory_usage(self._info.device)
        return BatchRunnerOutput(
            outputs={out.request_id: out for out in outputs}, forward_time_ms=forward_ms,
            num_forwards=self._num_forwards, peak_memory_bytes=peak, free_memory_bytes=free,
            num_lora_adapters=len({p for r in requests for p in self.loras.paths(r)}),
            num_lora_loads=self.loras.num_loads - loads,
            num_lora_evictions=self.loras.num_evictions - evictions,
        )

    def _run_wave(self, requests: list[DiffusionRequest], wave_id: int) -> list[DiffusionOutput]:
        """The wave's outputs, in order: its requests in parts of at most `max_loras`
        distinct adapters (one part, one forward, in the common case), each part's
        adapters made resident first; a request whose adapter does not load fails
        alone, its mates run."""
        results: dict[str, DiffusionOutput] = {}
        for part in self._lora_parts(requests, results):
            paths = [p for r in part for p in self.loras.paths(r)]
            errors = self.loras.acquire(paths)
            try:
                runnable = []
                for request in part:
                    failed = [errors[p] for p in self.loras.paths(request) if p in errors]
                    if failed:
                        results[request.request_id] = DiffusionOutput.from_error(
                            request.request_id, failed[0])
                    else:
                        runnable.append(request)
                if runnable:
                    for out in self._run_isolating(runnable, wave_id):
                        results[out.request_id] = out
            finally:
                self.loras.release(p for p in paths if p not in errors)
        return [results[r.request_id] for r in requests]

    def _lora_parts(self, requests: list[DiffusionRequest],
                    results: dict[str, DiffusionOutput]) -> list[list[DiffusionRequest]]:
        """`requests` cut, in order, into parts needing at most `max_loras` adapters;
        a request that alone needs more gets its error in `results`."""
        parts: list[list[DiffusionRequest]] = [[]]
        needed: set[str] = set()
        limit = self.loras.max_loras
        for request in requests:
            own = set(self.loras.paths(request))
            if len(own) > limit:
                results[request.request_id] = DiffusionOutput.from_error(
                    request.request_id, InvalidRequestError(
                        f"the request stacks {len(own)} LoRA adapters, more than this server "
                        f"loads at once (--max-loras {limit})", param="lora"))
                continue
            if parts[-1] and len(needed | own) > limit:
                parts.append([])
                needed = set()
            parts[-1].append(request)
            needed |= own
        return [part for part in parts if part]

    def _run_isolating(self, requests: list[DiffusionRequest],
                       wave_id: int) -> list[DiffusionOutput]:
        """One forward over `requests`; if it fails, the failing ones found by bisection
        (or all of them failed alike, per `batch_error_isolation`)."""
        try:
            return self._run(requests)
        except WaveInterrupted:
            raise
        except Exception as exc:  # the pipeline failed: the wave's requests fail, we don't
            logger.warning("wave %d (%d requests) failed: %s: %s", wave_id, len(requests),
                           type(exc).__name__, exc)
            # NOTE: a broken output contract (PipelineError) is the pipeline's bug at any
            # batch size; bisecting would only hide it, so only exceptions are isolated.
            isolate = not isinstance(exc, PipelineError) and len(requests) > 1
            if self.config.batch_error_isolation == "bisect" and isolate:
                before = self._num_forwards
                outputs = self._isolate(requests, exc)
                logger.warning("wave %d: isolated %d failing request(s) with %d extra forwards",
                               wave_id, sum(o.error is not None for o in outputs),
                               self._num_forwards - before)
                return outputs
            error = RequestError.from_exception(exc)
            return [DiffusionOutput.from_error(r.request_id, error) for r in requests]

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
        set_lora_wave: bool = True,
    ) -> list[DiffusionOutput]:
        """One pipeline forward over `requests` (a wave, or step mode's single request)
        and the per-request mapping of its outputs; raises what the forward raises.
        The requests' adapters are resident (`_run_wave`); the batch carries their
        stacks, and with `set_lora_wave` the pipeline is also handed them the older
        way (step mode's interleaved calls leave that pipeline-wide state alone)."""
        # 1. Per-request set-up: generators from each request's own seed.
        generators = make_generators(requests, self._info.device)
        stacks = [self.loras.stack_names(r) for r in requests]
        batch = DiffusionRequestBatch(requests=requests, generators=generators,
                                      should_stop=should_stop,
                                      on_partial_image=on_partial_image,
                                      lora_stacks=stacks)
        # 2. Once per wave: cache refresh and each request's adapter stack.
        self.pipeline.refresh_cache()
        if set_lora_wave:
            self.pipeline.set_lora_wave(stacks, batch.num_outputs_per_prompt)
        # 3. One forward for the whole wave, checked against the contract.
        self._num_forwards += 1
        try:
            with torch.inference_mode():
                outputs = self.pipeline.forward(batch)
        finally:
            if set_lora_wave:  # the stacks name adapters that may be evicted after the wave
                self.pipeline.set_lora_wave(None, 1)
        check_outputs(self._info.name, batch, outputs)
        # 4. Per-request output mapping.
        for request, out in zip(requests, outputs, strict=True):
            out.seed = request.sampling_params.seed
            if out.error is None and not out.aborted:
                out.images = to_output_type(out.images, request.sampling_params.output_type)
        return list(outputs)

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


def lora_file_rules(config: EngineConfig) -> LoraFileRules:
    """The adapter file rules of `config` (`--lora-allow-pickle`, `--max-lora-file-mb`;
    symlinks may lead into `--lora-dir`)."""
    return LoraFileRules(allow_pickle=config.lora_allow_pickle,
                         max_bytes=config.max_lora_file_mb << 20,
                         roots=(config.lora_dir,) if config.lora_dir else ())
