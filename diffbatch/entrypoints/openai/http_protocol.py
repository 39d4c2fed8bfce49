"""uvicorn's HTTP protocol with a header timeout and a connection limit in the OpenAI shape.

uvicorn times out only idle keep-alive connections (`timeout_keep_alive`, armed
after a response). A connection that opens and then sends its request headers a
byte at a time is never timed out, so a handful of slow clients can hold a server's
connections (and file descriptors) for as long as they like. This protocol adds:

- a header timeout: from the moment a connection waits for a request (it opened,
  or bytes of a new request arrived after a response) until that request's headers
  are complete. On expiry a connection that sent part of a request gets a 408 in the
  OpenAI error shape and is closed; one that sent nothing is just closed;
- a connection limit: only the `max_connections` oldest open connections are served
  (so at most that many requests are in progress: a connection carries one at a
  time). A request on a younger connection is marked in its scope
  (`OVER_LIMIT_STATE`) and answered by `OverLimitMiddleware` inside the app: a 503 in
  the OpenAI shape (`code: "server_busy"`, `Retry-After`), counted by the metrics like
  every answer, and its connection is closed. Ranking by age, not by the count at a
  request's first bytes, refuses only the connections over the limit when a burst
  opens them all at once. uvicorn's own `limit_concurrency` answers plain text
  instead, to every request while over;
- malformed HTTP (a request line or headers neither parser accepts) answered with a
  400 in the OpenAI error shape (`code: "invalid_http_request"`) where uvicorn sends
  plain text; the connection is closed, as uvicorn closes it.

It is a mixin over the protocol uvicorn would pick (`httptools`, else `h11`) and relies
on what both share: `connection_made`/`data_received`/`connection_lost`, the current
request's `cycle` (replaced when a request's headers are complete), the `app` it
hands each new request to, the server's `connections`, and `send_400_response(msg)`,
which both call when their parser rejects the bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from diffbatch.entrypoints.openai.errors import error_body

logger = logging.getLogger(__name__)

# The scope state key of a request over the connection limit (its value: the limit).
OVER_LIMIT_STATE = "diffbatch.over_connection_limit"
_connection_order = itertools.count()  # connections' opening order, for the limit


def http_protocol_class(
    *, header_timeout_s: float | None, max_connections: int | None,
    base: type[asyncio.Protocol] | None = None,
) -> type[asyncio.Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`.

    Args:
        header_timeout_s: Seconds a client may take to send a request's headers
            (None = no limit, uvicorn's own behaviour).
        max_connections: Most open connections and requests in progress (None = no
            limit).
        base: uvicorn's protocol to extend (None = the one uvicorn picks by default).
    """
    if header_timeout_s is not None and not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0 or None, got {header_timeout_s}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1 or None, got {max_connections}")
    return type(
        "GuardedHTTPProtocol", (_GuardedHTTPProtocol, base or AutoHTTPProtocol),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )


if TYPE_CHECKING:  # what the mixin's `super()` calls reach: the uvicorn protocol
    _ProtocolBase = asyncio.Protocol
else:
    _ProtocolBase = object


class _GuardedHTTPProtocol(_ProtocolBase):
    """The additions, over a uvicorn HTTP protocol (see the module docstring)."""

    header_timeout_s: float | None = None
    max_connections: int | None = None
    # Provided by the uvicorn protocol this is mixed into.
    app: Any
    cycle: Any
    client: tuple[str, int] | None
    connections: set[Any]
    transport: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_started = False  # bytes of a request arrived since the timer started
        self._order = next(_connection_order)
        self._app = self.app
        self._over_limit_app = _marked_over_limit(self.app, self.max_connections)

    # -- asyncio.Protocol -----------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.max_connections is not None and self._waiting_for_headers():
            # the app a new request goes to: this connection's rank among the open ones
            older = sum(1 for c in self.connections if getattr(c, "_order", -1) < self._order)
            self.app = self._over_limit_app if older >= self.max_connections else self._app
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete
            self._stop_header_timer()
        elif self._waiting_for_headers():
            self._request_started = True
            self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """The parser rejected the bytes: a 400 in the OpenAI shape, then close (what
        uvicorn does, with a JSON body in place of its plain text)."""
        self._stop_header_timer()  # (uvicorn has logged `msg`)
        self.transport.write(_raw_error_response(
            400, "Bad Request", "the request is not valid HTTP/1.1 (its request line or "
            "headers could not be parsed); the connection is closed",
            "invalid_http_request"))
        self.transport.close()

    # -- header timeout -------------------------------------------------------------
    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _start_header_timer(self) -> None:
        if self.header_timeout_s is None or self._header_timer is not None:
            return
        self._header_timer = asyncio.get_running_loop().call_later(
            self.header_timeout_s, self._on_header_timeout
        )

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._request_started = False

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._waiting_for_headers():
            return
        if self._request_started:
            logger.info("closing a connection from %s: request headers not complete within "
                        "%g s", _peer(self.client), self.header_timeout_s)
            self.transport.write(_timeout_response(self.header_timeout_s or 0))
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown client"


def _timeout_response(header_timeout_s: float) -> bytes:
    return _raw_error_response(
        408, "Request Timeout", f"request headers were not complete within "
        f"{header_timeout_s:g} s; the connection is closed", "request_timeout")


def _raw_error_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole response in the OpenAI error shape, written outside any ASGI cycle, for
    a connection that is closed after it."""
    body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def _marked_over_limit(app: Any, max_connections: int | None) -> Any:
    """`app`, for a request over the connection limit: its scope says so
    (`OVER_LIMIT_STATE`), and `OverLimitMiddleware` answers it."""

    async def over_limit(scope: Any, receive: Any, send: Any) -> None:
        scope.setdefault("state", {})[OVER_LIMIT_STATE] = max_connections
        await app(scope, receive, send)

    return over_limit
