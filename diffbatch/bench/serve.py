"""`diffbatch bench serve`: load an image server and report throughput and latency.

In the style of vLLM's `bench serve`: requests leave on a Poisson schedule
(`--request-rate`, gamma-distributed gaps with `--burstiness`), or all at once
(`--request-rate inf`), optionally capped at `--max-concurrency` in flight. Each
request is one `POST /v1/images/generations` with its own prompt and seed. The
report holds duration, completed and failed counts, throughput (requests/s and
images/s) and end-to-end latency (mean, p50, p90, p99). When the target exposes
diffbatch's Prometheus metrics at `/metrics`, the report adds what happened inside
the server during the run (the difference of two scrapes, so warm-up requests and
earlier runs do not count): the mean wave size and the queue wait (mean and p95,
p95 interpolated inside histogram buckets the way Prometheus' `histogram_quantile`
does). Targets without them (the peer servers) simply get no such section.

    diffbatch bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 \
        --request-rate 8 --size 64x64 --steps 4 --output-json result.json

With `--mode videos` each request is a video job of OpenAI's Videos API, followed
as its clients do: `POST /v1/videos`, poll `GET /v1/videos/{id}` every
`--poll-interval` seconds until it is completed, then download
`GET /v1/videos/{id}/content`. Its latency runs from the submission to the last byte
of the clip, and the report gives videos/s.

    diffbatch bench serve --mode videos --num-prompts 8 --size 32x32 --num-frames 9

`run_benchmark(BenchConfig(...))` is the same thing from Python; the scripts under
`benchmarks/` use it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from diffbatch.arg_types import int_at_least

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

IMAGES_ENDPOINT = "/v1/images/generations"
VIDEOS_ENDPOINT = "/v1/videos"
MODES = ("images", "videos")
# Prompts the benchmark cycles through (their content does not change the cost).
PROMPTS = (
    "a red circle on a white background",
    "a blue square in the top left corner",
    "a green triangle next to a yellow star",
    "two small purple dots far apart",
    "a large orange ring in the middle",
    "a black cross on a grey background",
    "a white heart below a red bar",
    "three cyan squares in a row",
)
# Server-side timing headers diffbatch sets on each image response (ms).
_TIMING_HEADERS = {
    "queue_ms": "x-diffbatch-queue-ms",
    "execute_ms": "x-diffbatch-execute-ms",
    "encode_ms": "x-diffbatch-encode-ms",
    "batch_size": "x-diffbatch-batch-size",
}
_WAVE_SIZE = "diffbatch_wave_size_requests"
_QUEUE_TIME = "diffbatch_request_queue_time_seconds"
_TORCH_THREADS = "diffbatch_worker_torch_threads"
_CAPACITY = "diffbatch_capacity_requests"
_MAX_ERRORS_KEPT = 5


@dataclass
class BenchConfig:
    """One benchmark run: the target, the load and the request shape."""

    base_url: str  # e.g. "http://127.0.0.1:8000" (no trailing path)
    model: str | None = None  # `model` field; None asks /v1/models, else leaves it out
    num_prompts: int = 64  # measured requests (warm-up not included)
    request_rate: float = math.inf  # requests/s; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    max_concurrency: int | None = None  # most requests in flight (None = no cap)
    width: int = 64
    height: int = 64
    steps: int | None = 4  # num_inference_steps (None = the server's default)
    guidance_scale: float | None = None  # None = the server's default
    n: int = 1  # images per request
    seed: int = 0  # seeds the arrival gaps, prompt choice and request seeds
    warmup_requests: int = 0  # sent (at the same concurrency cap) before measuring
    api_key: str | None = None
    endpoint: str = IMAGES_ENDPOINT
    timeout_s: float = 600.0  # per request
    disable_tqdm: bool = False
    keep_requests: bool = False  # put every request's timings into the result
    mode: str = "images"  # "videos": jobs of /v1/videos (submit, poll, download)
    num_frames: int | None = None  # videos: frames per clip (None = the server's default)
    poll_interval_s: float = 0.1  # videos: the pause between two polls of a job
    loras: tuple[str, ...] = ()  # adapters by name, request i sends loras[i % len]

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be an integer >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 or inf, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(
                f"max_concurrency must be an integer >= 1 or None, got {self.max_concurrency}"
            )
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "videos" and self.endpoint == IMAGES_ENDPOINT:
            self.endpoint = VIDEOS_ENDPOINT
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1") and self.endpoint.startswith("/v1/"):
            # the base URL an OpenAI client takes: the endpoint already starts with /v1
            self.base_url = self.base_url.removesuffix("/v1")

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass
class RequestResult:
    """What the client saw of one request."""

    index: int  # position in the arrival schedule
    start_s: float  # when it was sent, seconds since the run started
    latency_s: float = 0.0  # sent -> whole response read
    ok: bool = False
    status_code: int | None = None  # None: no HTTP answer (connection error, timeout)
    error: str | None = None
    num_images: int = 0
    server: dict[str, float] = field(default_factory=dict)  # diffbatch timing headers


# -- the load ----------------------------------------------------------------------------
def arrival_offsets_s(config: BenchConfig) -> list[float]:
    """Send time of each measured request, seconds after the start of the run.

    Gaps are gamma-distributed with shape `burstiness` and mean `1 / request_rate`
    (shape 1 is a Poisson process; below 1 burstier, above 1 more even).
    """
    if math.isinf(config.request_rate):
        return [0.0] * config.num_prompts
    rng = random.Random(config.seed)
    theta = 1.0 / (config.request_rate * config.burstiness)
    offsets, t = [], 0.0
    for _ in range(config.num_prompts):
        offsets.append(t)
        t += rng.gammavariate(config.burstiness, theta)
    return offsets


async def _scheduled(offsets: Sequence[float], start: float) -> AsyncIterator[int]:
    """Yield request indexes at their absolute send times (no drift from slow sleeps)."""
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield index


def request_body(config: BenchConfig, model: str | None, index: int) -> dict[str, Any]:
    """The JSON body of request `index` (its own prompt and seed)."""
    body: dict[str, Any] = {
        "prompt": PROMPTS[(config.seed + index) % len(PROMPTS)],
        "n": config.n,
        "size": config.size,
        "response_format": "b64_json",
        "seed": config.seed * 1_000_003 + index,
    }
    if config.mode == "videos":  # a video job: one clip, no response format
        del body["n"], body["response_format"]
        if config.num_frames is not None:
            body["num_frames"] = config.num_frames
    if model is not None:
        body["model"] = model
    if config.steps is not None:
        body["num_inference_steps"] = config.steps
    if config.guidance_scale is not None:
        body["guidance_scale"] = config.guidance_scale
    if config.loras:
        body["lora"] = config.loras[index % len(config.loras)]
    return body


# The client is aiohttp, as in vLLM's benchmarks: on a GPU machine an httpx client was the
# bottleneck (about 100 requests/s from one process at 64 in flight, falling as
# concurrency grew; docs/benchmarks.md), and aiohttp spends a few percent of its CPU per
# request. (Imported where a run starts: `diffbatch serve` builds this command's parser
# too, and needs no HTTP client.)
def _client_errors() -> tuple[type[Exception], ...]:
    import aiohttp

    return (aiohttp.ClientError, TimeoutError, ValueError)


class _Client:
    """The benchmark's HTTP session: `base_url` + path, JSON in, status, headers and
    JSON out."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session, self.base_url = session, base_url

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any, Any]:
        """(status, headers, body: the parsed JSON, the text for non-JSON, {} if empty)."""
        async with self.session.request(method, self.base_url + path, json=body) as response:
            raw = await response.read()
            if not raw:
                return response.status, response.headers, {}
            if response.content_type == "application/json":
                return response.status, response.headers, json.loads(raw)
            if response.content_type.startswith("video/"):  # a clip: its bytes
                return response.status, response.headers, raw
            return response.status, response.headers, raw.decode("utf-8", "replace")


async def _send_video(
    client: _Client, config: BenchConfig, body: dict[str, Any], index: int, t0: float
) -> RequestResult:
    """One video job: submit, poll until it is finished, download the clip."""
    start = time.perf_counter()
    result = RequestResult(index=index, start_s=start - t0)
    content: Any = None
    try:
        status, _, job = await client.request("POST", config.endpoint, body)
        payload = job
        while status == 200 and isinstance(job, dict) \
                and job.get("status") in ("queued", "in_progress"):
            await asyncio.sleep(config.poll_interval_s)
            status, _, job = await client.request("GET", f"{config.endpoint}/{job['id']}")
            payload = job
        if status == 200 and isinstance(job, dict) and job.get("status") == "completed":
            status, _, content = await client.request(
                "GET", f"{config.endpoint}/{job['id']}/content")
            payload = content
    except _client_errors() as exc:
        result.latency_s = time.perf_counter() - start
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - start
    result.status_code = status
    if status != 200:
        message = payload.get("error", payload) if isinstance(payload, dict) else payload
        result.error = f"HTTP {status}: {str(message)[:300]}"
    elif isinstance(job, dict) and job.get("status") != "completed":
        result.error = f"job {job.get('status')}: {str(job.get('error'))[:300]}"
    elif not isinstance(content, bytes) or not content:
        result.error = "the clip's download was empty"
    else:
        result.ok, result.num_images = True, 1
    return result


async def _send(
    client: _Client, config: BenchConfig, body: dict[str, Any], index: int, t0: float
) -> RequestResult:
    if config.mode == "videos":
        return await _send_video(client, config, body, index, t0)
    start = time.perf_counter()
    result = RequestResult(index=index, start_s=start - t0)
    try:
        status, headers, payload = await client.request("POST", config.endpoint, body)
    except _client_errors() as exc:
        result.latency_s = time.perf_counter() - start
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - start
    result.status_code = status
    if status != 200:
        message = payload.get("error", payload) if isinstance(payload, dict) else payload
        result.error = f"HTTP {status}: {str(message)[:300]}"
        return result
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != config.n:
        result.error = f"expected {config.n} images in `data`, got {str(data)[:100]}"
        return result
    result.ok, result.num_images = True, len(data)
    for name, header in _TIMING_HEADERS.items():
        value = headers.get(header)
        if value is not None:
            with contextlib.suppress(ValueError):
                result.server[name] = float(value)
    return result


async def _run_requests(
    client: _Client,
    config: BenchConfig,
    model: str | None,
    offsets: Sequence[float],
    first_index: int,
    on_done: Callable[[], None],
) -> list[RequestResult]:
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    t0 = time.perf_counter()

    async def one(index: int) -> RequestResult:
        body = request_body(config, model, first_index + index)
        if semaphore is None:
            result = await _send(client, config, body, index, t0)
        else:
            async with semaphore:
                result = await _send(client, config, body, index, t0)
        on_done()
        return result

    tasks = [asyncio.create_task(one(i)) async for i in _scheduled(offsets, t0)]
    return list(await asyncio.gather(*tasks))


# -- /metrics ----------------------------------------------------------------------------
async def scrape_metrics(client: _Client) -> dict[str, Any] | None:
    """diffbatch's wave-size and queue-time series, or None if the target has none."""
    try:
        status, _headers, text = await client.request("GET", "/metrics")
    except _client_errors():
        return None
    if status != 200 or not isinstance(text, str) or _WAVE_SIZE not in text:
        return None
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, Any]:
    """Pick the wave-size sum/count, the queue-time histogram, the worker's torch
    threads and the learned capacity per curve ("auto" only) out of Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"queue_buckets": {}, "capacity": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{_WAVE_SIZE}_sum", f"{_WAVE_SIZE}_count",
                               f"{_QUEUE_TIME}_sum", f"{_QUEUE_TIME}_count",
                               _TORCH_THREADS):
                out[sample.name] = sample.value
            elif sample.name == f"{_QUEUE_TIME}_bucket":
                out["queue_buckets"][float(sample.labels["le"])] = sample.value
            elif sample.name == _CAPACITY:
                out["capacity"][sample.labels.get("shape", "")] = int(sample.value)
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram {upper bound: count}, interpolated
    linearly inside its bucket (Prometheus' `histogram_quantile`); None if empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: its bound is all we know
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return lower


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Mean wave size and queue wait (mean, p95) of the requests between two scrapes,
    and the worker's torch threads at the second (the server may change them while
    serving, when other processes take its cores)."""

    def diff(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    waves = diff(f"{_WAVE_SIZE}_count")
    queued = diff(f"{_QUEUE_TIME}_count")
    buckets = {
        le: count - before["queue_buckets"].get(le, 0.0)
        for le, count in after["queue_buckets"].items()
    }
    p95_s = histogram_quantile(0.95, buckets)
    return {
        "num_waves": waves,
        "mean_wave_size": diff(f"{_WAVE_SIZE}_sum") / waves if waves else None,
        "queue_wait_ms_mean": diff(f"{_QUEUE_TIME}_sum") / queued * 1e3 if queued else None,
        "queue_wait_ms_p95": p95_s * 1e3 if p95_s is not None else None,
        # (the gauge reads 0 until the worker's first heartbeat: not known yet)
        "worker_torch_threads": after.get(_TORCH_THREADS) or None,
        # curve ("64x64/s4/n1/cfg") -> capacity at the second scrape; None with fixed
        # settings (no learned curve)
        "capacity": dict(after.get("capacity") or {}) or None,
    }


# -- the run -----------------------------------------------------------------------------
async def _served_model(client: _Client) -> str | None:
    """The first model `GET /v1/models` lists; None if the target has no such route."""
    try:
        status, _headers, payload = await client.request("GET", "/v1/models")
        if status == 200:
            return payload["data"][0]["id"]
    except (*_client_errors(), KeyError, IndexError, TypeError):  # type: ignore[misc]
        pass
    return None


def _percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    config: BenchConfig, results: list[RequestResult], duration_s: float
) -> dict[str, Any]:
    """The report fields computed from the client's side of the run."""
    ok = [r for r in results if r.ok]
    latencies_ms = [r.latency_s * 1e3 for r in ok]
    summary: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "image_throughput": sum(r.num_images for r in ok) / duration_s if duration_s else 0.0,
    }
    if config.mode == "videos":  # one clip per job
        summary["video_throughput"] = summary.pop("image_throughput")
    for name in ("mean", "p50", "p90", "p99"):
        summary[f"{name}_e2e_ms"] = None
    if latencies_ms:
        summary["mean_e2e_ms"] = statistics.fmean(latencies_ms)
        for q in (50, 90, 99):
            summary[f"p{q}_e2e_ms"] = _percentile(latencies_ms, q)
    server: dict[str, dict[str, float]] = {}
    for name in _TIMING_HEADERS:
        values = [r.server[name] for r in ok if name in r.server]
        if values:
            server[name] = {"mean": statistics.fmean(values), "p50": _percentile(values, 50),
                            "p95": _percentile(values, 95)}
    summary["server_timing"] = server or None
    summary["errors"] = [r.error for r in results if r.error][:_MAX_ERRORS_KEPT]
    return summary


async def run_benchmark_async(config: BenchConfig) -> dict[str, Any]:
    """Warm up, scrape /metrics, run the load, scrape again; return the report."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    in_flight = config.max_concurrency or max(config.num_prompts, config.warmup_requests)
    import aiohttp

    async with aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=min(in_flight, 1024)),
        timeout=aiohttp.ClientTimeout(total=config.timeout_s, connect=30.0),
    ) as session:
        client = _Client(session, config.base_url)
        model = config.model if config.model is not None else await _served_model(client)
        # 1. Warm-up: the same request shape, not measured.
        if config.warmup_requests:
            warm = await _run_requests(
                client, config, model, [0.0] * config.warmup_requests,
                config.num_prompts, lambda: None,
            )
            failed = [r.error for r in warm if not r.ok]
            if len(failed) == len(warm):
                raise RuntimeError(f"every warm-up request failed, e.g. {failed[0]}")
        # 2. The measured run, between two metrics scrapes.
        before = await scrape_metrics(client)
        offsets = arrival_offsets_s(config)
        with tqdm(total=config.num_prompts, desc="bench serve", unit="req",
                  disable=config.disable_tqdm) as bar:
            start = time.perf_counter()
            results = await _run_requests(
                client, config, model, offsets, 0, lambda: bar.update(1)
            )
            duration_s = time.perf_counter() - start
        after = await scrape_metrics(client)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
        "model": model,
        **summarize(config, results, duration_s),
        "server_metrics": metrics_delta(before, after) if before and after else None,
    }
    if config.keep_requests:
        report["requests"] = [asdict(r) for r in results]
    return report


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run one benchmark (blocking); see `run_benchmark_async`."""
    return asyncio.run(run_benchmark_async(config))


def format_report(report: dict[str, Any]) -> str:
    """The human-readable summary `diffbatch bench serve` prints."""

    def fmt(value: Any, unit: str = "") -> str:
        if value is None:
            return "n/a"
        return f"{value:.2f}{unit}" if isinstance(value, float) else f"{value}{unit}"

    config = report["config"]
    lines = [
        "{:=^60}".format(" Serving Benchmark Result "),
        f"{'Target:':<40}{config['base_url']}",
        f"{'Request rate (req/s):':<40}{config['request_rate']}",
        f"{'Burstiness:':<40}{config['burstiness']}",
        f"{'Max concurrency:':<40}{config['max_concurrency']}",
        f"{'Successful requests:':<40}{report['completed']}",
        f"{'Failed requests:':<40}{report['failed']}",
        f"{'Benchmark duration (s):':<40}{fmt(report['duration_s'])}",
        f"{'Request throughput (req/s):':<40}{fmt(report['request_throughput'])}",
        f"{'Video throughput (videos/s):':<40}{fmt(report['video_throughput'])}"
        if "video_throughput" in report else
        f"{'Image throughput (images/s):':<40}{fmt(report['image_throughput'])}",
        "{:-^60}".format(" End-to-end latency "),
    ]
    for name in ("mean", "p50", "p90", "p99"):
        lines.append(f"{name.upper() + ' E2E (ms):':<40}{fmt(report[f'{name}_e2e_ms'])}")
    metrics = report.get("server_metrics")
    if metrics:
        lines.append("{:-^60}".format(" Server (/metrics) "))
        lines.append(f"{'Mean wave size (requests):':<40}{fmt(metrics['mean_wave_size'])}")
        lines.append(f"{'Mean queue wait (ms):':<40}{fmt(metrics['queue_wait_ms_mean'])}")
        lines.append(f"{'P95 queue wait (ms, bucketed):':<40}{fmt(metrics['queue_wait_ms_p95'])}")
        for curve, capacity in (metrics.get("capacity") or {}).items():
            lines.append(f"{f'Capacity {curve} (requests):':<40}{capacity}")
    for error in report.get("errors") or []:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------
def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or 'inf', got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or 'inf', got {text}")
    return value


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _writable_file(text: str) -> str:
    """A file path whose folder exists (checked before the run, not after it)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"is a directory, expected a file path: {text!r} (e.g. {text.rstrip('/')}/"
            "results.json)")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"its folder does not exist: {folder!r}")
    return text


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"must start with http:// or https://, got {text!r}")
    return text


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) or \
            not int(height):
        raise argparse.ArgumentTypeError(f"must be <width>x<height>, e.g. 64x64, got {text!r}")
    return int(width), int(height)


API_KEY_ENV = "DIFFBATCH_API_KEY"  # the variable `diffbatch serve` takes its key from


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `diffbatch bench serve` (vLLM's names where they exist)."""
    parser.add_argument("--base-url", type=_url, default="http://127.0.0.1:8000",
                        help="server to load, without the endpoint path (a trailing /v1, "
                        "as an OpenAI client takes it, is dropped)")
    parser.add_argument("--endpoint", default=IMAGES_ENDPOINT, help="image generation path")
    parser.add_argument("--model", default=None,
                        help="`model` field of each request; none: the first of /v1/models, "
                        "or none"),
    parser.add_argument("--num-prompts", type=_positive_int, default=64,
                        help="measured requests")
    parser.add_argument("--request-rate", type=_rate, default=math.inf,
                        help="requests/s of the arrival process; inf sends all at once")
    parser.add_argument("--burstiness", type=_positive_number, default=1.0,
                        help="gamma shape of the gaps between requests (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=_positive_int, default=None,
                        help="most requests in flight; none: no cap")
    parser.add_argument("--size", type=_size, default="64x64", help="<width>x<height>")
    parser.add_argument("--steps", type=_positive_int, default=4,
                        help="num_inference_steps of each request")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="guidance_scale of each request; none: the server's")
    parser.add_argument("--n", type=_positive_int, default=1, help="images per request")
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seeds the arrival gaps, the prompts and the request seeds")
    parser.add_argument("--warmup-requests", type=_non_negative_int, default=0,
                        help="requests sent and not measured before the run")
    # (the variable is read when the run is configured: a default here would print
    # the key in --help)
    parser.add_argument("--api-key", default=None,
                        help="sent as `Authorization: Bearer`; none: $" + API_KEY_ENV
                        + ", the key `diffbatch serve` reads")
    parser.add_argument("--timeout", type=_positive_number, default=600.0,
                        help="per-request timeout (s)")
    parser.add_argument("--output-json", type=_writable_file, default=None,
                        help="also write the report here")
    parser.add_argument("--save-requests", action="store_true",
                        help="include every request's timings in the JSON report")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--mode", choices=MODES, default="images",
                        help="images: POST /v1/images/generations; videos: jobs of "
                        "/v1/videos (submit, poll, download)")
    parser.add_argument("--num-frames", type=_positive_int, default=None,
                        help="videos: frames per clip (default: the server's)")
    parser.add_argument("--poll-interval", type=_positive_number, default=0.1,
                        metavar="SECONDS", help="videos: pause between two polls of a job")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    width, height = args.size
    return BenchConfig(
        base_url=args.base_url, model=args.model, num_prompts=args.num_prompts,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, width=width, height=height, steps=args.steps,
        guidance_scale=args.guidance_scale, n=args.n, seed=args.seed,
        warmup_requests=args.warmup_requests,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, endpoint=args.endpoint,
        timeout_s=args.timeout, disable_tqdm=args.disable_tqdm,
        keep_requests=args.save_requests, mode=args.mode, num_frames=args.num_frames,
        poll_interval_s=args.poll_interval,
    )


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    report = run_benchmark(config_from_args(args))
    print(format_report(report))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.output_json}")
    return 0 if report["completed"] else 1


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `diffbatch bench serve` (the `bench` group leaves room for more)."""
    bench = subparsers.add_parser(
        "bench", help="benchmark a running server",
        description="Benchmark tools; `diffbatch bench serve --help` for the load generator.",
    )
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    parser = commands.add_parser(
        "serve", help="load an image server and report throughput and latency",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_bench_serve_arguments(parser)
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error", "critical"),
                        help="what this tool logs")
    parser.set_defaults(func=_cmd_bench_serve)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m diffbatch.bench.serve ...`: the same as `diffbatch bench serve ...`."""
    parser = argparse.ArgumentParser(
        prog="diffbatch bench serve", description=__doc__.splitlines()[0]
    )
    add_bench_serve_arguments(parser)
    args = parser.parse_args(argv)
    return _cmd_bench_serve(args)


if __name__ == "__main__":
    sys.exit(main())
