"""Does the `auto` batch policy hold its bars against fixed settings?

Three questions, each in paired rounds (the servers take turns, the order reversed
every other round) on `diffbatch serve MODEL` servers started one at a time (so
each calibrates on an otherwise idle machine), `tiny-sd` at 64x64, 4 steps:

- **lone**: one request at a time (`--lone-requests` per round). Bar: auto's p50 at
  most `LONE_BAR_MS` above fixed `--max-num-seqs 1 --request-batch-max-wait-ms 0`.
- **burst**: `--burst` requests at once at an idle server. Bar: auto's makespan at
  most `BURST_BAR` x fixed 16:0's.
- **poisson**: Poisson arrivals at half the capacity throughput (auto's images/s
  under a closed loop of 32 clients, measured first). Bars: auto's throughput is the
  arrival rate (at least `RATE_BAR` of it), and its p50 at most `POISSON_BAR` x the
  best of fixed 1:0, 8:0 and 16:10.

- **busy_start**: a CPU-bound co-tenant (`harness.CoTenant`, a busy loop per CPU)
  runs while an auto server starts and calibrates, and stops `--tenant-after-s` (10)
  after `/health` says ready; then `--clients` (16) closed-loop clients send requests
  for `--load-s` (30). The same runs on a server started without the co-tenant
  ("quiet start") and its twin, in the same rounds. Bars: in the last `--tail-s` (15)
  the busy start's mean wave (`/v1/waves`) is at least `BUSY_START_BAR` x the quiet
  start's, and so is its throughput; its capacity (`/metrics`, sampled each second)
  grows after the co-tenant stops, or already stands at the quiet start's.
- **step_co_tenant**: a step-mode auto server (`--step-execution`) under Poisson
  arrivals at `--step-rate` (8/s) of mixed 4/8/16/32-step requests, once beside the
  co-tenant (running for the whole measurement) and once without, on the same server,
  and without on a twin server, in the same rounds. Bar: throughput beside the
  co-tenant at least `STEP_CO_TENANT_BAR` x without (the busy loops take about half of
  each CPU).

Each bar has a noise floor: a "twin", a second server of the fixed setting it is
judged against (for poisson: the best one in a first, unmeasured round), measured in
the same rounds. A miss by no more than the twin's distance from its original counts
as met. Figures are medians over `--rounds` of per-round values. `--step-execution`
serves the auto server in step mode (the fixed servers stay in request mode).
`--co-tenant` runs the lone, burst and poisson bars beside the busy-loop co-tenant.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/policy_bars.py \\
        --out benchmarks/results/policy_bars.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import threading
import time
from typing import Any

import httpx
from peers_servers import harness
from step_vs_request import poisson_run

from diffbatch.bench.serve import BenchConfig, run_benchmark

LONE_BAR_MS = 3.0
BURST_BAR = 1.15
POISSON_BAR = 1.25
RATE_BAR = 0.95
FIXED = {"1:0": (1, 0.0), "8:0": (8, 0.0), "16:0": (16, 0.0), "16:10": (16, 10.0)}


def spec(name: str, args: argparse.Namespace) -> harness.ServerSpec:
    """The auto server (no tuning flag), or a fixed `max_num_seqs:wait_ms` one."""
    if name == "auto":
        flags = ["--step-execution"] if args.step_execution else []
        return harness.diffbatch_defaults_spec(args.model, name="auto", log_level="warning",
                                               extra_args=flags)
    seqs, wait = FIXED[name.removesuffix("-twin")]
    return harness.diffbatch_spec(args.model, threads=None, max_num_seqs=seqs, wait_ms=wait,
                                  name=name)


def load(server: harness.Server, args: argparse.Namespace, seed: int, **kwargs: Any) -> dict:
    config = BenchConfig(base_url=server.base_url, width=args.size, height=args.size,
                         steps=args.steps, seed=seed, disable_tqdm=True, **kwargs)
    report = run_benchmark(config)
    if report["failed"]:
        raise RuntimeError(f"{server.spec.name}: {report['failed']} failed: {report['errors']}")
    return report


def rounds(servers: dict[str, harness.Server], names: list[str], args: argparse.Namespace,
           measure: Any) -> dict[str, list[float]]:
    """`measure(server, seed)` for each server per round, the order reversed every
    other round; name -> per-round values."""
    values: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.rounds):
        for name in names if rep % 2 == 0 else names[::-1]:
            values[name].append(measure(servers[name], rep))
        print(f"  round {rep}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in values.items()),
              flush=True)
    return values


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def median_diff(a: list[float], b: list[float]) -> float:
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


def lone_and_burst(args: argparse.Namespace) -> dict[str, Any]:
    names = ["auto", "1:0", "1:0-twin", "16:0", "16:0-twin"]
    with harness.running([spec(n, args) for n in names], one_at_a_time=True) as servers:
        for name in names:  # warm-up, not measured
            load(servers[name], args, 99, num_prompts=args.warmup_requests, max_concurrency=1)
        print("lone: p50 ms per round", flush=True)
        lone = rounds(servers, ["auto", "1:0", "1:0-twin"], args, lambda s, seed: load(
            s, args, seed, num_prompts=args.lone_requests, max_concurrency=1)["p50_e2e_ms"])
        print("burst: makespan ms per round", flush=True)
        burst = rounds(servers, ["auto", "16:0", "16:0-twin"], args, lambda s, seed: 1000.0 * load(
            s, args, seed, num_prompts=args.burst)["duration_s"])
    above = median_diff(lone["auto"], lone["1:0"])
    twin_above = abs(median_diff(lone["1:0-twin"], lone["1:0"]))
    ratio = median_ratio(burst["auto"], burst["16:0"])
    twin = abs(median_ratio(burst["16:0-twin"], burst["16:0"]) - 1.0)
    return {
        "lone": {"p50_ms_rounds": lone, "auto_minus_fixed_ms": above,
                 "twin_spread_ms": twin_above, "bar_ms": LONE_BAR_MS,
                 "met": above <= LONE_BAR_MS + twin_above},
        "burst": {"makespan_ms_rounds": burst, "auto_over_fixed": ratio,
                  "twin_spread": twin, "bar": BURST_BAR, "met": ratio <= BURST_BAR + twin},
    }


def poisson(args: argparse.Namespace) -> dict[str, Any]:
    fixed = ["1:0", "8:0", "16:10"]
    with harness.running([spec(n, args) for n in ["auto", *fixed]],
                         one_at_a_time=True) as servers:
        capacity = load(servers["auto"], args, 98, num_prompts=args.capacity_requests,
                        max_concurrency=32)["request_throughput"]
        rate = 0.5 * capacity
        num = max(args.min_poisson_requests, int(rate * args.poisson_s))
        print(f"poisson: capacity {capacity:.1f} requests/s -> {rate:.1f}/s, {num} per round",
              flush=True)

        def run(server: harness.Server, seed: int) -> dict[str, Any]:
            return load(server, args, seed, num_prompts=num, request_rate=rate)

        first = {name: run(servers[name], 97)["p50_e2e_ms"] for name in fixed}
        best = min(first, key=first.__getitem__)
        with harness.running([spec(f"{best}-twin", args)]) as twins:
            servers = {**servers, **twins}
            names = ["auto", *fixed, f"{best}-twin"]
            reports: dict[str, list[dict[str, Any]]] = {n: [] for n in names}

            def measure(server: harness.Server, seed: int) -> float:
                report = run(server, seed)
                reports[server.spec.name].append(report)
                return report["p50_e2e_ms"]

            print(f"poisson: p50 ms per round (twin of {best})", flush=True)
            p50 = rounds(servers, names, args, measure)
    best_p50 = [min(p50[n][i] for n in fixed) for i in range(args.rounds)]
    ratio = median_ratio(p50["auto"], best_p50)
    twin = abs(median_ratio(p50[f"{best}-twin"], p50[best]) - 1.0)
    throughput = {n: [r["request_throughput"] for r in reports[n]] for n in names}
    served = statistics.median(throughput["auto"]) / rate
    return {"capacity_requests_per_s": capacity, "rate_per_s": rate, "requests": num,
            "best_fixed_first_round": best, "p50_ms_rounds": p50,
            "throughput_rounds": throughput, "auto_throughput_over_rate": served,
            "auto_over_best_fixed_p50": ratio, "twin_spread": twin, "bar": POISSON_BAR,
            "met": ratio <= POISSON_BAR + twin and served >= RATE_BAR}


BUSY_START_BAR = 0.8


def capacity_now(client: httpx.Client, server: harness.Server) -> float | None:
    """The largest `diffbatch_capacity_requests` the server reports now."""
    try:
        text = client.get(server.base_url + "/metrics").text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("diffbatch_capacity_requests{")]
    return max(values) if values else None


async def closed_loop(base_url: str, args: argparse.Namespace, seed: int) -> list[float]:
    """`--clients` clients, each sending its next request when its last one returns,
    for `--load-s`; the monotonic end time of every request answered."""
    deadline = time.monotonic() + args.load_s
    done: list[float] = []
    body = {"prompt": "", "size": f"{args.size}x{args.size}",
            "num_inference_steps": args.steps}
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, trust_env=False) as client:
        async def one(client_id: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                json = {**body, "prompt": f"a busy start {seed} {client_id} {n}",
                        "seed": seed * 100_000 + client_id * 1000 + n}
                response = await client.post("/v1/images/generations", json=json)
                if response.status_code != 200:
                    raise RuntimeError(f"request failed: {response.status_code} "
                                       f"{response.text[:300]}")
                done.append(time.monotonic())
                n += 1
        await asyncio.gather(*(one(i) for i in range(args.clients)))
    return done


def busy_start_run(args: argparse.Namespace, name: str, busy: bool, seed: int) -> dict:
    """Start an auto server (beside the co-tenant when `busy`), then the closed loop."""
    spec = harness.diffbatch_defaults_spec(args.model, name=name, log_level="warning")
    capacity: list[tuple[float, float]] = []  # (s since ready, capacity)
    with contextlib.ExitStack() as stack:
        tenant = stack.enter_context(harness.CoTenant()) if busy else None
        servers = stack.enter_context(harness.running([spec]))
        server = servers[name]
        ready = time.monotonic()
        stop_sampling = threading.Event()

        def sample() -> None:
            with httpx.Client(timeout=5.0, trust_env=False) as client:
                while not stop_sampling.wait(1.0 if capacity else 0.0):
                    value = capacity_now(client, server)
                    if value is not None:
                        capacity.append((time.monotonic() - ready, value))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        tenant_stopped_at = None
        if tenant is not None:
            time.sleep(max(0.0, ready + args.tenant_after_s - time.monotonic()))
            tenant.stop()
            tenant_stopped_at = time.monotonic() - ready
        load_start = time.monotonic()
        done = asyncio.run(closed_loop(server.base_url, args, seed))
        load_end = time.monotonic()
        stop_sampling.set()
        sampler.join()
        waves = httpx.get(server.base_url + "/v1/waves", timeout=10.0,
                          trust_env=False).json()["data"]
    tail_from = time.time() - (time.monotonic() - load_end) - args.tail_s
    tail = [w["num_requests"] for w in waves if w["finished_at"] >= tail_from]
    at_start = [c for t, c in capacity if t <= load_start - ready]
    return {
        "images_per_s": len([t for t in done if t <= load_end]) / (load_end - load_start),
        "tail_mean_wave": statistics.mean(tail) if tail else 0.0,
        "capacity_at_load_start": at_start[-1] if at_start else None,
        "capacity_at_end": capacity[-1][1] if capacity else None,
        "capacity_log": capacity,
        "tenant_stopped_s_after_ready": tenant_stopped_at,
    }


def busy_start(args: argparse.Namespace) -> dict[str, Any]:
    """The busy-start scenario (module docstring), in paired rounds."""
    names = ["busy", "quiet", "quiet-twin"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.rounds):
        for name in names if rep % 2 == 0 else names[::-1]:
            runs[name].append(busy_start_run(args, name, name == "busy", rep))
        print(f"  round {rep}: " + ", ".join(
            f"{n} {r[-1]['images_per_s']:.1f} img/s, tail wave {r[-1]['tail_mean_wave']:.1f}, "
            f"capacity {r[-1]['capacity_at_load_start']} -> {r[-1]['capacity_at_end']}"
            for n, r in runs.items()), flush=True)

    def per_round(field: str) -> dict[str, list[float]]:
        return {n: [r[field] for r in runs[n]] for n in names}

    wave, throughput = per_round("tail_mean_wave"), per_round("images_per_s")
    wave_ratio = median_ratio(wave["busy"], wave["quiet"])
    wave_twin = abs(median_ratio(wave["quiet-twin"], wave["quiet"]) - 1.0)
    rate_ratio = median_ratio(throughput["busy"], throughput["quiet"])
    rate_twin = abs(median_ratio(throughput["quiet-twin"], throughput["quiet"]) - 1.0)
    grew = [
        (busy["capacity_at_end"] or 0) > (busy["capacity_at_load_start"] or 0)
        or (busy["capacity_at_load_start"] or 0) >= (quiet["capacity_at_end"] or 0)
        for busy, quiet in zip(runs["busy"], runs["quiet"], strict=True)]
    return {
        "runs": runs, "tail_mean_wave_rounds": wave, "images_per_s_rounds": throughput,
        "tail_wave_busy_over_quiet": wave_ratio, "tail_wave_twin_spread": wave_twin,
        "throughput_busy_over_quiet": rate_ratio, "throughput_twin_spread": rate_twin,
        "capacity_grew_or_stood_at_quiet": grew, "bar": BUSY_START_BAR,
        "met": (wave_ratio >= BUSY_START_BAR - wave_twin
                and rate_ratio >= BUSY_START_BAR - rate_twin and all(grew)),
    }


STEP_CO_TENANT_BAR = 0.4


def step_co_tenant(args: argparse.Namespace) -> dict[str, Any]:
    """Step mode beside the co-tenant against step mode without (module docstring)."""
    flags = ["--step-execution", "--log-level", "warning"]
    specs = [harness.diffbatch_defaults_spec(args.model, name=name, extra_args=flags)
             for name in ("step", "step-twin")]
    load_args = argparse.Namespace(size=args.size, num_requests=args.step_requests,
                                   cancel_after_s=0.0)
    names = ["co-tenant", "quiet", "quiet-twin"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with harness.running(specs, one_at_a_time=True) as servers:
        for rep in range(args.rounds):
            for name in names if rep % 2 == 0 else names[::-1]:
                server = servers["step-twin" if name == "quiet-twin" else "step"]
                with contextlib.ExitStack() as stack:
                    if name == "co-tenant":
                        stack.enter_context(harness.CoTenant())
                    result = asyncio.run(poisson_run(
                        server.base_url, load_args, rate=args.step_rate,
                        workload="parity-mix", seed=rep))
                if result["num_errors"]:
                    raise RuntimeError(f"{name}: {result['num_errors']} failed: "
                                       f"{result['errors']}")
                runs[name].append(result)
            print(f"  round {rep}: " + ", ".join(
                f"{n} {r[-1]['completed_per_s']:.2f} req/s, mean {r[-1]['mean_ms']:.0f} ms"
                for n, r in runs.items()), flush=True)
    throughput = {n: [r["completed_per_s"] for r in runs[n]] for n in names}
    ratio = median_ratio(throughput["co-tenant"], throughput["quiet"])
    twin = abs(median_ratio(throughput["quiet-twin"], throughput["quiet"]) - 1.0)
    return {"runs": runs, "requests_per_s_rounds": throughput, "rate_per_s": args.step_rate,
            "co_tenant_over_quiet": ratio, "twin_spread": twin, "bar": STEP_CO_TENANT_BAR,
            "met": ratio >= STEP_CO_TENANT_BAR - twin}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lone-requests", type=int, default=20)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--capacity-requests", type=int, default=128)
    parser.add_argument("--poisson-s", type=float, default=8.0,
                        help="seconds of arrivals per server and round")
    parser.add_argument("--min-poisson-requests", type=int, default=16,
                        help="fewest Poisson requests per server and round")
    parser.add_argument("--warmup-requests", type=int, default=8,
                        help="sequential requests per server before the lone and burst rounds")
    parser.add_argument("--bars", nargs="+",
                        default=["lone", "poisson", "busy_start", "step_co_tenant"],
                        choices=["lone", "poisson", "busy_start", "step_co_tenant"],
                        help="lone: lone and burst")
    parser.add_argument("--clients", type=int, default=16, help="busy_start: closed loop")
    parser.add_argument("--load-s", type=float, default=30.0,
                        help="busy_start: seconds of closed-loop load per run")
    parser.add_argument("--tail-s", type=float, default=15.0,
                        help="busy_start: the last seconds whose waves are judged")
    parser.add_argument("--tenant-after-s", type=float, default=10.0,
                        help="busy_start: the co-tenant stops this long after ready")
    parser.add_argument("--step-rate", type=float, default=8.0,
                        help="step_co_tenant: Poisson arrivals per second")
    parser.add_argument("--step-requests", type=int, default=80,
                        help="step_co_tenant: requests per run")
    parser.add_argument("--step-execution", action="store_true",
                        help="serve the auto server with --step-execution (the fixed ones "
                             "stay in request mode)")
    parser.add_argument("--out", default="benchmarks/results/policy_bars.json")
    parser.add_argument("--co-tenant", action="store_true",
                        help="run the lone, burst and poisson bars beside a busy-loop "
                             "co-tenant per CPU, start-ups included")
    args = parser.parse_args()
    report = harness.report_header("policy_bars", args)
    with contextlib.ExitStack() as stack:
        if args.co_tenant:
            stack.enter_context(harness.CoTenant())
        if "lone" in args.bars:
            report.update(lone_and_burst(args))
        if "poisson" in args.bars:
            report["poisson"] = poisson(args)
    if "busy_start" in args.bars:
        report["busy_start"] = busy_start(args)
    if "step_co_tenant" in args.bars:
        report["step_co_tenant"] = step_co_tenant(args)
    for bar in ("lone", "burst", "poisson", "busy_start", "step_co_tenant"):
        if bar in report:
            print(f"{bar}: {'PASS' if report[bar]['met'] else 'MISS'}", flush=True)
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
