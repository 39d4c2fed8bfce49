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
import json
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app, uvicorn_config
from tests.fake_pipelines import FakeBatchPipeline, GatedPipeline, make_gate

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


def asgi_client(app: Any) -> httpx.AsyncClient:
    """A client of `app` in this process (httpx's ASGI transport), no socket."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


@contextlib.asynccontextmanager
async def app_client(engine: Engine, **app_kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client of `build_app(engine, **app_kwargs)`, served as "fake" unless
    `served_model_name` says otherwise; the engine stays open afterwards."""
    app_kwargs.setdefault("served_model_name", "fake")
    async with asgi_client(build_app(engine, close_engine_on_shutdown=False,
                                     **app_kwargs)) as client:
        yield client


def make_lora_dir(root: Any) -> str:
    """A LoRA folder: "style" holds a small valid safetensors file (the fake pipelines
    never apply its weights), "notes" is a folder without weights, "training" holds
    only an optimizer file and a checkpoint folder."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(root / "style")
    save_file({"unet.layer.lora_A.weight": torch.zeros(2, 4)},
              str(root / "style" / "pytorch_lora_weights.safetensors"))
    os.makedirs(root / "notes")
    (root / "notes" / "README.txt").write_text("not an adapter")
    os.makedirs(root / "training" / "checkpoint-500")
    (root / "training" / "optimizer.bin").write_bytes(b"")
    return str(root)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`make_lora_dir` in a folder of the test module's own."""
    return make_lora_dir(tmp_path_factory.mktemp("loras"))


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


@pytest.fixture(scope="module")
def engine(lora_dir: str) -> Iterator[Engine]:
    """The in-process engine of the ASGI tests: `FakeBatchPipeline`, waves of up to 4,
    the `lora_dir` adapters; a failing forward fails its whole wave. A module that needs
    other settings defines its own `engine`."""
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                lora_dir=lora_dir, batch_error_isolation="none") as engine:
        yield engine


def open_raw_request(port: int, body: dict[str, Any],
                     route: str = "/v1/images/generations",
                     headers: dict[str, str] | None = None) -> socket.socket:
    """Send one JSON request (with `headers`) to the server on `port` on a raw socket and
    return the socket unread: `disconnect` it to leave as a client that gave up."""
    data = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{extra}Content-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head + data)
    return sock


def disconnect(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
