"""How fast is a forward with each thread setting, on an idle machine and beside busy ones?

The worker's thread choice (`diffbatch/worker/threads.py`) gives torch the CPUs other
processes leave free, with OpenMP's default (spinning) wait. This measures the case
for it: the `tiny-sd` UNet forward at batch 1 and 8 (CFG doubles both), each setting in
a fresh process (OpenMP reads its settings once), with 0 and then 1 busy process
(`while True: pass`) beside it. Settings: all usable CPUs spinning (OpenMP's default),
all usable CPUs waiting passively, and the CPUs the busy processes leave free
(`threads_for`), the one the worker takes. Rounds alternate the settings; medians.

    .venv/bin/python benchmarks/threads_under_load.py \
        --out benchmarks/results/threads_under_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from peers_servers import harness

from diffbatch.worker.threads import threads_for, usable_cpu_count

# Runs in a fresh process: load tiny-sd's UNet, time `repeats` forwards at `batch`.
FORWARD = """
import json, statistics, sys, time, torch
from diffbatch.config import EngineConfig
from diffbatch.worker.model_runner import ModelRunner
batch, repeats = int(sys.argv[1]), int(sys.argv[2])
unet = ModelRunner(EngineConfig(model=sys.argv[3])).pipeline.pipe.unet
config = unet.config
side = int(sys.argv[4]) // 8
x = torch.randn(2 * batch, config.in_channels, side, side)
t = torch.full((2 * batch,), 500)
context = torch.randn(2 * batch, 77, config.cross_attention_dim)
times = []
with torch.inference_mode():
    for i in range(repeats + 2):
        start = time.perf_counter()
        unet(x, t, encoder_hidden_states=context)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1000.0)
print(json.dumps({"ms": statistics.median(times), "threads": torch.get_num_threads()}))
"""


def settings(usable: int, busy: int) -> dict[str, dict[str, str]]:
    free = threads_for(usable, float(busy))
    return {
        f"{usable} spinning": {"OMP_NUM_THREADS": str(usable)},
        f"{usable} passive": {"OMP_NUM_THREADS": str(usable), "OMP_WAIT_POLICY": "PASSIVE"},
        f"{free} (CPUs left free)": {"OMP_NUM_THREADS": str(free)},
    }


def forward_ms(args: argparse.Namespace, batch: int, env: dict[str, str]) -> float:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    full.update(env)
    result = subprocess.run(
        [sys.executable, "-c", FORWARD, str(batch), str(args.repeats), args.model,
         str(args.size)], env=full, capture_output=True, text=True, timeout=600, check=True)
    return float(json.loads(result.stdout.strip().splitlines()[-1])["ms"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1],
                        help="busy processes beside the forward")
    parser.add_argument("--repeats", type=int, default=10, help="forwards per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/threads_under_load.json")
    args = parser.parse_args(argv)
    report = harness.report_header("threads_under_load", args)
    usable = usable_cpu_count()
    results: list[dict[str, Any]] = []
    for busy in args.busy:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
        try:
            for batch in args.batches:
                named = settings(usable, busy)
                samples: dict[str, list[float]] = {name: [] for name in named}
                for _ in range(args.rounds):
                    for name, env in named.items():
                        samples[name].append(forward_ms(args, batch, env))
                row: dict[str, Any] = {"busy": busy, "batch": batch,
                                       "ms": {n: statistics.median(v) for n, v in samples.items()},
                                       "samples": samples}
                chosen = list(named)[-1]
                row["chosen_vs_best_other"] = row["ms"][chosen] / min(
                    ms for name, ms in row["ms"].items() if name != chosen)
                results.append(row)
                print(f"busy={busy} batch={batch}: " + ", ".join(
                    f"{n} {ms:.1f} ms" for n, ms in row["ms"].items()), flush=True)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    report.update(usable_cpus=usable, results=results)
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
