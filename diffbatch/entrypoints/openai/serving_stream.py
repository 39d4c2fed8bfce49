"""Streamed image requests (`stream: true`): OpenAI's server-sent events, from the engine.

A streamed request runs through `Engine.generate_stream`, which yields the request's
partial images while its wave runs, then its output. The answer starts with the
first of them, so every error before it is the usual JSON error with its status:
invalid input and a full queue are refused before the engine takes the request, and
a request that fails before its first event (no previews asked for, or a failure
early in the wave) answers as a non-streamed one. From the first event on, the answer
is `text/event-stream`, one event per partial image and one for the image:

    event: image_generation.partial_image
    data: {"type": "image_generation.partial_image", "b64_json": "...",
           "partial_image_index": 0, "created_at": 1700000000, "size": "64x64",
           "quality": "auto", "background": "auto", "output_format": "png"}

    event: image_generation.completed
    data: {"type": "image_generation.completed", "b64_json": "...", "created_at": ...,
           "size": ..., "quality": ..., "background": ..., "output_format": ...,
           "usage": {...}, "diffbatch": {"seed": 1, "batch_size": 4, ...}}

(`image_edit.partial_image` and `image_edit.completed` for edits). `usage` counts no
tokens (diffbatch has none: zeros); `diffbatch` is an extension holding what the
`x-diffbatch-*` headers of a non-streamed answer hold, since a stream's headers leave
before the wave ends. An error after the stream started (the request failed, or ran
past the request timeout) is one `error` event, `{"type": "error", "error": {"message",
"type", "param", "code"}}`, the shape the `openai` client raises as an `APIError`, and
the stream ends. A client that disconnects ends the stream, which aborts the request
as a non-streamed request's disconnect does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from diffbatch.entrypoints.openai.errors import (
    error_body,
    exception_error,
    request_error,
    request_error_response,
)
from diffbatch.errors import DiffbatchError, RequestTimeoutError
from diffbatch.outputs import DiffusionOutput, PartialImage, RequestError

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

    from diffbatch.entrypoints.openai.protocol import ImageGenerationRequest

logger = logging.getLogger(__name__)

EventKind = Literal["image_generation", "image_edit"]  # the events' name prefix
MEDIA_TYPE = "text/event-stream"
# Proxies must pass events on as they come (nginx buffers unless told not to).
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
             "output_tokens": 0, "total_tokens": 0}


def event_schema(kind: EventKind) -> dict[str, Any]:
    """The OpenAPI schema of each event of a `kind` stream (OpenAPI 3.1: the schema of a
    `text/event-stream` describes one event); `contentSchema` documents the payloads."""
    common = {"b64_json": {"type": "string"}, "created_at": {"type": "integer"},
              "size": {"type": "string"}, "quality": {"type": "string"},
              "background": {"type": "string"}, "output_format": {"type": "string"}}
    payloads = [
        {"type": "object", "properties": {
            "type": {"enum": [f"{kind}.partial_image"]}, **common,
            "partial_image_index": {"type": "integer"}}},
        {"type": "object", "properties": {
            "type": {"enum": [f"{kind}.completed"]}, **common,
            "usage": {"type": "object"}, "diffbatch": {
                "type": "object", "description": "extension: seed, batch_size, queue_ms, "
                "execute_ms, engine_ms (the x-diffbatch-* headers of a non-streamed answer); "
                "computed_steps and cached_steps for a request with a step cache"}}},
        {"type": "object", "properties": {
            "type": {"enum": ["error"]},
            "error": {"$ref": "#/components/schemas/ErrorInfo"}}},
    ]
    return {
        "type": "object", "required": ["event", "data"],
        "properties": {
            "event": {"enum": [f"{kind}.partial_image", f"{kind}.completed", "error"]},
            "data": {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"oneOf": payloads}},
        },
    }


def sse(event: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event: its name, and its JSON payload on one `data:` line."""
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def error_event(status: int, message: str, keywords: dict[str, Any]) -> bytes:
    """The `error` event of a stream that failed after it started (see the module doc):
    the error `error_response(status, message, **keywords)` would answer."""
    keywords = {"type": "server_error" if status >= 500 else "invalid_request_error",
                **{name: value for name, value in keywords.items() if value is not None}}
    return sse("error", {"type": "error", **error_body(message, **keywords)})


@dataclass
class ImageStream:
    """A started stream: its response headers and its events, the first one included."""

    headers: dict[str, str]
    events: AsyncIterator[bytes]


class StreamedImages:
    """One streamed request, from `generate_stream`'s items to the events of its answer.

    Args:
        items: `Engine.generate_stream` of the request (closing it aborts the request).
        request: The HTTP request (`output_format`, `quality`, ... of the events).
        kind: Which events: "image_generation" or "image_edit".
        size: "WxH", the size generated.
        encode: Encodes one PIL image to base64 in the request's format (blocking: it
            runs in a worker thread).
        redact: Removes server paths from an error message.
        timeout_s: The request timeout, over the whole stream (None: none).
    """

    def __init__(self, items: AsyncGenerator[PartialImage | DiffusionOutput, None],
                 request: ImageGenerationRequest, *, kind: EventKind, size: str,
                 encode: Callable[[Any], str], redact: Callable[[str], str],
                 timeout_s: float | None) -> None:
        self.items = items
        self.request = request
        self.kind = kind
        self.size = size
        self.encode = encode
        self.redact = redact
        self.timeout_s = timeout_s
        self._deadline = None if timeout_s is None else \
            asyncio.get_running_loop().time() + timeout_s

    async def start(self, headers: dict[str, str]) -> ImageStream | JSONResponse:
        """Wait for the first item: an `ImageStream` from it, or the JSON error of a
        request that failed before its first event.

        Raises:
            DiffbatchError: as `Engine.generate_stream` (invalid input, a full queue, a
                closed engine), and `RequestTimeoutError` (504) past the timeout.
        """
        try:
            first = await self._next()
        except BaseException:
            await self.items.aclose()  # aborts the request in the engine
            raise
        if isinstance(first, DiffusionOutput) and first.error is not None:
            await self.items.aclose()
            return request_error_response(self._redacted(first.error))
        return ImageStream({**headers, **STREAM_HEADERS}, self._events(first))

    async def _next(self) -> PartialImage | DiffusionOutput:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await anext(self.items)
        except TimeoutError:
            raise RequestTimeoutError(
                f"request did not finish within the server's request timeout of "
                f"{self.timeout_s:g} s and was aborted; retry later or ask for fewer or "
                "smaller images"
            ) from None

    async def _events(self, item: PartialImage | DiffusionOutput) -> AsyncIterator[bytes]:
        """The events from `item` on; an error ends them with an `error` event."""
        try:
            while isinstance(item, PartialImage):
                yield await self._partial_event(item)
                item = await self._next()
            if item.error is not None:
                yield error_event(*request_error(self._redacted(item.error)))
                return
            for image in item.images:
                yield await self._completed_event(image, item)
        except DiffbatchError as exc:  # the request timeout, past the first event
            yield error_event(*exception_error(exc))
        except Exception as exc:  # a bug here must still end the stream with an answer
            logger.exception("streaming a response failed")
            yield error_event(500, f"internal server error ({type(exc).__name__})", {})
        finally:
            await self.items.aclose()  # a no-op when done; else (disconnect) the abort

    def _common(self) -> dict[str, Any]:
        request = self.request
        return {"created_at": int(time.time()), "size": self.size,
                "quality": request.quality or "auto",
                "background": request.background or "auto",
                "output_format": request.output_format}

    async def _partial_event(self, partial: PartialImage) -> bytes:
        b64 = await asyncio.to_thread(self.encode, partial.image)
        kind = f"{self.kind}.partial_image"
        return sse(kind, {"type": kind, "b64_json": b64,
                          "partial_image_index": partial.index, **self._common()})

    async def _completed_event(self, image: Any, output: DiffusionOutput) -> bytes:
        b64 = await asyncio.to_thread(self.encode, image)
        kind = f"{self.kind}.completed"
        return sse(kind, {
            "type": kind, "b64_json": b64, **self._common(), "usage": _NO_USAGE,
            "diffbatch": {"seed": output.seed, "batch_size": output.batch_size,
                          "queue_ms": round(output.queue_time_ms, 2),
                          "execute_ms": round(output.execute_time_ms, 2),
                          "engine_ms": round(output.total_time_ms, 2),
                          **({} if output.cached_steps is None else {
                              "computed_steps": output.computed_steps,
                              "cached_steps": output.cached_steps})},
        })

    def _redacted(self, error: RequestError) -> RequestError:
        return RequestError(self.redact(error.message), error.status_code, error.type,
                            error.param)


__all__ = ["ImageStream", "StreamedImages", "error_event", "sse"]
