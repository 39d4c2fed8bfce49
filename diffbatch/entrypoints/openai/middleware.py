"""ASGI middleware of the image server: request guard, request-id echo, HTTP metrics.

All are plain ASGI (not Starlette's `BaseHTTPMiddleware`, which runs the app in a
separate task and breaks the `http.disconnect` listening that client-disconnect
aborts rely on).

`RequestGuardMiddleware` answers, before FastAPI parses anything, the requests it
can refuse from headers and size alone, in this order:

1. API key (only `/v1/...`; `/health`, `/metrics` and `/docs` stay open) -> 401
   with `WWW-Authenticate: Bearer`;
2. content type of a POST to a JSON route that is not JSON, or to an upload route
   that is not `multipart/form-data` -> 415. Only routes that exist and take such
   a POST are checked, so a POST to a route that does not exist is still a 404 and
   a POST to `/v1/models` a 405;
3. body over `max_body_bytes` (`max_upload_bytes` on an upload route; by
   `Content-Length`, or counted while reading) -> 413;
4. JSON body that is not UTF-8 (JSON on the wire is UTF-8, RFC 8259) -> 400
   `invalid_json`.

A body that stops arriving (no bytes for `body_timeout_s` while more are due) gets a
408 in the OpenAI shape and its connection is closed: the header timeout of
`http_protocol.py` ends when the headers are complete, and a client that then sends
its body slowly, or never, would otherwise hold a connection and a request slot for
as long as it likes.

A client that disconnects while its body is still being read gets no answer: the
guard records 499 (client closed), like a disconnect while the request runs,
instead of handing a truncated body on to be refused as malformed.

`OverLimitMiddleware` answers a request the HTTP protocol found over the connection
limit (`http_protocol.py`): 503 `server_busy` with `Retry-After`, and the connection
closed. It sends the answer, then reads and drops the rest of the request's body (up
to `OVER_LIMIT_DRAIN_BYTES`, for up to `OVER_LIMIT_DRAIN_S`) before the connection
closes, as a lingering close does: a connection closed with an upload still unread is
reset by the kernel, and a client still sending gets no answer at all.

`IncomingRequestMiddleware` tells the engine an image request is on its way in, so
requests sent together share a wave (see the class).

`HeadAsGetMiddleware` answers `HEAD` like `GET` without the body (uvicorn leaves
the body out of the answer to a `HEAD`), as Starlette's own routes do; FastAPI's
routes alone answer it 405.
`RequestIdEchoMiddleware` puts the client's `x-request-id` on every answer.
`HTTPMetricsMiddleware` counts every answer by route and status, times it, and
logs each failed answer in one DEBUG line (method, path, status, duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from diffbatch.entrypoints.openai.errors import error_response
from diffbatch.entrypoints.openai.http_protocol import OVER_LIMIT_STATE
from diffbatch.entrypoints.openai.protocol import OUTPUT_FORMATS
from diffbatch.entrypoints.utils import CLIENT_CLOSED_STATUS

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

PROTECTED_PREFIX = "/v1"
BUSY_RETRY_AFTER_S = 1  # seconds a client told "server busy" should wait before retrying
OVER_LIMIT_DRAIN_BYTES = 64 << 20  # the most of a refused request's body read and dropped
OVER_LIMIT_DRAIN_S = 5.0  # and the longest it is read for


def _content_type(content_type: str) -> tuple[str, str]:
    message = email.message.Message()
    message["content-type"] = content_type
    return message.get_content_maintype(), message.get_content_subtype()


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    main, subtype = _content_type(content_type)
    return main == "application" and (subtype == "json" or subtype.endswith("+json"))


def _is_multipart_form(content_type: str | None) -> bool:
    return bool(content_type) and _content_type(content_type or "") == ("multipart", "form-data")


class RequestGuardMiddleware:
    """Refuse unauthenticated, non-JSON and oversized requests early; see the module doc."""

    def __init__(
        self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
        json_routes: frozenset[str], upload_routes: frozenset[str] = frozenset(),
        max_upload_bytes: int | None = None, open_prefixes: tuple[str, ...] = (),
        body_timeout_s: float | None = None, json_or_upload_routes: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s  # longest pause in a body (None: no limit)
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.json_routes = json_routes  # paths whose POST body is JSON (checked here)
        self.upload_routes = upload_routes  # paths whose POST body is a multipart form
        # paths whose POST body is either (checked as the content type says)
        self.json_or_upload_routes = json_or_upload_routes
        self.max_upload_bytes = max_upload_bytes or max_body_bytes  # their body limit
        # `/v1` paths served without the key: links whose unguessable id is the credential
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # 1. API key.
        if self.api_key is not None and not scope["path"].startswith(self.open_prefixes):
            refusal = self._check_api_key(headers.get("authorization"))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        given = headers.get("content-type")
        either = scope["path"] in self.json_or_upload_routes
        upload = scope["path"] in self.upload_routes or (either and _is_multipart_form(given))
        if scope["method"] != "POST" or not (upload or either
                                             or scope["path"] in self.json_routes):
            await self.app(scope, receive, send)  # routing answers 404/405 as usual
            return
        # 2. Content type.
        if not (_is_multipart_form(given) if upload else _is_json(given)):
            wanted = ("a multipart form: send `Content-Type: multipart/form-data`" if upload
                      else "JSON: send `Content-Type: application/json`" + (
                          " (or a multipart form)" if either else ""))
            await error_response(
                415, f"request body must be {wanted} (got {given or 'none'})",
                code="unsupported_media_type",
            )(scope, receive, send)
            return
        # 3. Body size.
        limit = self.max_upload_bytes if upload else self.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._too_large(limit, int(length))(scope, receive, send)
            return
        body = await self._read_body(receive, limit)
        if body == CLIENT_CLOSED_STATUS:  # nobody to answer: recorded as 499, not as a 400
            logger.debug("client disconnected while sending %s", scope["path"])
            await Response(status_code=CLIENT_CLOSED_STATUS)(scope, receive, send)
            return
        if body == 413:  # over the limit while counting (chunked upload)
            await self._too_large(limit, None)(scope, receive, send)
            return
        if body == 408:  # the body stopped arriving
            logger.info("closing a connection: no bytes of its %s body for %g s",
                        scope["path"], self.body_timeout_s)
            await error_response(
                408, f"the request body stopped arriving: no bytes for "
                f"{self.body_timeout_s:g} s; the connection is closed",
                code="request_timeout", headers={"Connection": "close"},
            )(scope, receive, send)
            return
        assert isinstance(body, bytes)
        if upload:  # the form parser reads binary parts; its text fields are checked there
            await self.app(scope, _replay(body, receive), send)
            return
        # 4. Encoding.
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await error_response(
                400, f"request body is not valid JSON: it is not UTF-8 (byte "
                f"0x{body[exc.start]:02x} at position {exc.start}); send JSON encoded as UTF-8",
                code="invalid_json",
            )(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_api_key(self, authorization: str | None) -> JSONResponse | None:
        if not authorization:
            return error_response(
                401, "missing API key: send `Authorization: Bearer <key>`",
                type="invalid_request_error", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = authorization.partition(" ")
        assert self.api_key is not None
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            return error_response(
                401, "incorrect API key provided", type="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        return None

    def _too_large(self, limit: int, num_bytes: int | None) -> JSONResponse:
        got = f", got {num_bytes}" if num_bytes is not None else ""
        return error_response(
            413, f"request body must be at most {limit} bytes{got}",
            code="payload_too_large",
        )

    async def _read_body(self, receive: Receive, limit: int) -> bytes | int:
        """Read the whole body, or say why not: 413 once it passes the limit, 408 when
        no bytes came for `body_timeout_s`, 499 (`CLIENT_CLOSED_STATUS`) if the client
        went away before sending all of it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                return 408
            if message["type"] != "http.request":  # http.disconnect
                return CLIENT_CLOSED_STATUS
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return 413
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then reads the real channel.

    Reading the real channel afterwards is what lets a handler hear `http.disconnect`.
    """
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


class OverLimitMiddleware:
    """503 `server_busy` for a request over the connection limit (see the module
    docstring); the others pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = scope.get("state", {}).get(OVER_LIMIT_STATE) if scope["type"] == "http" \
            else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        logger.warning("refused a request: over the connection limit of %s", limit)
        response = error_response(
            503, f"the server is at its limit of {limit} connections and requests in "
            "progress; retry later", type="server_overloaded", code="server_busy",
            headers={"Retry-After": str(BUSY_RETRY_AFTER_S), "Connection": "close"},
        )

        async def send_held_open(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "more_body": True}  # the server closes after it
            await send(message)

        # The whole answer at once (a client that reads before it finished sending has
        # it), then the rest of the body is read, then the connection closes.
        await response(scope, receive, send_held_open)
        await _drop_body(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drop_body(receive: Receive) -> None:
    """Read and drop a request's body, within the drain bounds."""
    read = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(OVER_LIMIT_DRAIN_S):
            while read <= OVER_LIMIT_DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                read += len(message.get("body", b""))
                if not message.get("more_body"):
                    return


INCOMING_STATE = "diffbatch_release_incoming"  # scope state: the announcement's release


class IncomingRequestMiddleware:
    """Announces each POST to an image route to the engine the moment it arrives
    (`Engine.incoming_request`), before its body is read and parsed, so an idle
    engine's admission wait gathers requests sent together even when the server is
    slow to parse them. The route hands the request to the engine and releases the
    announcement (the release is in the scope state, `INCOMING_STATE`); any other end
    (a refusal, a disconnect) releases it here."""

    def __init__(self, app: ASGIApp, announce: Callable[[], Callable[[], None]],
                 routes: frozenset[str]) -> None:
        self.app, self.announce, self.routes = app, announce, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in self.routes):
            await self.app(scope, receive, send)
            return
        release = self.announce()
        scope.setdefault("state", {})[INCOMING_STATE] = release
        try:
            await self.app(scope, receive, send)
        finally:
            release()


class HeadAsGetMiddleware:
    """Answer `HEAD` as `GET`; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            # a copy: the server's own scope keeps "HEAD", so it sends no body
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class RequestIdEchoMiddleware:
    """Put the client's `x-request-id` on every answer that does not carry one.

    The id is only echoed (and logged by the image route): the engine's request ids
    are the server's own.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = None
        if scope["type"] == "http":
            client_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if client_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", client_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HTTPMetrics:
    """HTTP-level Prometheus metrics, in their own registry beside the engine's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "diffbatch_http_requests", "HTTP requests answered, by route and status.",
            ["route", "method", "status"], registry=self.registry,
        )
        self.duration_s = Histogram(
            "diffbatch_http_request_duration_seconds",
            "Time from receiving an HTTP request to the start of its answer.",
            ["route"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.encode_s = Histogram(
            "diffbatch_image_encode_seconds",
            "Time to encode one response's images (PNG/JPEG/WebP + base64), by format.",
            ["format"], registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        for output_format in OUTPUT_FORMATS:
            self.encode_s.labels(output_format)
        self.disconnects = Counter(
            "diffbatch_http_client_disconnects",
            "HTTP requests whose client went away before the answer.",
            registry=self.registry,
        )


class HTTPMetricsMiddleware:
    """Record route, status and duration of every HTTP answer into `HTTPMetrics`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: HTTPMetrics,
        routes: frozenset[str],
        on_answer: Callable[[Scope, int], None] | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        # Known paths, templates such as "/v1/images/files/{file_id}" included (their
        # label is the template); others are counted as "other" (bounded labels).
        self.routes = frozenset(r for r in routes if "{" not in r)
        self.templates = [(re.compile("^" + re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(r))
                                      + "$"), r) for r in sorted(routes) if "{" in r]
        self.on_answer = on_answer  # called with (scope, status) after every answer

    def route_label(self, path: str) -> str:
        if path in self.routes:
            return path
        return next((label for pattern, label in self.templates if pattern.match(path)),
                    "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.route_label(scope["path"])
        start = time.perf_counter()
        status = 0
        complete = False  # the answer's last body part was sent

        async def send_and_record(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.duration_s.labels(route).observe(time.perf_counter() - start)
            elif (message["type"] == "http.response.body" and not message.get("more_body")) \
                    or message["type"] == "http.response.pathsend":  # (a file, whole)
                complete = True
            await send(message)

        gone = False  # the client went away after the answer started, before its end
        try:
            await self.app(scope, receive, send_and_record)
            gone = bool(status) and not complete  # a stream stopped before its last event
        except (ClientDisconnect, OSError):  # sending to a client that went away
            gone = bool(status) and not complete
            raise
        finally:
            if gone:
                status = CLIENT_CLOSED_STATUS
            if status >= 400 or not status:
                # Successful image requests get their one DEBUG line from serving_images.
                logger.debug("%s %s -> %s in %.1f ms", scope["method"], scope["path"],
                             status or "no answer", (time.perf_counter() - start) * 1e3)
            label = str(status) if status else "disconnected"
            self.metrics.requests.labels(route, scope["method"], label).inc()
            if status == CLIENT_CLOSED_STATUS:
                self.metrics.disconnects.inc()
            if self.on_answer is not None and status:
                self.on_answer(scope, status)
