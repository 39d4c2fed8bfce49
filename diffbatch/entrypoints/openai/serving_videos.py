"""OpenAI's Videos API on a video model: `/v1/videos` jobs, served by the engine.

`POST /v1/videos` (JSON, or a multipart form as the official client sends it) checks
the request, submits one engine request and answers at once with the job
(`status: "queued"`). The job then runs on its own, whatever the client does (a client
that disconnects does not cancel it; `DELETE /v1/videos/{id}` does): its request
reports each denoising step it finishes (the video adapter's progress ticks,
`diffusers_video.py`), which become the job's `in_progress` and `progress`; the
finished frames are encoded as an H.264 MP4 (PyAV, which ships FFmpeg and libx264)
and kept in the `VideoStore` for `GET /v1/videos/{id}/content`.

Requests map to the engine's parameters so:

- `size` "WxH" is the frame size (the model's default when left out);
- `seconds` times the frame rate is the frame count, rounded to the nearest count the
  model takes (Wan: one more than a multiple of 4); `num_frames` sets it directly;
  with neither, the model's default clip;
- `fps` (the model's default: 16 for Wan) is the clip's frame rate;
- `num_inference_steps`, `guidance_scale`, `negative_prompt` and `seed` are passed on
  (`extra_body` of the official client).

Requests of one shape (size, frames, steps, guidance) batch like image requests: a
wave of them is one pipeline call.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Gauge
from pydantic import Field, ValidationError

from diffbatch.entrypoints.openai.errors import error_response, exception_response
from diffbatch.entrypoints.openai.protocol import (
    NOT_BLANK_PATTERN,
    ErrorResponse,
    OpenAIBaseModel,
    parse_size,
)
from diffbatch.entrypoints.openai.video_store import VideoJob, VideoStore
from diffbatch.errors import DiffbatchError, InvalidRequestError, ModelNotFoundError
from diffbatch.outputs import DiffusionOutput, PartialImage
from diffbatch.request import MAX_PROMPT_CHARS
from diffbatch.sampling_params import MAX_NUM_INFERENCE_STEPS, SamplingParams

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from diffbatch.engine.async_engine import Engine

logger = logging.getLogger(__name__)

VIDEOS_ROUTE = "/v1/videos"
MEDIA_TYPE = "video/mp4"
MAX_SECONDS = 60.0  # longest clip `seconds` may ask for (the model's frame cap is lower)
MAX_FPS = 60
MAX_LIST_LIMIT = 100
# How often the official client's `poll` asks (it reads this header).
POLL_AFTER_MS = 500
# Formats `input_reference` may be (OpenAI takes JPEG, PNG and WebP).
_REFERENCE_FORMATS = ("PNG", "JPEG", "WEBP")
# H.264 quality (x264's constant rate factor: 0 lossless, 23 its default; 18 looks
# lossless to most eyes).
_CRF = "18"


class VideoCreateRequest(OpenAIBaseModel):
    """The fields of `POST /v1/videos` (OpenAI's, then diffbatch's extensions)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, pattern=NOT_BLANK_PATTERN)
    model: str | None = None
    seconds: str | float | None = Field(
        default=None, description="clip length in seconds, e.g. \"4\"")
    size: str | None = Field(default=None, description="\"<width>x<height>\"")
    num_frames: int | None = Field(default=None, ge=1)
    fps: int | None = Field(default=None, ge=1, le=MAX_FPS)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_NUM_INFERENCE_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


def encode_mp4(frames: list[Any], fps: int) -> bytes:
    """Encode RGB frames (PIL images or uint8 arrays [H, W, 3]) as an H.264 MP4 in
    yuv420p, the format every browser and player plays."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": _CRF})
        first = np.asarray(frames[0])
        stream.height, stream.width = int(first.shape[0]), int(first.shape[1])
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            video_frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(np.asarray(frame, dtype=np.uint8)), format="rgb24")
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def frames_for_seconds(seconds: float, fps: int, multiple: int) -> int:
    """The frame count nearest `seconds` x `fps` that the model takes: one more than a
    multiple of `multiple` (1 for a model that takes any count), at least 1."""
    wanted = seconds * fps
    if multiple <= 1:
        return max(1, round(wanted))
    return max(0, round((wanted - 1) / multiple)) * multiple + 1


class VideoMetrics:
    """`/metrics` of the video jobs, in the HTTP layer's registry."""

    def __init__(self, registry: CollectorRegistry, store: VideoStore) -> None:
        self.jobs = Gauge("diffbatch_video_jobs", "Video jobs known now, by status "
                          "(queued: the video queue's depth).", ["status"], registry=registry)
        for status in ("queued", "in_progress", "completed", "failed"):
            self.jobs.labels(status).set_function(
                lambda status=status: store.count(status))  # type: ignore[misc]
        self.frames = Counter("diffbatch_video_frames_generated",
                              "Video frames generated (rate(): frames per second).",
                              registry=registry)
        self.outcomes = Counter("diffbatch_video_jobs_finished",
                                "Video jobs finished, by outcome.", ["outcome"],
                                registry=registry)
        for outcome in ("completed", "failed", "cancelled"):
            self.outcomes.labels(outcome)
        self.stored_bytes = Gauge("diffbatch_video_store_bytes",
                                  "Bytes of finished clips kept for download.",
                                  registry=registry)
        self.stored_bytes.set_function(lambda: store.num_bytes)


class OpenAIServingVideos:
    """The logic of the `/v1/videos` routes; see the module docstring."""

    def __init__(self, engine: Engine, *, served_model_name: str, store: VideoStore | None,
                 registry: CollectorRegistry, max_frame_pixels: int) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        # None: no jobs here (several Ray Serve replicas: a poll could reach another);
        # an empty store answers the reads, `create` refuses
        self.accepts_jobs = store is not None
        self.store = store if store is not None else VideoStore()
        self.max_frame_pixels = max_frame_pixels
        self.metrics = VideoMetrics(registry, self.store)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        info = engine.info
        self._tokenizer = None
        if info.prompt_tokenizer and info.max_prompt_tokens:
            from diffbatch.entrypoints.openai.serving_images import _load_tokenizer

            self._tokenizer = _load_tokenizer(info.prompt_tokenizer)

    # -- create ------------------------------------------------------------------------
    def prepare(self, request: VideoCreateRequest, reference: bytes | None
                ) -> tuple[VideoJob, SamplingParams]:
        """Check a request against this server and model; its job and params."""
        info = self.engine.info
        if not self.accepts_jobs:
            raise InvalidRequestError(
                "video jobs are not available here: this server runs as several replicas, "
                "each keeping its own jobs, so a job's poll could reach another; serve the "
                "video model with one replica")
        if request.model is not None and request.model != self.served_model_name:
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; this server serves "
                f"{self.served_model_name!r} (see GET /v1/models)", param="model")
        if reference is not None:
            _check_reference(reference, self.max_frame_pixels)
            raise InvalidRequestError(
                f"`input_reference` (image-to-video) is not supported by model "
                f"{self.served_model_name!r} ({info.name}): it generates from text alone",
                param="input_reference")
        self._check_prompt_length(request.prompt)
        size = parse_size(request.size)
        width, height = size if size is not None else (info.default_width,
                                                       info.default_height)
        if width * height > self.max_frame_pixels:
            raise InvalidRequestError(
                f"`size` {width}x{height} is over this server's {self.max_frame_pixels} "
                "pixels per frame (--max-image-pixels)", param="size")
        fps = request.fps or info.default_fps or 16
        seconds = _seconds(request.seconds)
        if request.num_frames is not None:
            num_frames = request.num_frames
        elif seconds is not None:
            num_frames = frames_for_seconds(seconds, fps, info.frame_multiple)
        else:
            num_frames = int(info.default_num_frames or 1)
        extra: dict[str, Any] = {"num_frames": num_frames}
        if "frame_rate" in (info.call_arguments or ()):  # LTX: positions scale with it
            extra["frame_rate"] = fps
        params = SamplingParams(
            height=height, width=width, num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale, negative_prompt=request.negative_prompt,
            seed=request.seed, extra=extra,
            partial_images=1,  # any > 0: the video adapter then reports each step done
        )
        job = VideoJob(
            id=f"video_{secrets.token_hex(16)}", prompt=request.prompt,
            model=self.served_model_name,
            seconds=_seconds_text(request.seconds, seconds, num_frames, fps),
            size=f"{width}x{height}", num_frames=num_frames, fps=fps,
            num_inference_steps=request.num_inference_steps
            or info.default_num_inference_steps,
            created_at=int(time.time()))
        return job, params

    async def create(self, request: VideoCreateRequest, reference: bytes | None) -> VideoJob:
        """Submit the job's request and start following it; refusals raise here."""
        job, params = self.prepare(request, reference)
        self.store.add(job)
        stream = self.engine.generate_stream(job.prompt, params, request_id=job.id)
        first: asyncio.Future[Any] = asyncio.ensure_future(anext(stream))
        # One turn of the loop runs the stream up to its first wait: by then the engine
        # has checked and queued the request, or raised (400, 503), which the caller
        # gets as this request's answer rather than as a failed job.
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:  # the server stops: nothing follows the job
            first.cancel()
            self.engine.abort(job.id)
            self.store.delete(job.id)
            raise
        if first.done() and first.exception() is not None:
            self.store.delete(job.id)
            exc = first.exception()
            assert exc is not None
            if isinstance(exc, InvalidRequestError) and exc.param in ("height", "width"):
                exc.param = "size"  # the engine's names of `size`'s sides
            raise exc
        task = asyncio.create_task(self._follow(job, stream, first), name=f"follow {job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(job.id, None))
        return job

    async def _follow(self, job: VideoJob, stream: AsyncIterator[Any],
                      first: asyncio.Future[Any]) -> None:
        """Follow the job's request to its end: progress, then the clip or the error."""
        try:
            item = await first
            while isinstance(item, PartialImage):
                job.status = "in_progress"
                if item.num_steps:
                    job.progress = max(job.progress, min(99, 100 * item.step // item.num_steps))
                item = await anext(stream)
            assert isinstance(item, DiffusionOutput)
            await self._finish(job, item)
        except Exception as exc:
            logger.exception("video job %s failed", job.id)
            self._fail(job, {"code": "server_error", "type": "server_error", "param": None,
                             "message": f"the job failed: {type(exc).__name__}"})
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    async def _finish(self, job: VideoJob, output: DiffusionOutput) -> None:
        if output.aborted:  # by the server (shutdown): DELETE forgets the job first
            if self.store.fail(job.id, {"code": "cancelled", "type": "server_error",
                                        "param": None,
                                        "message": "the job was cancelled by the server"}):
                self.metrics.outcomes.labels("cancelled").inc()
            return
        if output.error is not None:
            error = output.error
            self._fail(job, {"code": error.type, "type": error.type, "param": error.param,
                             "message": error.message})
            return
        frames = output.images[0]  # the first (and only) video: a list of PIL frames
        content = await asyncio.to_thread(encode_mp4, frames, job.fps)
        if self.store.complete(job.id, content) is not None:
            self.metrics.frames.inc(len(frames))
            self.metrics.outcomes.labels(
                "completed" if job.status == "completed" else "failed").inc()

    def _fail(self, job: VideoJob, error: dict[str, Any]) -> None:
        if self.store.fail(job.id, error) is not None:
            self.metrics.outcomes.labels("failed").inc()

    # -- read, delete ------------------------------------------------------------------
    def job(self, video_id: str) -> VideoJob:
        job = self.store.get(video_id)
        if job is None:
            raise ModelNotFoundError(
                f"no video job {video_id!r} here: it never existed, was deleted, or "
                f"expired ({self.store.ttl_s:g} s after it finished)", param="video_id")
        return job

    def delete(self, video_id: str) -> VideoJob:
        """Forget the job; a queued or running one is cancelled first (its request
        leaves its wave at the next denoising step)."""
        job = self.job(video_id)
        if not job.finished:
            self.engine.abort(job.id)
            self.metrics.outcomes.labels("cancelled").inc()
        self.store.delete(video_id)
        return job

    async def close(self) -> None:
        """Cancel the jobs' followers (server shutdown)."""
        for task in list(self._tasks.values()):
            task.cancel()

    def _check_prompt_length(self, prompt: str) -> None:
        if self._tokenizer is None:
            return
        limit = self.engine.info.max_prompt_tokens
        num_tokens = len(self._tokenizer(prompt, verbose=False)["input_ids"])
        if limit is not None and num_tokens > limit:
            raise InvalidRequestError(
                f"`prompt` is {num_tokens} tokens long; model {self.served_model_name!r} "
                f"reads at most {limit} tokens: shorten it", param="prompt")


def _seconds(value: str | float | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_SECONDS:
        raise InvalidRequestError(
            f"`seconds` must be a number of seconds above 0 and at most {MAX_SECONDS:g}, "
            f"got {str(value)[:20]!r}", param="seconds")
    return seconds


def _seconds_text(given: str | float | None, seconds: float | None, num_frames: int,
                  fps: int) -> str:
    """The job's `seconds`: as asked, else the clip's length."""
    if given is not None and seconds is not None:
        return given if isinstance(given, str) else f"{seconds:g}"
    return f"{num_frames / fps:.3g}"


def _check_reference(data: bytes, max_pixels: int) -> None:
    """`input_reference` must be a JPEG, PNG or WebP image of at most `max_pixels`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=list(_REFERENCE_FORMATS)) as image:
            if image.size[0] * image.size[1] > max_pixels:
                raise InvalidRequestError(
                    f"`input_reference` must be at most {max_pixels} pixels, got "
                    f"{image.size[0]}x{image.size[1]}", param="input_reference")
            image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(
            f"`input_reference` must be a PNG, JPEG or WebP image; the uploaded file "
            f"({len(data)} bytes) is not one", param="input_reference") from None


# -- routes ------------------------------------------------------------------------------
video_router = APIRouter()


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in sorted({*statuses, 503})}


def _serving(raw_request: Request) -> OpenAIServingVideos:
    return raw_request.app.state.serving_videos


def _job_response(job: VideoJob, status_code: int = 200) -> JSONResponse:
    headers = {} if job.finished else {"openai-poll-after-ms": str(POLL_AFTER_MS)}
    return JSONResponse(job.to_json(), status_code=status_code, headers=headers)


async def _read_create_request(raw_request: Request) -> tuple[VideoCreateRequest,
                                                               bytes | None]:
    """The request's fields (JSON or a multipart form) and its `input_reference` file."""
    content_type = raw_request.headers.get("content-type", "")
    reference: bytes | None = None
    if content_type.lower().startswith("multipart/form-data"):
        from starlette.datastructures import UploadFile

        from diffbatch.entrypoints.openai.uploads import _read_form

        form = await _read_form(raw_request)
        fields: dict[str, Any] = {}
        try:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if name != "input_reference" or reference is not None:
                        raise InvalidRequestError(
                            f"`{name}` must not be a file: only one `input_reference` "
                            "image may be uploaded", param=name)
                    reference = await value.read()
                elif name in fields:
                    raise InvalidRequestError(f"`{name}` is given twice; send it once",
                                              param=name)
                else:
                    fields[name] = value
        finally:
            await form.close()
    else:
        try:
            fields = json.loads(await raw_request.body())
        except ValueError as exc:
            raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise InvalidRequestError("request body must be a JSON object")
        if "input_reference" in fields:
            raise InvalidRequestError(
                "`input_reference` must be uploaded as a file of a multipart form",
                param="input_reference")
    try:
        return VideoCreateRequest.model_validate(fields), reference
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _create_body() -> dict[str, Any]:
    """The OpenAPI request body of `POST /v1/videos`: JSON, or a multipart form that
    may also carry the `input_reference` file (the route reads the body itself)."""
    schema = VideoCreateRequest.model_json_schema()
    form = {**schema, "properties": {**schema["properties"], "input_reference": {
        "type": "string", "format": "binary",
        "description": "an image for image-to-video (refused by text-to-video models)"}}}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}, "multipart/form-data": {"schema": form}}}}


@video_router.post(VIDEOS_ROUTE, responses=_errors(400, 401, 404, 413, 415, 429),
                   openapi_extra=_create_body())
async def create_video(raw_request: Request) -> Response:
    """Start a video job (OpenAI `videos.create`); the answer is the queued job."""
    try:
        request, reference = await _read_create_request(raw_request)
        job = await _serving(raw_request).create(request, reference)
    except DiffbatchError as exc:
        return exception_response(exc)
    return _job_response(job)


@video_router.get(VIDEOS_ROUTE, responses=_errors(400, 401))
async def list_videos(
    raw_request: Request,
    after: str | None = Query(None, max_length=100),
    limit: int = Query(20, ge=1, le=MAX_LIST_LIMIT),
    order: Literal["asc", "desc"] = Query("desc"),
) -> Response:
    """The jobs known here, newest first by default, in OpenAI's cursor page."""
    jobs, has_more = _serving(raw_request).store.list(after=after, limit=limit, order=order)
    data = [job.to_json() for job in jobs]
    return JSONResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None,
                         "has_more": has_more})


@video_router.get(VIDEOS_ROUTE + "/{video_id}", responses=_errors(401, 404))
async def retrieve_video(video_id: str, raw_request: Request) -> Response:
    """A job's status and progress (OpenAI `videos.retrieve`)."""
    try:
        return _job_response(_serving(raw_request).job(video_id))
    except DiffbatchError as exc:
        return exception_response(exc)


@video_router.delete(VIDEOS_ROUTE + "/{video_id}", responses=_errors(401, 404))
async def delete_video(video_id: str, raw_request: Request) -> Response:
    """Cancel a queued or running job, or delete a finished one and its clip."""
    try:
        job = _serving(raw_request).delete(video_id)
    except DiffbatchError as exc:
        return exception_response(exc)
    return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})


@video_router.get(VIDEOS_ROUTE + "/{video_id}/content", response_class=Response, responses={
    200: {"content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
          "description": "the clip, H.264 in MP4"}, **_errors(400, 401, 404, 409)})
async def video_content(video_id: str, raw_request: Request,
                        variant: str = Query("video")) -> Response:
    """A completed job's clip (OpenAI `videos.download_content`)."""
    serving = _serving(raw_request)
    try:
        job = serving.job(video_id)
    except DiffbatchError as exc:
        return exception_response(exc)
    if variant != "video":
        return error_response(400, f"`variant` {variant[:20]!r} is not served here: only "
                              "\"video\" (the MP4)", param="variant")
    if job.status != "completed" or job.content is None:
        return error_response(409, f"video {video_id} has no content: it is {job.status}"
                              + (" (see its `error`)" if job.status == "failed" else
                                 "; poll GET /v1/videos/{id} until it is completed"),
                              param="video_id", code="video_not_ready")
    left = max(0, (job.expires_at or 0) - int(time.time()))
    return Response(job.content, media_type=MEDIA_TYPE,
                    headers={"Cache-Control": f"private, max-age={left}"})
