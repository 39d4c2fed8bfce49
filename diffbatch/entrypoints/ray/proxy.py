"""Middleware for Ray Serve's HTTP proxy: routing keys, and a clear error when a replica
fails mid-request.

`RouteKeyMiddleware` reads the JSON body of an image generation request in the proxy,
before Ray Serve routes it, and puts its routing key (`route_key.py`) in the
`x-diffbatch-route-key` header, where the diffbatch request router (`router.py`) and
the replica read it. Ray Serve's proxy hands a replica only the request's headers and
lets it pull the body afterwards, so the key has to be added here; the body is then
replayed unchanged. A client's own `x-diffbatch-route-key` is dropped.

When the replica that holds a request dies (killed, out of memory, node lost),
Ray Serve's proxy ends the request without an answer and its HTTP server fills in a
bare `500 Internal Server Error` in plain text. `ReplicaFailureMiddleware` answers
such requests instead with diffbatch's OpenAI-shaped error, as `diffbatch serve`
does when its worker process dies:

    503 {"error": {"message": "the replica serving this request failed ...",
                   "type": "engine_unavailable", "code": "replica_failed"}}

Ray Serve loads proxy middleware from the import path in the proxy's environment
variable `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`; `serve_start_options()` sets it
through the Serve controller's environment, which the proxies inherit. Only answers
the proxy left empty are touched, so it is safe for other applications on the same
cluster, and a client that went away gets nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.middleware import Middleware
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "diffbatch.entrypoints.ray.proxy:proxy_middlewares"
REPLICA_FAILED_MESSAGE = (
    "the replica serving this request failed before it answered (it died or was "
    "stopped); Ray Serve replaces failed replicas, so the request can be retried"
)


def proxy_middlewares() -> list[Middleware]:
    """The proxy callback Ray Serve calls (see the module docstring)."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaFailureMiddleware), Middleware(RouteKeyMiddleware)]


def serve_start_options(host: str, port: int) -> dict[str, Any]:
    """Keyword arguments of `serve.start` for diffbatch: the proxy on `host:port`,
    with `ReplicaFailureMiddleware` installed in every proxy.

    Like all of `serve.start`'s options they apply when Serve first starts on a
    cluster; a Serve instance already running keeps its own.
    """
    return {
        "http_options": {"host": host, "port": port},
        "controller_options": {"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}},
    }


class ReplicaFailureMiddleware:
    """Answer 503 in the OpenAI error shape where the proxy would send a bare 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        disconnected = False

        async def watch_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def watch_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, watch_receive, watch_send)
        except Exception:
            if started:
                raise
            logger.warning("request to %s failed in the proxy", scope.get("path"), exc_info=True)
        if started or disconnected:
            return
        from diffbatch.entrypoints.openai.errors import error_response

        response = error_response(
            503, REPLICA_FAILED_MESSAGE, type="engine_unavailable", code="replica_failed"
        )
        await response(scope, receive, send)


class RouteKeyMiddleware:
    """Add the request's routing key as a header; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from diffbatch.entrypoints.ray.route_key import (
            MAX_KEYED_BODY_BYTES,
            ROUTE_KEY_HEADER,
            route_key_of_body,
        )

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = ROUTE_KEY_HEADER.encode("latin-1")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != name]
        content_type = next((v.decode("latin-1") for k, v in headers
                             if k.lower() == b"content-type"), "")
        if scope.get("method") != "POST" or "json" not in content_type.lower():
            await self.app({**scope, "headers": headers}, receive, send)
            return
        # Read the body (up to the keyed limit), then replay what was read.
        read: list[Message] = []
        size = 0
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break  # the client left: the proxy hears it on replay
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > MAX_KEYED_BODY_BYTES:
                break
        complete = read[-1]["type"] == "http.request" and not read[-1].get("more_body", False)
        if complete:
            body = b"".join(m.get("body", b"") for m in read)
            key = route_key_of_body("POST", scope.get("path", ""), content_type, body)
            if key is not None:
                headers.append((name, key.encode().encode("latin-1")))

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app({**scope, "headers": headers}, replay, send)
