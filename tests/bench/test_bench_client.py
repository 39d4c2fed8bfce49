"""`diffbatch bench serve`'s client against a small real HTTP server: what it counts as
done or failed, what it reads from the answers and what it sends."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from diffbatch.bench.serve import BenchConfig, run_benchmark_async


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ImageServer:
    """An images endpoint that answers every third request with a 400, as diffbatch
    answers bad input, and the others with one image and diffbatch's timing headers."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = self.most_in_flight = 0

    async def generations(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        position = len(self.bodies)
        self.auth.append(request.headers.get("Authorization"))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)  # let the other requests in
        self.in_flight -= 1
        if position % 3 == 0:
            return web.json_response(
                {"error": {"message": "size must be 64x64", "type": "invalid_request_error",
                           "param": "size", "code": None}}, status=400)
        return web.json_response({"created": 1, "data": [{"b64_json": "AAAA"}]},
                                 headers={"x-diffbatch-batch-size": "4",
                                          "x-diffbatch-queue-ms": "2.5"})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-sd"}]})


@pytest.fixture
async def server():
    images = ImageServer()
    app = web.Application()
    app.router.add_post("/v1/images/generations", images.generations)
    app.router.add_get("/v1/models", images.models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()  # a port the system picks
    port = runner.addresses[0][1]
    yield images, f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def test_successes_failures_headers_and_what_is_sent(server):
    images, url = server
    report = await run_benchmark_async(BenchConfig(
        base_url=url, num_prompts=9, max_concurrency=4, api_key="sk-test", disable_tqdm=True))
    assert (report["completed"], report["failed"]) == (6, 3)
    assert report["errors"][0].startswith("HTTP 400: {'message': 'size must be 64x64'")
    assert report["model"] == "tiny-sd"  # from /v1/models
    assert report["server_timing"]["batch_size"]["mean"] == 4.0
    assert report["server_timing"]["queue_ms"]["p50"] == 2.5
    assert report["server_metrics"] is None  # no /metrics: a peer server
    assert len({b["seed"] for b in images.bodies}) == 9  # each request its own seed
    assert all(b["model"] == "tiny-sd" and b["size"] == "64x64" for b in images.bodies)
    assert set(images.auth) == {"Bearer sk-test"}
    assert 1 < images.most_in_flight <= 4


async def test_a_target_that_does_not_answer_is_every_request_failed():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    report = await run_benchmark_async(BenchConfig(base_url=url, num_prompts=3, model="m",
                                                   disable_tqdm=True))
    assert (report["completed"], report["failed"]) == (0, 3)
    assert all("Connect" in error for error in report["errors"])
    with pytest.raises(RuntimeError, match="every warm-up request failed"):
        await run_benchmark_async(BenchConfig(base_url=url, num_prompts=3, model="m",
                                              warmup_requests=2, disable_tqdm=True))


def test_the_metrics_read_the_learned_capacity_per_curve_and_the_report_shows_it():
    from diffbatch.bench.serve import format_report, metrics_delta, parse_metrics

    text = "\n".join([
        "# TYPE diffbatch_wave_size_requests histogram",
        'diffbatch_wave_size_requests_bucket{le="+Inf"} 3.0',
        "diffbatch_wave_size_requests_sum 20.0",
        "diffbatch_wave_size_requests_count 3.0",
        "# TYPE diffbatch_capacity_requests gauge",
        'diffbatch_capacity_requests{shape="64x64/s4/n1/cfg"} 16.0',
        'diffbatch_capacity_requests{shape="128x128/s4/n1/cfg"} 8.0',
        "",
    ])
    before = parse_metrics(text.replace("_sum 20.0", "_sum 4.0").replace("_count 3.0",
                                                                        "_count 1.0"))
    delta = metrics_delta(before, parse_metrics(text))
    assert delta["mean_wave_size"] == 8.0  # (20 - 4) / (3 - 1)
    assert delta["capacity"] == {"64x64/s4/n1/cfg": 16, "128x128/s4/n1/cfg": 8}
    fixed = metrics_delta(before, parse_metrics(text.split("# TYPE diffbatch_capacity")[0]))
    assert fixed["capacity"] is None  # fixed settings learn no curve
    report = {
        "config": {"base_url": "http://h", "endpoint": "/v1/images/generations",
                   "model": "m", "request_rate": 1.0, "burstiness": 1.0,
                   "max_concurrency": None},
        "completed": 3, "failed": 0, "duration_s": 1.0, "request_throughput": 3.0,
        "image_throughput": 3.0, "mean_e2e_ms": 1.0, "p50_e2e_ms": 1.0,
        "p90_e2e_ms": 1.0, "p99_e2e_ms": 1.0, "server_metrics": delta,
    }
    printed = format_report(report)
    assert "Capacity 64x64/s4/n1/cfg (requests):" in printed
    assert printed.split("Capacity 128x128/s4/n1/cfg (requests):")[1].split()[0] == "8"
