"""diffbatch against what users would pick instead, under the same client load.

The same diffusers pipeline, the same request and response shape, the same client
(`diffbatch bench serve`), one run:
  (a) diffbatch: `diffbatch serve --max-num-seqs 8 --request-batch-max-wait-ms W`;
  (b) Ray Serve, `@serve.batch(max_batch_size=8, batch_wait_timeout_s=W)`;
  (c) LitServe, `max_batch_size=8, batch_timeout=W`;
  (d) plain FastAPI + diffusers, one request at a time.
Loads: Poisson at `--below` and `--above` times the serial capacity (measured at the
start: requests/s of the serial server with one request in flight) and a burst of
`--burst` requests at once. Each (server, load) is run `--repeats` times, servers
rotating order each round; the medians are reported, and as ratios to diffbatch
(peer / diffbatch: throughput below 1.0 and p99 above 1.0 mean diffbatch is
ahead). P3 holds when diffbatch's throughput >= each peer's at every load, with
its p99 no worse; each ratio is taken within a round and the median over rounds
reported. Server CPU seconds per request (all processes of the server) are
reported too: they are far less disturbed by a shared machine than timings.

    .venv/bin/python benchmarks/peers.py --out benchmarks/results/peers.json

`--defaults --threads none` compares what each server does out of the box instead:
`diffbatch serve MODEL` with no tuning flag, Ray Serve's `@serve.batch` and LitServe's
`LitAPI` with their own batching defaults (the installed versions': 10 requests and
10 ms for Ray Serve 2.x, no batching for LitServe), and no thread settings anywhere
(torch's defaults in every process; diffbatch's worker picks its own).

Peers need the `[bench]` extra (ray[serve], litserve).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

SERVERS = ("diffbatch", "ray", "litserve", "fastapi")


def server_specs(args: argparse.Namespace) -> list[harness.ServerSpec]:
    # --defaults: nothing set, each server's own batching (None: the library's default)
    batch, wait = (None, None) if args.defaults else (args.max_batch_size, args.wait_ms)
    specs = []
    for name in args.servers:
        if name != "diffbatch":
            specs.append(harness.peer_spec(name, args.model, threads=args.threads,
                                           max_batch_size=batch, wait_ms=wait))
        elif args.defaults:
            specs.append(harness.diffbatch_defaults_spec(
                args.model, name="diffbatch", threads=args.threads, log_level="warning"))
        else:
            specs.append(harness.diffbatch_spec(args.model, threads=args.threads,
                                                max_num_seqs=batch, wait_ms=wait))
    return specs


def bench(server: harness.Server, args: argparse.Namespace, **load: Any) -> dict[str, Any]:
    """One run against one server; adds the server's CPU seconds per request."""
    config = BenchConfig(base_url=server.base_url, width=args.size, height=args.size,
                         steps=args.steps, disable_tqdm=True, **load)
    cpu = server.cpu_seconds()
    report = run_benchmark(config)
    report["server_cpu_s_per_request"] = (server.cpu_seconds() - cpu) / config.num_prompts
    return report


def serial_capacity(server: harness.Server, args: argparse.Namespace) -> float:
    """Requests/s of `server` with one request in flight (the serial server's capacity)."""
    report = bench(server, args, num_prompts=args.calibration_requests, max_concurrency=1,
                   seed=12345)
    return report["request_throughput"]


def loads(args: argparse.Namespace, capacity: float) -> dict[str, dict[str, Any]]:
    return {
        f"poisson_{args.below:g}x": {"request_rate": args.below * capacity,
                                     "num_prompts": args.num_requests},
        f"poisson_{args.above:g}x": {"request_rate": args.above * capacity,
                                     "num_prompts": args.num_requests},
        f"burst_{args.burst}": {"request_rate": math.inf, "num_prompts": args.burst},
    }


def _median(values: Any) -> float:
    """The median of the values that exist (a run whose every request failed has no
    latency); nan when none does."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else math.nan


def summarize(samples: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Median of each figure over the repeats, per (load, server)."""
    rows = []
    for (load, name), reports in samples.items():
        metrics = [r["server_metrics"] for r in reports if r.get("server_metrics")]
        rows.append({
            "load": load, "server": name,
            "throughput_rps": statistics.median(r["request_throughput"] for r in reports),
            "p50_ms": _median(r["p50_e2e_ms"] for r in reports),
            "p99_ms": _median(r["p99_e2e_ms"] for r in reports),
            "server_cpu_s_per_request":
                statistics.median(r["server_cpu_s_per_request"] for r in reports),
            "failed": sum(r["failed"] for r in reports),
            "mean_wave_size":
                statistics.median(m["mean_wave_size"] for m in metrics) if metrics else None,
            "throughput_rps_rounds": [r["request_throughput"] for r in reports],
            "p50_ms_rounds": [r["p50_e2e_ms"] for r in reports],
            "p99_ms_rounds": [r["p99_e2e_ms"] for r in reports],
            "mean_wave_size_rounds": [m["mean_wave_size"] for m in metrics],
        })
    return rows


def add_ratios(
    rows: list[dict[str, Any]], samples: dict[tuple[str, str], list[dict[str, Any]]]
) -> dict[str, Any]:
    """Ratios peer / diffbatch per load, and the P3 verdict per (load, peer).

    Each ratio is taken within a round (the same arrival schedule, minutes apart at
    most) and the median over rounds is reported: the machine's load drifts
    between rounds far more than the servers differ within one.
    """
    verdicts: dict[str, Any] = {}
    for row in rows:
        base = samples.get((row["load"], "diffbatch"))
        if base is None:
            continue
        mine = samples[(row["load"], row["server"])]
        for name, key in (("throughput_rps", "request_throughput"), ("p50_ms", "p50_e2e_ms"),
                          ("p99_ms", "p99_e2e_ms"),
                          ("server_cpu_s_per_request", "server_cpu_s_per_request")):
            row[f"{name}_vs_diffbatch"] = statistics.median(
                m[key] / b[key] for m, b in zip(mine, base, strict=True))
        if row["server"] != "diffbatch":
            throughput_x = 1.0 / row["throughput_rps_vs_diffbatch"]
            p99_x = 1.0 / row["p99_ms_vs_diffbatch"]
            verdicts[f"{row['load']}/{row['server']}"] = {
                "diffbatch_throughput_x": throughput_x,  # diffbatch / peer
                "diffbatch_p99_x": p99_x,  # diffbatch / peer (<= 1 is no worse)
                "pass": throughput_x >= 1.0 and p99_x <= 1.0,
            }
    return verdicts


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    rows = report["results"]
    load_names = list(dict.fromkeys(r["load"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / max(len(servers), 1)
    for k, (key, title) in enumerate([("throughput_rps", "throughput (req/s)"),
                                      ("p50_ms", "p50 latency (ms)"),
                                      ("p99_ms", "p99 latency (ms)")]):
        ax = axes[k]
        for i, name in enumerate(servers):
            values = [next((r[key] for r in rows if r["load"] == load and r["server"] == name),
                           0.0) for load in load_names]
            ax.bar([j + i * width for j in range(len(load_names))], values, width, label=name)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(load_names))])
        ax.set_xticklabels(load_names, fontsize=8)
        ax.set_title(title)
        if key != "throughput_rps":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['args']['model']} {report['args']['size']}px, "
                 f"{report['args']['steps']} steps: diffbatch vs peers (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_request_args(parser)
    parser.add_argument("--threads", type=harness.threads_arg, default=1,
                        help="torch threads of every server, or 'none' (torch's defaults)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--defaults", action="store_true",
                        help="every server with its own batching defaults (diffbatch: auto); "
                        "--max-batch-size and --wait-ms are then unused")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--wait-ms", type=float, default=20.0,
                        help="batch wait of every batching server")
    parser.add_argument("--num-requests", type=int, default=48, help="per Poisson run")
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--below", type=float, default=0.5, help="x serial capacity")
    parser.add_argument("--above", type=float, default=1.5, help="x serial capacity")
    parser.add_argument("--capacity", type=float, default=None,
                        help="serial capacity in req/s (default: measured)")
    parser.add_argument("--calibration-requests", type=int, default=8)
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/peers.json")
    parser.add_argument("--no-plot", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.set_thread_env(args.threads)
    report = harness.report_header("peers", args)
    start = time.perf_counter()
    with harness.running(server_specs(args)) as servers:
        names = list(servers)
        for name in names:  # warm-up: every batch size once, then the load's shape
            bench(servers[name], args, num_prompts=args.warmup_requests, seed=777)
        serial = servers.get("fastapi") or servers[names[0]]
        capacity = args.capacity or serial_capacity(serial, args)
        report["serial_capacity_rps"] = capacity
        report["serial_capacity_from"] = "--capacity" if args.capacity else serial.spec.name
        print(f"serial capacity: {capacity:.2f} req/s ({report['serial_capacity_from']})",
              flush=True)
        plan = loads(args, capacity)
        report["loads"] = plan
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for load, shape in plan.items():
                for name in order:
                    result = bench(servers[name], args, seed=rep, **shape)
                    samples.setdefault((load, name), []).append(result)
                    print(f"round {rep} {load:14s} {name:9s}: "
                          f"{result['request_throughput']:6.2f} req/s, p50 "
                          f"{result['p50_e2e_ms'] or math.nan:8.1f} ms, p99 "
                          f"{result['p99_e2e_ms'] or math.nan:8.1f} ms, failed "
                          f"{result['failed']}", flush=True)
    rows = summarize(samples)
    report["verdicts"] = add_ratios(rows, samples)
    report["results"] = rows
    for row in rows:
        ratio = row.get("throughput_rps_vs_diffbatch")
        print(f"{row['load']:14s} {row['server']:9s} {row['throughput_rps']:6.2f} req/s "
              f"p50 {row['p50_ms']:8.1f} p99 {row['p99_ms']:8.1f} ms"
              + (f"  (throughput x{ratio:.2f}, p99 x{row['p99_ms_vs_diffbatch']:.2f} "
                 "of diffbatch)" if ratio else ""))
    harness.finish_report(report, args, plot, start_s=start)


if __name__ == "__main__":
    sys.exit(main())
