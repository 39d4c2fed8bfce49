"""What cost curve does `max_num_seqs="auto"` learn, and which capacity does it pick?

Starts an engine with the defaults for each model (start-up calibration at the
model's default shape), runs a burst of requests so the curve also learns from
real waves, then plots the learned forward time per image against the wave size
with the capacity the rule picked, and writes the numbers as JSON.

    .venv/bin/python benchmarks/learned_curve.py --out benchmarks/results/learned_curve.json

The figure goes to `docs/images/learned_cost_curve.png` (`--figure`).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from peers_servers import harness

from diffbatch import Engine, SamplingParams
from diffbatch.metrics import learned_batching


def learn(model: str, num_requests: int, device: str | None = None) -> dict:
    """Calibrate an engine for `model`, run a burst, return its learned curve."""
    start = time.perf_counter()
    with Engine(model, device=device) as engine:
        startup_s = time.perf_counter() - start
        calibrated = learned_batching(engine.policy)

        async def burst():
            return await asyncio.gather(*(
                engine.generate_async(f"a red circle, take {i}", SamplingParams(seed=i))
                for i in range(num_requests)))

        outs = asyncio.run(burst())
        learned = learned_batching(engine.policy)
    return {
        "model": model, "startup_s": startup_s, "limit": engine.policy.limit,
        "calibrated": calibrated, "after_burst": learned,
        "wave_sizes": sorted({o.batch_size for o in outs}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-sd", "shapes"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--device", default=None, help="torch device (default: auto)")
    parser.add_argument("--out", default="benchmarks/results/learned_curve.json")
    parser.add_argument("--figure", default="docs/images/learned_cost_curve.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()

    report = harness.report_header("learned_curve", args)
    report["models"] = [learn(model, args.num_requests, args.device) for model in args.models]
    for entry in report["models"]:
        for shape, curve in entry["after_burst"].items():
            points = ", ".join(f"B={b}: {ms:.1f}" for b, ms in curve["per_image_ms"].items())
            print(f"{entry['model']} {shape}: capacity {curve['capacity']} (limit "
                  f"{entry['limit']}); ms/image {points}; start-up {entry['startup_s']:.1f} s")
    harness.write_report(report, args.out)
    if not args.no_plot:
        plot(report, args.figure)


def plot(report: dict, path: str) -> None:
    """Cost per image relative to a wave of one, per model; a star at the capacity."""
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for entry in report["models"]:
        for shape, curve in entry["after_burst"].items():
            table = {int(b): ms for b, ms in curve["per_image_ms"].items()}
            base = table[min(table)]
            sizes = sorted(table)
            rel = [table[b] / base for b in sizes]
            (line,) = ax.plot(sizes, rel, marker="o", label=f"{entry['model']} {shape}")
            cap = curve["capacity"]
            if cap in table:
                ax.plot([cap], [table[cap] / base], marker="*", markersize=16,
                        color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("wave size B (requests)")
    ax.set_ylabel("forward time per image / at B=1")
    ax.set_title("Learned cost curves; a star marks the capacity auto picked")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
