"""The public engine: submit prompts, get each request's own images, error or abort.

`Engine` validates and resolves each request (pipeline defaults, seed, LoRA path,
batch key), hands it to the `EngineCore` loop, and resolves one future per
request exactly once: with its output, its abort, or the engine's closing. Sync
callers (`generate`) wait on those futures; async callers (`generate_async`) await
them, and cancelling the await aborts the request. `generate_stream` also yields the
request's partial images while its wave runs (`partial_images.py` routes them).

    from diffbatch import Engine, SamplingParams
    with Engine("tiny-sd", max_num_seqs=4, request_batch_max_wait_ms=20) as engine:
        outs = engine.generate(["a cat", "a dog"], SamplingParams(seed=7))

    async for item in engine.generate_stream("a cat", SamplingParams(partial_images=2)):
        ...  # PartialImage, PartialImage, then the DiffusionOutput
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import random
import threading
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any

from diffbatch.config import AUTO_REQUEST_WORK_FACTOR, EngineConfig
from diffbatch.engine.batch_policy import BatchPolicy
from diffbatch.engine.calibration import calibrate
from diffbatch.engine.core import EngineCore
from diffbatch.engine.lora_registry import LoraRegistry
from diffbatch.engine.partial_images import PartialImageRouter
from diffbatch.engine.request_checks import (
    check_against_model,
    check_task,
    resolve_num_frames,
)
from diffbatch.engine.step_dispatch import StepDispatch
from diffbatch.engine.wave_dispatch import WaveDispatch
from diffbatch.engine.wave_log import WaveLog
from diffbatch.errors import (
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    PipelineError,
    QueueFullError,
)
from diffbatch.executor.abstract import Executor
from diffbatch.metrics import EngineMetrics
from diffbatch.models import DEFAULT_MODEL
from diffbatch.outputs import DiffusionOutput, PartialImage, RequestError, finalize_images
from diffbatch.pipelines.family_rules import prompt_layout
from diffbatch.pipelines.interface import PipelineInfo
from diffbatch.request import DiffusionRequest, RequestStatus, validate_prompt
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
from diffbatch.step_cache import StepCacheConfig

logger = logging.getLogger(__name__)

_TQDM_MIN_PROMPTS = 16  # `generate` shows a progress bar from this many prompts on
_SHUTTING_DOWN = "the server is shutting down"
# What `shutdown()` gives the last waves and the worker to stop once the shutdown
# timeout passed: an interrupted wave stops at its next step, well within it.
SHUTDOWN_GRACE_S = 2.0


def resolve_request_batch_support(pipeline_class: Any) -> tuple[type | None, bool]:
    """Resolve the configured pipeline class and read `supports_request_batch`.

    None (the default `DiffusersT2IPipeline`, which batches) stays None: this process
    then never imports diffusers (seconds of CPU); the worker loads the class.
    """
    if pipeline_class is None:
        return None, True
    from diffbatch.pipelines.registry import resolve_pipeline_class

    cls = resolve_pipeline_class(pipeline_class)
    return cls, bool(getattr(cls, "supports_request_batch", False))


class Engine:
    """A diffusion serving engine with request-level batching.

    Args:
        model: local diffusers folder, hub id or built-in model name (None = default).
        **options: `EngineConfig` fields, e.g. `max_num_seqs`,
            `request_batch_max_wait_ms`, `executor` ("mp" or "inproc"),
            `pipeline_class`, and `pipeline_kwargs` (a dict for the pipeline's
            `from_pretrained`). An unknown name raises `ConfigError` naming it.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self._start(EngineConfig.from_options(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    # -- start-up --------------------------------------------------------------------
    def _start(self, config: EngineConfig) -> None:
        if config.model is None:  # name the default model, for logs and /v1/models
            config = dataclasses.replace(config, model=DEFAULT_MODEL)
        self.config = config
        self._closed = False
        self._draining = False  # shutdown() began: no new requests
        self._close_done = threading.Event()
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future[DiffusionOutput]] = {}
        self._rng = random.Random(config.seed)
        self.loras = LoraRegistry(config.lora_modules, config.lora_dir)  # served by name
        # 1. The model's name and the capability (a class attribute), before anything
        #    is loaded: a misspelt model fails here, not after a worker started.
        from diffbatch.pipelines.registry import check_diffusers_folder, check_model_spec

        check_model_spec(config.model)
        if config.pipeline_class is None and not config.pipeline_kwargs:
            check_diffusers_folder(config.model)  # (what the diffusers adapter reads)
        self.pipeline_class, self.supports_request_batch = resolve_request_batch_support(
            config.pipeline_class
        )
        if config.capacity_limit > 1 and not config.auto_capacity \
                and not self.supports_request_batch:
            diffusers_class = getattr(self.pipeline_class, "diffusers_class", None)
            if diffusers_class is not None:  # a diffusers class named as pipeline_class
                raise ConfigError(
                    f"max_num_seqs={config.max_num_seqs} needs a pipeline that batches "
                    f"requests, but pipeline_class {diffusers_class.__name__} (a diffusers "
                    "class) runs one request per forward; use max_num_seqs=1, or leave "
                    "pipeline_class out: diffbatch's adapter batches the model's own "
                    "pipeline")
            raise ConfigError(
                f"max_num_seqs={config.max_num_seqs} needs a pipeline with "
                f"`supports_request_batch = True`, but "
                f"{getattr(self.pipeline_class, '__name__', 'the pipeline')} does "
                "not declare it; use max_num_seqs=1 or a batch-capable pipeline class"
            )
        # 2. The executor loads the pipeline (in a worker process for "mp"); partial
        #    images it receives go to the streams that asked for them.
        self.executor = Executor.get_class(config.executor)(config)
        self.info: PipelineInfo = self.executor.info
        self.partial_images = PartialImageRouter()
        self.executor.set_partial_image_listener(self.partial_images.deliver)
        if config.step_execution and not self.info.supports_step_execution:
            self.executor.shutdown()
            raise ConfigError(
                f"step execution needs a pipeline that implements the step contract, but "
                f"{self.info.name} does not (supports_step_execution=False); serve it "
                "without --step-execution"
            )
        self.step_cache = StepCacheConfig.parse(config.step_cache, "step_cache")
        if self.step_cache.enabled and self.info.step_cache_unsupported is not None:
            self.executor.shutdown()
            raise ConfigError(f"--step-cache {config.step_cache}: "
                              f"{self.info.step_cache_unsupported}")
        # LoRA adapters known at start-up are read and checked by the runner now: a bad
        # --lora-modules entry fails start-up, naming it.
        try:
            self.loras.attach(self.executor)
        except BaseException:
            self.executor.shutdown()
            raise
        # 3. The loop with its metrics and wave log, then a warm-up request through the
        # whole path. The gauges read the core when scraped.
        self.max_request_work = self._request_work_limit()
        self.policy = BatchPolicy(config, self.info,
                                  supports_request_batch=self.supports_request_batch)
        # What the core's threads call back holds the Engine weakly: an Engine dropped
        # without `close()` is collected, and its finalizer stops them and the worker.
        me = weakref.ref(self)
        self.metrics = EngineMetrics(
            # (me() is alive while its metrics are scraped)
            lambda: me().core.num_waiting,  # type: ignore[union-attr]
            lambda: me().core.num_running,  # type: ignore[union-attr]
            lambda: me().core.num_waiting_by_key(), self.policy,  # type: ignore[union-attr]
            worker_health=self.executor.health_stats,
            compile_stats=self.executor.compile_stats,
        )
        self.wave_log = WaveLog()  # the waves served since start-up, for `GET /v1/waves`
        self.core = EngineCore(config, self.executor, policy=self.policy,
                               deliver=_weakly(self._deliver), metrics=self.metrics,
                               wave_log=self.wave_log,
                               dispatch=StepDispatch() if config.step_execution
                               else WaveDispatch())
        self.core.start()
        self._finalizer = weakref.finalize(self, _release_dropped, self.core, self.executor,
                                           self._futures, self._lock)
        self._finalizer.atexit = False  # at exit the executors' own handler stops workers
        if config.warmup:
            self._warmup()
        # 4. "auto": seed the cost curve at the model's default shape.
        if self.policy.learns and config.calibration_budget_s > 0:
            try:
                report = calibrate(self.executor, self.info, self.policy,
                                   config.calibration_budget_s)
            except BaseException:
                self.close()
                raise
            logger.info("calibration: %s; capacity at %s: %d", report.describe(),
                        self.policy.default_shape.label(report.steps),
                        self.policy.cost.capacity(self.policy.default_shape, report.steps))
        # 5. Start-up is over: what runs from here on is counted (see `start_serving`).
        self.core.start_serving()
        logger.info(
            "engine ready: model=%s pipeline=%s batch=%s max_num_seqs=%s (limit %d) wait=%s "
            "executor=%s",
            config.model, self.info.name, self.supports_request_batch, config.max_num_seqs,
            self.policy.limit, config.request_batch_max_wait_ms, config.executor,
        )

    def _mixed_reference_size(self, params: SamplingParams) -> tuple[int, int] | None:
        """With `mixed_resolution` on a pipeline that packs sizes, the size a
        text-to-image request's key holds instead of its own (the model's default:
        capacity is counted in its pixels); None keeps the request's size."""
        if not self.config.mixed_resolution or not self.info.supports_mixed_resolution \
                or params.task != "text-to-image":
            return None
        return self.info.default_height, self.info.default_width

    def _request_work_limit(self) -> int | None:
        """The most pixel-steps (width x height x steps) one image of a request may ask
        for; None = no limit. "auto" scales the model's default image."""
        limit = self.config.max_request_work
        if limit == "auto":
            info = self.info
            return (AUTO_REQUEST_WORK_FACTOR * info.default_height * info.default_width
                    * info.default_num_inference_steps * (info.default_num_frames or 1))
        return int(limit) or None

    def _warmup(self) -> None:
        params = SamplingParams(num_inference_steps=1, seed=0)
        _, future = self._submit("warm-up", params, f"warmup-{uuid.uuid4().hex}", 0)
        output = future.result()
        if not output.ok:
            message = output.error.message if output.error else "aborted"
            self.close()
            info = self.info
            raise PipelineError(
                f"engine start-up failed: the warm-up request failed: {message} (it ran at "
                f"the model's default size {info.default_width}x{info.default_height}, 1 "
                "step; start with --no-warmup, EngineConfig(warmup=False), to skip it)")

    # -- LoRA adapters served by name ------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` under `name` from now on (vLLM's
        `load_lora_adapter`). The runner reads, checks and loads it now (after the
        running wave, or between two steps): a bad adapter raises
        `InvalidRequestError` naming `name` and the reason."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name` (False if it was not served by name); the runner
        drops its weights once no running wave uses them."""
        return self.loras.remove(name)

    # -- requests --------------------------------------------------------------------
    def resolve_params(self, params: SamplingParams | None) -> SamplingParams:
        """Fill in pipeline defaults, a seed and the LoRA path; check the size."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"`sampling_params` must be a SamplingParams, got {type(params).__name__}",
                param="sampling_params",
            )
        info = self.info
        check_task(info, params)
        # An edit's size is its image's (SamplingParams checked any given size equals it).
        image_height, image_width = (
            (None, None) if params.image is None else params.image.shape[:2]
        )
        strength = params.strength
        if strength is None and params.image is not None:
            strength = info.default_strengths[params.task]
        resolved = params.clone(
            height=params.height or image_height or info.default_height,
            width=params.width or image_width or info.default_width,
            num_inference_steps=params.num_inference_steps or info.default_num_inference_steps,
            guidance_scale=(info.default_guidance_scale if params.guidance_scale is None
                            else params.guidance_scale),
            seed=self._rng.randrange(2**31) if params.seed is None else params.seed,
            lora=self.loras.resolve(params),
            strength=strength,
            extra=resolve_num_frames(info, params),
            step_cache=self.step_cache if params.step_cache is None else params.step_cache,
        )
        if resolved.step_cache is not None and resolved.step_cache.enabled \
                and info.step_cache_unsupported is not None:
            raise InvalidRequestError(
                f"`step_cache`: {info.step_cache_unsupported}", param="step_cache")
        check_against_model(info, resolved, self.max_request_work)
        return resolved

    def _prepare(
        self, prompt: str, params: SamplingParams | None, request_id: str | None, priority: int,
        *, streamed: bool = False,
    ) -> DiffusionRequest:
        """Validate and resolve one request (no side effects). Only a `streamed` request
        keeps its `partial_images`: elsewhere nobody would receive them."""
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self._draining:
            raise EngineClosedError(_SHUTTING_DOWN + " and takes no new requests; retry")
        validate_prompt(prompt)
        resolved = self.resolve_params(params)
        if resolved.partial_images and not streamed:
            resolved = resolved.clone(partial_images=0)
        request_id = uuid.uuid4().hex if request_id is None else request_id
        request = DiffusionRequest(request_id, prompt, resolved, priority=priority)
        cfg_enabled = self.info.cfg_enabled(resolved)
        # NOTE: per-request guidance was checked on the text-to-image pipelines only;
        # edits keep the guidance scale in their key, so an edit wave has one scale.
        request.key = SamplingParamsKey.from_params(
            resolved, cfg_enabled=cfg_enabled,
            per_request_guidance=self.info.supports_per_request_guidance
            and resolved.task == "text-to-image",
            reference_size=self._mixed_reference_size(resolved),
            guidance_used=self.info.uses_guidance_scale,
            prompt_layout=prompt_layout(self.info, prompt, resolved),
        )
        if self.config.step_execution:  # each request runs its own schedule
            request.key = request.key.for_step_execution()
        return request

    def _add(
        self, requests: list[DiffusionRequest]
    ) -> list[concurrent.futures.Future[DiffusionOutput]]:
        """Register one future per request and queue them all at once."""
        futures: list[concurrent.futures.Future[DiffusionOutput]] = []
        with self._lock:
            if self._draining:  # shutdown() began while this request was prepared
                raise EngineClosedError(_SHUTTING_DOWN + " and takes no new requests; retry")
            ids = [r.request_id for r in requests]
            repeated = sorted(i for i, count in collections.Counter(ids).items() if count > 1)
            if repeated:
                raise InvalidRequestError(
                    f"request id {repeated[0]!r} is given more than once; each request "
                    "needs its own id", param="request_id")
            active = sorted(i for i in ids if i in self._futures)
            if active:
                raise InvalidRequestError(
                    f"request id {active[0]!r} is already active", param="request_id"
                )
            limit = self.config.max_queue_size
            if limit is not None and len(requests) > limit:
                raise QueueFullError(
                    f"{len(requests)} requests submitted together are more than the waiting "
                    f"queue holds (max_queue_size={limit}); submit at most {limit} at once")
            if limit is not None and self.core.num_waiting + len(requests) > limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
            for request in requests:
                future: concurrent.futures.Future[DiffusionOutput] = concurrent.futures.Future()
                self._futures[request.request_id] = future
                futures.append(future)
        try:
            self.core.add_requests(requests)
        except Exception:
            with self._lock:
                for request in requests:
                    self._futures.pop(request.request_id, None)
            raise
        return futures

    def _submit(
        self, prompt: str, params: SamplingParams | None, request_id: str | None, priority: int,
    ) -> tuple[DiffusionRequest, concurrent.futures.Future[DiffusionOutput]]:
        with self._counting_rejections(1):
            request = self._prepare(prompt, params, request_id, priority)
            return request, self._add([request])[0]

    def _deliver(self, request: DiffusionRequest, output: DiffusionOutput) -> None:
        """Resolve the request's future exactly once (later calls are no-ops)."""
        with self._lock:
            future = self._futures.pop(request.request_id, None)
        if future is None:
            return
        output.total_time_ms = (time.monotonic() - request.arrival_time) * 1000.0
        if output.ok:
            try:
                output_type = request.sampling_params.output_type
                output.images = finalize_images(output.images, output_type)
            except Exception as exc:  # a malformed result fails only this request
                output.images, output.error = None, RequestError.from_exception(exc)
        if self.core.serving:  # the warm-up request is not served traffic
            outcome = "aborted" if output.aborted else ("error" if output.error else "completed")
            queue_s = output.queue_time_ms / 1000.0 if output.batch_size else None
            self.metrics.observe_finished(outcome, queue_s, output.total_time_ms / 1000.0)
            if output.cached_steps is not None and output.computed_steps is not None:
                self.metrics.observe_step_cache(str(self.config.model), output.computed_steps,
                                                output.cached_steps)
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_result(output)  # suppressed: the future was cancelled by its caller

    @contextlib.contextmanager
    def _counting_rejections(self, count: int) -> Iterator[None]:
        """Count `count` requests as rejected if admitting them raises (invalid input,
        a full queue): the engine's one place for its own refusals."""
        try:
            yield
        except (InvalidRequestError, QueueFullError):
            self.record_rejected(count)
            raise

    def record_rejected(self, count: int = 1) -> None:
        """Count requests rejected before they reached the queue (outcome "rejected")."""
        self.metrics.requests.labels(outcome="rejected").inc(count)

    # -- public API ------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        use_tqdm: bool = True,
    ) -> list[DiffusionOutput]:
        """Submit every prompt as its own request and wait for all of them.

        Returns one `DiffusionOutput` per prompt, in order; a failed request has
        `error` set and does not raise. Invalid input (`InvalidRequestError`, naming the
        prompt's index in a list), a full queue or a closed engine raise before anything
        is submitted.
        """
        if not isinstance(prompts, str) and (
                isinstance(prompts, bytes | dict) or not hasattr(prompts, "__iter__")):
            raise InvalidRequestError(
                f"`prompts` must be a string or a list of strings, got "
                f"{type(prompts).__name__}", param="prompt")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if isinstance(sampling_params, SamplingParams | None):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, dict) or not hasattr(sampling_params, "__iter__"):
            raise InvalidRequestError(
                f"`sampling_params` must be a SamplingParams or one per prompt, got "
                f"{type(sampling_params).__name__}"
                + (" (build one: SamplingParams(**options))"
                   if isinstance(sampling_params, dict) else ""),
                param="sampling_params")
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"`sampling_params` must be one SamplingParams or one per prompt: got "
                    f"{len(params_list)} for {len(prompts)} prompts", param="sampling_params",
                )
        if request_ids is not None and len(request_ids) != len(prompts):
            raise InvalidRequestError(
                f"`request_ids` must have one id per prompt: got {len(request_ids)} for "
                f"{len(prompts)} prompts", param="request_ids",
            )
        with self._counting_rejections(len(prompts)):
            requests = []
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                try:
                    requests.append(self._prepare(
                        prompt, params, None if request_ids is None else request_ids[i], 0))
                except InvalidRequestError as exc:
                    if len(prompts) > 1:  # which one, of a list (nothing was submitted)
                        exc.message = f"prompt {i}: {exc.message}"
                        exc.args = (exc.message,)
                    raise
            futures = self._add(requests)
        from tqdm import tqdm

        show = use_tqdm and len(futures) >= _TQDM_MIN_PROMPTS
        with tqdm(total=len(futures), desc="generate", unit="req", disable=not show) as bar:
            for future in futures:
                future.add_done_callback(lambda _: bar.update(1))
            try:
                return [future.result() for future in futures]
            except BaseException:  # Ctrl-C while waiting: nobody waits for them now
                self.abort([request.request_id for request in requests])
                raise

    def incoming_request(self) -> Callable[[], None]:
        """Tell the engine a request is on its way in (a front end began receiving it),
        so an admission wait gathers it with the requests sent beside it; call the
        returned function (idempotent) once it is added or will not be."""
        self.core.announce_incoming(1)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.core.announce_incoming(-1)
        return release

    async def generate_async(
        self,
        prompt: str,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> DiffusionOutput:
        """Submit one request and await its output; cancelling the await aborts it.

        Raises at once for invalid input (`InvalidRequestError`), a full queue
        (`QueueFullError`) or a closed engine; otherwise returns the output, with
        `error` set if the request failed.
        """
        request, future = self._submit(prompt, sampling_params, request_id, priority)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    async def generate_stream(
        self,
        prompt: str,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[PartialImage | DiffusionOutput, None]:
        """Submit one request; yield its partial images as its wave makes them, then its
        output, last. Leaving the iteration early (or cancelling it) aborts the request.

        The request gets up to `sampling_params.partial_images` previews of each image
        (`PartialImage`: `index`, `image_index`, `step`, and `image` in the request's
        output type), taken at evenly spaced steps while it shares its wave with any
        other requests. Raises at once as `generate_async` does; otherwise the last
        item is the `DiffusionOutput`, with `error` set if the request failed.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[PartialImage | None] = asyncio.Queue()

        def put(item: PartialImage | None) -> None:  # from the executor's or delivery thread
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                loop.call_soon_threadsafe(queue.put_nowait, item)

        with self._counting_rejections(1):
            request = self._prepare(prompt, sampling_params, request_id, priority,
                                    streamed=True)
            self.partial_images.open(request.request_id,
                                     request.sampling_params.output_type, put)
            try:
                future = self._add([request])[0]
            except BaseException:
                self.partial_images.close(request.request_id)
                raise
        # NOTE: the output comes after every preview: the executor hands previews out
        # before it returns the wave, and both reach the event loop through its FIFO
        # `call_soon_threadsafe` queue.
        future.add_done_callback(lambda _: put(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            yield future.result()
        finally:
            self.partial_images.close(request.request_id)
            if not future.done():
                self.abort(request.request_id)

    def abort(self, request_id: str | Sequence[str]) -> bool:
        """Abort waiting or running requests; their callers get an aborted output.

        Returns whether any request was aborted by this call.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = self.core.abort_requests(ids)
        for request in aborted:
            self._deliver(request, DiffusionOutput.make_aborted(request.request_id))
        return bool(aborted)

    def check_health(self) -> None:
        """Raise `EngineDeadError` unless the loop and the executor can take work."""
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self._draining:
            raise EngineClosedError(_SHUTTING_DOWN)
        if not self.core.is_running:
            raise EngineDeadError("the engine loop is not running")
        self.executor.check_health()

    @property
    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_unfinished(self) -> int:
        """Requests whose caller has not been answered yet."""
        with self._lock:
            return len(self._futures)

    def shutdown(self, timeout_s: float) -> None:
        """Stop gracefully within `timeout_s`, then close (the server's SIGTERM path).

        At once: refuse new requests and answer every waiting one (they have not
        started) with `EngineClosedError`. Running waves may finish until `timeout_s`
        has passed; then they are interrupted (at their next denoising step) and their
        requests answered the same way. Every error says the server is shutting down
        and maps to a 503 the client may retry elsewhere. Then `close(grace_s)`.
        """
        with self._lock:
            busy = self._closed or self._draining
            self._draining = True
        if busy:  # a second call returns once the first is done, as `close` does
            self._close_done.wait(timeout_s + 6 * SHUTDOWN_GRACE_S)
            return
        logger.info("shutting down: %d request(s) waiting, %d running; running waves may "
                    "finish within %g s", self.core.num_waiting, self.core.num_running,
                    timeout_s)
        # A worker that dies from here on is not replaced (it would load the model for
        # nobody), and the requests it ran are answered as shut down, not re-run.
        self.executor.stop_restarting()
        self.core.drain(EngineClosedError(
            f"{_SHUTTING_DOWN}: the worker process stopped under this request; retry it"))
        waiting = self.core.finish_waiting(RequestStatus.FINISHED_ERROR)
        self._fail(waiting, EngineClosedError(
            _SHUTTING_DOWN + ": this request had not started; retry it"))
        if not self.core.wait_idle(timeout_s):
            cut = self.core.abort_requests(self.core.open_request_ids(),
                                           RequestStatus.FINISHED_ERROR)
            logger.warning("shutdown timeout (%g s) passed: interrupting %d running "
                           "request(s)", timeout_s, len(cut))
            self._fail(cut, EngineClosedError(
                f"{_SHUTTING_DOWN}: this request did not finish within the shutdown timeout "
                f"({timeout_s:g} s) and was stopped; retry it"))
        self.close(timeout_s=SHUTDOWN_GRACE_S)

    def _fail(self, requests: list[DiffusionRequest], exc: Exception) -> None:
        error = RequestError.from_exception(exc)
        for request in requests:
            self._deliver(request, DiffusionOutput.from_error(request.request_id, error))

    def close(self, timeout_s: float | None = None) -> None:
        """Fail every open request with "engine is closed", stop the loop and workers.

        `timeout_s` bounds each stage of stopping (the last waves, then the worker);
        None waits as long as a stuck worker takes to stop (up to a minute per stage).
        A second call waits for the first to finish.
        """
        with self._lock:
            closing = getattr(self, "_closed", True)
            self._closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()  # closed here: nothing is left for the finalizer
        if closing:
            if hasattr(self, "_close_done"):  # bounded like the first call's stages
                self._close_done.wait(6 * timeout_s if timeout_s is not None else None)
            return
        # (closed in the middle of `shutdown`, e.g. by a server's forced exit: its callers
        # are told what `shutdown` tells them, a shutdown to retry elsewhere)
        reason = (f"{_SHUTTING_DOWN}: this request was stopped before it finished; retry it"
                  if getattr(self, "_draining", False) else "engine is closed")
        try:
            open_requests = self.core.stop()  # cancels the waves in flight
            self._fail(open_requests, EngineClosedError(reason))
            # Joining lets the delivery thread hand out what finished just before.
            if timeout_s is None:
                self.core.join()
            else:
                self.core.join(timeout_s)
            _fail_open_futures(self._futures, self._lock, "engine is closed")
            if timeout_s is None:
                self.executor.shutdown()
            else:
                self.executor.shutdown(timeout_s=timeout_s)
                self.core.join(timeout_s)  # the loop ends once the executor failed its waves
        finally:
            self._close_done.set()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """`method` (bound) as a callback that does not keep its object alive; a call after
    the object was collected does nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _fail_open_futures(futures: dict[str, concurrent.futures.Future[DiffusionOutput]],
                       lock: threading.Lock, message: str) -> None:
    """Resolve every future still registered with an `EngineClosedError(message)` output."""
    error = RequestError.from_exception(EngineClosedError(message))
    with lock:
        leftovers = list(futures.items())
        futures.clear()
    for request_id, future in leftovers:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled, set
            future.set_result(DiffusionOutput.from_error(request_id, error))


def _release_dropped(core: EngineCore, executor: Executor,
                     futures: dict[str, concurrent.futures.Future[DiffusionOutput]],
                     lock: threading.Lock) -> None:
    """What `Engine.close` does, for an Engine collected without it: fail what is still
    open, stop the loop and the worker. It runs where the last reference went; on one
    of the core's own threads (a delivery that held it last) it hands itself to a new
    thread, which may join them."""
    if threading.current_thread() in core.threads():
        threading.Thread(target=_release_dropped, args=(core, executor, futures, lock),
                         name="diffbatch-release", daemon=True).start()
        return
    logger.info("an Engine was dropped without close(): stopping its loop and worker")
    core.stop()
    _fail_open_futures(futures, lock,
                       "engine is closed: it was garbage-collected without close()")
    executor.shutdown(timeout_s=SHUTDOWN_GRACE_S)
    core.join(SHUTDOWN_GRACE_S)


__all__ = ["Engine", "RequestStatus", "resolve_request_batch_support"]
