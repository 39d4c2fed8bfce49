"""What does the admission wait cost a lone request?

Two diffbatch servers, identical but for `--request-batch-max-wait-ms` (0 and
`--wait-ms`, default 50), both with `--max-num-seqs 8` (the wait only runs when a
wave could hold more than one request). One client, one request at a time, rounds
alternating between the two servers. P4 = p50 latency with the wait - p50 without
(bar: <= 12 ms; with one request waiting the wait should end after its stable window
of min(50 ms, wait / 5) = 10 ms). The server's own queue time per request (the
`x-diffbatch-queue-ms` header: arrival to the start of its wave) is reported beside
it: the same difference, without the HTTP path's noise.

    .venv/bin/python benchmarks/low_load_latency.py \
        --out benchmarks/results/low_load_latency.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark


def sequential_round(server: harness.Server, args: argparse.Namespace, seed: int) -> dict:
    config = BenchConfig(base_url=server.base_url, num_prompts=args.num_requests,
                         max_concurrency=1, width=args.size, height=args.size,
                         steps=args.steps, seed=seed, disable_tqdm=True, keep_requests=True)
    report = run_benchmark(config)
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed: {report['errors']}")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_request_args(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the workers")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--wait-ms", type=float, default=50.0)
    parser.add_argument("--num-requests", type=int, default=20, help="per round")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per server")
    parser.add_argument("--out", default="benchmarks/results/low_load_latency.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    harness.set_thread_env(args.threads)
    report = harness.report_header("low_load_latency", args)
    start = time.perf_counter()
    names = {"wait_0": 0.0, f"wait_{args.wait_ms:g}": args.wait_ms}
    specs = [harness.diffbatch_spec(args.model, threads=args.threads,
                                    max_num_seqs=args.max_num_seqs, wait_ms=wait, name=name)
             for name, wait in names.items()]
    latencies: dict[str, list[float]] = {name: [] for name in names}
    queue_ms: dict[str, list[float]] = {name: [] for name in names}
    round_p50: dict[str, list[float]] = {name: [] for name in names}
    with harness.running(specs) as servers:
        for name in names:  # warm-up
            sequential_round(servers[name], args, seed=999)
        for rep in range(args.repeats):
            order = list(names) if rep % 2 == 0 else list(reversed(names))
            for name in order:
                result = sequential_round(servers[name], args, seed=rep)
                requests = result["requests"]
                latencies[name] += [r["latency_s"] * 1e3 for r in requests]
                queue_ms[name] += [r["server"]["queue_ms"] for r in requests
                                   if "queue_ms" in r["server"]]
                round_p50[name].append(result["p50_e2e_ms"])
                print(f"round {rep} {name:8s}: p50 {result['p50_e2e_ms']:7.1f} ms, "
                      f"p99 {result['p99_e2e_ms']:7.1f} ms", flush=True)
    rows = {}
    for name in names:
        rows[name] = {
            "wait_ms": names[name],
            "p50_ms": statistics.median(latencies[name]),
            "mean_ms": statistics.fmean(latencies[name]),
            "p90_ms": statistics.quantiles(latencies[name], n=10)[-1],
            "server_queue_ms_p50": statistics.median(queue_ms[name]) if queue_ms[name] else None,
            "server_queue_ms_mean": statistics.fmean(queue_ms[name]) if queue_ms[name] else None,
            "round_p50_ms": round_p50[name],
            "latencies_ms": latencies[name],
        }
    base, waited = rows["wait_0"], rows[f"wait_{args.wait_ms:g}"]
    report["results"] = rows
    report["P4_ms"] = waited["p50_ms"] - base["p50_ms"]
    report["P4_round_medians_ms"] = (statistics.median(round_p50[f"wait_{args.wait_ms:g}"])
                                     - statistics.median(round_p50["wait_0"]))
    if base["server_queue_ms_p50"] is not None:
        report["P4_server_queue_ms"] = waited["server_queue_ms_p50"] - base["server_queue_ms_p50"]
    print(f"P4 = p50 {waited['p50_ms']:.1f} ms - {base['p50_ms']:.1f} ms = "
          f"{report['P4_ms']:.1f} ms (server queue time: "
          f"{report.get('P4_server_queue_ms', float('nan')):.1f} ms)")
    harness.finish_report(report, args, plot, start_s=start)


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, row in report["results"].items():
        values = sorted(row["latencies_ms"])
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                label=f"{name}: p50 {row['p50_ms']:.1f} ms")
    ax.set_xlabel("end-to-end latency (ms), one request at a time")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Admission wait at low load: P4 = {report['P4_ms']:.1f} ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
