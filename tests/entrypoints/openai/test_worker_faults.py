"""What clients see when the worker process crashes or freezes, and when nobody waits
for a wave any more, over a real uvicorn server and a real worker process.

The worker runs `FaultyPipeline` (tests/fake_pipelines.py): prompts choose the fault
("hang-once NAME", "steps NAME", "crash ..."), and marker files in a folder of the
test's tell it when a wave is inside the worker, so "a wave is running" is a state
the test waits for, not a timing it hopes for. One server serves the whole module;
every test starts from a healthy worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import (
    RunningServer,
    disconnect,
    open_raw_request,
    serve_in_thread,
)
from tests.process_utils import wait_until

pytestmark = pytest.mark.slow

ROUTE = "/v1/images/generations"
DEADLINE_S = 120.0  # bounds a broken test only (a replacement worker imports torch)
STALL_TIMEOUT_S = 3.0  # the server's --worker-stall-timeout


@dataclass
class Faulty:
    server: RunningServer
    markers: Path  # $DIFFBATCH_FAKE_MARKER_DIR of the worker
    timeout_url: str  # the same engine behind an app with a 1 s request timeout

    def wait_for_marker(self, name: str) -> None:
        path = self.markers / name
        wait_until(path.exists, timeout_s=DEADLINE_S, what=f"marker {name}")

    def healthy_worker(self) -> int:
        executor = self.server.engine.executor
        assert executor.wait_healthy(DEADLINE_S)
        return executor.worker_pid

    def metric(self, name: str) -> float:
        return self.server.metric(name)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    markers = tmp_path_factory.mktemp("markers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFBATCH_FAKE_MARKER_DIR", str(markers))  # the worker inherits it
        # Its waves hang on purpose for as long as a test needs: no stuck-wave bound
        # (that has a server of its own below).
        engine = Engine(pipeline_class="tests.fake_pipelines.FaultyPipeline", executor="mp",
                        max_num_seqs=4, request_batch_max_wait_ms=0, max_waves_in_flight=2,
                        worker_stall_timeout_s=STALL_TIMEOUT_S, wave_stall_factor=0,
                        torch_num_threads=1)
    try:
        app = build_app(engine, served_model_name="faulty")
        timeout_app = build_app(engine, served_model_name="faulty", request_timeout_s=1.0,
                                close_engine_on_shutdown=False)
        with serve_in_thread(app) as url, serve_in_thread(timeout_app) as timeout_url:
            yield Faulty(RunningServer(url, engine, app), markers, timeout_url)
    finally:
        engine.close()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        yield pool


def post(pool: ThreadPoolExecutor, url: str, prompt: str) -> Future[httpx.Response]:
    return pool.submit(httpx.post, f"{url}{ROUTE}", json={"prompt": prompt}, timeout=DEADLINE_S)


def assert_503_with_retry_after(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "engine_unavailable"


def test_a_worker_killed_mid_wave_costs_no_request(faulty: Faulty,
                                                    pool: ThreadPoolExecutor) -> None:
    """The crashed wave re-runs on the replacement; the queue waits for it; requests that
    arrive during the restart queue too. Nobody gets a 503; /health says 503 meanwhile."""
    server = faulty.server
    pid = faulty.healthy_worker()
    reruns, restarts = faulty.metric("diffbatch_waves_rerun_total"), \
        faulty.metric("diffbatch_worker_restarts_total")
    running = post(pool, server.url, "hang-once killed")
    faulty.wait_for_marker("killed")
    queued = [post(pool, server.url, f"queued {i}") for i in range(3)]
    wait_until(lambda: server.engine.num_waiting == 3, what="three queued requests")
    hold = faulty.markers / "hold-load"
    hold.touch()  # the replacement waits in its start-up until the test lets it load
    try:
        os.kill(pid, signal.SIGKILL)
        health: list[httpx.Response] = []
        wait_until(lambda: health.append(httpx.get(f"{server.url}/health")) or
                   health[-1].status_code == 503, timeout_s=DEADLINE_S,
                   what="/health to say 503")
        assert_503_with_retry_after(health[-1])
        during = post(pool, server.url, "sent during the restart")
        wait_until(lambda: server.engine.num_waiting == 4, what="the request sent meanwhile")
    finally:
        hold.unlink()
    responses = [f.result() for f in (running, *queued, during)]
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    assert faulty.metric("diffbatch_waves_rerun_total") == reruns + 1  # the wave of one
    assert faulty.metric("diffbatch_worker_restarts_total") == restarts + 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_only_the_request_that_crashes_the_worker_again_fails(faulty: Faulty) -> None:
    faulty.healthy_worker()
    outs = faulty.server.engine.generate(  # one wave of three: the engine adds them at once
        ["crash me", "fine a", "fine b"], SamplingParams(seed=1), use_tqdm=False)
    assert outs[1].ok and outs[2].ok
    error = outs[0].error
    assert error is not None and error.status_code == 500
    assert "worker process died while running this request, and again" in error.message
    assert "SIGKILL" in error.message
    assert faulty.healthy_worker()


def test_a_frozen_worker_is_reported_then_replaced_and_its_wave_re_run(
    faulty: Faulty, pool: ThreadPoolExecutor,
) -> None:
    server = faulty.server
    pid = faulty.healthy_worker()
    frozen = faulty.metric("diffbatch_worker_frozen_total")
    running = post(pool, server.url, "hang-once frozen")
    faulty.wait_for_marker("frozen")
    hold = faulty.markers / "hold-load"
    hold.touch()  # the replacement waits in its start-up while /health is read
    os.kill(pid, signal.SIGSTOP)
    try:
        health: list[httpx.Response] = []
        wait_until(lambda: health.append(httpx.get(f"{server.url}/health")) or
                   health[-1].status_code == 503, timeout_s=DEADLINE_S,
                   what="/health to report the frozen worker")
        assert_503_with_retry_after(health[-1])
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f"diffbatch_worker_frozen_total {frozen + 1}" in metrics
        hold.unlink()
        response = running.result()
        assert response.status_code == 200, response.text  # re-run on the replacement
    finally:
        hold.unlink(missing_ok=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_forward_that_hangs_while_the_heartbeat_lives_is_a_stuck_worker(
    tmp_path: Path, pool: ThreadPoolExecutor,
) -> None:
    """The worker's heartbeat thread beats on while its forward hangs: once the wave has
    run past its stall bound (10x its learned time, at least the stall timeout)
    the worker is reported, counted, killed and replaced, and the wave re-run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFBATCH_FAKE_MARKER_DIR", str(tmp_path))
        engine = Engine(pipeline_class="tests.fake_pipelines.FaultyPipeline", executor="mp",
                        max_num_seqs=1, request_batch_max_wait_ms=0,
                        worker_stall_timeout_s=STALL_TIMEOUT_S, torch_num_threads=1)
    try:
        with serve_in_thread(build_app(engine, served_model_name="faulty")) as url:
            server = RunningServer(url, engine, None)
            # A wave of the shape teaches its expected time (before one, no bound).
            assert post(pool, url, "fine").result().status_code == 200
            hold = tmp_path / "hold-load"
            hold.touch()  # the replacement waits in its start-up while /health is read
            running = post(pool, url, "hang-once stuck")
            wait_until((tmp_path / "stuck").exists, timeout_s=DEADLINE_S, what="the hang")
            health: list[httpx.Response] = []
            wait_until(lambda: health.append(httpx.get(f"{url}/health")) or
                       health[-1].status_code == 503, timeout_s=DEADLINE_S,
                       what="/health to report the stuck worker")
            hold.unlink()
            assert_503_with_retry_after(health[-1])
            assert "stuck: wave" in health[-1].json()["error"]["message"]  # not "frozen"
            assert server.metric("diffbatch_worker_stuck_waves_total") == 1
            assert server.metric("diffbatch_worker_frozen_total") == 1
            response = running.result()
            assert response.status_code == 200, response.text  # re-run on the replacement
            assert server.metric("diffbatch_waves_rerun_total") == 1
    finally:
        engine.close()


def test_a_worker_that_dies_during_a_shutdown_is_not_replaced_and_its_wave_is_a_503(
    tmp_path: Path, pool: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture,
) -> None:
    """Shutting down, a worker that dies (or is killed as frozen) under a running wave
    starts no replacement, and its requests are answered as shut down (503, retry),
    at once, not re-run or held until the shutdown timeout."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFBATCH_FAKE_MARKER_DIR", str(tmp_path))
        engine = Engine(pipeline_class="tests.fake_pipelines.FaultyPipeline", executor="mp",
                        max_num_seqs=1, request_batch_max_wait_ms=0, wave_stall_factor=0,
                        torch_num_threads=1)
    try:
        pid = engine.executor.worker_pid
        running = pool.submit(engine.generate, "hang-once draining", use_tqdm=False)
        wait_until((tmp_path / "draining").exists, timeout_s=DEADLINE_S, what="the hang")
        shutdown = pool.submit(engine.shutdown, 10 * DEADLINE_S)  # far beyond this test
        wait_until(lambda: engine.core._drain_error is not None, what="the shutdown")
        caplog.clear()
        os.kill(pid, signal.SIGKILL)
        error = running.result(DEADLINE_S)[0].error
        assert error is not None and error.status_code == 503, error
        assert "shutting down" in error.message and "retry" in error.message
        shutdown.result(DEADLINE_S)  # done without waiting out its timeout
        assert engine.executor.num_restarts == 0
        assert not [r for r in caplog.records if "started worker process" in r.message]
    finally:
        engine.close()


def test_a_disconnect_stops_its_wave_at_the_next_step(faulty: Faulty) -> None:
    server = faulty.server
    faulty.healthy_worker()
    cancelled = faulty.metric("diffbatch_waves_cancelled_total")
    sock = open_raw_request(server.port, {"prompt": "steps disconnected"})
    faulty.wait_for_marker("disconnected")  # its wave runs (for ten minutes, unless...)
    disconnect(sock)
    faulty.wait_for_marker("disconnected.interrupted")  # ...stopped at its next step
    wait_until(lambda: server.engine.num_running == 0, what="the running gauge to drop")
    assert faulty.metric("diffbatch_waves_cancelled_total") == cancelled + 1
    assert httpx.post(f"{server.url}{ROUTE}", json={"prompt": "next"},
                      timeout=DEADLINE_S).status_code == 200


def test_a_client_gone_mid_stream_stops_its_wave_at_the_next_step(faulty: Faulty) -> None:
    server = faulty.server
    faulty.healthy_worker()
    cancelled = faulty.metric("diffbatch_waves_cancelled_total")
    aborted = server.engine.metrics.count("aborted")
    http_metric = server.app.state.http_metrics.registry.get_sample_value
    disconnects = http_metric("diffbatch_http_client_disconnects_total")
    body = {"prompt": "steps streamed-away", "stream": True, "partial_images": 1}
    with httpx.stream("POST", f"{server.url}{ROUTE}", json=body,
                      timeout=DEADLINE_S) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())  # the partial image came from the worker...
        assert first == "event: image_generation.partial_image"
        faulty.wait_for_marker("streamed-away")  # ...and its wave runs on
    # leaving the block closed the connection mid-stream
    faulty.wait_for_marker("streamed-away.interrupted")  # stopped at its next step
    wait_until(lambda: server.engine.num_running == 0, what="the running gauge to drop")
    assert faulty.metric("diffbatch_waves_cancelled_total") == cancelled + 1
    # a client gone mid-stream went before its answer (the image) as any other does
    wait_until(lambda: http_metric("diffbatch_http_client_disconnects_total")
               == disconnects + 1, what="the disconnect to be counted")
    assert http_metric("diffbatch_http_requests_total",
                       {"route": ROUTE, "method": "POST", "status": "499"}) >= 1
    assert server.engine.metrics.count("aborted") == aborted + 1


def test_a_request_timeout_stops_its_wave_at_the_next_step(faulty: Faulty) -> None:
    faulty.healthy_worker()
    response = httpx.post(f"{faulty.timeout_url}{ROUTE}", json={"prompt": "steps timed-out"},
                          timeout=DEADLINE_S)
    assert response.status_code == 504, response.text
    faulty.wait_for_marker("timed-out.interrupted")
    wait_until(lambda: faulty.server.engine.num_running == 0, what="the running gauge to drop")


def test_a_queued_wave_nobody_waits_for_is_dropped_before_it_starts(
    faulty: Faulty, pool: ThreadPoolExecutor,
) -> None:
    """Behind a running wave, a full wave waits at the worker; when all its requests go
    away it is dropped there, and the running wave is not disturbed."""
    server = faulty.server
    faulty.healthy_worker()
    engine = server.engine
    first = pool.submit(engine.generate, ["steps ahead"], use_tqdm=False)
    faulty.wait_for_marker("ahead")
    ids = [f"queued-{i}-{time.monotonic_ns()}" for i in range(4)]
    params = [SamplingParams(seed=i) for i in range(4)]
    queued = pool.submit(engine.generate, [f"steps behind-{i}" for i in range(4)], params,
                         request_ids=ids, use_tqdm=False)
    wait_until(lambda: engine.num_running == 5, what="the full wave to queue at the worker")
    cancelled = faulty.metric("diffbatch_waves_cancelled_total")
    engine.abort(ids)
    assert all(out.aborted for out in queued.result(DEADLINE_S))
    wait_until(lambda: faulty.metric("diffbatch_waves_cancelled_total") == cancelled + 1,
               what="the queued wave to be cancelled")
    [request_id] = [rid for rid in engine.core.open_request_ids()]
    engine.abort(request_id)
    assert first.result(DEADLINE_S)[0].aborted
    wait_until(lambda: engine.num_running == 0, what="both waves to stop")
    for i in range(4):  # the queued wave never started in the worker
        assert not (faulty.markers / f"behind-{i}").exists()


def test_a_request_over_the_work_limit_is_refused_with_400(faulty: Faulty) -> None:
    # "auto": 100x the fake model's default image (16x16, 2 steps), per image.
    limit = 100 * 16 * 16 * 2
    assert faulty.server.engine.max_request_work == limit
    response = httpx.post(f"{faulty.server.url}{ROUTE}", timeout=DEADLINE_S, json={
        "prompt": "a cat", "size": "64x64", "num_inference_steps": 20})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "num_inference_steps"
    assert f"at most {limit} per image" in error["message"]
    assert "--max-request-work" in error["message"]
    assert "64x64 x 20 steps = 327680 pixel-steps per image (each pixel counted 4 times" \
        in error["message"]
    # a size over the limit at one step blames the size
    response = httpx.post(f"{faulty.server.url}{ROUTE}", timeout=DEADLINE_S, json={
        "prompt": "a cat", "size": "512x512", "num_inference_steps": 1})
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, "size"), response.text
    assert "ask for a smaller size" in error["message"]
