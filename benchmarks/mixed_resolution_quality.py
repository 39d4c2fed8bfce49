"""Does packing sizes into one forward change what `shapes-dit` draws?

The 120 held-out prompts of `scripts/eval_default_model.py`, every other one at 96x96
and the rest at 64x64, seed 1234 + index, run twice through an in-process engine with
waves of up to 8: once with size in the key (waves of one size), once with
`mixed_resolution=True` (64x64 and 96x96 requests packed into one transformer
forward). Reported: the judge's scores of each run and the largest pixel difference
between the two runs' images (0-255). Bar (#59): packed within 2 points of unpacked.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/mixed_resolution_quality.py \\
        --out benchmarks/results/mixed_resolution_quality.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peers_servers import harness  # noqa: E402

from diffbatch import Engine, SamplingParams  # noqa: E402
from scripts import shapes_data as sd  # noqa: E402


def run(packed: bool, prompts: list[str], params: list[SamplingParams],
        threads: int) -> tuple[dict[str, float], list]:
    start = time.perf_counter()
    with Engine("shapes-dit", executor="inproc", mixed_resolution=packed, max_num_seqs=8,
                calibration_budget_s=0, torch_num_threads=threads) as engine:
        results = engine.generate(prompts, params, use_tqdm=False)
    images = [r.images[0] for r in results]
    hits = {"colour": 0, "shape": 0, "background": 0, "all": 0}
    for image, prompt in zip(images, prompts, strict=True):
        match = sd.judge_matches(image, prompt)
        for key in ("colour", "shape", "background"):
            hits[key] += bool(match[key])
        hits["all"] += all(match.values())
    scores = {key: 100 * value / len(prompts) for key, value in hits.items()}
    scores["seconds"] = time.perf_counter() - start
    return scores, images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=120, help="held-out prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/mixed_resolution_quality.json")
    args = parser.parse_args()
    prompts = sd.heldout_prompts(120)[:args.n]
    sizes = [64 if i % 2 == 0 else 96 for i in range(len(prompts))]
    params = [SamplingParams(height=s, width=s, seed=1234 + i) for i, s in enumerate(sizes)]
    report = harness.report_header("mixed_resolution_quality", args)
    unpacked, a = run(False, prompts, params, args.threads)
    packed, b = run(True, prompts, params, args.threads)
    report["unpacked"], report["packed"] = unpacked, packed
    report["max_pixel_diff_0_255"] = max(
        float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max())
        for x, y in zip(a, b, strict=True))
    report["largest_drop_points"] = max(unpacked[k] - packed[k]
                                        for k in ("colour", "shape", "background", "all"))
    for name in ("unpacked", "packed"):
        s = report[name]
        print(f"{name:9s} all {s['all']:.1f} colour {s['colour']:.1f} shape {s['shape']:.1f} "
              f"background {s['background']:.1f} ({s['seconds']:.0f} s)")
    print(f"largest drop {report['largest_drop_points']:.1f} points; "
          f"largest pixel difference {report['max_pixel_diff_0_255']:.0f}/255")
    harness.write_report(report, args.out)


if __name__ == "__main__":
    main()
