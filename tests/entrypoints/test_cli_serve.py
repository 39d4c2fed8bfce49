"""`diffbatch serve` as a user runs it: a subprocess, real port, Ctrl-C to stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.process_utils import wait_gone, worker_pids

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0  # cold import of torch + diffusers and the model load


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    """Poll /health until it answers 200; fail if the process exits or the deadline passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        try:  # doubles as the pause between polls, and catches an early exit
            proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"diffbatch serve exited early with code {proc.returncode}")
    pytest.fail(f"diffbatch serve not ready after {START_TIMEOUT_S:g} s")


def test_serve_answers_and_stops_cleanly_on_ctrl_c(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DIFFBATCH_API_KEY": "cli-key"}
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffbatch.entrypoints.cli", "serve", "tiny-sd", "--port",
         str(port), "--executor", "inproc", "--served-model-name", "cli-model",
         "--log-level", "info"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(proc, url)
        headers = {"Authorization": "Bearer cli-key"}
        assert httpx.post(f"{url}/v1/images/generations", json={"prompt": "p"}).status_code == 401
        response = httpx.post(f"{url}/v1/images/generations", headers=headers, timeout=120,
                              json={"prompt": "a red circle", "num_inference_steps": 2,
                                    "seed": 0, "model": "cli-model"})
        assert response.status_code == 200, response.text
        assert response.json()["size"] == "64x64"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        log.seek(0)
        text = log.read()
        assert "closing the engine" in text
        assert "a red circle" not in text  # prompts are never logged above DEBUG
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


REPO_ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
          ) -> tuple[subprocess.Popen, str, Any]:
    """Start `diffbatch serve ARGS` on a free port; its log goes to tmp_path/serve.log."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - the caller closes it
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffbatch.entrypoints.cli", "serve", *args, "--port", str(port),
         "--torch-threads", "1", "--log-level", "info"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        stdout=log, stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}", log


def metric_value(url: str, name: str, **labels: str) -> float:
    """One sample of the server's `/metrics`, by name and labels (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S,
             ) -> None:
    """Poll `predicate` every 10 ms until it holds (bounds a broken test only)."""
    idle = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        idle.wait(0.01)


def worker_of(pid: int) -> int:
    """The pid of the `python -m diffbatch.worker` child of process `pid`."""
    (worker,) = worker_pids(pid) or (None,)
    assert worker is not None, f"process {pid} has no worker process"
    return worker


def stop(proc: subprocess.Popen, log: Any) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def test_sigterm_with_a_wave_in_flight_answers_everyone_503_and_exits(tmp_path) -> None:
    """The running wave may finish for --shutdown-timeout, then it is interrupted; every
    client gets an OpenAI-shaped 503 with Retry-After, and the server exits."""
    proc, url, log = serve(
        tmp_path, "--pipeline-class", "tests.fake_pipelines.FaultyPipeline",
        "--max-num-seqs", "1", "--request-batch-max-wait-ms", "0", "--max-waves-in-flight", "1",
        "--shutdown-timeout", "1", env={"DIFFBATCH_FAKE_MARKER_DIR": str(tmp_path)})
    try:
        wait_ready(proc, url)
        with ThreadPoolExecutor(3) as pool:
            def post(prompt: str) -> Any:
                return pool.submit(httpx.post, f"{url}/v1/images/generations",
                                   json={"prompt": prompt}, timeout=START_TIMEOUT_S)

            running = post("steps sigterm")  # ten minutes of steps, unless interrupted
            wait_for((tmp_path / "sigterm").exists, "the wave to start")
            waiting = [post("queued 0"), post("queued 1")]
            wait_for(lambda: metric_value(url, "diffbatch_num_requests_waiting") == 2,
                     "two waiting requests")
            proc.send_signal(signal.SIGTERM)
            responses = [f.result() for f in (running, *waiting)]
        proc.wait(timeout=60)  # the wave alone would run for ten minutes
        for response in responses:
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["type"] == "engine_unavailable" and "shutting down" in error["message"]
        assert "shutdown timeout (1 s)" in responses[0].json()["error"]["message"]
        assert "had not started" in responses[1].json()["error"]["message"]
        assert (tmp_path / "sigterm.interrupted").exists()  # stopped, not abandoned
    finally:
        stop(proc, log)


def test_a_sigkilled_server_takes_its_worker_down_mid_wave_and_leaves_nothing(tmp_path) -> None:
    marker = tmp_path / "in-loop"
    semaphores_before = {p.name for p in SHM.iterdir() if p.name.startswith("sem.")}
    proc, url, log = serve(
        tmp_path, "tiny-sd", "--pipeline-class", "tests.fake_pipelines.MarkedTinySD",
        "--max-num-seqs", "1", "--request-batch-max-wait-ms", "0", "--max-request-work", "0",
        env={"DIFFBATCH_FAKE_MARKER": str(marker)})
    try:
        wait_ready(proc, url)
        worker = worker_of(proc.pid)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(httpx.post, f"{url}/v1/images/generations", timeout=START_TIMEOUT_S,
                        json={"prompt": "a long wave", "num_inference_steps": 1000})
            wait_for(marker.exists, "the wave to reach its denoising loop")
            proc.kill()
            proc.wait()
        assert wait_gone(worker, 60.0), "the worker outlived its server"
        for pid in (proc.pid, worker):
            assert not [p for p in SHM.iterdir() if p.name.startswith(f"diffbatch_{pid}_")]
        new = {p.name for p in SHM.iterdir() if p.name.startswith("sem.")} - semaphores_before
        assert not new, f"semaphores left behind: {sorted(new)}"
    finally:
        stop(proc, log)
