"""Peer (b): Ray Serve with `@serve.batch`.

A local Ray cluster (`ray.init(num_cpus=2, include_dashboard=False)`, loopback
only), Serve's HTTP proxy on 127.0.0.1, and one replica whose `@serve.batch`
method gathers up to `max_batch_size` requests (waiting at most
`batch_wait_timeout_s` after the first) and runs them as one pipeline call in a
thread, so the replica's event loop keeps queueing requests meanwhile.
`max_ongoing_requests` is raised well above the batch size, so a burst reaches the
batch queue instead of waiting in the proxy.

    PYTHONPATH=benchmarks .venv/bin/python -m peers_servers.ray_serve_batch \
        --model tiny-sd --port 8003 --threads 1 --max-batch-size 8 --batch-wait-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse
from ray import serve

from peers_servers.pipeline import (
    IMAGES_ROUTE,
    ImageJob,
    error_body,
    generate,
    load_pipeline,
    warm_up,
)

MAX_ONGOING_REQUESTS = 1024
app = FastAPI(title="ray-serve-batch peer")


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 1})
@serve.ingress(app)
class ImageDeployment:
    """One replica holding the pipeline; requests meet in `generate_batch`."""

    def __init__(
        self, model: str, threads: int | None, max_batch_size: int | None,
        batch_wait_s: float | None,
    ) -> None:
        self.pipe = load_pipeline(model, threads)
        warm_up(self.pipe)
        if max_batch_size is not None:  # else `@serve.batch`'s default
            self.generate_batch.set_max_batch_size(max_batch_size)
        if batch_wait_s is not None:
            self.generate_batch.set_batch_wait_timeout_s(batch_wait_s)

    @serve.batch
    async def generate_batch(self, jobs: list[ImageJob]) -> list[dict[str, Any]]:
        return await asyncio.to_thread(generate, self.pipe, jobs)

    @app.post(IMAGES_ROUTE)
    async def create_image(self, body: Any = Body(...)) -> JSONResponse:
        try:
            job = ImageJob.from_body(body)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        return JSONResponse(await self.generate_batch(job))

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--port", type=int, default=8003)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="default: @serve.batch's own")
    parser.add_argument("--batch-wait-ms", type=float, default=None,
                        help="default: @serve.batch's own")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(
            ImageDeployment.bind(
                args.model, args.threads, args.max_batch_size,
                None if args.batch_wait_ms is None else args.batch_wait_ms / 1000.0),
            name="diffbatch-peer", route_prefix="/",
        )
        print(f"ray serve peer ready on 127.0.0.1:{args.port}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
