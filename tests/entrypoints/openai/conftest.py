"""Fixtures of the HTTP tests: real uvicorn servers on free loopback ports.

`serve_in_thread` runs uvicorn in a thread of the test process, so a test can read
the engine's state (`num_waiting`, metrics) directly. The listening socket is
bound and put in listen mode before uvicorn starts, so the readiness check is a
single `GET /health` that the kernel queues until uvicorn accepts it (bounded by
a deadline), not a sleep-and-retry loop.

Gated servers use `GatedPipeline` (executor "inproc") with events of their own:
a forward blocks until the test sets `release`, so tests control timing exactly.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app, uvicorn_config
from tests.fake_pipelines import GatedPipeline, make_gate

READY_TIMEOUT_S = 120.0  # a cold start builds the tiny model and starts a worker
API_KEY = "test-key"


@dataclass
class RunningServer:
    """A served app: its base URL, engine and app."""

    url: str
    engine: Engine
    app: Any
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample of the engine's Prometheus registry (0 when absent)."""
        return self.engine.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@contextlib.contextmanager
def serve_in_thread(app: Any, *, ready_timeout_s: float = READY_TIMEOUT_S,
                    **config_kwargs: Any) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port; yields the base URL.

    The server is configured as `diffbatch serve` configures it (`uvicorn_config`:
    header timeout, keep-alive timeout, connection limit); `config_kwargs` change that.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn_config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=10, **config_kwargs
    ))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        # Readiness: the connection waits in the listen backlog until uvicorn serves it.
        response = httpx.get(f"{url}/health", timeout=ready_timeout_s)
        assert response.status_code == 200, response.text
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not shut down"


@contextlib.contextmanager
def gated_server(gate_base: type[GatedPipeline] = GatedPipeline, **app_kwargs: Any,
                 ) -> Iterator[tuple[RunningServer, type[GatedPipeline]]]:
    """A served in-process engine whose forwards block until the gate is released.

    `config` (a dict) goes to `serve_in_thread` as uvicorn configuration; `gate_base`
    is the gated pipeline to subclass (e.g. `PreviewGatedPipeline`).
    """
    engine_kwargs = {
        k: app_kwargs.pop(k) for k in ("max_num_seqs", "max_queue_size", "lora_dir")
        if k in app_kwargs
    }
    # Fixed settings: the tests hold waves at the gate (an auto engine would calibrate
    # through it at start-up).
    engine_kwargs.setdefault("max_num_seqs", 1)
    engine_kwargs.setdefault("request_batch_max_wait_ms", 0)
    config_kwargs = app_kwargs.pop("config", {})
    gate = make_gate(gate_base, module=__name__)
    engine = Engine(pipeline_class=gate, executor="inproc", **engine_kwargs)
    try:
        app = build_app(engine, served_model_name="gated", **app_kwargs)
        with serve_in_thread(app, **config_kwargs) as url:
            try:
                yield RunningServer(url, engine, app, app_kwargs.get("api_key")), gate
            finally:
                _open(gate)  # never leave a forward blocked at teardown
    finally:
        _open(gate)
        engine.close()


def _open(gate: type[GatedPipeline]) -> None:
    """Set every event a gated forward may wait on."""
    for name in ("release", "finish"):
        event = getattr(gate, name, None)
        if event is not None:
            event.set()


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 30.0,
               what: str = "condition") -> None:
    """Poll `predicate` every 10 ms until it holds; fail after `timeout_s`.

    A bounded check of state that changes on another thread (e.g. an abort reaching
    the engine); the deadline only bounds a broken test, nothing asserts on timing.
    """
    idle = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        idle.wait(0.01)
