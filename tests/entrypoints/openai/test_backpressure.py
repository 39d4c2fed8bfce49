"""Disconnects, a full queue and the request timeout, over a real uvicorn server.

The engine runs `GatedPipeline` in-process: a forward blocks until the test sets
`gate.release`, so "a request is running" and "a request is waiting" are states
the test creates, not timings it hopes for. A disconnect is a raw socket closed
after its request was sent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.conftest import (
    RunningServer,
    disconnect,
    gated_server,
    open_raw_request,
)
from tests.process_utils import wait_until

pytestmark = pytest.mark.slow

ROUTE = "/v1/images/generations"
GATE_TIMEOUT_S = 30.0  # bounds a broken test only
# How long a request answered without a forward (a refusal, a timeout) may take: far
# above the milliseconds it needs, far below the gate's wait, so a broken test fails
# in seconds instead of waiting for the gate.
ANSWER_TIMEOUT_S = 10.0


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def post_in_thread(pool: ThreadPoolExecutor, server: RunningServer,
                   prompt: str) -> Future[httpx.Response]:
    """POST one image request from a worker thread; the future holds the response."""
    return pool.submit(httpx.post, f"{server.url}{ROUTE}", json={"prompt": prompt},
                       headers=server.headers, timeout=120)


def post_answered_at_once(server: RunningServer, prompt: str) -> httpx.Response:
    """POST one image request that the server must answer while the gate stays shut."""
    try:
        return httpx.post(f"{server.url}{ROUTE}", json={"prompt": prompt},
                          headers=server.headers, timeout=ANSWER_TIMEOUT_S)
    except httpx.TimeoutException:
        pytest.fail(f"{prompt!r} got no answer in {ANSWER_TIMEOUT_S} s: it waited "
                    "behind the blocked forward")


def assert_engine_empty(server: RunningServer) -> None:
    engine = server.engine
    wait_until(lambda: engine.num_waiting == engine.num_running == engine.num_unfinished == 0,
               what="the engine to hold no request")


def test_disconnect_while_waiting_aborts_the_request(pool: ThreadPoolExecutor) -> None:
    with gated_server(max_num_seqs=1) as (server, gate):
        aborted = server.engine.metrics.count("aborted")
        running = post_in_thread(pool, server, "runs first")
        assert gate.entered.wait(GATE_TIMEOUT_S)
        sock = open_raw_request(server.port, {"prompt": "waits, then leaves"})
        wait_until(lambda: server.engine.num_waiting == 1, what="the request to queue")
        disconnect(sock)
        wait_until(lambda: server.engine.metrics.count("aborted") == aborted + 1,
                   what="the abort to be counted")
        assert server.engine.num_waiting == 0
        gate.release.set()
        assert running.result().status_code == 200
        assert_engine_empty(server)
        assert server.engine.metrics.count("aborted") == aborted + 1
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "diffbatch_http_client_disconnects_total 1.0" in metrics


def test_disconnect_while_running_discards_the_result() -> None:
    with gated_server(max_num_seqs=1) as (server, gate):
        aborted = server.engine.metrics.count("aborted")
        sock = open_raw_request(server.port, {"prompt": "runs, then leaves"})
        assert gate.entered.wait(GATE_TIMEOUT_S)
        disconnect(sock)
        wait_until(lambda: server.engine.metrics.count("aborted") == aborted + 1,
                   what="the abort to be counted")
        gate.release.set()
        assert_engine_empty(server)
        completed = server.engine.metrics.count("completed")
        response = httpx.post(f"{server.url}{ROUTE}", json={"prompt": "next"}, timeout=60)
        assert response.status_code == 200
        assert server.engine.metrics.count("completed") == completed + 1


def test_full_queue_answers_503_while_accepted_requests_complete(
    pool: ThreadPoolExecutor,
) -> None:
    with gated_server(max_num_seqs=1, max_queue_size=2) as (server, gate):
        rejected = server.engine.metrics.count("rejected")
        accepted = [post_in_thread(pool, server, "running")]
        assert gate.entered.wait(GATE_TIMEOUT_S)
        accepted += [post_in_thread(pool, server, f"waiting {i}") for i in range(2)]
        wait_until(lambda: server.engine.num_waiting == 2, what="two waiting requests")
        # Answered while the forward is still blocked: the refusal does not queue.
        response = post_answered_at_once(server, "one too many")
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_overloaded", "queue_full")
        assert not gate.release.is_set()
        assert server.engine.metrics.count("rejected") == rejected + 1
        gate.release.set()
        assert [f.result().status_code for f in accepted] == [200, 200, 200]
        assert_engine_empty(server)


def test_request_timeout_aborts_and_answers_504() -> None:
    with gated_server(request_timeout_s=0.5) as (server, gate):
        aborted = server.engine.metrics.count("aborted")
        response = post_answered_at_once(server, "too slow")
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["type"] == "timeout_error"
        assert "request timeout of 0.5 s" in error["message"]
        assert server.engine.metrics.count("aborted") == aborted + 1
        gate.release.set()
        assert_engine_empty(server)


def test_health_turns_503_when_the_engine_is_closed() -> None:
    with gated_server() as (server, gate):
        assert httpx.get(f"{server.url}/health").status_code == 200
        gate.release.set()
        server.engine.close()
        response = httpx.get(f"{server.url}/health")
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "engine_unavailable"


def test_a_health_check_that_waits_does_not_hold_up_other_requests(
    pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A health check can wait (on a worker that just died, for its reader thread to
    handle the death); meanwhile the server answers everyone else."""
    with gated_server() as (server, gate):
        gate.release.set()
        checking, answer = threading.Event(), threading.Event()

        def slow_check_health() -> None:
            checking.set()
            assert answer.wait(GATE_TIMEOUT_S)

        monkeypatch.setattr(server.engine, "check_health", slow_check_health)
        health = pool.submit(httpx.get, f"{server.url}/health", timeout=60)
        try:
            assert checking.wait(GATE_TIMEOUT_S)
            models = httpx.get(f"{server.url}/v1/models", timeout=10)  # not behind it
            assert models.status_code == 200
            assert not health.done()
        finally:
            answer.set()
        assert health.result().status_code == 200
