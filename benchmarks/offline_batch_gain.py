"""Does the engine reach the raw pipeline's batched throughput?

For each model and size, and each batch size B, it measures in one run:
  (a) raw: the diffusers pipeline itself, called with B prompts and B generators
      (the limit request batching can reach);
  (b) engine: `Engine.generate` over a full queue with `max_num_seqs = B`.
Reported: images/s of both, the raw gain over B=1, and engine/raw per B (bar: >= 0.95).

    .venv/bin/python benchmarks/offline_batch_gain.py \
        --out benchmarks/results/offline_batch_gain.json

Measurements alternate raw and engine rounds and take the median, since these
machines are shared and noisy; compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peers_servers import harness
from peers_servers.pipeline import load_pipeline

from diffbatch import Engine, SamplingParams

PROMPTS = ["a red circle", "a blue square", "a green cat", "a yellow dog", "a small house",
           "a tall tree", "a white boat", "a black car"]


def raw_images_per_s(pipe, batch: int, size: int, steps: int, num_images: int) -> float:
    """Images/s of the bare diffusers pipeline at batch size `batch`."""
    rounds = max(1, num_images // batch)
    start = time.perf_counter()
    for r in range(rounds):
        prompts = [PROMPTS[(r * batch + i) % len(PROMPTS)] for i in range(batch)]
        gens = [torch.Generator().manual_seed(r * batch + i) for i in range(batch)]
        pipe(prompt=prompts, negative_prompt=[""] * batch, height=size, width=size,
             num_inference_steps=steps, guidance_scale=5.0, generator=gens, output_type="pt")
    return rounds * batch / (time.perf_counter() - start)


def engine_images_per_s(engine: Engine, size: int, steps: int, num_images: int) -> float:
    """Images/s of `Engine.generate` over a full queue of `num_images` requests."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_images)]
    params = [SamplingParams(height=size, width=size, num_inference_steps=steps,
                             guidance_scale=5.0, seed=i, output_type="pt")
              for i in range(num_images)]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    failed = [o.error.message for o in outs if not o.ok]
    if failed:
        raise RuntimeError(f"engine requests failed: {failed[:3]}")
    return num_images / elapsed


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)

    results = []
    for model in args.models:
        pipe = load_pipeline(model)  # the bare diffusers pipeline, as the peers load it
        for batch in args.batch_sizes:
            engine = Engine(model, max_num_seqs=batch, executor=args.executor,
                            torch_num_threads=args.threads)
            try:
                for size in args.sizes:
                    num_images = max(args.num_images, batch)
                    raw_images_per_s(pipe, batch, size, args.steps, batch)  # warm-up
                    engine_images_per_s(engine, size, args.steps, batch)  # warm-up
                    raw, eng = [], []
                    for rep in range(args.repeats):
                        # --flip-order: engine first on odd rounds (the second of two
                        # alternating measurements tends to run slower on a shared box).
                        if args.flip_order and rep % 2:
                            eng.append(engine_images_per_s(engine, size, args.steps, num_images))
                            raw.append(raw_images_per_s(pipe, batch, size, args.steps, num_images))
                        else:
                            raw.append(raw_images_per_s(pipe, batch, size, args.steps, num_images))
                            eng.append(engine_images_per_s(engine, size, args.steps, num_images))
                    row = {"model": model, "size": size, "batch": batch,
                           "raw_images_per_s": statistics.median(raw),
                           "engine_images_per_s": statistics.median(eng),
                           "raw_rounds": raw, "engine_rounds": eng}
                    row["engine_over_raw"] = row["engine_images_per_s"] / row["raw_images_per_s"]
                    results.append(row)
                    print(f"{model:9s} {size:4d}px B={batch}: raw {row['raw_images_per_s']:7.2f} "
                          f"img/s, engine {row['engine_images_per_s']:7.2f} img/s, "
                          f"ratio {row['engine_over_raw']:.3f}", flush=True)
            finally:
                engine.close()
    for row in results:
        base = next(r for r in results if r["model"] == row["model"]
                    and r["size"] == row["size"] and r["batch"] == min(args.batch_sizes))
        row["raw_gain"] = row["raw_images_per_s"] / base["raw_images_per_s"]
        row["engine_gain"] = row["engine_images_per_s"] / base["engine_images_per_s"]
    return {**harness.report_header("offline_batch_gain", args), "results": results}


def plot(report: dict, path: str) -> None:
    plt = harness.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    groups = sorted({(r["model"], r["size"]) for r in report["results"]})
    for model, size in groups:
        rows = [r for r in report["results"] if (r["model"], r["size"]) == (model, size)]
        xs = [r["batch"] for r in rows]
        line = ax.plot(xs, [r["raw_images_per_s"] for r in rows], "--", alpha=0.6)[0]
        ax.plot(xs, [r["engine_images_per_s"] for r in rows], "-o", color=line.get_color(),
                label=f"{model} {size}px (dashed: raw)")
    ax.set_xlabel("batch size B (max_num_seqs)")
    ax.set_ylabel("images/s")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.set_title("Engine vs raw diffusers pipeline throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_batch_grid_args(parser)
    parser.add_argument("--num-images", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flip-order", action="store_true",
                        help="run the engine first on every other round")
    parser.add_argument("--executor", choices=["mp", "inproc"], default="mp")
    parser.add_argument("--out", default="benchmarks/results/offline_batch_gain.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    report = run(args)
    harness.finish_report(report, args, plot)


if __name__ == "__main__":
    main()
