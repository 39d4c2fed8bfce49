"""Does routing by batch key keep waves full across Ray Serve replicas?

Two replicas, driven by a closed loop of `--clients` clients, each request's batch key
drawn uniformly from `--keys` keys (image sizes). Three applications run side by side
on one local Ray cluster and take turns, round by round:

  diffbatch  the diffbatch request router (the default of `diffbatch serve --ray`);
  random     Ray Serve's default router (`--ray-router random`: the less busy of two
             random replicas);
  twin       a second copy of `random`: the noise floor of the comparison.

The pipeline is `SleepPipeline`, a real batched pipeline (loaded by name, like any
custom pipeline) whose forward sleeps `--fixed-ms` plus `--per-request-ms` per
request, so a bigger wave pays off and the result does not depend on this machine's
CPUs. Per round and application: throughput (answers per second), the mean wave
(requests / waves, from the `x-diffbatch-batch-size` of every answer) and, from the
replicas' own forward log, how long each replica sat idle while the other ran a wave.

Scenarios: `mixed` (`--keys` keys, the bars: mean wave >= 1.6x and throughput >= 1.3x
of `random`), `single` (one key: no replica idle > 10% of the round while the other
works), and with `--tiny-sd`, `tiny-sd` with `--adapters` LoRA adapters (one per
request, uniformly; figures only, this machine has 2 CPUs for both replicas).

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/ray_routing.py \\
        --rounds 5 --tiny-sd --out benchmarks/results/ray_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import torch

from diffbatch.outputs import DiffusionOutput
from diffbatch.pipelines.interface import BasePipeline, DiffusionRequestBatch, PipelineInfo

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
ROUTE = "/v1/images/generations"
SLEEP_PIPELINE = "ray_routing.SleepPipeline"  # replicas import it from benchmarks/
CONFIGS = ("diffbatch", "random", "twin")
READY_TIMEOUT_S = 300.0


class SleepPipeline(BasePipeline):
    """A batched pipeline whose forward costs `fixed_ms + per_request_ms * len(batch)`
    of sleep (blank images), and logs each forward's start, end, size and height (the
    benchmark's batch key) as a JSON line to `<log_dir>/<pid>.jsonl` (one file per replica)."""

    supports_request_batch = True

    def __init__(self, fixed_ms: float = 200.0, per_request_ms: float = 10.0,
                 log_dir: str | None = None) -> None:
        self.fixed_s = fixed_ms / 1000.0
        self.per_request_s = per_request_ms / 1000.0
        self.log = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.log = open(os.path.join(log_dir, f"{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    @classmethod
    def from_pretrained(cls, model: str | None = None, **kwargs: Any) -> SleepPipeline:
        return cls(**kwargs)

    def info(self) -> PipelineInfo:
        return PipelineInfo(name="sleep", default_height=16, default_width=16,
                            default_num_inference_steps=1, default_guidance_scale=0.0,
                            size_multiple=8)

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        start = time.time()
        time.sleep(self.fixed_s + self.per_request_s * len(batch))
        if self.log is not None and batch.prompts != ["warm-up"]:
            self.log.write(json.dumps({"start": start, "end": time.time(),
                                       "size": len(batch),
                                       "height": batch.requests[0].sampling_params.height})
                           + "\n")
            self.log.flush()
        outputs = []
        for request in batch.requests:
            params = request.sampling_params
            images = torch.zeros(batch.num_outputs_per_prompt, 3, params.height, params.width)
            outputs.append(DiffusionOutput(request.request_id, images=images))
        return outputs


# -- servers --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def ray_cluster(cores: int) -> Iterator[str]:
    """A local Ray cluster with Serve's proxy (diffbatch's middleware); yields its URL."""
    import ray
    from ray import serve

    from diffbatch.entrypoints.ray.proxy import serve_start_options

    # Replicas import `SleepPipeline` from this folder and `diffbatch` from this
    # checkout; both are on the path the cluster's processes inherit.
    paths = [str(REPO_ROOT / "benchmarks"), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    ray.init(address="local", num_cpus=cores, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    try:
        port = _free_port()
        serve.start(**serve_start_options("127.0.0.1", port))
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def applications(base: dict[str, Any], url: str, log_root: str | None) -> Iterator[dict[str, str]]:
    """The three applications of `CONFIGS` with the engine arguments `base`; yields
    their URLs by name."""
    from ray import serve

    from diffbatch.entrypoints.ray.server import build_app

    targets = []
    for name in CONFIGS:
        args = {**base, "ray_router": "diffbatch" if name == "diffbatch" else "random"}
        if log_root is not None:
            args["pipeline_kwargs"] = {**args.get("pipeline_kwargs", {}),
                                       "log_dir": os.path.join(log_root, name)}
        targets.append(serve.RunTarget(build_app(args), name=name, route_prefix=f"/{name}"))
    serve.run_many(targets)
    try:
        urls = {name: f"{url}/{name}" for name in CONFIGS}
        for app_url in urls.values():
            _wait_ready(app_url)
        yield urls
    finally:
        for name in CONFIGS:
            serve.delete(name)


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {READY_TIMEOUT_S} s")


# -- client ---------------------------------------------------------------------------
async def closed_loop(url: str, bodies: list[dict[str, Any]], clients: int, seconds: float,
                      warmup_s: float, seed: int) -> dict[str, Any]:
    """`clients` clients each sending a request as soon as its last one is answered,
    the body drawn from `bodies`; counts the answers of the `seconds` after
    `warmup_s`."""
    rng = random.Random(seed)
    answers: list[tuple[float, float, str, int]] = []  # sent, answered, replica, wave size
    failures = 0
    start = time.time()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.time() < stop_at:
            body = {**rng.choice(bodies), "seed": rng.randrange(2**31)}
            sent = time.time()
            try:
                response = await http.post(ROUTE, json=body)
            except httpx.HTTPError:
                failures += 1
                continue
            if response.status_code != 200:
                failures += 1
                continue
            answers.append((sent, time.time(), response.headers.get("x-diffbatch-replica", "-"),
                            int(response.headers.get("x-diffbatch-batch-size", "1"))))

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    counted = [a for a in answers if measure_from <= a[1] < stop_at]
    waves = sum(1.0 / a[3] for a in counted)
    per_replica: dict[str, int] = {}
    for a in counted:
        per_replica[a[2]] = per_replica.get(a[2], 0) + 1
    return {
        "window": (measure_from, stop_at),
        "answers_per_s": len(counted) / seconds,
        "mean_wave": len(counted) / waves if waves else 0.0,
        "answers": len(counted), "failures": failures, "per_replica": per_replica,
    }


def idle_while_other_works(log_dir: str, window: tuple[float, float]) -> float | None:
    """The largest share of `window` one replica spent outside a forward while the
    other replica was in one (from the forward logs of `SleepPipeline`)."""
    logs = sorted(Path(log_dir).glob("*.jsonl"))
    if len(logs) != 2:
        return None
    lo, hi = window
    busy = [[(r["start"], r["end"]) for r in map(json.loads, p.read_text().splitlines())
             if r["end"] > lo and r["start"] < hi] for p in logs]
    step = 0.001
    idle = [0.0, 0.0]
    t = lo
    while t < hi:
        inside = [any(s <= t < e for s, e in intervals) for intervals in busy]
        for i in (0, 1):
            if not inside[i] and inside[1 - i]:
                idle[i] += step
        t += step
    return max(idle) / (hi - lo)


# -- scenarios ------------------------------------------------------------------------
def run_scenario(name: str, urls: dict[str, str], bodies: list[dict[str, Any]],
                 args: argparse.Namespace, log_root: str | None,
                 configs: tuple[str, ...] = CONFIGS) -> dict[str, Any]:
    """`args.rounds` rounds, the applications taking turns in each."""
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for i in range(args.rounds):
        order = configs if i % 2 == 0 else tuple(reversed(configs))
        for config in order:
            result = asyncio.run(closed_loop(urls[config], bodies, args.clients, args.seconds,
                                             args.warmup_s, seed=1000 * i))
            if log_root is not None:
                result["idle_share"] = idle_while_other_works(
                    os.path.join(log_root, config), result["window"])
            rounds[config].append(result)
            logger.info("%s %s round %d: %.1f answers/s, mean wave %.2f, idle %s, %s",
                        name, config, i, result["answers_per_s"], result["mean_wave"],
                        result.get("idle_share"), result["per_replica"])
    summary: dict[str, Any] = {}
    for config, results in rounds.items():
        summary[config] = {
            "answers_per_s_median": statistics.median(r["answers_per_s"] for r in results),
            "mean_wave_median": statistics.median(r["mean_wave"] for r in results),
            "idle_share_max": max((r["idle_share"] for r in results
                                   if r.get("idle_share") is not None), default=None),
            "failures": sum(r["failures"] for r in results),
        }
    if "random" in summary:
        base = summary["random"]
        for config in configs:
            summary[config]["wave_vs_random"] = (summary[config]["mean_wave_median"]
                                                 / base["mean_wave_median"])
            summary[config]["throughput_vs_random"] = (
                summary[config]["answers_per_s_median"] / base["answers_per_s_median"])
    for results in rounds.values():
        for r in results:
            r.pop("window")
    return {"scenario": name, "bodies": bodies, "rounds": rounds, "summary": summary}


def sleep_scenarios(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    log_root = tempfile.mkdtemp(prefix="ray-routing-")
    base = {
        "pipeline_class": SLEEP_PIPELINE, "served_model_name": "sleep",
        "pipeline_kwargs": {"fixed_ms": args.fixed_ms, "per_request_ms": args.per_request_ms},
        "num_replicas": 2, "executor": "inproc", "max_num_seqs": args.max_num_seqs,
        "request_batch_max_wait_ms": 0, "calibration_budget_s": 0, "warmup": False,
        "num_cpus_per_replica": args.cores / 6,
        "max_ongoing_requests": args.max_ongoing_requests,
    }
    sizes = [8 * (i + 1) for i in range(args.keys)]
    mixed = [{"prompt": "a shape", "size": f"{s}x{s}"} for s in sizes]
    with applications(base, url, log_root) as urls:
        results = [run_scenario("mixed", urls, mixed, args, log_root)]
        results.append(run_scenario("single", urls, mixed[:1], args, log_root,
                                    configs=("diffbatch", "random")))
    return results


def tiny_sd_scenario(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from diffbatch.pipelines.registry import resolve_model_path
    from diffbatch.pipelines.tiny import ensure_tiny_model
    from diffbatch.pipelines.tiny_lora import make_tiny_lora

    ensure_tiny_model("tiny-sd")
    lora_dir = tempfile.mkdtemp(prefix="ray-routing-loras-")
    names = [f"style-{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        make_tiny_lora(resolve_model_path("tiny-sd"), os.path.join(lora_dir, name), seed=i)
    base = {
        "model": "tiny-sd", "num_replicas": 2, "executor": "inproc",
        "max_num_seqs": args.max_num_seqs, "request_batch_max_wait_ms": 0,
        "calibration_budget_s": 0, "torch_num_threads": 1, "lora_dir": lora_dir,
        "num_cpus_per_replica": args.cores / 6,
        "max_ongoing_requests": args.max_ongoing_requests,
    }
    bodies = [{"prompt": "a shape", "size": "64x64", "num_inference_steps": 2, "lora": name}
              for name in names]
    with applications(base, url, None) as urls:
        return run_scenario("tiny-sd", urls, bodies,
                            argparse.Namespace(**{**vars(args), "rounds": args.tiny_sd_rounds}),
                            None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=2, help="the Ray cluster's CPUs")
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-ongoing-requests", type=int, default=None,
                        help="per replica (default: the deployment's, 3 * max_num_seqs)")
    parser.add_argument("--fixed-ms", type=float, default=200.0)
    parser.add_argument("--per-request-ms", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured per round")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured, per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny-sd", action="store_true", help="also run tiny-sd + adapters")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tiny-sd-rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_before = os.getloadavg()
    with ray_cluster(args.cores) as url:
        scenarios = sleep_scenarios(url, args)
        if args.tiny_sd:
            scenarios.append(tiny_sd_scenario(url, args))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO_ROOT, check=False).stdout.strip()
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "args": vars(args), "scenarios": scenarios,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    for scenario in scenarios:
        print(scenario["scenario"], json.dumps(scenario["summary"], indent=1))


if __name__ == "__main__":
    main()
