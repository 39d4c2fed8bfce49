"""Is the built-in transformer `shapes-dit` served at least 0.8x as fast as `shapes`?

Three servers, each `diffbatch serve MODEL --port P` with no tuning flag: `shapes`,
`shapes-dit` and a second `shapes` (the twin: its ratio to the first is the noise floor).
Each round drives every server in turn (the order rotates from round to round) with a
closed loop of `--concurrency` clients (`run_benchmark`, the code of `diffbatch bench
serve`) sending `--num-images` requests of one 64x64 image at each model's own default
steps and guidance (the request leaves them out). Reported per round: images/s of each
server, dit/shapes and twin/shapes; the figures are the medians of those ratios.
Bar: median dit/shapes >= 0.8.

    .venv/bin/python benchmarks/shapes_dit_speed.py --out benchmarks/results/shapes_dit_speed.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

BAR = 0.8  # shapes-dit images/s over shapes images/s
NAMES = ("shapes", "shapes-dit", "twin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-images", type=int, default=48, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=8, help="requests before round 1")
    parser.add_argument("--out", default="benchmarks/results/shapes_dit_speed.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    start_s = time.perf_counter()
    report = harness.report_header("shapes_dit_speed", args)
    specs = [harness.diffbatch_defaults_spec(model, name=name, log_level="warning")
             for name, model in zip(NAMES, ("shapes", "shapes-dit", "shapes"), strict=True)]
    rounds: list[dict[str, float]] = []
    with harness.running(specs, one_at_a_time=True) as servers:
        for i in range(args.rounds):
            order = NAMES[i % 3:] + NAMES[:i % 3]
            got: dict[str, float] = {}
            for name in order:
                result = run_benchmark(BenchConfig(
                    base_url=servers[name].base_url, num_prompts=args.num_images,
                    max_concurrency=args.concurrency, steps=None, seed=i,
                    warmup_requests=args.warmup if i == 0 else 0, disable_tqdm=True))
                if result["failed"]:
                    raise RuntimeError(f"{name}: {result['failed']} requests failed")
                got[name] = result["image_throughput"]
            got["dit/shapes"] = got["shapes-dit"] / got["shapes"]
            got["twin/shapes"] = got["twin"] / got["shapes"]
            rounds.append(got)
            print(f"round {i + 1} ({', '.join(order)}): " + "  ".join(
                f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    spread = [min(r["twin/shapes"] for r in rounds), max(r["twin/shapes"] for r in rounds)]
    report.update(rounds=rounds, medians=medians, twin_spread=spread, bar=BAR,
                  passed=medians["dit/shapes"] >= BAR)
    print(f"median dit/shapes {medians['dit/shapes']:.2f} (bar {BAR}), twin/shapes "
          f"{medians['twin/shapes']:.2f} (rounds {spread[0]:.2f}-{spread[1]:.2f}): "
          f"{'PASS' if report['passed'] else 'MISS'}", flush=True)
    harness.finish_report(report, args, lambda *_: None, start_s=start_s)


if __name__ == "__main__":
    main()
