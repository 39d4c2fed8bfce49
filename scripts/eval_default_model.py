"""Evaluate a built-in shapes model on held-out prompts with the pixel-level judge.

Loads the folder (``shapes`` or ``shapes-dit``) with a stock diffusers
``DiffusionPipeline.from_pretrained`` (no diffbatch code on the generation path), generates
one image per held-out prompt (prompts
that name a (colour, shape, background) triple never rendered in training), and prints
colour / shape / background adherence. Writes an image grid with the prompts.

Usage:
    python scripts/eval_default_model.py                      # 120 prompts, grid, scores
    python scripts/eval_default_model.py --bench              # also batch-8 vs batch-1 speed
    python scripts/eval_default_model.py --model diffbatch/models/shapes-dit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import shapes_data as sd  # noqa: E402


def load(folder: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts: list[str], seeds: list[int], steps: int, guidance: float):
    import inspect

    gens = [torch.Generator().manual_seed(s) for s in seeds]
    extra = {}
    if "use_resolution_binning" in inspect.signature(pipe.__call__).parameters:
        # PixArt: its resolution bins exist only for 256-2048 px models (shapes-dit: 64),
        # and its caption cleaning needs bs4 and ftfy (the captions need no cleaning)
        extra = {"use_resolution_binning": False, "clean_caption": False}
    out = pipe(
        prompts,
        height=64,
        width=64,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=gens,
        output_type="np",
        **extra,
    ).images
    return [(np.clip(im, 0, 1) * 255).round().astype(np.uint8) for im in out]


def make_grid(images, prompts, verdicts, path: Path, cols: int = 6, scale: int = 2) -> None:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    cell_w, img_h, text_h = 64 * scale + 20, 64 * scale, 52
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * cell_w, rows * (img_h + text_h)), (250, 250, 250))
    draw = ImageDraw.Draw(grid)
    for k, (im, prompt, ok) in enumerate(zip(images, prompts, verdicts, strict=True)):
        r, c = divmod(k, cols)
        x0, y0 = c * cell_w + 10, r * (img_h + text_h)
        grid.paste(Image.fromarray(im).resize((img_h, img_h), Image.NEAREST), (x0, y0 + 4))
        lines = textwrap.wrap(prompt, width=24)[:3]
        for i, line in enumerate(lines):
            draw.text((x0 - 6, y0 + img_h + 6 + 11 * i), line, fill=(20, 20, 20), font=font)
        mark = "ok" if ok else "miss"
        draw.text(
            (x0 + img_h - 22, y0 + img_h + 6 + 11 * len(lines)),
            mark,
            fill=(0, 130, 0) if ok else (200, 0, 0),
            font=font,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def bench(pipe, steps: int, guidance: float, repeats: int) -> dict:
    """images/s at batch 1 (8 calls) vs batch 8 (1 call), interleaved, after a warm-up."""
    prompts = sd.heldout_prompts(8, seed=1)
    generate(pipe, prompts[:1], [0], steps, guidance)
    generate(pipe, prompts, list(range(8)), steps, guidance)
    t1, t8 = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(8):
            generate(pipe, [prompts[i]], [i], steps, guidance)
        t1.append(time.perf_counter() - t)
        t = time.perf_counter()
        generate(pipe, prompts, list(range(8)), steps, guidance)
        t8.append(time.perf_counter() - t)
    b1, b8 = 8 / float(np.median(t1)), 8 / float(np.median(t8))
    return {"b1_images_per_s": b1, "b8_images_per_s": b8, "gain": b8 / b1, "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "diffbatch/models/shapes")
    ap.add_argument("--n", type=int, default=120, help="number of held-out prompts")
    ap.add_argument("--steps", type=int, default=None, help="default: diffbatch_defaults.json")
    ap.add_argument("--guidance", type=float, default=None)
    ap.add_argument(
        "--prompts",
        choices=["heldout", "train"],
        default="heldout",
        help="held-out triples (the score) or training triples (for comparison)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grid", type=Path, default=None,
                    help="default: docs/images/<model folder name with _>_grid.png")
    ap.add_argument("--grid-n", type=int, default=36)
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the scores here")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    defaults = json.loads((args.model / "diffbatch_defaults.json").read_text())
    steps = args.steps or defaults["num_inference_steps"]
    guidance = args.guidance if args.guidance is not None else defaults["guidance_scale"]
    pipe = load(args.model)

    if args.grid is None:
        args.grid = ROOT / "docs/images" / f"{args.model.name.replace('-', '_')}_grid.png"
    make_prompts = sd.heldout_prompts if args.prompts == "heldout" else sd.train_prompts
    prompts = make_prompts(args.n)
    assert all(sd.caption_split(p) == args.prompts for p in prompts)
    images: list[np.ndarray] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        chunk = prompts[i : i + args.batch]
        seeds = [args.seed + i + k for k in range(len(chunk))]
        images += generate(pipe, chunk, seeds, steps, guidance)
    gen_s = time.perf_counter() - t0

    hits = {"colour": 0, "shape": 0, "background": 0, "all": 0}
    per_shape: dict[str, list[int]] = {s: [0, 0] for s in sd.SHAPES}
    verdicts = []
    for im, p in zip(images, prompts, strict=True):
        m = sd.judge_matches(im, p)
        for k in ("colour", "shape", "background"):
            hits[k] += bool(m[k])
        ok = bool(m["colour"] and m["shape"] and m["background"])
        hits["all"] += ok
        verdicts.append(ok)
        want = sd.parse_caption(p)["shape"]
        per_shape[want][0] += bool(m["shape"])
        per_shape[want][1] += 1
    n = len(prompts)
    scores = {k: 100.0 * v / n for k, v in hits.items()}
    print(f"model {args.model}  steps {steps}  guidance {guidance}  prompts {n} ({args.prompts})")
    print(f"generation: {gen_s:.1f} s at batch {args.batch}, {args.threads} threads")
    print(f"colour adherence      {scores['colour']:5.1f}%  (shape's colour)")
    print(f"shape adherence       {scores['shape']:5.1f}%")
    print(f"background adherence  {scores['background']:5.1f}%")
    print(f"all three             {scores['all']:5.1f}%")
    for s, (k, m) in per_shape.items():
        print(f"  {s:9s} shape {k}/{m}")
    result = {
        "steps": steps,
        "guidance": guidance,
        "n": n,
        "scores": scores,
        "per_shape": per_shape,
    }
    if not args.no_grid:
        k = min(args.grid_n, n)
        make_grid(images[:k], prompts[:k], verdicts[:k], args.grid)
        print(f"wrote {args.grid}")
    if args.bench:
        b = bench(pipe, steps, guidance, args.bench_repeats)
        print(
            f"batch gain: batch 1 {b['b1_images_per_s']:.1f} img/s, batch 8 "
            f"{b['b8_images_per_s']:.1f} img/s -> {b['gain']:.2f}x"
        )
        result["bench"] = b
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
