"""Does batching pay for short video clips served through `/v1/videos`?

Three `diffbatch serve tiny-wan` servers (worker process, one torch thread each):
`b1` (`--max-num-seqs 1`), `b4` (`--max-num-seqs 4`) and `b1-twin`, a second copy of
`b1` whose spread against `b1` is the noise floor. Each round drives every server in
turn (the order rotates from round to round) with `diffbatch bench serve --mode
videos`: `--jobs` video jobs of one shape sent at once, each submitted, polled and
downloaded as OpenAI's clients do. Reported per server: the median over rounds of
videos/s and of the p50 and p90 job latency, and the mean wave size the server saw;
the gain is b4 / b1 videos/s, the noise floor twin / b1.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/video_batching.py \\
        --out benchmarks/results/video_batching.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

SERVERS = {"b1": 1, "b4": 4, "b1-twin": 1}  # name -> --max-num-seqs


def one_round(server: harness.Server, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    report = run_benchmark(BenchConfig(
        base_url=server.base_url, model="tiny-wan", num_prompts=args.jobs, mode="videos",
        width=args.size, height=args.size, steps=args.steps, num_frames=args.frames,
        seed=seed, poll_interval_s=args.poll_interval, disable_tqdm=True))
    if report["failed"]:
        raise RuntimeError(f"{server.spec.name}: {report['failed']} jobs failed: "
                           f"{report['errors']}")
    metrics = report["server_metrics"] or {}
    return {"videos_per_s": report["video_throughput"], "p50_ms": report["p50_e2e_ms"],
            "p90_ms": report["p90_e2e_ms"], "mean_wave_size": metrics.get("mean_wave_size")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=16, help="video jobs per round")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    parser.add_argument("--threads", type=harness.threads_arg, default=1)
    parser.add_argument("--out", default="benchmarks/results/video_batching.json")
    args = parser.parse_args()
    harness.set_thread_env(args.threads)
    start = time.perf_counter()
    specs = [harness.diffbatch_spec("tiny-wan", threads=args.threads, max_num_seqs=seqs,
                                    wait_ms=0, name=name)
             for name, seqs in SERVERS.items()]
    rounds: list[dict[str, dict[str, Any]]] = []
    with harness.running(specs, one_at_a_time=True) as servers:
        names = list(SERVERS)
        for server in servers.values():  # warm-up: the first jobs load lazily-built parts
            one_round(server, argparse.Namespace(**{**vars(args), "jobs": 4}), seed=999)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            results = {name: one_round(servers[name], args, seed=r) for name in order}
            rounds.append(results)
            print(f"round {r + 1}: " + ", ".join(
                f"{name} {res['videos_per_s']:.2f} videos/s (wave {res['mean_wave_size']})"
                for name, res in results.items()), flush=True)
    summary = {}
    for name in SERVERS:
        summary[name] = {key: statistics.median(rnd[name][key] for rnd in rounds)
                         for key in ("videos_per_s", "p50_ms", "p90_ms", "mean_wave_size")}
    per_round_gain = [rnd["b4"]["videos_per_s"] / rnd["b1"]["videos_per_s"] for rnd in rounds]
    per_round_twin = [rnd["b1-twin"]["videos_per_s"] / rnd["b1"]["videos_per_s"]
                      for rnd in rounds]
    summary["gain_b4_over_b1"] = statistics.median(per_round_gain)
    summary["twin_over_b1"] = statistics.median(per_round_twin)
    summary["twin_spread"] = [min(per_round_twin), max(per_round_twin)]
    report = {**harness.report_header("video_batching", args), "rounds": rounds,
              "summary": summary, "elapsed_s": time.perf_counter() - start}
    harness.write_report(report, args.out)
    print(summary, flush=True)


if __name__ == "__main__":
    main()
