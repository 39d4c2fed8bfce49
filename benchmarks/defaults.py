"""Does `diffbatch serve MODEL` with no tuning flags beat the plain diffusers script?

For each model (default: `tiny-sd` and `shapes`, the default model, both at 64x64,
4 steps), in one run, rounds alternating (served first in even rounds, plain first
in odd ones):
  (a) served: `diffbatch serve MODEL --port P`, no tuning flag at all (batch size,
      admission wait and torch threads are the server's own choice; the harness
      gives it no thread settings either), driven over HTTP on this machine by a
      closed loop of `--concurrency` (16) clients (`run_benchmark`, the code of
      `diffbatch bench serve`) for `--num-images` requests of one image. Reported:
      images/s, the mean wave size the server saw (its /metrics), server CPU s/image.
  (b) plain loop: the plain diffusers pipeline in a FRESH process with torch's
      defaults, started without OMP/MKL thread or wait settings (what a user's
      script gets; `peers_servers/plain_loop.py`), calling the pipeline with b
      prompts at a time for at least `--num-images` images, at b = 1, b = B and the
      `--extra-batches` (8). B is the mean wave size of the served warm-up run
      (same load, not measured), rounded. Reported: images/s, CPU s/image. On a
      GPU machine, `--device cuda` moves the plain pipeline there (`pipe.to("cuda")`,
      what a user's GPU script does); the server needs no flag, it takes CUDA itself.
  (c) with `--baseline-tree PATH`: the served run (a) of another checkout's
      `diffbatch serve MODEL` (same command, same load), in the same rounds: an A/B
      of two versions of the defaults, reported as served / baseline per round (not
      judged), and the baseline's own ratio to the plain loop at b = B.
With `--step-execution` the served server (a) runs `diffbatch serve MODEL
--step-execution`, and the baseline (c), unless `--baseline-tree` names another
checkout, is this checkout's request mode (no flag): step mode against the
request-mode defaults in the same rounds. In step mode B is the mean of the largest
running batch each request was part of (its batch-size header).
Figures (median over `--repeats` rounds of ratios taken within a round):
served/plain@B = served images/s / plain images/s at b = B, and served/plain@1.
Bars, per model: served/plain@B >= 0.8 and served/plain@1 >= 2.0; PASS when both
hold. served/plain at the extra batch sizes is reported, not judged.

    .venv/bin/python benchmarks/defaults.py --out benchmarks/results/defaults.json

With `--co-tenant` a plain Python busy loop per CPU runs beside everything, start-ups
included: the question becomes whether the defaults hold on a machine that is not
theirs alone (the plain loop runs beside the same co-tenant).

The served server keeps uvicorn's access log at its default level (the command is
exactly a user's). Each round starts one plain-loop process (model load, a few
seconds, untimed). The served run pays HTTP, JSON, PNG encoding and the client on
the same cores; the plain loop pays none of them (its images stay tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

BATCHED_BAR = 0.8  # served / plain loop at the served mean wave size
BATCH1_BAR = 2.0  # served / plain loop at batch 1
PLAIN_TIMEOUT_S = 3600.0


def served_round(server: harness.Server, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Images/s of the server under a closed loop of `--concurrency` clients."""
    config = BenchConfig(
        base_url=server.base_url, num_prompts=args.num_images,
        max_concurrency=args.concurrency, width=args.size, height=args.size,
        steps=args.steps, seed=seed, disable_tqdm=True,
    )
    cpu = server.cpu_seconds()
    report = run_benchmark(config)
    cpu = server.cpu_seconds() - cpu
    if report["failed"]:
        raise RuntimeError(f"served round had {report['failed']} failed requests: "
                           f"{report['errors']}")
    return {"images_per_s": report["image_throughput"],
            "mean_wave_size": mean_wave_size(report),
            "p50_ms": report["p50_e2e_ms"],
            "server_cpu_s_per_image": cpu / args.num_images}


def mean_wave_size(report: dict[str, Any]) -> float | None:
    """The server's mean wave size over the run (/metrics; else the batch-size header)."""
    metrics = report.get("server_metrics") or {}
    if metrics.get("mean_wave_size") is not None:
        return metrics["mean_wave_size"]
    timing = (report.get("server_timing") or {}).get("batch_size")
    return timing["mean"] if timing else None


def plain_round(model: str, args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    """One fresh plain-loop process, without thread settings, timing every batch size."""
    env = harness.user_env()
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(harness.BENCH_DIR), str(harness.REPO_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "peers_servers.plain_loop", "--model", model,
           "--size", str(args.size), "--steps", str(args.steps),
           "--num-images", str(args.num_images), "--batches", *map(str, batches)]
    if args.device:
        cmd += ["--device", args.device]
    result = subprocess.run(cmd, env=env, cwd=str(harness.REPO_ROOT), capture_output=True,
                            text=True, timeout=PLAIN_TIMEOUT_S,
                            preexec_fn=harness.die_with_this_process())
    if result.returncode != 0:
        raise RuntimeError(f"plain loop failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--step-execution"] if args.step_execution else []
    specs = [harness.diffbatch_defaults_spec(model, name=model, extra_args=flags)]
    if args.baseline_tree or args.step_execution:
        specs.append(harness.diffbatch_defaults_spec(model, name="baseline",
                                                     source_tree=args.baseline_tree))
    # one at a time: each picks its threads and calibrates on an otherwise idle machine
    with harness.running(specs, one_at_a_time=True) as servers:
        server = servers[model]
        baseline_server = servers.get("baseline")
        if baseline_server is not None:
            served_round(baseline_server, args, seed=999)
        # Warm-up at the measured load; its mean wave size sets B.
        warm = served_round(server, args, seed=999)
        wave = warm["mean_wave_size"] or 1.0
        batch_b = max(1, round(wave))
        batches = sorted({1, batch_b, *args.extra_batches})
        print(f"{model}: warm-up {warm['images_per_s']:.2f} images/s, mean wave "
              f"{wave:.2f} -> B = {batch_b}; plain loop at b = {batches}", flush=True)
        served: list[dict[str, Any]] = []
        plain: list[dict[str, Any]] = []
        baseline: list[dict[str, Any]] = []
        kinds = ["served", "plain"] + (["baseline"] if baseline_server is not None else [])
        for rep in range(args.repeats):
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                if kind == "served":
                    served.append(served_round(server, args, seed=rep))
                elif kind == "baseline":
                    baseline.append(served_round(baseline_server, args, seed=rep))
                else:
                    plain.append(plain_round(model, args, batches))
            line = ", ".join(f"b={b} {plain[-1]['batches'][str(b)]['images_per_s']:.2f}"
                             for b in batches)
            base = (f"; baseline {baseline[-1]['images_per_s']:.2f} (wave "
                    f"{baseline[-1]['mean_wave_size'] or 0:.2f})" if baseline else "")
            print(f"{model} round {rep}: served {served[-1]['images_per_s']:.2f} images/s "
                  f"(wave {served[-1]['mean_wave_size'] or 0:.2f}); plain {line}{base}",
                  flush=True)
    row = summarize(model, args, warm, batch_b, batches, served, plain)
    if baseline:
        plain_b = [p["batches"][str(batch_b)] for p in plain]
        row["baseline"] = summarize_baseline(args.baseline_tree or "this checkout",
                                             served, baseline, plain_b)
    return row


def summarize_baseline(tree: str, served: list[dict[str, Any]], baseline: list[dict[str, Any]],
                       plain_b: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline's served rounds, served / baseline and baseline / plain@B per round."""
    ratios = [s["images_per_s"] / b["images_per_s"]
              for s, b in zip(served, baseline, strict=True)]
    over_plain = [b["images_per_s"] / p["images_per_s"]
                  for b, p in zip(baseline, plain_b, strict=True)]
    return {
        "tree": str(tree),
        "images_per_s": statistics.median(b["images_per_s"] for b in baseline),
        "images_per_s_rounds": [b["images_per_s"] for b in baseline],
        "mean_wave_size_rounds": [b["mean_wave_size"] for b in baseline],
        "served_over_baseline": statistics.median(ratios),
        "served_over_baseline_rounds": ratios,
        "baseline_over_plain_at_B": statistics.median(over_plain),
        "baseline_over_plain_at_B_rounds": over_plain,
    }


def summarize(
    model: str, args: argparse.Namespace, warm: dict[str, Any], batch_b: int,
    batches: list[int], served: list[dict[str, Any]], plain: list[dict[str, Any]],
) -> dict[str, Any]:
    """Medians over rounds, within-round ratios and the two bars."""

    def med(values: list[float | None]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    plain_rows = {}
    ratios = {}
    for b in batches:
        per_round = [p["batches"][str(b)] for p in plain]
        plain_rows[str(b)] = {
            "images_per_s": med([r["images_per_s"] for r in per_round]),
            "cpu_s_per_image": med([r["cpu_s_per_image"] for r in per_round]),
            "images_per_s_rounds": [r["images_per_s"] for r in per_round],
        }
        ratios[str(b)] = med([s["images_per_s"] / r["images_per_s"]
                              for s, r in zip(served, per_round, strict=True)])
    batched, batch1 = ratios[str(batch_b)], ratios["1"]
    wave_rounds = [s["mean_wave_size"] for s in served]
    rounds_b = round(med(wave_rounds) or 1.0)
    if rounds_b != batch_b:
        print(f"note: {model}'s measured rounds had a median mean wave size of "
              f"{med(wave_rounds):.2f} (B = {rounds_b}), the warm-up run {batch_b}; the bar "
              f"uses b = {batch_b}", flush=True)
    return {
        "model": model, "size": args.size, "steps": args.steps,
        "concurrency": args.concurrency, "num_images": args.num_images,
        "batch_B": batch_b, "warmup_mean_wave_size": warm["mean_wave_size"],
        "batch_B_from_rounds": rounds_b,
        "plain_torch_threads": plain[0]["torch_threads"] if plain else None,
        "plain_device": plain[0].get("device") if plain else None,
        "served": {
            "images_per_s": med([s["images_per_s"] for s in served]),
            "mean_wave_size": med(wave_rounds),
            "p50_ms": med([s["p50_ms"] for s in served]),
            "server_cpu_s_per_image": med([s["server_cpu_s_per_image"] for s in served]),
            "images_per_s_rounds": [s["images_per_s"] for s in served],
            "mean_wave_size_rounds": wave_rounds,
        },
        "plain": plain_rows,
        "served_over_plain": ratios,  # batch size -> median within-round ratio
        "bars": {
            "served_over_plain_at_B": {"value": batched, "bar": BATCHED_BAR,
                                       "pass": batched >= BATCHED_BAR},
            "served_over_plain_at_1": {"value": batch1, "bar": BATCH1_BAR,
                                       "pass": batch1 >= BATCH1_BAR},
        },
        "pass": batched >= BATCHED_BAR and batch1 >= BATCH1_BAR,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """The one-screen summary."""
    lines = [f"{'model':9s} {'px':>4s} {'steps':>5s} {'served':>8s} {'wave':>5s} {'B':>3s}  "
             f"{'plain images/s by batch':28s} {'s/p@B':>6s} {'s/p@1':>6s}  verdict",
             "-" * 96]
    for row in rows:
        plain = " ".join(f"{b}:{p['images_per_s']:.2f}" for b, p in row["plain"].items())
        bars = row["bars"]
        lines.append(
            f"{row['model']:9s} {row['size']:4d} {row['steps']:5d} "
            f"{row['served']['images_per_s']:8.2f} {row['served']['mean_wave_size'] or 0:5.2f} "
            f"{row['batch_B']:3d}  {plain:28s} "
            f"{bars['served_over_plain_at_B']['value']:6.2f} "
            f"{bars['served_over_plain_at_1']['value']:6.2f}  "
            f"{'PASS' if row['pass'] else 'FAIL'}")
    lines.append("-" * 96)
    lines.append(f"served: images/s with {rows[0]['concurrency'] if rows else '?'} clients; "
                 f"wave: its mean wave size; s/p@B: served / plain loop at b = B (bar >= "
                 f"{BATCHED_BAR}); s/p@1: at b = 1 (bar >= {BATCH1_BAR})")
    for row in rows:
        bars = row["bars"]
        marks = [f"{name} {bar['value']:.2f} {'PASS' if bar['pass'] else 'FAIL'}"
                 for name, bar in bars.items()]
        lines.append(f"{row['model']}: {'PASS' if row['pass'] else 'FAIL'} ({'; '.join(marks)})")
        if "baseline" in row:
            base = row["baseline"]

            def listed(values: list[float]) -> str:
                return ", ".join(f"{v:.3f}" for v in values)

            lines.append(f"{row['model']}: baseline ({base['tree']}) "
                         f"{base['images_per_s']:.2f} images/s; served / baseline "
                         f"{base['served_over_baseline']:.3f} (median of rounds "
                         f"{listed(base['served_over_baseline_rounds'])}); baseline / plain@B "
                         f"{base['baseline_over_plain_at_B']:.3f} (rounds "
                         f"{listed(base['baseline_over_plain_at_B_rounds'])})")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    rows = report["results"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        labels = [f"plain b={b}" for b in row["plain"]] + ["served"]
        values = [p["images_per_s"] for p in row["plain"].values()]
        values.append(row["served"]["images_per_s"])
        colors = ["tab:grey"] * len(row["plain"]) + ["tab:blue"]
        ax.bar(labels, values, color=colors)
        ax.set_ylabel("images/s (median)")
        ax.set_title(f"{row['model']} {row['size']}px {row['steps']} steps: "
                     f"{'PASS' if row['pass'] else 'FAIL'}\nserved mean wave "
                     f"{row['served']['mean_wave_size'] or 0:.2f}, B = {row['batch_B']}",
                     fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("diffbatch serve (no tuning flags) vs the plain diffusers loop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-sd", "shapes"])
    parser.add_argument("--size", type=int, default=64, help="width and height of every image")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="closed-loop clients of the served runs")
    parser.add_argument("--num-images", type=int, default=96,
                        help="images per served run and per plain-loop batch size (whole calls)")
    parser.add_argument("--extra-batches", type=int, nargs="*", default=[8],
                        help="plain-loop batch sizes besides 1 and B")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per model")
    parser.add_argument("--device", default=None,
                        help='where the plain loop runs, e.g. "cuda" on a GPU machine (the '
                             "server picks its device itself: CUDA where there is one)")
    parser.add_argument("--baseline-tree", default=None,
                        help="another checkout whose `diffbatch serve` runs the same served "
                             "rounds as `baseline` (an A/B of two versions; not judged)")
    parser.add_argument("--step-execution", action="store_true",
                        help="serve with --step-execution; the baseline (this checkout's "
                             "request mode unless --baseline-tree) runs in the same rounds")
    parser.add_argument("--co-tenant", action="store_true",
                        help="a busy-loop process per CPU (harness.CoTenant) runs through "
                             "the whole measurement, start-ups included")
    parser.add_argument("--out", default="benchmarks/results/defaults.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    report = harness.report_header("defaults", args)
    start = time.perf_counter()
    with harness.CoTenant() if args.co_tenant else contextlib.nullcontext():
        rows = [measure_model(model, args) for model in args.models]
    report["results"] = rows
    report["verdicts"] = {row["model"]: "PASS" if row["pass"] else "FAIL" for row in rows}
    report["pass"] = all(row["pass"] for row in rows)
    print(format_table(rows))
    harness.finish_report(report, args, plot, start_s=start)


if __name__ == "__main__":
    sys.exit(main())
