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

Each bar has a noise floor: a "twin", a second server of the fixed setting it is
judged against (for poisson: the best one in a first, unmeasured round), measured in
the same rounds. A miss by no more than the twin's distance from its original counts
as met. Figures are medians over `--rounds` of per-round values. `--step-execution`
serves the auto server in step mode (the fixed servers stay in request mode).

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/policy_bars.py \\
        --out benchmarks/results/policy_bars.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from peers_servers import harness

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
    parser.add_argument("--bars", nargs="+", default=["lone", "poisson"],
                        choices=["lone", "poisson"], help="lone: lone and burst")
    parser.add_argument("--step-execution", action="store_true",
                        help="serve the auto server with --step-execution (the fixed ones "
                             "stay in request mode)")
    parser.add_argument("--out", default="benchmarks/results/policy_bars.json")
    args = parser.parse_args()
    report = harness.report_header("policy_bars", args)
    if "lone" in args.bars:
        report.update(lone_and_burst(args))
    if "poisson" in args.bars:
        report["poisson"] = poisson(args)
    for bar in ("lone", "burst", "poisson"):
        if bar in report:
            print(f"{bar}: {'PASS' if report[bar]['met'] else 'MISS'}", flush=True)
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
