"""How long is a model's worker away after it crashes: forked or spawned?

One engine per start method (`--executor mp`, `calibration_budget_s=0`) serves a
request, then its worker is killed with SIGKILL; the figure is the time from the
kill until the replacement worker is healthy, and until it answered one request.
`forkserver` forks the replacement from the fork server of the engine's
environment (`diffbatch/executor/forkserver.py`, the default on the CPU; forced here
on any device, so on CUDA it checks that a forked worker can use the GPU); `spawn`
starts it as its own program (`DIFFBATCH_WORKER_START=spawn`); `spawn-twin` is a
second copy of `spawn` (the noise floor). The methods take turns in every round
(reversed every other round); each engine's first start is reported too (the fork
server's first worker pays the imports as a spawned one does). Figures are medians
over `--rounds`. With `--co-tenant` a busy loop per CPU (`harness.CoTenant`) runs
throughout.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/worker_restart.py \\
        --out benchmarks/results/worker_restart.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's diffbatch

from peers_servers import harness

from diffbatch import Engine
from diffbatch.executor import forkserver

METHODS = {"forkserver": "forkserver", "spawn": "spawn", "spawn-twin": "spawn"}


def one_round(method: str, args: argparse.Namespace) -> dict[str, float]:
    os.environ[forkserver.START_METHOD_ENV] = METHODS[method]
    # A start-up environment of its own per method: the fork-server engine must not
    # find a fork server the previous round left warm (that one's imports are paid).
    os.environ["DIFFBATCH_BENCH_ROUND"] = f"{method}-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine = Engine(args.model, executor="mp", calibration_budget_s=0, warmup=True,
                    device=args.device)
    try:
        first_start = time.perf_counter() - start
        assert engine.generate(["a red circle"], use_tqdm=False)[0].ok
        pid = engine.executor.worker_pid
        assert pid is not None
        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while engine.executor.worker_pid in (None, pid):
            time.sleep(0.005)
        assert engine.executor.wait_healthy(300)
        healthy = time.perf_counter() - killed
        assert engine.generate(["a red circle"], use_tqdm=False)[0].ok
        answered = time.perf_counter() - killed
    finally:
        engine.shutdown(30)
        forkserver.close_all()
    return {"first_start_s": first_start, "restart_healthy_s": healthy,
            "restart_answered_s": answered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default=None,
                        help="the worker's device (default: CUDA when available); the "
                             "forkserver rows fork on any device")
    parser.add_argument("--co-tenant", action="store_true",
                        help="a busy loop per CPU beside everything")
    parser.add_argument("--out", default="benchmarks/results/worker_restart.json")
    args = parser.parse_args()
    report: dict[str, Any] = harness.report_header("worker_restart", args)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    with harness.CoTenant() if args.co_tenant else contextlib.nullcontext():
        for i in range(args.rounds):
            order = list(METHODS) if i % 2 == 0 else list(reversed(METHODS))
            for method in order:
                runs[method].append(one_round(method, args))
                print(f"round {i + 1} {method}: {runs[method][-1]}", flush=True)
    report["runs"] = runs
    report["medians"] = {
        method: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for method, rows in runs.items()}
    lines = ["| method | first start, s | restart until healthy, s | until answered, s |",
             "|---|---|---|---|"]
    for method, m in report["medians"].items():
        lines.append(f"| {method} | {m['first_start_s']:.2f} | {m['restart_healthy_s']:.2f} "
                     f"| {m['restart_answered_s']:.2f} |")
    report["markdown"] = "\n".join(lines)
    print(report["markdown"])
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
