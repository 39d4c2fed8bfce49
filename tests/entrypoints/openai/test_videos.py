"""OpenAI's Videos API on `tiny-wan`, through the official `openai` client.

One module-scoped server (a real uvicorn, an in-process engine over the real tiny Wan
pipeline) serves every test. Tests that need a job held at a given denoising step
gate the transformer with a forward pre-hook (`TransformerGate`): the job waits
inside its step until the test releases it, so statuses and cancellation are
observed on events, never on timing.
"""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import API_KEY, RunningServer, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "tiny-wan"
WAIT_S = 60.0  # bound of every wait on the server (fails fast when something hangs)


class TransformerGate:
    """Counts the transformer's calls and holds the one numbered `hold_at` until
    `release` is set (Wan calls it twice per step with CFG on)."""

    def __init__(self, engine: Engine) -> None:
        pipeline = engine.executor.runner.pipeline  # type: ignore[attr-defined]
        self.calls = 0
        self.hold_at: int | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._handle = pipeline.pipe.transformer.register_forward_pre_hook(self._hook)

    def _hook(self, module: object, args: object) -> None:
        with self._lock:
            self.calls += 1
            hold = self.calls == self.hold_at
        if hold:
            self.held.set()
            assert self.release.wait(WAIT_S), "the test never released the gate"

    def hold(self, at_call: int) -> None:
        """Hold the `at_call`-th call from now."""
        with self._lock:
            self.hold_at = self.calls + at_call
        self.held.clear()
        self.release.clear()

    def open(self) -> None:
        self.hold_at = None
        self.release.set()

    def close(self) -> None:
        self.open()
        self._handle.remove()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with Engine(MODEL, executor="inproc", max_num_seqs=4, warmup=False,
                request_batch_max_wait_ms=0) as engine:
        app = build_app(engine, served_model_name=MODEL, api_key=API_KEY,
                        close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            yield RunningServer(url, engine, app, API_KEY)


@pytest.fixture()
def gate(server: RunningServer) -> Iterator[TransformerGate]:
    gate = TransformerGate(server.engine)
    yield gate
    gate.close()


@pytest.fixture()
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def decode_mp4(data: bytes) -> list[np.ndarray]:
    """Every frame of an MP4, as RGB uint8 arrays."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]


def wait_for(client: openai.OpenAI, video_id: str, condition) -> object:
    """Poll the job (no sleep: each GET is a round trip) until `condition(video)`."""
    deadline = threading.Event()
    timer = threading.Timer(WAIT_S, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            video = client.videos.retrieve(video_id)
            if condition(video):
                return video
        raise AssertionError(f"video {video_id} never reached the condition")
    finally:
        timer.cancel()


def test_create_and_poll_then_download_gives_the_asked_frames_and_size(client) -> None:
    video = client.videos.create_and_poll(model=MODEL, prompt="a red cat", size="48x32",
                                          seconds="1", poll_interval_ms=20,
                                          extra_body={"seed": 3})
    assert video.object == "video" and video.status == "completed", video
    assert video.progress == 100 and video.model == MODEL and video.size == "48x32"
    assert video.seconds == "1" and video.error is None
    assert video.completed_at >= video.created_at and video.expires_at > video.completed_at
    content = client.videos.download_content(video.id)
    frames = decode_mp4(content.read())
    # 1 s at the model's 16 fps is 16 frames, rounded to Wan's 4k+1 counts: 17
    assert len(frames) == 17
    assert frames[0].shape == (32, 48, 3)
    assert len({frame.tobytes() for frame in frames}) > 1  # a clip, not one still


def test_extra_body_sets_frames_steps_and_fps(client) -> None:
    video = client.videos.create_and_poll(
        model=MODEL, prompt="a dog", poll_interval_ms=20,
        extra_body={"num_frames": 5, "fps": 8, "num_inference_steps": 2,
                    "guidance_scale": 1.0, "negative_prompt": "blurry", "seed": 1})
    assert video.status == "completed", video.error
    assert video.size == "32x32"  # the model's default
    assert video.seconds == "0.625"  # 5 frames at 8 fps
    import av

    with av.open(io.BytesIO(client.videos.download_content(video.id).read())) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 8
        assert sum(1 for _ in container.decode(stream)) == 5


def test_status_goes_through_every_value(client, server, gate) -> None:
    gate.hold(at_call=5)  # 4 steps with CFG: 2 calls per step; hold the third step
    created = client.videos.create(model=MODEL, prompt="a tree", extra_body={"seed": 5})
    assert created.status == "queued" and created.progress == 0
    assert gate.held.wait(WAIT_S)
    # (each step's progress reaches the job from the engine's output loop, after the
    # step: wait for the second; the held third cannot move it past 50)
    running = wait_for(client, created.id, lambda v: v.progress == 50)
    assert running.status == "in_progress" and running.progress == 50  # 2 of 4 steps
    gate.open()
    done = wait_for(client, created.id, lambda v: v.status not in ("queued", "in_progress"))
    assert done.status == "completed" and done.progress == 100

    # failed: the server cancels a job itself (as at shutdown)
    gate.hold(at_call=1)
    job = client.videos.create(model=MODEL, prompt="a fish", extra_body={"seed": 6})
    assert gate.held.wait(WAIT_S)
    server.engine.abort(job.id)
    gate.open()
    failed = wait_for(client, job.id, lambda v: v.status == "failed")
    assert failed.error.code == "cancelled" and failed.error.message
    response = httpx.get(f"{server.url}/v1/videos/{job.id}/content", headers=server.headers)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "video_not_ready"


def test_delete_cancels_a_running_job_at_the_next_step(client, server, gate) -> None:
    gate.hold(at_call=3)  # inside the second of 400 steps
    job = client.videos.create(model=MODEL, prompt="a long clip",
                               extra_body={"num_inference_steps": 400, "seed": 7})
    assert gate.held.wait(WAIT_S)
    calls_before = gate.calls
    deleted = client.videos.delete(job.id)
    assert deleted.id == job.id and deleted.deleted and deleted.object == "video.deleted"
    gate.open()
    # the worker is free again: the next job runs (it would wait 398 steps otherwise)
    follow = client.videos.create_and_poll(model=MODEL, prompt="next", poll_interval_ms=20,
                                           extra_body={"num_inference_steps": 1})
    assert follow.status == "completed"
    # the cancelled job ran to the end of its step and stopped: the calls since are
    # its second step's unconditional call and the next job's two
    assert gate.calls - calls_before <= 1 + 2
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
    waves = [w for w in server.engine.wave_log.since(0, 1000) if w.num_aborted]
    assert waves, "the cancelled job's wave is not logged as aborted"


def test_four_requests_of_one_shape_run_as_one_wave(client, server, gate) -> None:
    gate.hold(at_call=1)
    blocker = client.videos.create(model=MODEL, prompt="blocker", extra_body={"seed": 0})
    assert gate.held.wait(WAIT_S)
    seeds = [11, 12, 13, 14]
    jobs = [client.videos.create(model=MODEL, prompt=f"clip {seed}", size="32x32",
                                 extra_body={"num_frames": 5, "seed": seed,
                                             "num_inference_steps": 2})
            for seed in seeds]
    last_wave = server.engine.wave_log.last_id
    gate.open()
    for job in [blocker, *jobs]:
        assert wait_for(client, job.id, lambda v: v.status != "in_progress"
                        and v.status != "queued").status == "completed"
    waves = server.engine.wave_log.since(last_wave, 100)
    assert [w.num_requests for w in waves] == [1, 4], waves
    # each clip equals its solo run (the same request alone)
    batched = decode_mp4(client.videos.download_content(jobs[2].id).read())
    solo_job = client.videos.create_and_poll(
        model=MODEL, prompt="clip 13", size="32x32", poll_interval_ms=20,
        extra_body={"num_frames": 5, "seed": 13, "num_inference_steps": 2})
    solo = decode_mp4(client.videos.download_content(solo_job.id).read())
    assert len(batched) == len(solo) == 5
    # (the frames themselves agree within 1 level before encoding:
    # tests/pipelines/test_diffusers_video.py; H.264 keeps equal inputs equal)
    diff = max(int(np.abs(a.astype(int) - b.astype(int)).max())
               for a, b in zip(batched, solo, strict=True))
    assert diff <= 2, diff


def test_list_is_paginated_newest_first(client) -> None:
    ids = [client.videos.create(model=MODEL, prompt=f"list {i}",
                                extra_body={"num_inference_steps": 1}).id for i in range(3)]
    page = client.videos.list(limit=2)
    assert [v.id for v in page.data] == ids[::-1][:2] and page.has_more
    rest = client.videos.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    ascending = [v.id for v in client.videos.list(order="asc", limit=100).data]
    assert ascending.index(ids[0]) < ascending.index(ids[2])
    for video_id in ids:
        wait_for(client, video_id, lambda v: v.status == "completed")


def test_metrics_count_frames_and_outcomes(client, server) -> None:
    client.videos.create_and_poll(model=MODEL, prompt="metrics", poll_interval_ms=20,
                                  extra_body={"num_frames": 5, "num_inference_steps": 1})
    text = httpx.get(f"{server.url}/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith("diffbatch_video_")}
    assert samples["diffbatch_video_frames_generated_total"] >= 5
    assert samples['diffbatch_video_jobs_finished_total{outcome="completed"}'] >= 1
    assert 'diffbatch_video_jobs{status="queued"}' in samples


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", "/v1/videos/video_x"),
    ("GET", "/v1/videos/video_x/content"), ("DELETE", "/v1/videos/video_x"),
])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong"])
def test_every_video_route_needs_the_api_key(server, method, path, authorization) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{server.url}{path}", headers=headers,
                             json={"prompt": "x"} if method == "POST" else None)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_corrupt_input_reference_is_a_400(server) -> None:
    response = httpx.post(f"{server.url}/v1/videos", headers=server.headers,
                          data={"prompt": "a cat"},
                          files={"input_reference": ("ref.png", b"\x89PNG not really")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input_reference" and "PNG" in error["message"]
    # a real image: refused too, as this model makes videos from text alone
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    response = httpx.post(f"{server.url}/v1/videos", headers=server.headers,
                          data={"prompt": "a cat"},
                          files={"input_reference": ("ref.png", png.getvalue())})
    assert response.status_code == 400
    assert "image-to-video" in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "num_frames": 6}, "num_frames"),  # Wan takes 4k+1 frames
    ({"prompt": "x", "size": "40x32"}, "size"),  # not a multiple of 16
    ({"prompt": "x", "seconds": "forever"}, "seconds"),
    ({"prompt": "x", "seconds": "0"}, "seconds"),
    ({"prompt": "x", "fps": 0}, "fps"),
    ({"prompt": "x", "frames": 5}, "frames"),  # unknown field
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "num_frames": 10_001}, "num_frames"),
    # frames x pixels x steps over the automatic work limit (100 default clips)
    ({"prompt": "x", "num_frames": 257, "num_inference_steps": 100}, "num_inference_steps"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param) -> None:
    response = httpx.post(f"{server.url}/v1/videos", headers=server.headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "/tmp" not in error["message"]


def test_unknown_model_and_video_are_404s(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.videos.create(model="sora-2", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_unknown")
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_unknown")


def test_json_body_without_the_client(server) -> None:
    response = httpx.post(f"{server.url}/v1/videos", headers=server.headers,
                          json={"prompt": "plain json", "num_inference_steps": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "video" and body["status"] == "queued"
    assert response.headers["openai-poll-after-ms"]


def test_answers_validate_against_the_clients_own_models(client, server) -> None:
    """Every answer validates strictly against the official client's pydantic models,
    but for the enumerations of OpenAI's own models (Sora's sizes and lengths)."""
    from openai.types import Video, VideoDeleteResponse

    def check(body: dict) -> None:
        assert set(Video.model_fields) - {"model", "size", "seconds"} <= set(body)
        Video.model_validate({**body, "model": "sora-2", "size": "720x1280", "seconds": "4"},
                             strict=True)

    video = client.videos.create_and_poll(model=MODEL, prompt="shapes", poll_interval_ms=20,
                                          extra_body={"num_inference_steps": 1})
    done = httpx.get(f"{server.url}/v1/videos/{video.id}", headers=server.headers).json()
    check(done)
    listed = httpx.get(f"{server.url}/v1/videos?limit=2", headers=server.headers).json()
    assert set(listed) == {"object", "data", "first_id", "last_id", "has_more"}
    for item in listed["data"]:
        check(item)
    deleted = httpx.delete(f"{server.url}/v1/videos/{video.id}", headers=server.headers)
    VideoDeleteResponse.model_validate(deleted.json(), strict=True)
    failed = client.videos.create(model=MODEL, prompt="to fail")
    server.engine.abort(failed.id)
    body = wait_for(client, failed.id, lambda v: v.status == "failed").model_dump()
    check(body)
    from openai.types.video_create_error import VideoCreateError

    VideoCreateError.model_validate(body["error"], strict=True)


def test_bench_serve_video_mode_submits_polls_and_downloads(server) -> None:
    from diffbatch.bench.serve import BenchConfig, format_report, run_benchmark

    report = run_benchmark(BenchConfig(
        base_url=f"{server.url}/v1", model=MODEL, num_prompts=4, mode="videos", width=32,
        height=32, steps=2, num_frames=5, api_key=API_KEY, poll_interval_s=0.02,
        disable_tqdm=True))
    assert report["completed"] == 4 and report["failed"] == 0, report["errors"]
    assert report["video_throughput"] > 0 and "image_throughput" not in report
    assert report["p50_e2e_ms"] > 0 and report["p99_e2e_ms"] >= report["p50_e2e_ms"]
    assert "Video throughput (videos/s):" in format_report(report)
    # a job the server refuses is a failed request with its message
    bad = run_benchmark(BenchConfig(
        base_url=server.url, model=MODEL, num_prompts=1, mode="videos", width=40, height=32,
        api_key=API_KEY, disable_tqdm=True))
    assert bad["failed"] == 1 and "HTTP 400" in bad["errors"][0]


def test_without_a_video_store_jobs_are_refused(server) -> None:
    """Several Ray Serve replicas (`video_store_bytes=0`): each would keep its own
    jobs, so the server refuses them with a 400 rather than lose their polls."""
    import asyncio

    from tests.entrypoints.openai.conftest import app_client

    async def run() -> httpx.Response:
        async with app_client(server.engine, served_model_name=MODEL,
                              video_store_bytes=0) as client:
            listed = await client.get("/v1/videos")
            assert listed.status_code == 200 and listed.json()["data"] == []
            assert 'diffbatch_video_jobs{status="queued"} 0.0' in (
                await client.get("/metrics")).text
            return await client.post("/v1/videos", json={"prompt": "x"})

    response = asyncio.run(run())
    assert response.status_code == 400
    assert "one replica" in response.json()["error"]["message"]


def test_image_routes_refuse_a_video_model(server) -> None:
    response = httpx.post(f"{server.url}/v1/images/generations", headers=server.headers,
                          json={"prompt": "a cat"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "POST /v1/videos" in error["message"]


def test_a_client_that_disconnects_does_not_cancel_its_job(client, server) -> None:
    from tests.entrypoints.openai.conftest import disconnect

    prompt = "left alone with the key"
    body = json.dumps({"prompt": prompt, "num_inference_steps": 2}).encode()
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
                .encode() + body)
    disconnect(raw)  # gone before reading the answer

    def job_of_prompt():
        return next((v for v in client.videos.list(limit=100).data if v.prompt == prompt),
                    None)

    deadline = threading.Event()
    timer = threading.Timer(WAIT_S, deadline.set)
    timer.start()
    try:
        while (job := job_of_prompt()) is None or job.status != "completed":
            assert not deadline.is_set(), f"the job did not complete: {job}"
    finally:
        timer.cancel()


def test_ltx_video_is_served_too() -> None:
    """LTX-Video through the same API: its clip is encoded at the frame rate the model
    was asked for (which LTX also takes as `frame_rate`)."""
    import asyncio

    import av

    from tests.entrypoints.openai.conftest import app_client

    async def run(engine: Engine) -> bytes:
        async with app_client(engine, served_model_name="tiny-ltx") as client:
            job = (await client.post("/v1/videos", json={
                "prompt": "a cat", "size": "32x32", "seconds": "0.5", "fps": 10,
                "num_inference_steps": 2})).json()
            while job["status"] in ("queued", "in_progress"):
                await asyncio.sleep(0.02)  # (a busy poll would hold the GIL from the engine)
                job = (await client.get(f"/v1/videos/{job['id']}")).json()
            assert job["status"] == "completed", job
            return (await client.get(f"/v1/videos/{job['id']}/content")).content

    with Engine("tiny-ltx", executor="inproc", warmup=False,
                calibration_budget_s=0) as engine:
        content = asyncio.run(run(engine))
    with av.open(io.BytesIO(content)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 10
        assert sum(1 for _ in container.decode(stream)) == 5  # 0.5 s at 10 fps: 4k+1
