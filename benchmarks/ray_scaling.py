"""What does Ray Serve cost per request, and what do two replicas give on this machine?

Three servers of the same model, all up at once and driven over HTTP by the same
client, taking turns so that each measurement sees the same machine load:

  plain   `python -m diffbatch serve` (uvicorn, one engine);
  ray-1   diffbatch on Ray Serve, 1 replica (application `/one`);
  ray-2   diffbatch on Ray Serve, 2 replicas (application `/two`).

Every engine runs with `--executor` (default "mp", the server's default), the same
`--max-num-seqs`, and `--torch-threads` torch threads (default 1; see below). Two
measurements:

  overhead    sequential requests of a tiny workload, alternating plain and ray-1:
              the median latency of each; ray-1 minus plain is what the proxy hop
              and Ray's routing add per request;
  throughput  `--num-requests` requests at `--concurrency` of a heavier workload:
              images/s over the run; rounds alternate the three servers, and the
              median round of each is reported.

NOTE: one torch thread per engine is the default because these machines are shared
and oversubscribed: there, torch with 2 threads was 5-25x slower than with 1 (its
OpenMP threads spin-wait for a core), which would swamp everything measured here.
So ray-2 (two single-threaded engines) can use both cores where plain and ray-1 use
one; on an idle machine, give one engine all cores instead (`--torch-threads 2`).

    .venv/bin/python benchmarks/ray_scaling.py --out benchmarks/results/ray_scaling.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
from peers_servers import harness

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
ROUTE = "/v1/images/generations"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {READY_TIMEOUT_S} s")


# -- servers --------------------------------------------------------------------------
@contextlib.contextmanager
def plain_server(args: argparse.Namespace) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m diffbatch serve` in a subprocess; yields its URL and process at once
    (`_wait_ready` before using it)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.torch_threads)}  # the worker's torch
    cmd = [sys.executable, "-m", "diffbatch", "serve", args.model, "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--request-batch-max-wait-ms",
           str(args.wait_ms), "--executor", args.executor, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=harness.die_with_this_process())
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextlib.contextmanager
def ray_servers(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """A local Ray cluster with diffbatch at `/one` (1 replica) and `/two` (2 replicas)."""
    import ray
    from ray import serve

    from diffbatch.entrypoints.ray.proxy import serve_start_options
    from diffbatch.entrypoints.ray.server import build_app

    ray.init(address="local", num_cpus=args.cores, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    try:
        port = _free_port()
        serve.start(**serve_start_options("127.0.0.1", port))
        # Both applications deploy at once (their three replicas load side by side).
        serve.run_many([
            serve.RunTarget(build_app({
                "model": args.model, "num_replicas": num_replicas,
                "max_num_seqs": args.max_num_seqs, "request_batch_max_wait_ms": args.wait_ms,
                "executor": args.executor, "torch_num_threads": args.torch_threads,
                # Logical reservation: three replicas must fit `--cores` CPUs.
                "num_cpus_per_replica": args.cores / 3,
            }), name=name, route_prefix=f"/{name}")
            for name, num_replicas in (("one", 1), ("two", 2))
        ])
        url = f"http://127.0.0.1:{port}"
        _wait_ready(f"{url}/one")
        _wait_ready(f"{url}/two")
        yield f"{url}/one", f"{url}/two"
    finally:
        serve.shutdown()
        ray.shutdown()


# -- client ---------------------------------------------------------------------------
def _body(size: int, steps: int, seed: int) -> dict[str, Any]:
    return {"prompt": f"a red circle number {seed}", "size": f"{size}x{size}", "seed": seed,
            "num_inference_steps": steps, "response_format": "b64_json"}


def latencies_ms(urls: list[str], args: argparse.Namespace) -> list[list[float]]:
    """Sequential requests of the overhead workload, taking turns between `urls`."""
    out: list[list[float]] = [[] for _ in urls]
    with httpx.Client(timeout=120) as client:
        for i in range(args.warmup + args.num_sequential):
            for j, url in enumerate(urls):
                body = _body(args.overhead_size, args.overhead_steps, i)
                start = time.perf_counter()
                client.post(f"{url}{ROUTE}", json=body).raise_for_status()
                if i >= args.warmup:
                    out[j].append((time.perf_counter() - start) * 1000.0)
    return out


async def _throughput(url: str, args: argparse.Namespace) -> tuple[float, dict[str, int]]:
    semaphore = asyncio.Semaphore(args.concurrency)
    replicas: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, seed: int) -> None:
        async with semaphore:
            response = await client.post(ROUTE, json=_body(args.size, args.steps, seed))
            response.raise_for_status()
            replica = response.headers.get("x-diffbatch-replica", "-")
            replicas[replica] = replicas.get(replica, 0) + 1

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(args.concurrency)))  # warm-up
        replicas.clear()
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(args.num_requests)))
        elapsed = time.perf_counter() - start
    return args.num_requests / elapsed, replicas


def _measure(plain_url: str, one_url: str, two_url: str, args: argparse.Namespace
             ) -> tuple[dict[str, list[tuple[float, dict[str, int]]]], list[float], list[float]]:
    """Latencies of plain and ray-1 in turns, then throughput rounds of all three."""
    urls = {"plain": plain_url, "ray-1": one_url, "ray-2": two_url}
    plain_lat, ray_lat = latencies_ms([plain_url, one_url], args)
    rounds: dict[str, list[tuple[float, dict[str, int]]]] = {name: [] for name in urls}
    for _ in range(args.rounds):
        for name, url in urls.items():
            rounds[name].append(asyncio.run(_throughput(url, args)))
            logger.info("%s: %.2f images/s", name, rounds[name][-1][0])
    return rounds, plain_lat, ray_lat


def run(args: argparse.Namespace) -> dict[str, Any]:
    from diffbatch.pipelines.tiny import ensure_tiny_model

    if args.model.startswith("tiny-"):
        ensure_tiny_model(args.model)  # build once, before any server starts
    load_before = os.getloadavg()
    # The plain server is up (its port bound) before Ray starts: Ray's processes open
    # many sockets, and one of them could take the port picked for the plain server
    # while it still loads (seen: "address already in use", the server gone).
    with plain_server(args) as (plain_url, plain_proc):
        _wait_ready(plain_url, plain_proc)
        with ray_servers(args) as (one_url, two_url):
            rounds, plain_lat, ray_lat = _measure(plain_url, one_url, two_url, args)
    latencies = {"plain": plain_lat, "ray-1": ray_lat, "ray-2": None}
    results = []
    for name, server_rounds in rounds.items():
        lat = latencies[name]
        results.append({
            "server": name,
            "latency_ms_median": statistics.median(lat) if lat else None,
            "latency_ms_p90": statistics.quantiles(lat, n=10)[-1] if lat else None,
            "images_per_s_median": statistics.median(r[0] for r in server_rounds),
            "images_per_s_rounds": [r[0] for r in server_rounds],
            "requests_per_replica_last_round": server_rounds[-1][1],
        })
    by_name = {r["server"]: r for r in results}
    summary = {
        "ray_overhead_ms_per_request": (by_name["ray-1"]["latency_ms_median"]
                                        - by_name["plain"]["latency_ms_median"]),
        "ray1_over_plain_throughput": (by_name["ray-1"]["images_per_s_median"]
                                       / by_name["plain"]["images_per_s_median"]),
        "ray2_over_ray1_throughput": (by_name["ray-2"]["images_per_s_median"]
                                      / by_name["ray-1"]["images_per_s_median"]),
    }
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "args": vars(args),
        "results": results,
        "summary": summary,
    }


def markdown(report: dict[str, Any]) -> str:
    """The results as the table docs/scaling.md shows."""
    args, s = report["args"], report["summary"]
    lines = [
        f"| server | latency, {args['overhead_size']}px {args['overhead_steps']} steps, "
        f"median (p90) | throughput, {args['size']}px {args['steps']} steps, "
        f"{args['concurrency']} concurrent | requests per replica |",
        "|---|---|---|---|",
    ]
    for r in report["results"]:
        spread = ", ".join(str(n) for n in sorted(r["requests_per_replica_last_round"].values()))
        latency = ("-" if r["latency_ms_median"] is None else
                   f"{r['latency_ms_median']:.0f} ms ({r['latency_ms_p90']:.0f} ms)")
        lines.append(
            f"| {r['server']} | {latency} | {r['images_per_s_median']:.2f} images/s | {spread} |"
        )
    lines += [
        "",
        f"Ray overhead per request: {s['ray_overhead_ms_per_request']:+.0f} ms (median); "
        f"ray-1 / plain throughput: {s['ray1_over_plain_throughput']:.2f}; "
        f"ray-2 / ray-1 throughput: {s['ray2_over_ray1_throughput']:.2f}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2,
                        help="the Ray cluster's CPUs")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of every engine (see the NOTE above)")
    parser.add_argument("--executor", choices=("mp", "inproc"), default="mp",
                        help="every engine's executor: mp (the default) runs the model in a "
                             "worker process; inproc in the server's or replica's own "
                             "process, one process less per engine (a quick check that the "
                             "script runs)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=10.0)
    parser.add_argument("--overhead-size", type=int, default=64)
    parser.add_argument("--overhead-steps", type=int, default=2)
    parser.add_argument("--num-sequential", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(args)
    report["markdown"] = markdown(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(report["markdown"])


if __name__ == "__main__":
    main()
