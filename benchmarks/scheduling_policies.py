"""Does `grouped` beat `fifo` on mixed traffic, and does guidance co-batching widen waves?

Two open-loop workloads through `Engine.generate_async` (the path the HTTP server
uses), with tiny-sd in worker processes. Arrivals are Poisson at `--load` times the
serial capacity (one request at a time, measured first in the same run).

  (a) mixed: 50% 64x64 and 50% 128x128 requests plus a burst of `--burst` at once,
      served by `fifo` and by `grouped` (`--max-head-wait-ms`, `--max-wave-pixels`),
      `--rounds` times. Reported: throughput, p50/p99 end-to-end latency, max queue
      wait, max wait as the oldest waiting request, mean wave size, waves by close
      reason. Bars: grouped throughput >= 1.3x fifo, grouped p99 <= fifo p99, and
      grouped's max queue wait <= max_head_wait_ms + its longest wave.
  (b) guidance: 64x64 requests alternating guidance 5.0 / 7.5, with per-request
      guidance on (the adapter) and forced off (`NoGuidanceCoBatching`), under each
      of `--guidance-policies`. Reported: mean wave size. Bar: with co-batching,
      waves >= 1.8x larger than without.

The engines being compared run side by side on the same arrivals (see
`side_by_side`): this machine is shared, and only engines measured at the same time
see the same background load. Throughput is requests completed per second over the
common window, from the first arrival until the first engine has finished the
whole workload.

    .venv/bin/python benchmarks/scheduling_policies.py \
        --out benchmarks/results/scheduling_policies.json

Compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import replace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from peers_servers import harness

from diffbatch import Engine, SamplingParams
from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interface import PipelineInfo

PROMPTS = ["a red circle", "a blue square", "a green cat", "a yellow dog", "a small house",
           "a tall tree", "a white boat", "a black car"]
# Importable by name in the worker process: this file's folder is on the spawned
# worker's sys.path, like the parent's.
NO_COBATCH_CLASS = "scheduling_policies.NoGuidanceCoBatching"


class NoGuidanceCoBatching(DiffusersT2IPipeline):
    """The diffusers adapter with per-request guidance declared off: `guidance_scale`
    is part of the batch key, so requests with different scales never share a wave."""

    def _make_info(self) -> PipelineInfo:
        return replace(super()._make_info(), supports_per_request_guidance=False)


# -- workload ------------------------------------------------------------------------
def poisson_schedule(
    rng: random.Random, num_requests: int, rate_per_s: float, burst: int, burst_at_s: float
) -> list[float]:
    """Arrival offsets (s): a Poisson process of `num_requests`, plus `burst` at once."""
    times, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_s)
        times.append(t)
    times += [burst_at_s] * burst
    return sorted(times)


async def run_open_loop(
    engine: Engine, arrivals_s: list[float], params: list[SamplingParams]
) -> dict[str, Any]:
    """Submit request i at `arrivals_s[i]` and collect every output and latency."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    records: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + arrivals_s[i] - loop.time()))  # arrival time
        submitted = loop.time()
        out = await engine.generate_async(PROMPTS[i % len(PROMPTS)], params[i])
        records.append({
            "i": i, "arrival_s": submitted - start, "done_s": loop.time() - start,
            "e2e_s": loop.time() - submitted, "queue_ms": out.queue_time_ms,
            "execute_ms": out.execute_time_ms, "batch_size": out.batch_size, "ok": out.ok,
        })

    assert engine.metrics is not None
    waves_before = engine.metrics.wave_sizes_sum_count()
    reasons_before = waves_by_close_reason(engine)
    await asyncio.gather(*(one(i) for i in range(len(arrivals_s))))
    total, count = engine.metrics.wave_sizes_sum_count()
    reasons = {k: v - reasons_before.get(k, 0) for k, v in waves_by_close_reason(engine).items()}
    failed = [r["i"] for r in records if not r["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[:3]}")
    e2e = sorted(r["e2e_s"] for r in records)
    # Wait as the oldest waiting request: from when every earlier arrival had started
    # (or its own arrival) to its own start. This is what max_head_wait_ms bounds.
    latest_start_s, wait_as_oldest_ms = 0.0, 0.0
    for r in sorted(records, key=lambda r: (r["arrival_s"], r["i"])):
        start_s = r["arrival_s"] + r["queue_ms"] / 1000
        oldest_since_s = max(r["arrival_s"], latest_start_s)
        wait_as_oldest_ms = max(wait_as_oldest_ms, (start_s - oldest_since_s) * 1000)
        latest_start_s = max(latest_start_s, start_s)
    makespan = max(r["done_s"] for r in records) - min(r["arrival_s"] for r in records)
    num_waves = count - waves_before[1]
    return {
        "num_requests": len(records),
        "throughput_req_per_s": len(records) / makespan,  # side_by_side: common window
        "makespan_s": makespan,
        "p50_e2e_s": _percentile(e2e, 50),
        "p99_e2e_s": _percentile(e2e, 99),
        "max_queue_wait_ms": max(r["queue_ms"] for r in records),
        "max_wait_as_oldest_ms": wait_as_oldest_ms,
        "max_wave_forward_ms": max(r["execute_ms"] for r in records),
        "num_waves": num_waves,
        "mean_wave_size": (total - waves_before[0]) / num_waves if num_waves else 0.0,
        "waves_by_close_reason": {k: v for k, v in sorted(reasons.items()) if v},
        "_done_s": sorted(r["done_s"] for r in records),  # for side_by_side; not reported
        "_first_arrival_s": min(r["arrival_s"] for r in records),
    }


def waves_by_close_reason(engine: Engine) -> dict[str, int]:
    """Waves run so far per close reason, from the engine's `diffbatch_waves` counter."""
    counts: dict[str, int] = {}
    assert engine.metrics is not None
    for family in engine.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "diffbatch_waves_total":
                reason = sample.labels["close_reason"]
                counts[reason] = counts.get(reason, 0) + int(sample.value)
    return counts


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def params_for(size: int, seed: int, steps: int, guidance_scale: float = 5.0) -> SamplingParams:
    return SamplingParams(height=size, width=size, num_inference_steps=steps, seed=seed,
                          guidance_scale=guidance_scale, output_type="pt")


async def serial_time_s(engine: Engine, sizes: tuple[int, ...], steps: int,
                        repeats: int) -> float:
    """Mean over `sizes` of the median time of one request alone (a wave of one)."""
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for i in range(repeats + 1):
        for size in sizes:  # interleaved, so drift on a shared machine hits both
            start = time.perf_counter()
            out = await engine.generate_async(PROMPTS[i % len(PROMPTS)],
                                              params_for(size, 90_000 + i, steps))
            if not out.ok:
                raise RuntimeError(f"calibration request failed: {out.error}")
            if i:  # the first round warms each size up
                times[size].append(time.perf_counter() - start)
    return statistics.mean(statistics.median(t) for t in times.values())


class Engines:
    """The engines of one run, started on first use and kept for the whole run.

    Keyed by (policy, co-batching); an idle engine's worker costs no CPU, and
    keeping them lets the policies alternate round by round.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._engines: dict[tuple[str, bool], Engine] = {}

    def get(self, policy: str, cobatch: bool = True) -> Engine:
        if (policy, cobatch) not in self._engines:
            args = self.args
            engine = Engine(
                args.model, max_num_seqs=args.max_num_seqs, executor=args.executor,
                request_batch_max_wait_ms=args.request_batch_max_wait_ms,
                pipeline_class=None if cobatch else NO_COBATCH_CLASS,
                scheduling_policy=policy, max_head_wait_ms=args.max_head_wait_ms,
                max_wave_pixels=args.max_wave_pixels,  # (both policies honour it)
                torch_num_threads=args.threads, seed=0,
            )
            if engine.info.supports_per_request_guidance != cobatch:
                engine.close()
                raise RuntimeError(f"co-batching should be {cobatch} for {engine.info.name}")
            self._engines[policy, cobatch] = engine
        return self._engines[policy, cobatch]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds (worst case for the max queue waits), plus the rounds."""
    keys = [k for k in rows[0] if k not in ("max_queue_wait_ms", "max_wait_as_oldest_ms",
                                            "max_wave_forward_ms", "waves_by_close_reason")]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in keys}
    for k in ("max_queue_wait_ms", "max_wait_as_oldest_ms", "max_wave_forward_ms"):
        out[k] = max(r[k] for r in rows)
    out["rounds"] = rows
    return out


async def side_by_side(
    engines: dict[str, Engine], arrivals_s: list[float], params: list[SamplingParams]
) -> dict[str, dict[str, Any]]:
    """Run the same open-loop workload on every engine at once.

    NOTE: concurrently, not one after the other: on a shared machine whose load
    changes by 2x within a minute, engines measured side by side see the same
    background load, so their ratio is stable even when absolute numbers are not.
    They also share the CPU; once the faster engine is done the slower one gets
    it all, which flatters the slower one (the ratio errs low, never high).
    """
    rows = await asyncio.gather(*(run_open_loop(e, arrivals_s, params) for e in engines.values()))
    # Throughput over the common window, from the first arrival until the first engine
    # is done with the whole workload: both shared the machine for all of it.
    start_s = min(row["_first_arrival_s"] for row in rows)
    end_s = min(row["_done_s"][-1] for row in rows)
    for row in rows:
        done_s = row.pop("_done_s")
        row.pop("_first_arrival_s")
        row["completed_in_window"] = sum(t <= end_s for t in done_s)
        row["window_s"] = end_s - start_s
        row["throughput_req_per_s"] = row["completed_in_window"] / row["window_s"]
    return dict(zip(engines, rows, strict=True))


async def side_by_side_serial_s(engines: list[Engine], sizes: tuple[int, ...],
                                args: argparse.Namespace) -> float:
    """Serial time per request, measured on every engine at once (same contention)."""
    times = await asyncio.gather(*(serial_time_s(e, sizes, args.steps, args.calibration_repeats)
                                   for e in engines))
    return statistics.mean(times)


# -- (a) mixed sizes: fifo vs grouped ------------------------------------------------
async def mixed_workload(args: argparse.Namespace, engines: Engines) -> dict[str, Any]:
    rng = random.Random(args.seed)
    pair = {"fifo": engines.get("fifo"), "grouped": engines.get("grouped")}
    serial = await side_by_side_serial_s(list(pair.values()), (64, 128), args)
    rate = args.load / serial
    burst_at = args.num_requests / rate / 3
    rows: dict[str, list[dict[str, Any]]] = {"fifo": [], "grouped": []}
    for r in range(args.rounds):
        arrivals = poisson_schedule(rng, args.num_requests, rate, args.burst, burst_at)
        params = [params_for(rng.choice((64, 128)), 1000 * r + i, args.steps)
                  for i in range(len(arrivals))]
        for policy, row in (await side_by_side(pair, arrivals, params)).items():
            rows[policy].append(row)
            print(f"(a) round {r} {policy:7s}: {row['throughput_req_per_s']:.2f} req/s, p99 "
                  f"{row['p99_e2e_s']:.2f} s, max queue wait {row['max_queue_wait_ms']:.0f} ms "
                  f"(as oldest {row['max_wait_as_oldest_ms']:.0f} ms), mean wave "
                  f"{row['mean_wave_size']:.2f}", flush=True)
    fifo, grouped = _summary(rows["fifo"]), _summary(rows["grouped"])
    bound_ms = args.max_head_wait_ms + grouped["max_wave_forward_ms"]
    ratios = [g["throughput_req_per_s"] / f["throughput_req_per_s"]
              for f, g in zip(rows["fifo"], rows["grouped"], strict=True)]
    results: dict[str, Any] = {
        "serial_s_per_request": serial,
        "serial_capacity_req_per_s": 1 / serial,
        "arrival_rate_req_per_s": rate,
        "burst_at_s": burst_at,
        "fifo": fifo,
        "grouped": grouped,
        "throughput_ratio_per_round": ratios,
        "throughput_ratio": statistics.median(ratios),
        "p99_ratio": grouped["p99_e2e_s"] / fifo["p99_e2e_s"],
        "max_queue_wait_bound_ms": bound_ms,
    }
    results["bars"] = {
        "throughput_ratio_ge_1.3": results["throughput_ratio"] >= 1.3,
        "p99_no_worse": grouped["p99_e2e_s"] <= fifo["p99_e2e_s"],
        "max_queue_wait_within_bound": grouped["max_queue_wait_ms"] <= bound_ms,
        "max_wait_as_oldest_within_bound": grouped["max_wait_as_oldest_ms"] <= bound_ms,
    }
    return results


# -- (b) alternating guidance scales: co-batching on vs off --------------------------
async def guidance_workload(args: argparse.Namespace, engines: Engines) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    results: dict[str, Any] = {}
    for policy in args.guidance_policies:
        pair = {"on": engines.get(policy, True), "off": engines.get(policy, False)}
        serial = await side_by_side_serial_s(list(pair.values()), (64,), args)
        rate = args.load / serial
        arrivals = poisson_schedule(rng, args.guidance_requests, rate, 0, 0.0)
        params = [params_for(64, i, args.steps, 5.0 if i % 2 == 0 else 7.5)
                  for i in range(len(arrivals))]
        results[f"{policy}_serial_s_per_request"] = serial
        results[f"{policy}_arrival_rate_req_per_s"] = rate
        for label, row in (await side_by_side(pair, arrivals, params)).items():
            results[f"{policy}_{label}"] = row
            print(f"(b) {policy:7s} co-batching {label:3s}: mean wave "
                  f"{row['mean_wave_size']:.2f}, {row['throughput_req_per_s']:.2f} req/s, "
                  f"p99 {row['p99_e2e_s']:.2f} s", flush=True)
        results[f"{policy}_wave_size_ratio"] = (
            results[f"{policy}_on"]["mean_wave_size"] / results[f"{policy}_off"]["mean_wave_size"]
        )
    results["bars"] = {f"{p}_wave_size_ratio_ge_1.8": results[f"{p}_wave_size_ratio"] >= 1.8
                       for p in args.guidance_policies}
    return results


# -- report --------------------------------------------------------------------------
def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()

    panels = []
    if "mixed" in report:
        m = report["mixed"]
        panels += [
            ("(a) throughput, req/s", ["fifo", "grouped"],
             [m[p]["throughput_req_per_s"] for p in ("fifo", "grouped")]),
            ("(a) p99 end-to-end, s", ["fifo", "grouped"],
             [m[p]["p99_e2e_s"] for p in ("fifo", "grouped")]),
            ("(a) max queue wait, s", ["fifo", "grouped", "grouped\nas oldest", "bound"],
             [m["fifo"]["max_queue_wait_ms"] / 1000, m["grouped"]["max_queue_wait_ms"] / 1000,
              m["grouped"]["max_wait_as_oldest_ms"] / 1000,
              m["max_queue_wait_bound_ms"] / 1000]),
        ]
    if "guidance" in report:
        g = report["guidance"]
        names = [f"{p}_{label}" for p in report["args"]["guidance_policies"]
                 for label in ("off", "on")]
        panels.append(("(b) mean wave size, 5.0/7.5 mix",
                       [n.replace("_", "\nco-batch ") for n in names],
                       [g[n]["mean_wave_size"] for n in names]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (title, labels, values) in zip(axes, panels, strict=True):
        colors = ["#888" if ("fifo" in label and "on" not in label) or "off" in label
                  else "#27a" if label == "bound" else "#2a7" for label in labels]
        ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_title(title, fontsize=9)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"scheduling policies, {report['args']['model']} "
                 f"({report['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = harness.report_header("scheduling_policies", args)
    engines = Engines(args)
    try:
        for name, workload in (("mixed", mixed_workload), ("guidance", guidance_workload)):
            if args.workload in (name, "all"):
                start = time.perf_counter()
                report[name] = await workload(args, engines)
                report[name]["wall_s"] = time.perf_counter() - start
    finally:
        engines.close()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["mixed", "guidance", "all"], default="all")
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--request-batch-max-wait-ms", type=float, default=20.0)
    parser.add_argument("--max-head-wait-ms", type=float, default=2000.0)
    parser.add_argument("--max-wave-pixels", type=int, default=8 * 128 * 128)
    parser.add_argument("--load", type=float, default=2.0,
                        help="arrival rate as a multiple of the serial capacity")
    parser.add_argument("--num-requests", type=int, default=64, help="(a) Poisson requests")
    parser.add_argument("--burst", type=int, default=64, help="(a) requests in the burst")
    parser.add_argument("--rounds", type=int, default=3, help="(a) rounds")
    parser.add_argument("--guidance-requests", type=int, default=48)
    parser.add_argument("--guidance-policies", nargs="+", choices=["fifo", "grouped"],
                        default=["fifo", "grouped"])
    parser.add_argument("--calibration-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--executor", choices=["mp", "inproc"], default="mp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/scheduling_policies.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    harness.finish_report(report, args, plot)


if __name__ == "__main__":
    main()
