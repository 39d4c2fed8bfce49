"""Step mode against request mode: the same server, the same loads, one run.

Two `diffbatch serve MODEL` servers, started one after the other and measured one at a
time (rounds alternate which goes first): request mode, and step mode
(`--step-execution`), each with its batching flags (`--max-num-seqs`, by default
auto, and the admission wait of request mode, by default auto). Per workload:

  (a) uniform: every request `--steps` steps;
  (b) mixed: steps drawn from 4/8/16/30;
  (c) cancel: steps drawn from 16/32/64/120 (the mix, 4x longer), and 30% of the
      clients hang up after `--cancel-after-s` (1 s) if their answer has not come
      (the server sees a disconnect); a request answered sooner counts as completed.
      The longer mix puts the hang-ups where a real model's requests are after 1 s:
      still running (with the plain mix at 64x64 nearly every request is answered
      within the second, and no client hangs up at all).

First the request-mode capacity of each workload's steps is measured (closed loop
of `--saturation-concurrency` clients: requests/s; (c) without hang-ups). Then each
workload runs Poisson arrivals at 0.5, 0.8 and 0.95 of its own capacity (`--loads`,
`--cancel-loads`), `--num-requests` each (`--cancel-requests` for (c)), on both
servers, in alternating order. `--workloads` picks a subset. Reported per run:
completed requests/s (over the span from the first send to the last answer),
mean/p50/p99 latency of the completed requests, server CPU seconds per completed
image (every process of the server's session: the worker included).

Bars (ratios step/request within one round, median over `--repeats` rounds):
  - mixed @ 0.8: mean latency <= 0.7x, throughput >= 1.0x;
  - uniform @ 0.95: throughput >= 0.95x;
  - cancel, at each load: completed requests/s >= 1.2x;
  - per-tick overhead outside the fused denoiser call <= 3% of the tick, measured
    in process on `--overhead-batch` requests (`StepRunner`, ticks without joins or
    leaves; median tick).

Where both modes keep up with the arrivals, completed/s is the arrival rate times the
share of clients answered before they hang up: step mode can only gain the hang-ups
it answers in time, and a request longer than the deadline is lost in both modes. The
compute a cancelled request no longer burns shows where request mode falls behind
its arrivals (the higher loads).

    .venv/bin/python benchmarks/step_vs_request.py --out benchmarks/results/step_vs_request.json

`--parity` runs the parity check instead, on three servers: request mode, a twin of
it (the same flags: its spread against the first is the noise floor) and step mode.
Per round, in an order that rotates: (1) saturated throughput, a closed loop of
`--parity-clients` (16) clients sending identical `--steps`-step requests
(`--steps 0`: the model's default), `--parity-requests` of them on each server;
(2) mixed step counts (4/8/16/32) under Poisson arrivals at 0.8x request mode's
capacity of that mix (measured in the round), mean latency on each server. Ratios
against request mode, median over `--repeats` rounds. Bars: step/request throughput
>= 0.9x (>= 0.95x at default steps), mean latency <= 0.5x; a miss inside the twin's
spread is noise. `--parity-parts` runs only (1) (`saturated`) or (2) (`mixed`).

    .venv/bin/python benchmarks/step_vs_request.py --parity --steps 4 --repeats 5 \
        --out benchmarks/results/step_parity.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import zlib
from typing import Any

import httpx
from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

MIX = (4, 8, 16, 30)
PARITY_MIX = (4, 8, 16, 32)
CANCEL_MIX = tuple(4 * steps for steps in MIX)
LOADS = (0.5, 0.8, 0.95)
WORKLOADS = ("uniform", "mixed", "cancel")
CANCEL_SHARE = 0.3
STARTUP_TIMEOUT_S = 600.0
BARS = {
    "mixed@0.8 mean latency": 0.7,
    "mixed@0.8 throughput": 1.0,
    "uniform@0.95 throughput": 0.95,
    "cancel completed/s": 1.2,  # at each cancel load
    "tick overhead": 0.03,
}


def server_specs(args: argparse.Namespace) -> list[harness.ServerSpec]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
             "--max-request-work", "0"]
    request = harness.diffbatch_defaults_spec(
        args.model, name="request", extra_args=[*flags, "--request-batch-max-wait-ms",
                                                str(args.wait_ms)])
    step = harness.diffbatch_defaults_spec(
        args.model, name="step", extra_args=[*flags, "--step-execution"])
    return [request, step]


def capacity(server: harness.Server, args: argparse.Namespace, steps: int | None,
             seed: int, workload: str = "mixed", num: int | None = None) -> float:
    """Requests/s of request mode under a closed loop (uniform `steps`, or the steps
    of `workload`: "mixed" or "long", the cancel workload's without hang-ups)."""
    if steps is not None:
        report = run_benchmark(BenchConfig(
            base_url=server.base_url, num_prompts=args.capacity_requests,
            max_concurrency=args.saturation_concurrency, width=args.size, height=args.size,
            steps=steps, seed=seed, disable_tqdm=True))
        return float(report["request_throughput"])
    result = asyncio.run(poisson_run(server.base_url, args, rate=float("inf"),
                                     workload=workload, seed=seed,
                                     concurrency=args.saturation_concurrency,
                                     num=num or args.capacity_requests))
    return result["completed_per_s"]


def steps_of(workload: str, rng: random.Random, args: argparse.Namespace) -> int:
    if workload == "uniform":
        return args.steps
    if workload == "parity-mix":
        return rng.choice(PARITY_MIX)
    return rng.choice(CANCEL_MIX if workload in ("cancel", "long") else MIX)


async def poisson_run(base_url: str, args: argparse.Namespace, *, rate: float, workload: str,
                      seed: int, concurrency: int | None = None,
                      num: int | None = None) -> dict[str, Any]:
    """Send `num` requests with Poisson gaps at `rate` (inf: at once, limited to
    `concurrency` in flight); cancel-workload clients hang up after the deadline."""
    rng = random.Random(seed)
    num = num or args.num_requests
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    plans = [(steps_of(workload, rng, args),
              workload == "cancel" and rng.random() < CANCEL_SHARE) for _ in range(num)]
    limit = asyncio.Semaphore(concurrency or num)
    latencies: list[float] = []
    errors: list[str] = []
    cancelled = 0
    first_send = time.perf_counter()
    last_answer = first_send

    async def one(client: httpx.AsyncClient, index: int) -> None:
        nonlocal cancelled, last_answer
        await asyncio.sleep(max(0.0, first_send + offsets[index] - time.perf_counter()))
        steps, hang_up = plans[index]
        body = {"prompt": f"a test shape number {index}", "size": f"{args.size}x{args.size}",
                "num_inference_steps": steps, "seed": seed * 100_003 + index,
                "response_format": "b64_json"}
        async with limit:
            start = time.perf_counter()
            try:
                request = client.post("/v1/images/generations", json=body)
                if hang_up:
                    response = await asyncio.wait_for(request, args.cancel_after_s)
                else:
                    response = await request
            except TimeoutError:
                cancelled += 1
                return
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            now = time.perf_counter()
            if response.status_code != 200:
                errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            latencies.append(now - start)
            last_answer = max(last_answer, now)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits,
                                 trust_env=False) as client:
        await asyncio.gather(*(one(client, i) for i in range(num)))
    span = max(last_answer - first_send, 1e-9)
    ordered = sorted(latencies)
    return {
        "completed": len(latencies), "cancelled": cancelled, "errors": errors[:5],
        "num_errors": len(errors), "span_s": span,
        "completed_per_s": len(latencies) / span,
        "mean_ms": 1000 * statistics.fmean(ordered) if ordered else None,
        "p50_ms": 1000 * ordered[len(ordered) // 2] if ordered else None,
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered else None,
    }


def measure(server: harness.Server, args: argparse.Namespace, *, rate: float, workload: str,
            seed: int, num: int | None = None) -> dict[str, Any]:
    cpu = server.cpu_seconds()
    result = asyncio.run(poisson_run(server.base_url, args, rate=rate, workload=workload,
                                     seed=seed, num=num))
    cpu = server.cpu_seconds() - cpu
    result["cpu_s_per_image"] = cpu / result["completed"] if result["completed"] else None
    return result


def tick_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """In process: the share of a tick spent outside the fused denoiser call."""
    from diffbatch.config import EngineConfig
    from diffbatch.ipc.messages import StepJoin
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
    from diffbatch.sched.output import SchedulerOutput
    from diffbatch.worker.model_runner import ModelRunner
    from diffbatch.worker.step_runner import StepRunner

    runner = ModelRunner(EngineConfig(model=args.model))
    info = runner.info()
    steps = StepRunner(runner)

    def batch(count: int, steps_each: int) -> list[DiffusionRequest]:
        made = []
        for i in range(count):
            params = SamplingParams(height=args.size, width=args.size,
                                    num_inference_steps=steps_each,
                                    guidance_scale=info.default_guidance_scale, seed=i,
                                    output_type="pt")
            request = DiffusionRequest(f"r{steps_each}-{i}", f"prompt {i}", params)
            request.key = SamplingParamsKey.from_params(
                params, cfg_enabled=info.cfg_enabled(params)).for_step_execution()
            made.append(request)
        return made

    # A warm-up batch first (as a server's warm-up request): the first ticks of a
    # fresh process pay one-time allocations on both sides of the measurement.
    for requests, first_id in ((batch(args.overhead_batch, 8), 0),
                               (batch(args.overhead_batch, 60), 1000)):
        ids = list(range(first_id, first_id + len(requests)))
        steps.join(StepJoin(SchedulerOutput(1, requests, requests[0].key), ids,
                            len(requests)))
        steps.take_ticks()
        while not steps.idle:
            steps.tick()
    ticks = [t for t in steps.take_ticks() if t.joins == 0 and t.leaves == 0]
    share = statistics.median(1.0 - t.forward_ms / t.step_ms for t in ticks)
    return {"batch": len(requests), "ticks": len(ticks),
            "median_tick_ms": statistics.median(t.step_ms for t in ticks),
            "median_forward_ms": statistics.median(t.forward_ms for t in ticks),
            "overhead_share": share}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_round(servers: dict[str, harness.Server], args: argparse.Namespace,
              round_index: int) -> dict[str, Any]:
    seed = 1000 * round_index
    measure_capacity = {
        "uniform": lambda: capacity(servers["request"], args, args.steps, seed),
        "mixed": lambda: capacity(servers["request"], args, None, seed + 1),
        "cancel": lambda: capacity(servers["request"], args, None, seed + 2, workload="long",
                                   num=args.cancel_requests),
    }
    caps = {workload: measure_capacity[workload]() for workload in args.workloads}
    print(f"round {round_index}: request-mode capacity " + ", ".join(
        f"{workload} {rate:.2f} req/s" for workload, rate in caps.items()), flush=True)
    order = ["request", "step"] if round_index % 2 == 0 else ["step", "request"]
    rows = {}
    for workload in args.workloads:
        cancel = workload == "cancel"
        for load in args.cancel_loads if cancel else args.loads:
            name = f"{workload}@{load:g}"
            runs = {mode: measure(servers[mode], args, rate=load * caps[workload],
                                  workload=workload, seed=seed + zlib.crc32(name.encode()) % 997,
                                  num=args.cancel_requests if cancel else None)
                    for mode in order}
            runs["ratio"] = {
                "throughput": ratio(runs["step"]["completed_per_s"],
                                    runs["request"]["completed_per_s"]),
                "mean_latency": ratio(runs["step"]["mean_ms"], runs["request"]["mean_ms"]),
                "p99_latency": ratio(runs["step"]["p99_ms"], runs["request"]["p99_ms"]),
            }
            rows[name] = runs
            print(f"  {name:14s} " + "  ".join(
                f"{m}: {runs[m]['completed_per_s']:.2f}/s mean {runs[m]['mean_ms'] or 0:.0f} ms"
                for m in ("request", "step")), flush=True)
    return {"capacity_req_per_s": caps, "rows": rows}


def parity_specs(args: argparse.Namespace) -> list[harness.ServerSpec]:
    request, step = server_specs(args)
    twin = harness.diffbatch_defaults_spec(
        args.model, name="twin", extra_args=request.cmd[request.cmd.index("--max-num-seqs"):])
    return [request, twin, step]


def parity_round(servers: dict[str, harness.Server], args: argparse.Namespace,
                 round_index: int) -> dict[str, Any]:
    """One round of the parity check (see the module docstring)."""
    seed = 1000 * round_index
    modes = ["request", "twin", "step"]
    order = modes[round_index % 3:] + modes[:round_index % 3]
    saturated: dict[str, float] = {}
    for mode in order if "saturated" in args.parity_parts else ():
        report = run_benchmark(BenchConfig(
            base_url=servers[mode].base_url, num_prompts=args.parity_requests,
            max_concurrency=args.parity_clients, width=args.size, height=args.size,
            steps=args.steps or None, seed=seed, disable_tqdm=True))
        saturated[mode] = float(report["request_throughput"])
    cap, mixed = None, {}
    if "mixed" in args.parity_parts:
        cap = asyncio.run(poisson_run(servers["request"].base_url, args, rate=float("inf"),
                                      workload="parity-mix", seed=seed + 1,
                                      concurrency=args.saturation_concurrency,
                                      num=args.capacity_requests))["completed_per_s"]
        mixed = {mode: asyncio.run(poisson_run(servers[mode].base_url, args, rate=0.8 * cap,
                                               workload="parity-mix", seed=seed + 2))
                 for mode in order}
    row = {
        "order": order, "saturated_req_per_s": saturated, "mix_capacity_req_per_s": cap,
        "mixed": mixed,
        "throughput": {m: ratio(saturated.get(m), saturated.get("request"))
                       for m in ("twin", "step")},
        "mean_latency": {m: ratio(mixed[m]["mean_ms"], mixed["request"]["mean_ms"])
                         if mixed else None for m in ("twin", "step")},
    }
    line = f"round {round_index} ({', '.join(order)}):"
    if saturated:
        line += " saturated " + ", ".join(f"{m} {saturated[m]:.2f}/s" for m in modes)
    if mixed:
        line += f"; mix @0.8 x {cap:.2f}/s mean " + ", ".join(
            f"{m} {mixed[m]['mean_ms'] or 0:.0f} ms" for m in modes)
    print(line, flush=True)
    return row


def parity_verdict(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def spread(what: str, mode: str) -> list[float]:
        return sorted(r[what][mode] for r in rounds if r[what][mode] is not None)

    throughput_bar = 0.9 if args.steps else 0.95
    figures = {}
    parts = {"throughput": "saturated", "mean_latency": "mixed"}
    for what, bar, upper in (("throughput", throughput_bar, False),
                             ("mean_latency", 0.5, True)):
        if parts[what] not in args.parity_parts:
            continue
        step, twin = spread(what, "step"), spread(what, "twin")
        median = statistics.median(step) if step else None
        figures[what] = {
            "step_median": median, "step_all": step, "twin_median":
            statistics.median(twin) if twin else None, "twin_range": [twin[0], twin[-1]]
            if twin else None, "bar": bar,
            "pass": median is not None and (median <= bar if upper else median >= bar)}
    return figures


def verdict(rounds: list[dict[str, Any]], overhead: dict[str, Any]) -> dict[str, Any]:
    def median(row: str, what: str) -> float | None:
        values = [r["rows"][row]["ratio"][what] for r in rounds
                  if r["rows"].get(row, {}).get("ratio", {}).get(what) is not None]
        return statistics.median(values) if values else None

    workloads = {name.split("@")[0] for r in rounds for name in r["rows"]}
    figures: dict[str, float | None] = {}
    bars: dict[str, float] = {}
    if "mixed" in workloads:
        figures["mixed@0.8 mean latency"] = median("mixed@0.8", "mean_latency")
        figures["mixed@0.8 throughput"] = median("mixed@0.8", "throughput")
    if "uniform" in workloads:
        figures["uniform@0.95 throughput"] = median("uniform@0.95", "throughput")
    cancel_rows = sorted({name for r in rounds for name in r["rows"]
                          if name.startswith("cancel@")}, key=lambda n: float(n[7:]))
    for row in cancel_rows:
        figures[f"{row} completed/s"] = median(row, "throughput")
        bars[f"{row} completed/s"] = BARS["cancel completed/s"]
    figures["tick overhead"] = overhead["overhead_share"]
    bars.update({name: BARS[name] for name in figures if name in BARS})
    upper = {"mixed@0.8 mean latency", "tick overhead"}
    passed = {name: value is not None and (value <= bars[name] if name in upper
                                           else value >= bars[name])
              for name, value in figures.items()}
    return {"figures": figures, "bars": bars, "passed": passed, "pass": all(passed.values()),
            "workloads": sorted(workloads)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="steps of the uniform loads")
    parser.add_argument("--max-num-seqs", default="auto")
    parser.add_argument("--wait-ms", default="auto", help="request mode's admission wait")
    parser.add_argument("--loads", type=float, nargs="+", default=list(LOADS))
    parser.add_argument("--num-requests", type=int, default=120, help="per Poisson run")
    parser.add_argument("--capacity-requests", type=int, default=96)
    parser.add_argument("--saturation-concurrency", type=int, default=32)
    parser.add_argument("--cancel-after-s", type=float, default=1.0)
    parser.add_argument("--cancel-loads", type=float, nargs="+", default=list(LOADS))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="which workloads to run (the overhead is always measured)")
    parser.add_argument("--cancel-requests", type=int, default=60,
                        help="per cancel run, and for the cancel workload's capacity")
    parser.add_argument("--overhead-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="rounds")
    parser.add_argument("--parity", action="store_true",
                        help="the parity check instead (see the module docstring)")
    parser.add_argument("--parity-clients", type=int, default=16)
    parser.add_argument("--parity-requests", type=int, default=96)
    parser.add_argument("--parity-parts", nargs="+", choices=("saturated", "mixed"),
                        default=["saturated", "mixed"], help="which parity checks to run")
    parser.add_argument("--out", default="benchmarks/results/step_vs_request.json")
    args = parser.parse_args(argv)
    report = harness.report_header("step_vs_request", args)
    start = time.perf_counter()
    if args.parity:
        with harness.running(parity_specs(args), startup_timeout_s=STARTUP_TIMEOUT_S,
                             one_at_a_time=True) as servers:
            rounds = []
            for i in range(args.repeats):  # the report is written after every round
                rounds.append(parity_round(servers, args, i))
                report.update(rounds=rounds, verdict=parity_verdict(rounds, args),
                              elapsed_s=time.perf_counter() - start)
                harness.write_report(report, args.out)
        for what, figure in report["verdict"].items():
            twin = figure["twin_range"]
            print(f"{what}: step/request median {figure['step_median']:.3f} (bar "
                  f"{figure['bar']:g}: {'PASS' if figure['pass'] else 'MISS'}); twin/request "
                  f"median {figure['twin_median']:.3f}, range {twin[0]:.3f}-{twin[1]:.3f}")
        harness.write_report(report, args.out)
        return
    overhead = tick_overhead(args)
    print(f"tick overhead at batch {overhead['batch']}: {overhead['overhead_share']:.1%} "
          f"(tick {overhead['median_tick_ms']:.1f} ms)", flush=True)
    # NOTE: one server after the other: each worker picks its threads and calibrates
    # while the machine is otherwise idle (started together, each saw the other busy).
    with harness.running(server_specs(args), startup_timeout_s=STARTUP_TIMEOUT_S,
                         one_at_a_time=True) as servers:
        rounds = [run_round(servers, args, i) for i in range(args.repeats)]
    report.update(rounds=rounds, overhead=overhead, verdict=verdict(rounds, overhead),
                  elapsed_s=time.perf_counter() - start)
    for name, value in report["verdict"]["figures"].items():
        mark = "PASS" if report["verdict"]["passed"][name] else "MISS"
        shown = "-" if value is None else f"{value:.3f}"
        print(f"{name:26s} {shown:>8s}  bar {report['verdict']['bars'][name]:g}  {mark}")
    print("PASS" if report["verdict"]["pass"] else "MISS", flush=True)
    harness.write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
