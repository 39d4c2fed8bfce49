"""The logic of `POST /v1/images/generations` and `/v1/images/edits`: one HTTP request,
one engine request.

A request runs in stages: `prepare_image` (`prepare_edit` for an edit) runs 1-2,
`generate` runs 3-5, and the route calls one after the other:

1. check what this server decides alone: the model name (or a LoRA adapter's, which
   selects it), `response_format`, `lora` names this server does not serve, whether
   the model can run an edit at all (before its uploads are decoded), and the size
   against the server's own limits (see `check_size`); what depends on the model (its
   size multiple and pixel cap, the call arguments it takes) is the engine's, checked
   once, when the request is added;
2. build `SamplingParams` (an edit first decodes its uploaded image and mask,
   `uploads.py`, in a worker thread);
3. await `Engine.generate_async` alone, under the request timeout. Nothing else is
   awaited with it, so concurrent HTTP requests sit in the engine's queue together
   and batch there. Cancelling this coroutine (client disconnect, timeout) aborts
   the request in the engine;
4. encode the images (PNG/JPEG/WebP, then base64, or kept in the `ImageStore` for
   `response_format: "url"`) in a worker thread, so encoding one response never
   blocks the event loop that serves the others;
5. build the OpenAI response.

A request with `stream: true` runs stages 3-5 in `stream` instead, as server-sent
events (`serving_stream.py`): each partial image is encoded and sent as its wave makes
it, then the image.

Nothing here counts refused requests: a refusal in stages 1-2 is counted with every
other refusal the server answers, once, by the metrics middleware's hook
(`api_server._rejection_counter`); one in stage 3 is the engine's own to count.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import io
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffbatch import request_work
from diffbatch.engine.request_checks import resolve_lora
from diffbatch.entrypoints.openai.errors import request_error_response
from diffbatch.entrypoints.openai.image_store import FILES_ROUTE, ImageStore, max_file_bytes
from diffbatch.entrypoints.openai.protocol import (
    QUALITY_STEP_FACTORS,
    DiffbatchInfo,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ImageObject,
    ModelAccepts,
)
from diffbatch.entrypoints.openai.serving_stream import EventKind, ImageStream, StreamedImages
from diffbatch.entrypoints.openai.uploads import decode_edit_inputs
from diffbatch.errors import (
    DiffbatchError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTimeoutError,
)
from diffbatch.image_size import largest_square, size_too_large
from diffbatch.sampling_params import MAX_SIDE, SamplingParams

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

    from diffbatch.engine.async_engine import Engine
    from diffbatch.entrypoints.openai.middleware import HTTPMetrics

logger = logging.getLogger(__name__)

# Default `--max-image-pixels`: width * height of one image (2048x2048).
DEFAULT_MAX_IMAGE_PIXELS = 2048 * 2048
# Quality of jpeg/webp when the request gives no `output_compression` (OpenAI's default).
DEFAULT_QUALITY = 100
# Default `--png-compress-level` (zlib, 0-9). PNG is lossless, so the level trades only
# encoding time for bytes; level 1 encodes several times faster than PIL's default 6 for
# a few more bytes (measured in docs/benchmarks.md, "Measured reasons in the code").
DEFAULT_PNG_COMPRESS_LEVEL = 1


@dataclass(frozen=True)
class SizeRule:
    """The `size` values that work on this server with its model, as its answers and its
    OpenAPI spec state them: sides that are multiples of the model's `multiple`, at
    most `max_side` each and `max_pixels` in all.

    A description, not a check: the server checks only its own limit
    (`OpenAIServingImages.check_size`), the engine the model's (`diffbatch.image_size`
    says why).
    """

    multiple: int  # the model's size multiple (VAE scale factor x denoiser downsampling)
    max_pixels: int  # most width * height: `--max-image-pixels` or the model's cap if lower
    default_size: tuple[int, int]  # (width, height) of "auto"
    max_side: int = MAX_SIDE  # most pixels of one side (SamplingParams' bound)

    @property
    def largest_square(self) -> int:
        """Side of the largest square size allowed (0 when none is)."""
        return largest_square(self.max_pixels, self.multiple, self.max_side)

    def sides(self) -> list[int]:
        """Every side of a square-bounded size: multiples up to `largest_square`."""
        return list(range(self.multiple, self.largest_square + 1, self.multiple))


@dataclass
class ImageResult:
    """A successful generation, ready to become the HTTP response."""

    response: ImageGenerationResponse
    headers: dict[str, str]  # server-side timings, for clients and benchmarks


def encode_image_files(
    images: list[Any], output_format: str, quality: int | None,
    png_compress_level: int = DEFAULT_PNG_COMPRESS_LEVEL,
) -> list[bytes]:
    """Encode PIL images to files of `output_format` (png, jpeg or webp).

    Runs in a worker thread; `quality` (0-100) applies to jpeg and webp only,
    `png_compress_level` (zlib, 0-9) to png only.
    """
    encoded: list[bytes] = []
    for image in images:
        buffer = io.BytesIO()
        if output_format == "png":
            image.save(buffer, format="PNG", compress_level=png_compress_level)
        else:
            rgb = image.convert("RGB") if image.mode not in ("RGB", "L") else image
            q = DEFAULT_QUALITY if quality is None else quality
            rgb.save(buffer, format=output_format.upper(), quality=q)
        encoded.append(buffer.getvalue())
    return encoded


def encode_images(
    images: list[Any], output_format: str, quality: int | None,
    png_compress_level: int = DEFAULT_PNG_COMPRESS_LEVEL,
) -> list[str]:
    """`encode_image_files`, each file as a base64 string (`response_format: "b64_json"`)."""
    return [base64.b64encode(data).decode("ascii") for data in
            encode_image_files(images, output_format, quality, png_compress_level)]


class OpenAIServingImages:
    """Serves image generation for one engine; see the module docstring.

    Args:
        engine: A started `diffbatch.Engine`.
        served_model_name: The name clients pass as `model`.
        request_timeout_s: Abort a request not finished after this many seconds
            (None = no limit) and answer 504.
        max_image_pixels: Largest width * height of one image; larger sizes get 400.
        png_compress_level: zlib level of PNG responses, 0-9 (1 fastest, 9 smallest).
        http_metrics: Where to record encoding time (None = not recorded).
        image_store: Where `response_format: "url"` images are kept (None: "url" is
            refused with a 400).
        public_url: Base of the links to stored images, e.g. "https://img.example.com"
            (None: the base URL each request was sent to).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        served_model_name: str,
        request_timeout_s: float | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        png_compress_level: int = DEFAULT_PNG_COMPRESS_LEVEL,
        http_metrics: HTTPMetrics | None = None,
        image_store: ImageStore | None = None,
        public_url: str | None = None,
    ) -> None:
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
        if max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {max_image_pixels}")
        if not 0 <= png_compress_level <= 9:
            raise ValueError(
                f"png_compress_level must be between 0 and 9, got {png_compress_level}"
            )
        self.engine = engine
        self.served_model_name = served_model_name
        self.request_timeout_s = request_timeout_s
        self.max_image_pixels = max_image_pixels
        self.png_compress_level = png_compress_level
        self.http_metrics = http_metrics
        self.image_store = image_store
        self.public_url = public_url.rstrip("/") if public_url else None
        info = engine.info
        self.size_rule = SizeRule(
            multiple=info.size_multiple,
            max_pixels=min(max_image_pixels, info.model_max_pixels or max_image_pixels),
            default_size=(info.default_width, info.default_height),
        )
        tokenizer_folder = getattr(info, "prompt_tokenizer", None)
        self._tokenizer = _load_tokenizer(tokenizer_folder) \
            if tokenizer_folder and getattr(info, "max_prompt_tokens", None) else None
        lora_dir = engine.config.lora_dir
        # Folder names that must not reach a client in an error message.
        self._private_paths = sorted(
            {p for p in (lora_dir, lora_dir and os.path.realpath(lora_dir)) if p},
            key=len, reverse=True,
        )
        self._private_modules = engine.loras.modules  # name -> path, read when redacting

    def model_accepts(self) -> ModelAccepts:
        """What the model takes here (`GET /v1/models`): its sizes (square ones, the side
        doubling from the size multiple up to the largest allowed, and the default) and
        the edits it runs. "Allowed" is what a request at the default step count gets
        through: the pixel caps and the work limit (`--max-request-work`) at those steps,
        so a client offering these sizes never offers one the server then refuses."""
        rule, info = self.size_rule, self.engine.info
        max_pixels = min(rule.max_pixels, self._work_pixels(info.default_num_inference_steps))
        largest = largest_square(max_pixels, rule.multiple, rule.max_side)
        sides = {largest} if largest else set()
        side = rule.multiple
        while side <= largest:
            sides.add(side)
            side *= 2
        width, height = rule.default_size
        sizes = {f"{s}x{s}" for s in sides}
        if width * height <= max_pixels:
            sizes.add(f"{width}x{height}")
        return ModelAccepts(
            default_size=f"{width}x{height}",
            sizes=sorted(sizes,
                         key=lambda size: int(size.split("x")[0]) * int(size.split("x")[1])),
            size_multiple=rule.multiple, max_pixels=max_pixels,
            default_steps=info.default_num_inference_steps,
            edits=[task for task in ("image-to-image", "inpaint") if info.supports_task(task)],
        )

    def check_request(self, request: ImageGenerationRequest) -> tuple[int, int]:
        """Stage 1: the server's checks; returns the (width, height) to generate."""
        self._check_model_and_lora(request)
        size = request.image_size()
        width, height = size if size is not None else self.size_rule.default_size
        given = f"{width}x{height}" if size is None else " ".join(str(request.size).split())[:40]
        self.check_size(width, height, given)
        return width, height

    def check_size(self, width: int, height: int, given: str) -> None:
        """Refuse a size over this server's own limit (`--max-image-pixels`, `MAX_SIDE`
        per side): 400 on `size`, naming the largest square size that works here.

        Only the server's limit: the model's (its multiple, its own cap) are the
        engine's, checked when the request is added (`diffbatch.image_size`).
        """
        if width * height > self.max_image_pixels or max(width, height) > MAX_SIDE:
            raise size_too_large(given, "this server", self.size_rule.max_pixels,
                                 self.size_rule.largest_square, max_side=MAX_SIDE)

    def check_edit_request(
        self, request: ImageEditRequest, *, has_mask: bool
    ) -> tuple[int, int] | None:
        """Stage 1 of an edit: the model can run it; returns the size asked for (None:
        "auto", the uploaded image's, decided once it is read)."""
        self._check_model_and_lora(request)
        info = self.engine.info
        task = "inpaint" if has_mask else "image-to-image"
        if not info.supports_task(task):
            edits = ", ".join(info.default_strengths) or "none"
            raise InvalidRequestError(
                f"model {self.served_model_name!r} ({info.name}) cannot run {task} edits: "
                f"no diffusers {task} pipeline runs it (edits it runs: {edits})",
                param="mask" if has_mask else "image",
            )
        size = request.image_size()
        if size is not None:
            self.check_size(*size, " ".join(str(request.size).split())[:40])
        return size

    def _auto_edit_pixels(self, request: ImageEditRequest) -> int:
        """The most pixels "auto" may give an edit: the pixel cap, and what the work limit
        leaves for its steps (below one size multiple squared, the engine refuses the
        request with the work limit's 400)."""
        steps = request.num_inference_steps or self.engine.info.default_num_inference_steps
        return min(self.size_rule.max_pixels, self._work_pixels(steps))

    def _work_pixels(self, steps: int) -> int:
        """The most pixels an image may have to run `steps` within the engine's work
        limit (no limit: the pixel cap)."""
        limit = getattr(self.engine, "max_request_work", None)
        if limit is None:
            return self.size_rule.max_pixels
        info = self.engine.info
        return request_work.max_pixels(limit, steps, info.default_height * info.default_width)

    def _check_prompt_length(self, request: ImageGenerationRequest) -> None:
        """Refuse a prompt longer than the model's text encoder reads (a 400 naming the
        limit), rather than let the pipeline cut it silently."""
        limit = self.engine.info.max_prompt_tokens
        if self._tokenizer is None or limit is None:
            return
        # verbose=False: no "longer than the maximum" warning per request
        num_tokens = len(self._tokenizer(request.prompt, verbose=False)["input_ids"])
        if num_tokens > limit:
            raise InvalidRequestError(
                f"`prompt` is {num_tokens} tokens long; model {self.served_model_name!r} "
                f"reads at most {limit} tokens (start and end tokens included): shorten "
                "it", param="prompt",
            )

    def _check_model_and_lora(self, request: ImageGenerationRequest) -> None:
        if getattr(self.engine.info, "is_video", False):
            raise InvalidRequestError(
                f"model {self.served_model_name!r} ({self.engine.info.name}) makes videos, "
                "not images: use POST /v1/videos", param="model")
        if request.response_format == "url" and self.image_store is None:
            raise InvalidRequestError(
                "`response_format` \"url\" is not available: this server keeps no image "
                "files (--image-store-mb 0, the default of several Ray Serve replicas); use "
                "\"b64_json\"",
                param="response_format",
            )
        if request.model is not None and request.model != self.served_model_name \
                and not self._is_adapter(request.model):
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; this server serves "
                f"{self.served_model_name!r} and its LoRA adapters (see GET /v1/models)",
                param="model",
            )
        self._check_prompt_length(request)
        if request.lora is None:
            return
        loras = self.engine.loras
        if not loras.enabled:
            raise InvalidRequestError(
                "`lora` is not available: this server was started without `--lora-dir` "
                "or `--lora-modules`", param="lora",
            )
        if loras.lora_dir is None:
            # Without a LoRA folder the engine would take an unknown name as a path.
            names = [request.lora] if isinstance(request.lora, str) \
                else [entry.name for entry in request.lora]
            served = loras.modules()
            for name in names:
                if name not in served:
                    raise ModelNotFoundError(
                        f"LoRA adapter {name!r} is not served here (see GET /v1/models)",
                        param="lora")

    def _is_adapter(self, model: str) -> bool:
        """Whether `model` names a LoRA adapter this server serves (vLLM: a request
        selects an adapter by passing its name as `model`)."""
        loras = self.engine.loras
        if model in loras.modules():
            return True
        if loras.lora_dir is None:
            return False
        try:
            resolve_lora(model, loras.lora_dir)
        except DiffbatchError:
            return False
        return True

    def lora_of(self, request: ImageGenerationRequest) -> tuple[Any, float]:
        """The engine-side `lora` and `lora_scale` of `request`: the adapter its `model`
        names (if any) stacked before its `lora`; `lora_scale` scales them all."""
        lora: Any = request.lora
        if isinstance(lora, list):
            lora = [(entry.name, entry.scale) for entry in lora]
        if request.model is None or request.model == self.served_model_name:
            return lora, request.lora_scale
        if lora is None:
            return request.model, request.lora_scale
        return [(request.model, 1.0), *([(lora, 1.0)] if isinstance(lora, str) else lora)], \
            request.lora_scale

    def sampling_params(
        self, request: ImageGenerationRequest, width: int, height: int
    ) -> SamplingParams:
        """Stage 2: the engine-side parameters of `request` (validated again there)."""
        self._check_store_room(request, width, height)
        lora, lora_scale = self.lora_of(request)
        return SamplingParams(
            height=height,
            width=width,
            num_inference_steps=self._num_inference_steps(request),
            guidance_scale=request.guidance_scale,
            negative_prompt=request.negative_prompt,
            num_outputs_per_prompt=request.n,
            seed=request.seed,
            output_type="pil",
            lora=lora,
            lora_scale=lora_scale,
            partial_images=request.partial_images or 0,
            step_cache=request.step_cache,
        )

    def _num_inference_steps(self, request: ImageGenerationRequest) -> int | None:
        """The request's steps: as given, else what its OpenAI `quality` asks for (a
        share of the model's default count), else None (the model's default)."""
        factor = QUALITY_STEP_FACTORS.get(request.quality or "auto")
        if request.num_inference_steps is not None or factor is None:
            return request.num_inference_steps
        return max(1, round(self.engine.info.default_num_inference_steps * factor))

    def _check_store_room(self, request: ImageGenerationRequest, width: int,
                          height: int) -> None:
        """Refuse, before any compute, links to images the store could not keep
        together (a bound on their encoded size)."""
        if request.response_format != "url" or request.stream or self.image_store is None:
            return
        bound = request.n * max_file_bytes(width, height)
        if bound > self.image_store.max_bytes:
            raise InvalidRequestError(
                f"{request.n} image(s) of {width}x{height} may take up to {bound} bytes as "
                f"files, more than this server's image store holds "
                f"({self.image_store.max_bytes} bytes); use \"b64_json\", or ask for "
                "fewer or smaller images",
                param="response_format",
            )

    def _encode_one(self, request: ImageGenerationRequest, image: Any) -> str:
        """One image as base64 in the request's format (blocking), its time recorded."""
        start = time.perf_counter()
        [b64] = encode_images([image], request.output_format, request.output_compression,
                              self.png_compress_level)
        if self.http_metrics is not None:
            self.http_metrics.encode_s.labels(request.output_format).observe(
                time.perf_counter() - start)
        return b64

    def _store(self, images: list[Any], request: ImageGenerationRequest) -> list[str]:
        """Encode `images` and keep them in the image store; returns their file ids."""
        assert self.image_store is not None  # checked in stage 1
        files = encode_image_files(images, request.output_format, request.output_compression,
                                   self.png_compress_level)
        return self.image_store.put_all(files, request.output_format)

    def _redact(self, message: str) -> str:
        """`message` without the server's folder names (a pipeline error may hold them)."""
        for path in self._private_paths:
            message = message.replace(path, "<lora-dir>")
        for name, path in self._private_modules().items():
            message = message.replace(path, f"<lora {name}>")
        return message

    def prepare_image(self, request: ImageGenerationRequest) -> SamplingParams:
        """Stages 1-2 of a generation: the server's checks, then the engine-side params.

        Raises:
            DiffbatchError: a request this server refuses (400/404).
        """
        width, height = self.check_request(request)
        return self.sampling_params(request, width, height)

    async def prepare_edit(
        self, request: ImageEditRequest, image_data: bytes, mask_data: bytes | None,
    ) -> SamplingParams:
        """Stages 1-2 of an edit: the server's checks, the uploads decoded off the event
        loop (`image_data`, and `mask_data` if sent), then the engine-side params.

        Raises:
            DiffbatchError: as `prepare_image`, and 400 for an upload that is no usable
                image or mask (`uploads.py`).
        """
        size = self.check_edit_request(request, has_mask=mask_data is not None)
        inputs = await asyncio.to_thread(
            decode_edit_inputs, image_data, mask_data, max_pixels=self.max_image_pixels,
            size=size, multiple=self.size_rule.multiple,
            max_output_pixels=self._auto_edit_pixels(request),
        )
        height, width = inputs.image.shape[:2]
        self.check_size(width, height, f"{width}x{height}")
        return self.sampling_params(request, width, height).clone(
            image=inputs.image, mask=inputs.mask, strength=request.strength,
        )

    async def generate(
        self, request: ImageGenerationRequest, params: SamplingParams, request_id: str,
        client_request_id: str | None = None, base_url: str = "",
    ) -> ImageResult | JSONResponse:
        """Stages 3-5 for a prepared request; a failed engine request becomes its error
        response.

        `request_id` is the engine's id, made by the server; `client_request_id` (the
        client's `x-request-id`, if any) is only logged and echoed back. `base_url` (the
        URL the request was sent to) starts the links of `response_format: "url"`
        unless the server has a `public_url`.

        Raises:
            DiffbatchError: the engine's refusal (400/404, a full queue: 503), a dead
                engine (503) or the request timeout (504); the app maps them.
        """
        start = time.perf_counter()
        width, height = params.width, params.height
        # 3. Generate; only this request is awaited here.
        try:
            async with asyncio.timeout(self.request_timeout_s):
                with _sides_named_size():
                    output = await self.engine.generate_async(
                        request.prompt, params, request_id=request_id,
                        priority=request.priority,
                    )
        except TimeoutError:
            raise RequestTimeoutError(
                f"request did not finish within the server's request timeout of "
                f"{self.request_timeout_s:g} s and was aborted; retry later or ask for "
                "fewer or smaller images"
            ) from None
        if output.error is not None:  # logged by the metrics middleware with its status
            logger.debug("request %s (client id %.100r) failed: %s", request_id,
                         client_request_id, output.error.message)
            error = dataclasses.replace(output.error, message=self._redact(output.error.message))
            return request_error_response(error)
        # 4. Encode off the event loop (and keep the files, for links).
        encode_start = time.perf_counter()
        if request.response_format == "url":
            images = await asyncio.to_thread(self._store, list(output.images), request)
            links = self.public_url or base_url.rstrip("/")
            data = [ImageObject(url=f"{links}{FILES_ROUTE}/{file_id}") for file_id in images]
        else:
            b64 = await asyncio.to_thread(
                encode_images, list(output.images), request.output_format,
                request.output_compression, self.png_compress_level,
            )
            data = [ImageObject(b64_json=item) for item in b64]
        encode_s = time.perf_counter() - encode_start
        if self.http_metrics is not None:
            self.http_metrics.encode_s.labels(request.output_format).observe(encode_s)
        # 5. Respond.
        response = ImageGenerationResponse(
            data=data, output_format=request.output_format, size=f"{width}x{height}",
            diffbatch=None if output.cached_steps is None or output.computed_steps is None
            else DiffbatchInfo(step_cache=(params.step_cache or self.engine.step_cache).spec(),
                               computed_steps=output.computed_steps,
                               cached_steps=output.cached_steps),
        )
        headers = {
            "x-request-id": client_request_id or request_id,
            "x-diffbatch-queue-ms": f"{output.queue_time_ms:.2f}",
            "x-diffbatch-execute-ms": f"{output.execute_time_ms:.2f}",
            "x-diffbatch-engine-ms": f"{output.total_time_ms:.2f}",  # arrival -> delivered
            "x-diffbatch-encode-ms": f"{encode_s * 1e3:.2f}",
            "x-diffbatch-batch-size": str(output.batch_size),
            # image i of the response was drawn with seed + i
            "x-diffbatch-seed": str(params.seed if output.seed is None else output.seed),
        }
        logger.debug(
            "request %s (client id %.100r): %s prompt_len=%d n=%d size=%dx%d batch=%d "
            "queue=%.1fms execute=%.1fms encode=%.1fms total=%.1fms",
            request_id, client_request_id, params.task, len(request.prompt), request.n, width,
            height,
            output.batch_size,
            output.queue_time_ms, output.execute_time_ms, encode_s * 1e3,
            (time.perf_counter() - start) * 1e3,
        )
        return ImageResult(response=response, headers=headers)

    async def stream(
        self, request: ImageGenerationRequest, params: SamplingParams, request_id: str,
        client_request_id: str | None = None, *, kind: EventKind = "image_generation",
    ) -> ImageStream | JSONResponse:
        """Stages 3-5 of a streamed request (`serving_stream.py`): the stream of `kind`
        events once its first event is there, or the JSON error of a request that failed
        before it.

        Raises:
            DiffbatchError: as `generate`, before the stream starts.
        """
        items = self.engine.generate_stream(
            request.prompt, params, request_id=request_id, priority=request.priority,
        )
        stream = StreamedImages(
            items, request, kind=kind, size=f"{params.width}x{params.height}",
            encode=functools.partial(self._encode_one, request), redact=self._redact,
            timeout_s=self.request_timeout_s,
        )
        with _sides_named_size():
            return await stream.start({"x-request-id": client_request_id or request_id})


def _load_tokenizer(folder: str) -> Any:
    """The model's prompt tokenizer, to count a prompt's tokens before the engine."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@contextlib.contextmanager
def _sides_named_size() -> Iterator[None]:
    """An engine refusal that blames `height` or `width` blames the request's `size`."""
    try:
        yield
    except InvalidRequestError as exc:
        if exc.param in ("height", "width"):  # the engine's names of `size`'s sides
            exc.param = "size"
        raise

