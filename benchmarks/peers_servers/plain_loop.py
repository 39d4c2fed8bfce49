"""The plain diffusers loop a user would write without diffbatch, timed, as a program.

Loads the model's diffusers pipeline with torch's defaults (this program sets no
thread count and no OpenMP setting; run it from an environment without them, as
`defaults.py` does, and it sees what a user's script sees), then for each batch size
B calls the pipeline with B prompts at a time (`pipeline.pipeline_call`: one
generator per image, the call diffbatch's adapter makes for a wave) until at least
`--num-images` images are made. Each batch size gets one untimed call first (the
first call of a shape pays allocations and lazy set-up). Prints one JSON object:

    {"torch_threads": 2, "load_s": 3.1,
     "batches": {"1": {"images": 48, "wall_s": ..., "images_per_s": ...,
                       "cpu_s_per_image": ...}, "8": {...}}}

    PYTHONPATH=benchmarks .venv/bin/python -m peers_servers.plain_loop \\
        --model tiny-sd --size 64 --steps 4 --batches 1 8 --num-images 48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def time_batch(pipe: Any, batch: int, size: int, steps: int, num_images: int) -> dict[str, Any]:
    """Images/s and CPU s/image of back-to-back calls of `batch` prompts."""
    from peers_servers.pipeline import ImageJob, pipeline_call

    def jobs(call: int) -> list[ImageJob]:
        return [ImageJob(f"a plain prompt {call * batch + i}", 1, size, size, steps, None, None,
                         call * batch + i) for i in range(batch)]

    pipeline_call(pipe, jobs(-1))  # untimed: the first call of this shape
    calls = -(-num_images // batch)
    start, cpu = time.perf_counter(), time.process_time()
    for call in range(calls):
        images = pipeline_call(pipe, jobs(call))
    images.cpu()  # on a GPU, the last call's kernels have finished once its images are here
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    made = calls * batch
    return {"images": made, "wall_s": wall, "images_per_s": made / wall,
            "cpu_s_per_image": cpu / made}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64, help="width and height")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                        help="batch sizes, timed in this order")
    parser.add_argument("--num-images", type=int, default=48,
                        help="images per batch size at least (whole calls)")
    parser.add_argument("--device", default=None,
                        help='torch device, e.g. "cuda" (default: the CPU, where '
                             "from_pretrained loads)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    from peers_servers.pipeline import load_pipeline

    pipe = load_pipeline(args.model, device=args.device)  # threads=None: torch's default
    import torch

    report: dict[str, Any] = {"torch_threads": torch.get_num_threads(),
                              "device": str(pipe.device),
                              "load_s": time.perf_counter() - start, "batches": {}}
    for batch in args.batches:
        report["batches"][str(batch)] = time_batch(pipe, batch, args.size, args.steps,
                                                   args.num_images)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
