"""Peer (c): LitServe with `max_batch_size` and `batch_timeout`.

LitServe's HTTP server process hands decoded requests to an inference worker
process, which gathers up to `max_batch_size` of them (waiting at most
`batch_timeout` seconds) and calls `predict` once per batch; decoding, the
pipeline call, PNG encoding and the response body all run in that worker.

    PYTHONPATH=benchmarks .venv/bin/python -m peers_servers.litserve_batch \
        --model tiny-sd --port 8002 --threads 1 --max-batch-size 8 --batch-timeout-ms 20
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import litserve as ls
from fastapi import HTTPException

from peers_servers.pipeline import (
    IMAGES_ROUTE,
    ImageJob,
    generate,
    load_pipeline,
    warm_up,
)


class ImageLitAPI(ls.LitAPI):
    """The diffusers pipeline as a LitAPI: a batch of jobs in, one response body each out."""

    def __init__(self, model: str, threads: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.threads = threads

    def setup(self, device: str) -> None:
        self.pipe = load_pipeline(self.model, self.threads)
        warm_up(self.pipe)

    # NOTE: no annotations on `request` and on encode_response's return: LitServe
    # builds its route from them (an unannotated `request` is the raw JSON body).
    def decode_request(self, request, **kwargs):
        try:
            return ImageJob.from_body(request)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    def batch(self, inputs: list[ImageJob]) -> list[ImageJob]:
        return list(inputs)

    def predict(self, jobs):
        # A batch of jobs; with `max_batch_size=1` (LitAPI's default) LitServe does not
        # batch and hands over one job.
        if isinstance(jobs, ImageJob):
            return generate(self.pipe, [jobs])[0]
        return generate(self.pipe, jobs)

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output, **kwargs):
        return output


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # LitServer.run cleans its processes up on Ctrl-C


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="default: LitAPI's own")
    parser.add_argument("--batch-timeout-ms", type=float, default=None,
                        help="default: LitAPI's own")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    batching: dict[str, Any] = {}  # what is not given stays LitAPI's default
    if args.max_batch_size is not None:
        batching["max_batch_size"] = args.max_batch_size
    if args.batch_timeout_ms is not None:
        batching["batch_timeout"] = args.batch_timeout_ms / 1000.0
    api = ImageLitAPI(args.model, args.threads, api_path=IMAGES_ROUTE, **batching)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=600)
    server.run(host=args.host, port=args.port, num_api_servers=1, log_level=args.log_level,
               generate_client_file=False)


if __name__ == "__main__":
    main()
