"""`diffbatch serve` as a user runs it: a subprocess, real port, Ctrl-C to stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

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
