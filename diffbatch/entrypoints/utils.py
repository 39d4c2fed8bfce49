"""Helpers shared by HTTP entrypoints: cancelling a handler when its client disconnects."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec

from starlette.responses import Response

from diffbatch.errors import EngineClosedError

if TYPE_CHECKING:
    from starlette.requests import Request

logger = logging.getLogger(__name__)

P = ParamSpec("P")

# nginx's "client closed request"; never seen by the client, only by logs and metrics.
CLIENT_CLOSED_STATUS = 499


async def listen_for_disconnect(request: Request) -> None:
    """Return once the client of `request` has disconnected.

    Reads the raw ASGI channel, so it must only run after the body has been read
    (FastAPI reads it before the handler is called).
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(
    handler: Callable[P, Awaitable[Response]],
) -> Callable[P, Awaitable[Response]]:
    """Run a FastAPI handler so that a client disconnect cancels it.

    The handler must take the Starlette request as `raw_request`. Cancelling the
    handler cancels whatever it awaits; for the image route that is
    `Engine.generate_async`, which aborts the request in the engine.

    NOTE: this races the handler against a task that waits for `http.disconnect`
    on the ASGI channel instead of polling `request.is_disconnected()`: polling
    would need a loop with a sleep, and `is_disconnected` only looks at messages
    already queued. This is the pattern of vLLM's `with_cancellation` and of
    Starlette's `StreamingResponse`. It needs pure ASGI middleware between the
    server and the route (`BaseHTTPMiddleware` would hide the channel).

    Returns a 499 response (for logs and metrics only) when the client went away.

    A client disconnect never cancels the wrapper itself; the server does, when it
    exits without waiting for the request (a second Ctrl-C, or past uvicorn's
    graceful-shutdown timeout). The request is then stopped and raises
    `EngineClosedError`, which the app answers as every request cut by a shutdown
    (a 503 to retry), not with uvicorn's plain-text 500.
    """

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
        raw_request: Any = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(listen_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait(
                {handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            handler_task.cancel()
            await asyncio.gather(handler_task, return_exceptions=True)  # the abort
            this = asyncio.current_task()
            if this is not None:
                this.uncancel()  # answered below instead
            raise EngineClosedError("the server is shutting down: this request was "
                                    "stopped before it finished; retry it") from None
        finally:
            for task in (handler_task, disconnect_task):
                if not task.done():
                    task.cancel()
        if handler_task in done:
            return handler_task.result()
        # The client is gone: wait for the cancelled handler to finish its cleanup
        # (the engine abort) so that nothing outlives this request.
        await asyncio.gather(handler_task, return_exceptions=True)
        logger.debug("client disconnected from %s; request cancelled", raw_request.url.path)
        return Response(status_code=CLIENT_CLOSED_STATUS)

    return wrapper
