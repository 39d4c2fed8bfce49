"""What does each way of waiting cost torch's OpenMP threads, quiet and busy?

The plain diffusers loop (`peers_servers/plain_loop.py`) in a fresh process per
candidate, each started with one setting of the OpenMP runtime torch ships (GNU
OpenMP, `libgomp`, in the Linux wheels): torch's default (a thread per CPU,
spinning after each parallel region), `OMP_WAIT_POLICY=PASSIVE`, bounded spins
(`GOMP_SPINCOUNT`), and one thread. The candidates alternate over `--rounds`
(reversed every other round); figures are medians of images/s per batch size. With
`--co-tenant`, a plain Python busy loop per CPU (`harness.CoTenant`) runs throughout.
The server's own choice (`diffbatch/worker/threads.py`) rests on these figures.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/openmp_wait.py \\
        --co-tenant --out benchmarks/results/openmp_wait.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from peers_servers import harness

CANDIDATES: dict[str, dict[str, str]] = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin30k": {"GOMP_SPINCOUNT": "30000"},
    "1thread": {"OMP_NUM_THREADS": "1"},
}


def plain_loop(settings: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    """Images/s per batch size of one fresh plain-loop process with `settings`."""
    env = {k: v for k, v in harness.user_env().items() if not k.startswith("GOMP_")}
    env.update(settings)
    env["PYTHONPATH"] = os.pathsep.join([str(harness.BENCH_DIR), str(harness.REPO_ROOT)])
    cmd = [sys.executable, "-m", "peers_servers.plain_loop", "--model", args.model,
           "--size", str(args.size), "--steps", str(args.steps), "--num-images",
           str(args.num_images), "--batches", *map(str, args.batches)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                         timeout=3600)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return {b: row["images_per_s"] for b, row in report["batches"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-images", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES),
                        default=list(CANDIDATES))
    parser.add_argument("--co-tenant", action="store_true",
                        help="a busy-loop process per CPU runs throughout")
    parser.add_argument("--out", default="benchmarks/results/openmp_wait.json")
    parser.add_argument("--no-plot", action="store_true", help="(it draws none)")
    args = parser.parse_args()
    report = harness.report_header("openmp_wait", args)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in args.candidates}
    with harness.CoTenant() if args.co_tenant else contextlib.nullcontext():
        for rep in range(args.rounds):
            order = args.candidates if rep % 2 == 0 else args.candidates[::-1]
            for name in order:
                rounds[name].append(plain_loop(CANDIDATES[name], args))
                print(f"round {rep} {name}: {rounds[name][-1]}", flush=True)
    medians: dict[str, Any] = {
        name: {b: statistics.median(r[b] for r in runs) for b in runs[0]}
        for name, runs in rounds.items()}
    report.update({"rounds": rounds, "median_images_per_s": medians})
    for name, by_batch in medians.items():
        print(f"{name}: " + ", ".join(f"b={b} {v:.2f}" for b, v in by_batch.items()))
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
