"""Peer (d): a plain FastAPI + diffusers server that runs one request at a time.

What most people write first: one pipeline, one `asyncio.Lock` around it (FIFO, so
no request starves), the call and the PNG encoding in a worker thread so the event
loop keeps accepting connections. No batching.

    PYTHONPATH=benchmarks .venv/bin/python -m peers_servers.fastapi_serial \
        --model tiny-sd --port 8001 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse

from peers_servers.pipeline import (
    IMAGES_ROUTE,
    ImageJob,
    error_body,
    generate,
    load_pipeline,
    warm_up,
)


def build_app(pipe: Any) -> FastAPI:
    """The app: the image route behind one lock, and `/health`."""
    app = FastAPI(title="fastapi-serial peer")
    lock = asyncio.Lock()

    @app.post(IMAGES_ROUTE)
    async def create_image(body: Any = Body(...)) -> JSONResponse:
        try:
            job = ImageJob.from_body(body)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        async with lock:
            [response] = await asyncio.to_thread(generate, pipe, [job])
        return JSONResponse(response)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    pipe = load_pipeline(args.model, args.threads)
    warm_up(pipe)
    uvicorn.run(build_app(pipe), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
