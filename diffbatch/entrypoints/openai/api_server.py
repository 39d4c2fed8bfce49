"""The OpenAI-compatible image server: app factory and `run_server` (uvicorn).

`build_app(engine, ...)` wires a started engine into a FastAPI app: the routes
(`api_router.py`), the logic (`serving_images.py`), the OpenAI error shape
(`errors.py`), the guard, request-id and metrics middleware (`middleware.py`) and
this server's OpenAPI spec (`openapi.py`). The engine is started before the server
accepts connections (`run_server` builds it first) and closed by the app's lifespan
when the server shuts down.

Connection-level limits are uvicorn's side (`uvicorn_config`, `http_protocol.py`):
how long a client may take to send its headers, how long an idle keep-alive
connection stays open, and how many connections are served at once.

Shutdown (SIGTERM or Ctrl-C) is bounded by `--shutdown-timeout`: the signal starts
`Engine.shutdown` at once (no new requests, waiting ones answered 503, running
waves finish until the timeout, then are interrupted and answered 503), while
uvicorn stops listening and waits for the open requests, which the engine answers
by then; the lifespan then closes the engine and its worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

from diffbatch.entrypoints.openai.api_router import (
    EDITS_ROUTE,
    IMAGES_ROUTE,
    PLAYGROUND_PATH,
    STATIC_DIR,
    SUBMITTED_STATE,
    lora_admin_router,
    router,
)
from diffbatch.entrypoints.openai.errors import install_exception_handlers
from diffbatch.entrypoints.openai.http_protocol import OVER_LIMIT_STATE
from diffbatch.entrypoints.openai.image_store import (
    DEFAULT_MAX_MB as DEFAULT_IMAGE_STORE_MB,
)
from diffbatch.entrypoints.openai.image_store import (
    DEFAULT_TTL_S as DEFAULT_IMAGE_URL_TTL_S,
)
from diffbatch.entrypoints.openai.image_store import FILES_ROUTE, ImageStore
from diffbatch.entrypoints.openai.middleware import (
    HeadAsGetMiddleware,
    HTTPMetrics,
    HTTPMetricsMiddleware,
    IncomingRequestMiddleware,
    OverLimitMiddleware,
    RequestGuardMiddleware,
    RequestIdEchoMiddleware,
)
from diffbatch.entrypoints.openai.openapi import install_openapi
from diffbatch.entrypoints.openai.serving_images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_PNG_COMPRESS_LEVEL,
    OpenAIServingImages,
)
from diffbatch.entrypoints.openai.serving_videos import (
    VIDEOS_ROUTE,
    OpenAIServingVideos,
    video_router,
)
from diffbatch.entrypoints.openai.video_store import DEFAULT_MAX_MB as DEFAULT_VIDEO_STORE_MB
from diffbatch.entrypoints.openai.video_store import DEFAULT_TTL_S as DEFAULT_VIDEO_TTL_S
from diffbatch.entrypoints.openai.video_store import VideoStore
from diffbatch.entrypoints.utils import CLIENT_CLOSED_STATUS
from diffbatch.errors import ConfigError
from diffbatch.models import DEFAULT_MODEL

if TYPE_CHECKING:
    import argparse
    import socket

    from diffbatch.engine.async_engine import Engine

logger = logging.getLogger(__name__)

# Default `max_body_bytes`: far above any valid request (prompts are <= 10,000 chars).
DEFAULT_MAX_BODY_BYTES = 1 << 20
# Default `max_upload_bytes` (`--max-upload-mb`): an edit's whole multipart body. A
# 2048x2048 RGBA PNG of noise is about 16 MiB, plus a mask; OpenAI takes files < 50 MB.
DEFAULT_MAX_UPLOAD_MB = 32
_IMAGE_ROUTES = frozenset({IMAGES_ROUTE, EDITS_ROUTE})
# `/v1` paths served without the API key: image links, whose unguessable id is the key.
_OPEN_PREFIXES = (f"{FILES_ROUTE}/",)
DOCS_ASSETS_PATH = "/docs/assets"  # Swagger UI's and ReDoc's scripts, served locally
# Connection-level defaults (`diffbatch serve --header-timeout ...`). A client's headers
# are a few hundred bytes: 10 s is generous on any link, and bounds how long a
# slow-header client holds a connection (uvicorn alone never times them out).
DEFAULT_HEADER_TIMEOUT_S = 10.0
# `--body-timeout`: the longest pause in a request body before a 408 (nginx's
# `client_body_timeout` is 60 s); an upload of 32 MB does not pause this long.
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's default: an idle keep-alive connection
# Most open connections and requests in progress; above it, 503. Each request in
# progress can hold a body of up to `max_body_bytes`; the benchmark client opens up
# to 1024 connections.
DEFAULT_LIMIT_CONCURRENCY = 1024
_UVICORN_STARTUP_FAILURE = 3  # the exit code `uvicorn.run` gives a server that did not start
# `--shutdown-timeout`: how long running waves may finish after SIGTERM before they are
# interrupted. Kubernetes gives a pod 30 s between SIGTERM and SIGKILL; this leaves room.
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# uvicorn waits this much longer than the shutdown timeout for open requests before it
# cancels them: the engine answers them all by the timeout, so it never has to.
_UVICORN_SHUTDOWN_MARGIN_S = 5.0


def build_app(
    engine: Engine,
    *,
    served_model_name: str,
    api_key: str | None = None,
    request_timeout_s: float | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    png_compress_level: int = DEFAULT_PNG_COMPRESS_LEVEL,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_MB << 20,
    image_store_bytes: int = DEFAULT_IMAGE_STORE_MB << 20,
    image_url_ttl_s: float = DEFAULT_IMAGE_URL_TTL_S,
    public_url: str | None = None,
    close_engine_on_shutdown: bool = True,
    shutdown_grace_s: float | None = None,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
    allow_runtime_lora_updating: bool = False,
    video_store_bytes: int = DEFAULT_VIDEO_STORE_MB << 20,
    video_ttl_s: float = DEFAULT_VIDEO_TTL_S,
) -> FastAPI:
    """Build the FastAPI app that serves `engine`.

    Args:
        engine: A started `diffbatch.Engine`.
        served_model_name: The model name clients pass and `/v1/models` lists.
        api_key: When set, every `/v1/...` request needs `Authorization: Bearer <key>`;
            `/health`, `/metrics` and `/docs` stay open.
        request_timeout_s: Abort and answer 504 to requests not done after this long.
        max_image_pixels: Largest width * height of one image (400 above it).
        png_compress_level: zlib level of PNG responses, 0-9: 1 encodes fastest,
            9 smallest (the pixels are the same at every level).
        max_body_bytes: Largest JSON request body (413 above it).
        max_upload_bytes: Largest multipart body of an edit, image and mask together
            (413 above it).
        image_store_bytes: Memory kept for `response_format: "url"` images, oldest
            dropped first; 0 refuses "url" with a 400.
        image_url_ttl_s: How long such a link works.
        public_url: Base of those links (e.g. "https://img.example.com/api" behind a
            proxy); None: the base URL each request was sent to.
        close_engine_on_shutdown: Close the engine when the server shuts down.
        shutdown_grace_s: Bound on each stage of closing the engine at shutdown (the
            last waves, then the worker); None = the engine's own bounds.
        body_timeout_s: Longest pause in a request body (no bytes arriving) before a
            408 that closes the connection; None = no limit.
        allow_runtime_lora_updating: Serve `POST /v1/load_lora_adapter` and
            `/v1/unload_lora_adapter` (vLLM's routes; under the API key like every
            `/v1` route); without it they are 404s.
        video_store_bytes: Memory kept for finished clips of `/v1/videos` jobs (a
            video model only), oldest dropped first; 0 refuses video jobs with a 400
            (several Ray Serve replicas, each of which would keep its own jobs).
        video_ttl_s: How long a finished video job and its clip stay reachable.

    Returns:
        The app; serve it with uvicorn (see `run_server`).
    """
    if not served_model_name:
        raise ValueError("served_model_name must be a non-empty string")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_upload_bytes < 1:
        raise ValueError(f"max_upload_bytes must be >= 1, got {max_upload_bytes}")
    if image_store_bytes < 0:
        raise ValueError(f"image_store_bytes must be >= 0, got {image_store_bytes}")
    if public_url is not None and not public_url.startswith(("http://", "https://")):
        raise ValueError(f"public_url must start with http:// or https://, got {public_url!r}")
    if body_timeout_s is not None and not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0 or None, got {body_timeout_s}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info(
            "serving %r at %s (max_num_seqs=%s, api key %s)",
            served_model_name, IMAGES_ROUTE, engine.config.max_num_seqs,
            "required" if api_key else "off",
        )
        try:
            yield
        finally:
            videos = getattr(app.state, "serving_videos", None)
            if videos is not None:
                await videos.close()
            if close_engine_on_shutdown:
                logger.info("shutting down: closing the engine")
                await asyncio.to_thread(engine.close, shutdown_grace_s)

    # FastAPIOffline: /docs and /redoc load their scripts from this server, not from a
    # CDN, so they work on a machine without internet access
    app = FastAPIOffline(
        static_url=DOCS_ASSETS_PATH,
        title="diffbatch",
        summary="OpenAI-compatible image generation with request-level batching",
        version=_version(),
        lifespan=lifespan,
        # a path with a trailing slash is a 404 like any unknown path, not a redirect
        # to a URL built from the client's own Host header
        redirect_slashes=False,
    )
    http_metrics = HTTPMetrics()
    app.state.engine = engine
    app.state.http_metrics = http_metrics
    app.state.started_at = int(time.time())
    app.state.serving_images = OpenAIServingImages(
        engine,
        served_model_name=served_model_name,
        request_timeout_s=request_timeout_s,
        max_image_pixels=max_image_pixels,
        png_compress_level=png_compress_level,
        http_metrics=http_metrics,
        image_store=ImageStore(image_store_bytes, image_url_ttl_s) if image_store_bytes
        else None,
        public_url=public_url,
    )
    app.include_router(router)
    if getattr(engine.info, "is_video", False):  # OpenAI's Videos API (serving_videos.py)
        app.state.serving_videos = OpenAIServingVideos(
            engine, served_model_name=served_model_name,
            store=VideoStore(video_store_bytes, video_ttl_s) if video_store_bytes else None,
            registry=http_metrics.registry, max_frame_pixels=max_image_pixels)
        app.include_router(video_router)
    if allow_runtime_lora_updating:
        app.include_router(lora_admin_router)
    app.mount(PLAYGROUND_PATH, StaticFiles(directory=STATIC_DIR), name="playground")
    install_exception_handlers(app)
    install_openapi(
        app, size_rule=app.state.serving_images.size_rule,
        lora_enabled=_lora_enabled(engine) or allow_runtime_lora_updating,
        api_key_required=api_key is not None,
        max_request_work=getattr(engine, "max_request_work", None),
        default_steps=engine.info.default_num_inference_steps,
        max_upload_pixels=max_image_pixels, open_prefixes=_OPEN_PREFIXES,
        negative_prompt=getattr(engine.info, "negative_prompt", "yes") == "yes",
        step_cache=getattr(engine.info, "step_cache_unsupported", None) is None,
    )
    # Added last = outermost: metrics see every answer, including the guard's.
    app.add_middleware(RequestGuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes,
                       json_routes=frozenset({IMAGES_ROUTE}),
                       upload_routes=frozenset({EDITS_ROUTE}), max_upload_bytes=max_upload_bytes,
                       json_or_upload_routes=frozenset({VIDEOS_ROUTE}),
                       open_prefixes=_OPEN_PREFIXES, body_timeout_s=body_timeout_s)
    # Inside the metrics: a refusal over the connection limit is counted as any answer.
    app.add_middleware(OverLimitMiddleware)
    app.add_middleware(
        HTTPMetricsMiddleware,
        metrics=http_metrics,
        routes=_route_paths(app),
        on_answer=_rejection_counter(engine),
    )
    app.add_middleware(RequestIdEchoMiddleware)
    app.add_middleware(HeadAsGetMiddleware)
    incoming = getattr(engine, "incoming_request", None)
    if incoming is not None:  # outermost: announced before anything reads the body
        app.add_middleware(IncomingRequestMiddleware, announce=incoming,
                           routes=frozenset({IMAGES_ROUTE, EDITS_ROUTE}))
    return app


def _route_paths(app: FastAPI) -> frozenset[str]:
    """Paths of our routes and FastAPI's docs, templates included (the metrics' bounded
    route labels)."""
    paths = {getattr(r, "path", None) for r in [*router.routes, *app.routes]}
    return frozenset(p for p in paths if p)


def _rejection_counter(engine: Engine) -> Any:
    """The HTTP layer's one count of refused image requests (the engine's `rejected`).

    Every answer passes the metrics middleware, so its hook sees every refusal of an
    image request (a 4xx but 499, which is a client gone), wherever the server made
    it: the guard (401, 413, 415, a body not UTF-8), FastAPI's validation and the
    form reader (400), the serving stages 1-2 (400, 404), and the connection limit
    (503 `server_busy`). A request handed to the
    engine (`SUBMITTED_STATE`) is not counted here: the engine counts its own
    refusals (invalid for the model, a full queue) where it makes them, for every
    caller alike, and anything else it answers is an outcome of its own.
    """

    def on_answer(scope: dict[str, Any], status: int) -> None:
        refused = 400 <= status < CLIENT_CLOSED_STATUS \
            or OVER_LIMIT_STATE in scope.get("state", {})  # a 503 of the connection limit
        if scope["path"] not in _IMAGE_ROUTES or not refused \
                or scope.get("method") != "POST":  # a GET there (405) is no image request
            return
        if not scope.get("state", {}).get(SUBMITTED_STATE):
            engine.record_rejected()

    return on_answer


def _version() -> str:
    from diffbatch import __version__

    return __version__


def uvicorn_config(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    header_timeout_s: float | None = DEFAULT_HEADER_TIMEOUT_S,
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
    http_base: type[asyncio.Protocol] | None = None,
    **kwargs: Any,
) -> uvicorn.Config:
    """The uvicorn configuration of `app`, with the connection limits of `http_protocol.py`.

    Args:
        app: The ASGI app (`build_app`).
        host: Address to listen on.
        port: Port to listen on.
        log_level: uvicorn's log level.
        header_timeout_s: Seconds a client may take to send a request's headers; then
            408 and the connection is closed (None = no limit).
        keep_alive_timeout_s: Seconds an idle keep-alive connection stays open.
        limit_concurrency: Most open connections and requests in progress; more get
            503 (None = no limit).
        http_base: uvicorn's HTTP protocol to extend (None = uvicorn's default,
            httptools where it is installed, else h11).
        **kwargs: Other `uvicorn.Config` arguments.
    """
    from diffbatch.entrypoints.openai.http_protocol import http_protocol_class

    protocol = http_protocol_class(header_timeout_s=header_timeout_s,
                                   max_connections=limit_concurrency, base=http_base)
    kwargs.setdefault("timeout_graceful_shutdown",
                      DEFAULT_SHUTDOWN_TIMEOUT_S + _UVICORN_SHUTDOWN_MARGIN_S)
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol,
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        **kwargs,
    )


def check_can_listen(host: str, port: int) -> None:
    """Raise `ConfigError` when the server could not listen at `host`:`port` (an
    unknown host, a port taken), as uvicorn would find only once the model is loaded.
    Port 0 (the system picks one) always can."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind(address)
    except OSError as exc:  # socket.gaierror included
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                          "(--host, --port)", param="port") from None


def _lora_enabled(engine: Engine) -> bool:
    """Whether requests may name LoRA adapters here (a folder, or adapters by name)."""
    loras = getattr(engine, "loras", None)
    return loras.enabled if loras is not None else engine.config.lora_dir is not None


def run_server(args: argparse.Namespace) -> None:
    """Start the engine from CLI `args`, then serve it with uvicorn until interrupted."""
    from diffbatch import Engine, EngineConfig
    from diffbatch.engine.async_engine import SHUTDOWN_GRACE_S

    config = EngineConfig.from_cli_args(args)
    check_can_listen(args.host, args.port)  # before the model loads, not after
    engine = Engine.from_config(config)
    shutdown_timeout_s = getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
    try:
        app = build_app(
            engine,
            served_model_name=args.served_model_name or served_name_of(engine, args.model),
            api_key=args.api_key,
            request_timeout_s=args.request_timeout,
            max_image_pixels=args.max_image_pixels,
            png_compress_level=args.png_compress_level,
            shutdown_grace_s=SHUTDOWN_GRACE_S,
            max_upload_bytes=args.max_upload_mb << 20,
            image_store_bytes=(DEFAULT_IMAGE_STORE_MB if args.image_store_mb is None
                               else args.image_store_mb) << 20,
            image_url_ttl_s=args.image_url_ttl,
            public_url=args.public_url,
            body_timeout_s=args.body_timeout,
            allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False),
            video_store_bytes=getattr(args, "video_store_mb", DEFAULT_VIDEO_STORE_MB) << 20,
            video_ttl_s=getattr(args, "video_ttl", DEFAULT_VIDEO_TTL_S),
        )
    except BaseException:
        engine.close()
        raise
    if args.port:
        logger.info("listening on http://%s:%d (docs at /docs)", args.host, args.port)
    else:  # the system picks the port when uvicorn binds: its "running on" line names it
        logger.info("listening on %s at a port the system picks (see below; docs at /docs)",
                    args.host)
    server_config = uvicorn_config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(),
        header_timeout_s=args.header_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
        limit_concurrency=args.limit_concurrency,
        timeout_graceful_shutdown=shutdown_timeout_s + _UVICORN_SHUTDOWN_MARGIN_S,
    )
    server = DrainingServer(server_config, engine=engine, shutdown_timeout_s=shutdown_timeout_s)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled
        pass
    finally:
        engine.close()  # the lifespan closed it already unless uvicorn failed to start
    if not server.started:  # e.g. the port is taken; uvicorn logged why
        raise SystemExit(_UVICORN_STARTUP_FAILURE)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, starting the engine's bounded shutdown on the first exit signal.

    uvicorn alone only stops listening and waits for the open requests, then cancels
    them (a plain-text 500) after its graceful timeout, while the engine keeps
    computing; see the module docstring for what happens instead.
    """

    def __init__(self, config: uvicorn.Config, *, engine: Engine,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain is None:  # in a signal handler: start the work, never block here
            logger.info("received signal %d: shutting down within %g s", sig,
                        self.shutdown_timeout_s)
            self._drain = threading.Thread(
                target=self.engine.shutdown, args=(self.shutdown_timeout_s,),
                name="diffbatch-shutdown", daemon=True)
            self._drain.start()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the app's shutdown on a forced exit and cancels it with the
            # loop instead (a logged traceback); run it, it is bounded: it closes the
            # engine, answering what is still open.
            await self.lifespan.shutdown()


def served_name_of(engine: Engine, model: str | None) -> str:
    """The default served model name: the MODEL argument as given, without a trailing
    slash (a folder named by tab completion, `mymodel/`, is served as `mymodel`), else
    the engine's model."""
    if model:
        return model.rstrip("/" + os.sep) or model
    configured: str | None = getattr(engine.config, "model", None)
    return configured or DEFAULT_MODEL
