"""Does `auto` keep up with a load that rises with no pause between rates?

The other benchmarks start every load after a quiet spell, so the server measures
each rate from its first second. Traffic in production rises and falls without one:
here each server gets Poisson arrivals at 0.5x, then 0.9x, then 1.2x of `--capacity`
requests/s (`--phase-seconds` each), back to back; each phase is a run of
`diffbatch bench serve` started as the one before ends. Recorded per phase: throughput
and p50/p99 latency.

Servers: `auto` (`diffbatch serve MODEL`, no tuning flag) from this checkout; with
`--baseline-tree PATH`, `baseline` too, the same command run from another checkout (an
A/B of two versions: `git worktree add /tmp/base REV`); and `--fixed S:W`, fixed
settings for reference (`--max-num-seqs S --request-batch-max-wait-ms W`). Rounds
alternate the servers' order, with a pause before each server's sequence. Figures are
medians over rounds, and each server's p50 against the first server's, round by round
(this machine's speed drifts between rounds; a round's servers run within a minute).

    .venv/bin/python benchmarks/rising_load.py --model tiny-sd --size 128 \\
        --capacity 25 --baseline-tree /tmp/base --fixed 16:10 --rounds 6 \\
        --out benchmarks/results/rising_load.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from auto_batching import AUTO, fixed_setting, server_specs
from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

DEFAULT_OUT = "benchmarks/results/rising_load.json"
PHASES = (0.5, 0.9, 1.2)  # x capacity, back to back
PAUSE_S = 6.0  # before each server's sequence: longer than the engine's 5 s rate window
STARTUP_TIMEOUT_S = 300.0


def specs(args: argparse.Namespace) -> list[harness.ServerSpec]:
    """auto (and `baseline` from `--baseline-tree`) and the `--fixed` settings, started
    as `auto_batching.py` starts its servers."""
    servers = server_specs(args.model, [AUTO, *args.fixed], threads=None)
    if args.baseline_tree:
        servers.insert(1, harness.diffbatch_defaults_spec(
            args.model, name="baseline", log_level="warning", source_tree=args.baseline_tree))
    return servers


def run_sequence(server: harness.Server, args: argparse.Namespace, seed: int
                 ) -> list[dict[str, Any]]:
    rows = []
    for factor in PHASES:
        rate = factor * args.capacity
        report = run_benchmark(BenchConfig(
            base_url=server.base_url, width=args.size, height=args.size, steps=args.steps,
            num_prompts=max(1, round(rate * args.phase_seconds)), request_rate=rate,
            seed=seed, disable_tqdm=True))
        rows.append({"factor": factor, "throughput_rps": report["request_throughput"],
                     "p50_ms": report["p50_e2e_ms"], "p99_ms": report["p99_e2e_ms"],
                     "failed": report["failed"]})
    return rows


def summarize(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per server and phase: medians over rounds, and p50 / the first server's p50 per
    round."""
    names = list(runs)
    summary: dict[str, Any] = {}
    for name in names:
        phases = {}
        for i, factor in enumerate(PHASES):
            mine = [r[i] for r in runs[name]]
            first = [r[i] for r in runs[names[0]]]
            phases[f"{factor}x"] = {
                "throughput_rps": statistics.median(r["throughput_rps"] for r in mine),
                "p50_ms": statistics.median(r["p50_ms"] for r in mine),
                "p50_ms_rounds": [r["p50_ms"] for r in mine],
                "p50_vs_first_rounds": [a["p50_ms"] / b["p50_ms"]
                                        for a, b in zip(mine, first, strict=True)],
                "failed": sum(r["failed"] for r in mine),
            }
        summary[name] = phases
    return summary


def format_table(summary: dict[str, Any]) -> str:
    names = list(summary)
    lines = [f"{'server':16s} {'phase':6s} {'rps':>7s} {'p50 ms':>8s}  "
             f"p50 / {names[0]} per round (median)"]
    for name in names:
        for phase, row in summary[name].items():
            ratios = row["p50_vs_first_rounds"]
            lines.append(f"{name:16s} {phase:6s} {row['throughput_rps']:7.2f} "
                         f"{row['p50_ms']:8.0f}  {[round(x, 2) for x in ratios]} "
                         f"({statistics.median(ratios):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--capacity", type=float, default=25.0,
                        help="requests/s the phases are fractions of (default 25: tiny-sd "
                        "128x128, 4 steps, on 2 cores)")
    parser.add_argument("--phase-seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--baseline-tree", default=None,
                        help="another checkout whose `diffbatch serve` runs as `baseline`")
    parser.add_argument("--fixed", type=fixed_setting, nargs="*", default=[],
                        metavar="S:W", help="fixed settings to run beside auto")
    parser.add_argument("--warmup-requests", type=int, default=64)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    report = harness.report_header("rising_load", args)
    start = time.perf_counter()
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    with harness.running(specs(args), startup_timeout_s=STARTUP_TIMEOUT_S,
                         one_at_a_time=True) as servers:
        names = list(servers)
        for name in names:  # warm-up: a closed loop, as a server's first clients would
            run_benchmark(BenchConfig(
                base_url=servers[name].base_url, width=args.size, height=args.size,
                steps=args.steps, num_prompts=args.warmup_requests, max_concurrency=32,
                disable_tqdm=True))
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order[::-1] if r % 2 else order:
                time.sleep(PAUSE_S)
                runs.setdefault(name, []).append(run_sequence(servers[name], args, r))
                print(f"round {r} {name}: " + " | ".join(
                    f"{p['factor']}x {p['throughput_rps']:.1f} rps p50 {p['p50_ms']:.0f}"
                    for p in runs[name][-1]), flush=True)
    report["runs"] = {name: runs[name] for name in names}
    report["summary"] = summarize(report["runs"])
    print(format_table(report["summary"]))
    harness.finish_report(report, args, plot, start_s=start)


def plot(report: dict[str, Any], path: str) -> None:
    """p50 per phase and server, one point per round and the median."""
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(report["summary"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        phases = report["summary"][name]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(phases))]
        ax.bar(xs, [row["p50_ms"] for row in phases.values()], width, label=name)
        for x, row in zip(xs, phases.values(), strict=True):
            ax.plot([x] * len(row["p50_ms_rounds"]), row["p50_ms_rounds"], "k.", ms=3)
    ax.set_xticks(range(len(PHASES)), [f"{f}x, no pause before" if j else f"{f}x"
                                       for j, f in enumerate(PHASES)])
    ax.set_ylabel("p50 latency (ms): median over rounds, dots per round")
    ax.set_title(f"Rising load, {report['args']['model']} "
                 f"{report['args']['size']}x{report['args']['size']}, capacity "
                 f"{report['args']['capacity']:g} req/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
