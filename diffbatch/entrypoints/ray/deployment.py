"""The Ray Serve deployment: one diffbatch `Engine` per replica, the usual app as ingress.

Each replica

1. starts its own `Engine` from `RayServeArgs.engine_config()` (in a thread, so the
   replica's event loop stays free while the model loads);
2. serves the same FastAPI app as `diffbatch serve` (`openai.api_server.build_app`),
   bound late through Ray Serve's `__serve_build_asgi_app__`, so the app holds this
   replica's engine. Clients change nothing. Every answer carries the replica's id in
   `x-diffbatch-replica`, so load spreading can be seen;
3. reports the batch keys it is running and the adapters it has loaded to the
   diffbatch request router (`record_routing_stats`, router.py);
4. answers Ray Serve's health check with `Engine.check_health()`: a replica whose
   engine loop or worker is dead is marked unhealthy and replaced by Ray Serve.

Batching happens inside each replica: a replica's engine batches the requests Ray
routes to it, and Ray routes at most `max_ongoing_requests` to one replica at once.
The diffbatch request router (router.py, the default) sends requests of one batch
key to the same replica, so its waves fill.

A client disconnect reaches the replica through Ray Serve: the proxy cancels the
replica-side request, which cancels the route handler, and `Engine.generate_async`
aborts the engine request on cancellation (the same path as `diffbatch serve`).

This module imports Ray; `diffbatch.entrypoints.ray.server` imports it only when a
Ray application is built.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

from ray import serve

from diffbatch.entrypoints.ray import REPLICA_HEADER
from diffbatch.entrypoints.ray.args import DEFAULT_DEPLOYMENT_NAME, RayServeArgs
from diffbatch.entrypoints.ray.route_key import route_key_of_headers
from diffbatch.entrypoints.ray.router import STATS_ADAPTERS, STATS_KEYS

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from diffbatch.engine.async_engine import Engine

logger = logging.getLogger(__name__)


class RouteKeyTally:
    """This replica's requests in flight by batch key, and the adapters it has served
    (its worker loads an adapter on first use and keeps it): what it reports to the
    diffbatch request router (`record_routing_stats`)."""

    def __init__(self) -> None:
        self.batch_keys: collections.Counter[str] = collections.Counter()
        self.adapters: set[str] = set()

    def stats(self) -> dict[str, object]:
        return {STATS_KEYS: {k: n for k, n in self.batch_keys.items() if n > 0},
                STATS_ADAPTERS: sorted(self.adapters)}


class ReplicaHeaderMiddleware:
    """Add `x-diffbatch-replica: <replica id>` to every HTTP answer (plain ASGI), and
    leave `x-request-id` to Ray Serve's proxy, which puts the request's id (the
    client's, else its own, which the replica saw as the request's) on every answer:
    the app's echo of the same id would make the header appear twice. Requests that
    carry a routing key (`x-diffbatch-route-key`, from the proxy) are counted in
    `tally` while they run.

    Plain ASGI, like the server's own middleware, so the handler still hears
    `http.disconnect` on the ASGI channel.
    """

    def __init__(self, app: ASGIApp, *, replica_id: str, tally: RouteKeyTally) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode("latin-1"), replica_id.encode("latin-1"))
        self.tally = tally

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, self.header]}
            await send(message)

        key = route_key_of_headers(scope.get("headers"))
        if key is None:
            await self.app(scope, receive, send_with_header)
            return
        self.tally.batch_keys[key.batch] += 1
        self.tally.adapters.update(key.adapters)
        try:
            await self.app(scope, receive, send_with_header)
        finally:
            self.tally.batch_keys[key.batch] -= 1
            if self.tally.batch_keys[key.batch] <= 0:
                del self.tally.batch_keys[key.batch]


@serve.deployment(name=DEFAULT_DEPLOYMENT_NAME)
@serve.ingress()
class DiffbatchDeployment:
    """One replica: a diffbatch engine and the OpenAI-compatible app that serves it.

    Args:
        args: the application's arguments; options of the deployment itself
            (replicas, resources, health checks) are applied by `build_deployment`.
    """

    async def __init__(self, args: RayServeArgs) -> None:  # type: ignore[misc]  # Ray awaits it
        from diffbatch import Engine

        self.args = args
        self.replica_id = serve.get_replica_context().replica_tag
        self.tally = RouteKeyTally()
        self.engine: Engine = await asyncio.to_thread(Engine.from_config, args.engine_config())
        logger.info("replica %s: engine ready (model=%s)", self.replica_id, args.model)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        """Ray Serve calls this once `__init__` is done; the app closes the engine."""
        from diffbatch.entrypoints.openai.api_server import build_app, served_name_of

        try:
            app = build_app(
                self.engine,
                served_model_name=(self.args.served_model_name
                                   or served_name_of(self.engine, self.args.model)),
                close_engine_on_shutdown=True,
                **self.args.app_kwargs(),
            )
            app.add_middleware(ReplicaHeaderMiddleware, replica_id=self.replica_id,
                               tally=self.tally)
        except BaseException:
            self.engine.close()
            raise
        return app

    def record_routing_stats(self) -> dict[str, object]:
        """Ray Serve asks each replica for these periodically and hands them to the
        routers: the batch keys in flight here and the adapters loaded (router.py)."""
        return self.tally.stats()

    def check_health(self) -> None:
        """Ray Serve's health check: raises unless the engine can take work."""
        self.engine.check_health()


def build_deployment(args: RayServeArgs) -> serve.Application:
    """The bound Ray Serve application for `args` (replicas, resources, health checks)."""
    options = args.deployment_options()
    config = args.engine_config()
    logger.info(
        "diffbatch on Ray Serve: deployment=%s replicas=%s cpus/replica=%g gpus/replica=%g "
        "max_ongoing_requests=%d model=%s max_num_seqs=%s executor=%s router=%s",
        options["name"], options.get("num_replicas", options.get("autoscaling_config")),
        args.num_cpus_per_replica, args.num_gpus_per_replica, options["max_ongoing_requests"],
        config.model, config.max_num_seqs, config.executor, args.ray_router,
    )
    # (`@serve.deployment` adds `options`; mypy reads class decorators as no-ops)
    return DiffbatchDeployment.options(**options).bind(args)  # type: ignore[attr-defined]
