"""`diffbatch serve` as a user runs it: a subprocess, real port, Ctrl-C to stop.

The first tests start a server each (shutdown, SIGKILL); the rest share one
`diffbatch serve tiny-sd` (`served`: the default `mp` executor, a real socket) and
check what its flags and request fields do by value: metric counts after known
traffic, the batch-size header, `priority`, `output_compression`, `--seed`, the API
key; the last one stops it with Ctrl-C.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import disconnect, open_raw_request
from tests.entrypoints.openai.test_edits import decode
from tests.process_utils import SHM_DIR, fork_server_pids, segments_of, wait_gone, worker_pids

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0  # cold import of torch + diffusers and the model load
STATE_TIMEOUT_S = 20.0  # a ready server reaches a state a test awaits (a wave starts) in this


# uvicorn's line once it listens (at --log-level info): the port `--port 0` got
LISTENING = re.compile(r"Uvicorn running on https?://\S+:(\d+)")


def listening_url(log_path: str) -> str | None:
    """The server's URL once its log says where it listens (None before)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        match = LISTENING.search(f.read())
    return f"http://127.0.0.1:{match.group(1)}" if match else None


def wait_ready(proc: subprocess.Popen, log_path: str) -> str:
    """The URL of `diffbatch serve --port 0 --log-level info` (logging to `log_path`) once
    its /health answers 200; fails if the process exits or the deadline passes.

    The system picks the port as the server binds it: no port is chosen here and
    released for the server to take, which another process could take first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    url = None
    while time.monotonic() < deadline:
        url = url or listening_url(log_path)
        try:
            if url and httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        try:  # doubles as the pause between polls, and catches an early exit
            proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"diffbatch serve exited early with code {proc.returncode}")
    pytest.fail(f"diffbatch serve not ready after {START_TIMEOUT_S:g} s")


REPO_ROOT = Path(__file__).resolve().parents[2]


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
          ) -> tuple[subprocess.Popen, str, Any]:
    """`diffbatch serve ARGS` on a port the system picks, ready to take requests: the
    process, its URL and its log (tmp_path/serve.log; `stop` closes it)."""
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - the caller closes it
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffbatch.entrypoints.cli", "serve", *args, "--port", "0",
         "--torch-threads", "1", "--log-level", "info"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        return proc, wait_ready(proc, log.name), log
    except BaseException:
        stop(proc, log)
        raise


def metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the server's `/metrics`, by (name, labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric_value(url: str, name: str, **labels: str) -> float:
    """One sample of the server's `/metrics`, by name and labels (0 when absent)."""
    return metrics(url).get((name, frozenset(labels.items())), 0.0)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = STATE_TIMEOUT_S,
             ) -> None:
    """Poll `predicate` every 10 ms until it holds; fail after `timeout_s` (a state of a
    ready server: a red test fails in seconds, not after a start-up's bound)."""
    idle = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        idle.wait(0.01)


def worker_of(pid: int) -> int:
    """The pid of the worker process that process `pid` started."""
    (worker,) = worker_pids(pid) or (None,)
    assert worker is not None, f"process {pid} has no worker process"
    return worker


def stop(proc: subprocess.Popen, log: Any) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def serve_faulty(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str, Any]:
    """`diffbatch serve` of `FaultyPipeline` (markers in `tmp_path`), one request per
    wave and no admission wait, with `flags`; ready to take requests."""
    return serve(
        tmp_path, "--pipeline-class", "tests.fake_pipelines.FaultyPipeline",
        "--max-num-seqs", "1", "--request-batch-max-wait-ms", "0", *flags,
        env={"DIFFBATCH_FAKE_MARKER_DIR": str(tmp_path)})


def poster(pool: ThreadPoolExecutor, url: str) -> Callable[[str], Any]:
    """`post(prompt)`: one image request sent from `pool`; its future."""
    def post(prompt: str) -> Any:
        return pool.submit(httpx.post, f"{url}/v1/images/generations",
                           json={"prompt": prompt}, timeout=START_TIMEOUT_S)
    return post


def test_sigterm_with_a_wave_in_flight_answers_everyone_503_and_exits(tmp_path) -> None:
    """The running wave may finish for --shutdown-timeout, then it is interrupted; every
    client gets an OpenAI-shaped 503 with Retry-After, and the server exits."""
    proc, url, log = serve_faulty(tmp_path, "--max-waves-in-flight", "1",
                                  "--shutdown-timeout", "1")
    try:
        with ThreadPoolExecutor(3) as pool:
            post = poster(pool, url)
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


def test_shutdown_answers_a_wave_queued_at_the_worker_at_once_and_a_second_ctrl_c_503s(
        tmp_path) -> None:
    """A wave handed to the worker behind the running one has not started: the first
    Ctrl-C answers it at once. The second Ctrl-C exits without waiting for the running
    wave, whose client still gets an OpenAI-shaped 503, not a plain-text 500."""
    proc, url, log = serve_faulty(tmp_path, "--max-waves-in-flight", "2",
                                  "--shutdown-timeout", "600")
    try:
        with ThreadPoolExecutor(2) as pool:
            post = poster(pool, url)
            running = post("steps interrupt")  # ten minutes of steps, unless interrupted
            wait_for((tmp_path / "interrupt").exists, "the wave to start")
            queued = post("queued at the worker")
            wait_for(lambda: metric_value(url, "diffbatch_num_requests_running") == 2,
                     "a second wave handed to the worker")
            proc.send_signal(signal.SIGINT)
            answer = queued.result()  # at once: the running wave has ten minutes to go
            assert answer.status_code == 503, answer.text
            assert "had not started" in answer.json()["error"]["message"]
            assert not running.done()
            proc.send_signal(signal.SIGINT)
            cut = running.result()
        proc.wait(timeout=60)
        assert cut.status_code == 503, cut.text
        assert cut.headers["retry-after"] == "1"
        error = cut.json()["error"]
        assert error["type"] == "engine_unavailable" and "shutting down" in error["message"]
    finally:
        stop(proc, log)


def unmapped(names: set[str]) -> set[str]:
    """Those of the /dev/shm files `names` that exist and no live process maps (matched
    by inode: a named semaphore is mapped under the temporary name it was made as)."""
    files = {}  # (device "major:minor" as maps writes it, inode) -> name
    for name in names:
        with contextlib.suppress(OSError):
            stat = (SHM_DIR / name).stat()
            device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"
            files[(device, stat.st_ino)] = name
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                fields = line.split()  # address, perms, offset, device, inode, path
                if len(fields) >= 5 and fields[4].isdigit():
                    files.pop((fields[3], int(fields[4])), None)
    return set(files.values())


def test_a_sigkilled_server_takes_its_worker_down_mid_wave_and_leaves_nothing(tmp_path) -> None:
    marker = tmp_path / "in-loop"
    semaphores_before = {p.name for p in SHM_DIR.iterdir() if p.name.startswith("sem.")}
    proc, url, log = serve(
        tmp_path, "tiny-sd", "--pipeline-class", "tests.fake_tiny_sd.MarkedTinySD",
        "--max-num-seqs", "1", "--request-batch-max-wait-ms", "0", "--max-request-work", "0",
        env={"DIFFBATCH_FAKE_MARKER": str(marker)})
    try:
        worker = worker_of(proc.pid)
        fork_servers = fork_server_pids(proc.pid)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(httpx.post, f"{url}/v1/images/generations", timeout=START_TIMEOUT_S,
                        json={"prompt": "a long wave", "num_inference_steps": 999})
            wait_for(marker.exists, "the wave to reach its denoising loop")
            proc.kill()
            proc.wait()
        assert wait_gone(worker, 60.0), "the worker outlived its server"
        for server in fork_servers:
            assert wait_gone(server, 60.0), "the worker's fork server outlived its server"
        for pid in (proc.pid, worker):
            assert not segments_of(pid)
        new = {p.name for p in SHM_DIR.iterdir() if p.name.startswith("sem.")} - semaphores_before
        left = unmapped(new)  # a live process's (another test's) semaphore is in use
        assert not left, f"semaphores left behind: {sorted(left)}"
    finally:
        stop(proc, log)


# -- one server as a user starts it, shared by the tests below ---------------------------
SEED = 1234  # the server's --seed
ROUTE = "/v1/images/generations"


API_KEY = "cli-key"  # the server's $DIFFBATCH_API_KEY
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVED_NAME = "cli-model"  # the server's --served-model-name


@dataclass
class Served:
    """`diffbatch serve tiny-sd` in a subprocess: the default `mp` executor, a real socket."""

    url: str
    proc: subprocess.Popen
    log: Any  # its log file, open for reading

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def post(self, **body: Any) -> httpx.Response:
        """One image request (2 steps unless told); the response, checked to be a 200."""
        response = httpx.post(f"{self.url}{ROUTE}", timeout=START_TIMEOUT_S, headers=AUTH,
                              json={"prompt": "a red circle", "num_inference_steps": 2, **body})
        assert response.status_code == 200, response.text
        return response

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.url, name, **labels)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Waves of up to 2 after an admission wait of up to 1 s, picked by priority
    (`grouped`); requests that give no seed draw one from --seed's random source; no
    bound on a request's work (`holding_the_worker`'s request); an API key from the
    environment and a served model name. The module's last test stops it (Ctrl-C)."""
    proc, url, log = serve(tmp_path_factory.mktemp("served"), "tiny-sd", "--seed", str(SEED),
                           "--max-num-seqs", "2", "--request-batch-max-wait-ms", "1000",
                           "--scheduling-policy", "grouped", "--max-request-work", "0",
                           "--served-model-name", SERVED_NAME,
                           env={"DIFFBATCH_API_KEY": API_KEY})
    try:
        yield Served(url, proc, log)
    finally:
        stop(proc, log)


def test_metrics_count_exactly_the_traffic_sent(served: Served) -> None:
    """Three images and one refusal move every counter and histogram count by exactly
    that much (the lines exist at 0 from start-up; their values are what is checked)."""
    before = metrics(served.url)
    for seed in (1, 2, 3):  # one at a time: three waves of one
        served.post(seed=seed)
    refused = httpx.post(f"{served.url}{ROUTE}", headers=AUTH,
                         json={"prompt": "p", "size": "40x40"})
    assert refused.status_code == 400, refused.text
    after = metrics(served.url)

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("diffbatch_requests_total", outcome="completed") == 3
    assert grew("diffbatch_requests_total", outcome="rejected") == 1
    assert grew("diffbatch_requests_total", outcome="error") == 0
    assert grew("diffbatch_request_e2e_time_seconds_count") == 3
    assert grew("diffbatch_request_queue_time_seconds_count") == 3
    assert grew("diffbatch_wave_size_requests_count") == 3
    assert grew("diffbatch_wave_size_requests_sum") == 3
    assert grew("diffbatch_wave_size_requests_bucket", le="1.0") == 3
    assert grew("diffbatch_wave_forward_time_seconds_count") == 3
    assert grew("diffbatch_http_requests_total", route=ROUTE, method="POST", status="200") == 3
    assert grew("diffbatch_http_requests_total", route=ROUTE, method="POST", status="400") == 1
    assert after[("diffbatch_num_requests_waiting", frozenset())] == 0
    assert after[("diffbatch_num_requests_running", frozenset())] == 0


@contextlib.contextmanager
def holding_the_worker(served: Served) -> Iterator[socket.socket]:
    """A 900-step request (near the most tiny-sd's scheduler takes: the test's requests
    queue behind it however slow the machine) running on the worker, over a raw
    connection the caller closes (`disconnect`) to stop its wave at the next step."""
    holder = open_raw_request(served.port, {"prompt": "holds the worker", "seed": 7,
                                            "num_inference_steps": 900}, headers=AUTH)
    try:
        wait_for(lambda: served.metric("diffbatch_num_requests_running") == 1,
                 "the long wave to start")
        yield holder
    finally:  # also when a check failed: the wave stops now, not after its 900 steps
        with contextlib.suppress(OSError):  # already disconnected by the caller
            holder.shutdown(socket.SHUT_RDWR)
        holder.close()


def test_batch_size_header_is_the_size_of_the_wave(served: Served) -> None:
    """A lone request runs in a wave of 1; two sent behind a running wave share a wave
    of 2 (the server's --max-num-seqs): while the worker is busy, the first waits in
    the queue (only a full wave goes ahead to the worker), however late the second
    comes."""
    assert served.post(seed=4).headers["x-diffbatch-batch-size"] == "1"
    with ThreadPoolExecutor(2) as pool, holding_the_worker(served) as holder:
        pair = [pool.submit(served.post, seed=seed) for seed in (5, 6)]
        wait_for(lambda: served.metric("diffbatch_num_requests_running") == 3,
                 "the pair's wave to be queued at the worker")
        disconnect(holder)  # its wave stops at the next denoising step
        burst = [future.result() for future in pair]
    assert [r.headers["x-diffbatch-batch-size"] for r in burst] == ["2", "2"]


def test_priority_reaches_the_engine(served: Served) -> None:
    """Behind a running wave, a later request with a better (lower) priority runs before
    an earlier one: the wave log shows the waves in the order they ran."""
    last_id = httpx.get(f"{served.url}/v1/waves", headers=AUTH).json()["last_id"]
    with ThreadPoolExecutor(2) as pool, holding_the_worker(served) as holder:
        earlier = pool.submit(served.post, seed=8, priority=10)  # 64x64
        wait_for(lambda: served.metric("diffbatch_num_requests_waiting") == 1,
                 "the earlier request to wait")
        later = pool.submit(served.post, seed=9, priority=-10, size="32x32")
        wait_for(lambda: served.metric("diffbatch_num_requests_waiting") == 2,
                 "the later request to wait")
        disconnect(holder)  # its wave stops at the next denoising step
        earlier.result(), later.result()
    waves = httpx.get(f"{served.url}/v1/waves", params={"after": last_id}, headers=AUTH
                      ).json()["data"]
    assert [w["key"].split("/")[:2] for w in waves] == [
        ["64x64", "s900"], ["32x32", "s2"], ["64x64", "s2"]]


@pytest.mark.parametrize("output_format", ["jpeg", "webp"])
def test_output_compression_sets_the_encoders_quality(served: Served, output_format: str,
                                                      ) -> None:
    sizes = {}
    for quality in (5, 95):
        body = served.post(seed=10, output_format=output_format,
                           output_compression=quality).json()
        data = base64.b64decode(body["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(data)).format == output_format.upper()
        sizes[quality] = len(data)
    assert sizes[5] < sizes[95], sizes


def test_seed_flag_seeds_the_requests_that_give_none(served: Served) -> None:
    """An unseeded request gets the next seed of --seed's random source (so a restarted
    server gives the same images in the same order), and that seed decides the image."""
    unseeded = served.post()
    seed = int(unseeded.headers["x-diffbatch-seed"])
    source = random.Random(SEED)
    assert seed in {source.randrange(2**31) for _ in range(100)}  # not a fresh random one
    same, other = served.post(seed=seed), served.post(seed=seed + 1)
    assert np.array_equal(decode(unseeded), decode(same))
    assert not np.array_equal(decode(unseeded), decode(other))


# -- last: it stops the shared server ------------------------------------------------------
def test_serve_answers_and_stops_cleanly_on_ctrl_c(served: Served) -> None:
    """The key guards the routes and the served name is the model's; Ctrl-C closes the
    engine and exits 0, and the log names the model and never a prompt."""
    url = served.url
    assert httpx.post(f"{url}{ROUTE}", json={"prompt": "p"}).status_code == 401
    response = served.post(seed=0, model=SERVED_NAME)
    assert response.json()["size"] == "64x64"
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=60) == 0
    served.log.seek(0)
    text = served.log.read()
    assert "closing the engine" in text
    assert f"serving '{SERVED_NAME}'" in text and "Logging error" not in text
    assert "a red circle" not in text  # prompts are never logged above DEBUG
