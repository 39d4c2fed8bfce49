"""Does diffbatch, served over HTTP, keep the batch gain the model itself has?

For each model, size and batch size B, in one run, alternating:
  (a) raw: the plain diffusers pipeline in this process, called with B prompts and
      B generators per call (`peers_servers.pipeline.pipeline_call`, the same call
      diffbatch's adapter makes), `num_images` images back to back;
  (b) served: `diffbatch serve --max-num-seqs B` (worker process, `--executor mp`),
      driven over HTTP by `diffbatch bench serve` with a closed loop of 2*B requests
      in flight, so a full wave always waits while one runs (saturating load).
Figures per B: P1 = (served gain at B) / (raw gain at B), gains over B = 1;
P2 = served images/s / raw images/s. Bar: P1 >= 0.9 and P2 >= 0.95 at every B.
Each figure is the median of `--repeats` alternating rounds (raw first in even
rounds, served first in odd ones). Also reported: the mean wave size the server
saw, and CPU seconds per image (this process for raw; every process of the server
for served, the client apart), which a shared machine's load disturbs far less
than images/s: P2_cpu = raw CPU s/image / served CPU s/image.

    .venv/bin/python benchmarks/batch_gain.py --out benchmarks/results/batch_gain.json

The served path does more than the raw call (HTTP, JSON, the worker pipe, PNG
encoding, the client); that is the point: P2 prices all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark
from diffbatch.cpus import parse_cpu_list


def raw_round(
    pipe: Any, batch: int, size: int, steps: int, num_images: int,
    cpus: frozenset[int] | None = None,
) -> dict[str, float]:
    """Images/s and CPU s/image of the bare pipeline at batch size `batch`, its thread
    pinned to `cpus` for the round when given (as the served worker is)."""
    from peers_servers.pipeline import ImageJob, pipeline_call

    with pinned(cpus):
        start, cpu = time.perf_counter(), time.process_time()
        for r in range(num_images // batch):
            jobs = [ImageJob(f"raw prompt {r * batch + i}", 1, size, size, steps, None, None,
                             r * batch + i) for i in range(batch)]
            pipeline_call(pipe, jobs)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
    return {"images_per_s": num_images / wall, "cpu_s_per_image": cpu / num_images}


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Pin this thread to `cpus` inside the block (no-op for None)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def served_round(
    server: harness.Server, batch: int, size: int, steps: int, num_images: int, seed: int
) -> dict[str, Any]:
    """Images/s of the server under a closed loop of 2*batch requests in flight."""
    config = BenchConfig(
        base_url=server.base_url, num_prompts=num_images, max_concurrency=2 * batch,
        width=size, height=size, steps=steps, seed=seed, disable_tqdm=True,
    )
    server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
    report = run_benchmark(config)
    server_cpu = server.cpu_seconds() - server_cpu
    client_cpu = time.process_time() - client_cpu
    if report["failed"]:
        raise RuntimeError(f"served round had {report['failed']} failed requests: "
                           f"{report['errors']}")
    metrics = report["server_metrics"] or {}
    return {"images_per_s": report["image_throughput"],
            "cpu_s_per_image": server_cpu / num_images,
            "client_cpu_s_per_image": client_cpu / num_images,
            "mean_wave_size": metrics.get("mean_wave_size")}


def _images(batch: int, num_images: int, min_waves: int) -> int:
    """At least `min_waves` waves of `batch`, a whole number of them."""
    count = max(num_images, min_waves * batch)
    return -(-count // batch) * batch


def measure_model(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    from peers_servers.pipeline import load_pipeline

    pipe = load_pipeline(model, args.threads)
    extra = ["--max-waves-in-flight", str(args.max_waves_in_flight)]
    cpus = None
    if args.worker_cpus:
        extra += ["--worker-cpus", args.worker_cpus]
        cpus = parse_cpu_list(args.worker_cpus)
    specs = [harness.diffbatch_spec(model, threads=args.threads, max_num_seqs=b,
                                    wait_ms=args.wait_ms, executor=args.executor, name=f"B{b}",
                                    extra_args=extra)
             for b in args.batch_sizes]
    rows = []
    with harness.running(specs) as servers:
        for size in args.sizes:
            # Warm-up: the first call of a shape pays allocations and lazy set-up.
            for b in args.batch_sizes:
                raw_round(pipe, b, size, args.steps, b, cpus)
                served_round(servers[f"B{b}"], b, size, args.steps, 2 * b, seed=999)
            samples: dict[int, dict[str, list]] = {b: {"raw": [], "served": []}
                                                   for b in args.batch_sizes}
            for rep in range(args.repeats):
                for b in args.batch_sizes:
                    n = _images(b, args.num_images, args.min_waves)
                    # NOTE: whichever of two alternating processes runs second was
                    # measured 5-15% slower here (its caches were just the other's),
                    # so the order flips every round.
                    for kind in ("raw", "served") if rep % 2 == 0 else ("served", "raw"):
                        samples[b][kind].append(
                            raw_round(pipe, b, size, args.steps, n, cpus) if kind == "raw" else
                            served_round(servers[f"B{b}"], b, size, args.steps, n, seed=rep))
            for b in args.batch_sizes:
                raw, served = samples[b]["raw"], samples[b]["served"]
                row = {
                    "model": model, "size": size, "batch": b,
                    "raw_images_per_s": statistics.median(r["images_per_s"] for r in raw),
                    "served_images_per_s": statistics.median(s["images_per_s"] for s in served),
                    "raw_cpu_s_per_image": statistics.median(r["cpu_s_per_image"] for r in raw),
                    "served_cpu_s_per_image":
                        statistics.median(s["cpu_s_per_image"] for s in served),
                    "client_cpu_s_per_image":
                        statistics.median(s["client_cpu_s_per_image"] for s in served),
                    "mean_wave_size": statistics.median(
                        s["mean_wave_size"] or 0.0 for s in served),
                    "raw_images_per_s_rounds": [r["images_per_s"] for r in raw],
                    "served_images_per_s_rounds": [s["images_per_s"] for s in served],
                }
                rows.append(row)
                print(f"{model:9s} {size:4d}px B={b}: raw {row['raw_images_per_s']:7.2f} img/s, "
                      f"served {row['served_images_per_s']:7.2f} img/s "
                      f"(waves of {row['mean_wave_size']:.1f})", flush=True)
    return rows


def add_figures(rows: list[dict[str, Any]]) -> None:
    """Gains over the smallest B, P1 and P2 (and their CPU-time twins) per row."""
    for row in rows:
        base = min((r for r in rows if (r["model"], r["size"]) == (row["model"], row["size"])),
                   key=lambda r: r["batch"])
        row["raw_gain"] = row["raw_images_per_s"] / base["raw_images_per_s"]
        row["served_gain"] = row["served_images_per_s"] / base["served_images_per_s"]
        row["P1"] = row["served_gain"] / row["raw_gain"]
        row["P2"] = row["served_images_per_s"] / row["raw_images_per_s"]
        row["P2_cpu"] = row["raw_cpu_s_per_image"] / row["served_cpu_s_per_image"]


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    rows = report["results"]
    groups = sorted({(r["model"], r["size"]) for r in rows})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for model, size in groups:
        group = [r for r in rows if (r["model"], r["size"]) == (model, size)]
        xs = [r["batch"] for r in group]
        line = ax.plot(xs, [r["raw_images_per_s"] for r in group], "--", alpha=0.6)[0]
        ax.plot(xs, [r["served_images_per_s"] for r in group], "-o", color=line.get_color(),
                label=f"{model} {size}px")
        bx.plot(xs, [r["P2"] for r in group], "-o", color=line.get_color(),
                label=f"{model} {size}px P2")
        bx.plot(xs, [r["P1"] for r in group], ":s", color=line.get_color(), alpha=0.7)
    for axis in (ax, bx):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size B (--max-num-seqs)")
    ax.set_ylabel("images/s (solid: served, dashed: raw)")
    ax.legend(fontsize=7)
    ax.set_title("Served vs raw throughput")
    bx.axhline(0.95, color="grey", lw=0.8)
    bx.axhline(0.9, color="grey", lw=0.8, ls=":")
    bx.set_ylabel("ratio (solid: P2, dotted: P1)")
    bx.set_title("P2 = served/raw, P1 = served gain/raw gain")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_batch_grid_args(parser)
    parser.add_argument("--num-images", type=int, default=48,
                        help="images per round (at least --min-waves waves of B)")
    parser.add_argument("--min-waves", type=int, default=12,
                        help="waves per round at least: a served round pays the closed "
                        "loop's start (the first wave waits for its requests to arrive) and "
                        "end (the last responses), which the raw loop does not; more waves "
                        "make that a smaller share of the round")
    parser.add_argument("--max-waves-in-flight", type=int, default=2,
                        help="--max-waves-in-flight of the servers (1 = one wave at a time)")
    parser.add_argument("--worker-cpus", default=None,
                        help="--worker-cpus of the servers (e.g. 1); the raw rounds are then "
                        "pinned to the same CPUs, so both sides run on the cores they get")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per point")
    parser.add_argument("--threads", type=harness.threads_arg, default=1,
                        help="torch threads of the raw pipeline and of the server's worker, "
                        "or 'none' (torch's defaults; the worker picks its own)")
    parser.add_argument("--wait-ms", type=float, default=50.0,
                        help="--request-batch-max-wait-ms of the servers")
    parser.add_argument("--executor", choices=["mp", "inproc"], default="mp")
    parser.add_argument("--out", default="benchmarks/results/batch_gain.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    harness.set_thread_env(args.threads)
    report = harness.report_header("batch_gain", args)
    start = time.perf_counter()
    rows = []
    for model in args.models:
        rows += measure_model(args, model)
    add_figures(rows)
    report["results"] = rows
    for row in rows:
        print(f"{row['model']:9s} {row['size']:4d}px B={row['batch']}: P1 {row['P1']:.3f} "
              f"P2 {row['P2']:.3f} (CPU-time P2 {row['P2_cpu']:.3f})")
    harness.finish_report(report, args, plot, start_s=start)


if __name__ == "__main__":
    sys.exit(main())
