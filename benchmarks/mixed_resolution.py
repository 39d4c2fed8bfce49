"""Mixed resolutions: one packed transformer call against separate per-size calls.

Question: is one denoiser call over requests of different sizes (`TokenPacker`:
token-wise layers on all requests' tokens, attention per size group) cheaper than
one call per size, as a wave of size-keyed requests would run them?

For each model and size mix, the denoiser inputs are the pipeline's own (captured
from its first denoiser call for each size, CFG doubling included), and each round
times, in alternating order: the separate calls (one per size, each over that size's
requests), the packed call, and the separate calls again (the twin: the noise floor).
Reported per mix: the median over rounds of packed/separate and twin/separate.

`--serve` answers the serving question instead: 16 closed-loop clients, each
request of a size drawn from 64/96/128 (`--sizes`), `--steps` steps, against one
engine per configuration (worker process, auto batching), all started up front and
measured in alternating order each round, `--window-s` seconds each: `mixed`
(`mixed_resolution=True`), `keyed` (size in the key, the default) and `twin` (a second
keyed engine: the noise floor). Reported per model: images/s and mean wave (requests
per wave, from the engine's wave log), and the medians over rounds of mixed/keyed
and twin/keyed.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/mixed_resolution.py \
        --out benchmarks/results/mixed_resolution.json
    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/mixed_resolution.py \
        --serve --out benchmarks/results/mixed_resolution_serve.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import statistics
import subprocess
import threading
import time
from typing import Any

import torch

from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interception import FusionPoint, ModuleCall
from diffbatch.pipelines.interception.packed_tokens import TokenPacker
from diffbatch.pipelines.registry import resolve_model_path

MIXES = {  # name -> sizes, one entry per request
    "64+128": (64, 128),
    "64+96+128": (64, 96, 128),
    "4x64+1x128": (64, 64, 64, 64, 128),
}
_SHARED = frozenset({"txt_ids", "img_ids"})


class _Captured(Exception):
    pass


def capture_call(pipeline: DiffusersT2IPipeline, size: int, count: int) -> dict[str, Any]:
    """The keyword arguments of the pipeline's first denoiser call for `count`
    requests of `size`x`size` (the pipeline's defaults otherwise)."""
    transformer = pipeline.pipe.transformer
    seen: dict[str, Any] = {}

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.update(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
        raise _Captured

    kwargs: dict[str, Any] = {"guidance_scale": pipeline.info().default_guidance_scale}
    if "use_resolution_binning" in inspect.signature(type(pipeline.pipe).__call__).parameters:
        kwargs["use_resolution_binning"] = False  # PixArt: no bins for tiny sample sizes
        kwargs["clean_caption"] = False
    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pipeline.pipe(prompt=["a red square on a blue field"] * count, height=size, width=size,
                      num_inference_steps=2, output_type="latent", **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen


def time_calls(run: Any, repeats: int) -> float:
    """Median ms of `repeats` runs of `run()` (waiting for the GPU, if any)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def measure_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    pipeline = DiffusersT2IPipeline.from_pretrained(resolve_model_path(model), device=args.device)
    transformer = pipeline.pipe.transformer
    packer = TokenPacker(transformer)
    point = FusionPoint(transformer, "forward", "step", "transformer", _SHARED)
    rows: dict[str, Any] = {}
    for mix, sizes in MIXES.items():
        counts = {s: sizes.count(s) for s in dict.fromkeys(sizes)}
        with torch.inference_mode():
            inputs = {s: capture_call(pipeline, s, n) for s, n in counts.items()}
            calls = [ModuleCall(point, transformer.forward, (), kw) for kw in inputs.values()]

            def separate(inputs: dict[int, Any] = inputs) -> None:
                for kw in inputs.values():
                    transformer.forward(**kw)

            def packed(calls: list[ModuleCall] = calls) -> None:
                packer.pack_calls(calls)

            for _ in range(2):  # warm-up
                separate()
                packed()
            rounds = []
            for r in range(args.rounds):
                # each repeat times the three back to back (order alternating), so a
                # repeat's ratios see the same machine state
                times: dict[str, list[float]] = {"separate": [], "packed": [], "twin": []}
                for j in range(args.repeats):
                    order = [("separate", separate), ("packed", packed), ("twin", separate)]
                    if (r + j) % 2:
                        order.reverse()
                    for name, fn in order:
                        times[name].append(time_calls(fn, 1))
                rounds.append({
                    **{name: statistics.median(t) for name, t in times.items()},
                    "packed_ratio": statistics.median(
                        p / q for p, q in zip(times["packed"], times["separate"], strict=True)),
                    "twin_ratio": statistics.median(
                        p / q for p, q in zip(times["twin"], times["separate"], strict=True)),
                })
        rows[mix] = {
            "sizes": list(sizes),
            "samples_per_call": {str(s): int(kw["hidden_states"].shape[0])
                                 for s, kw in inputs.items()},
            "rounds": rounds,
            "separate_ms": statistics.median(t["separate"] for t in rounds),
            "packed_ms": statistics.median(t["packed"] for t in rounds),
            "packed_over_separate": statistics.median(t["packed_ratio"] for t in rounds),
            "twin_over_separate": statistics.median(t["twin_ratio"] for t in rounds),
        }
        row = rows[mix]
        print(f"{model:12s} {mix:11s} separate {row['separate_ms']:7.2f} ms  packed "
              f"{row['packed_ms']:7.2f} ms  packed/separate {row['packed_over_separate']:.3f}"
              f"  twin {row['twin_over_separate']:.3f}", flush=True)
    return rows


def serve_window(engine: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """`args.clients` closed-loop clients for `args.window_s`: images/s, mean wave."""
    from diffbatch import SamplingParams

    stop_at = time.perf_counter() + args.window_s
    counts = [0] * args.clients
    first_wave = engine.wave_log.last_id + 1

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < stop_at:
            size = rng.choice(args.sizes)
            params = SamplingParams(height=size, width=size, num_inference_steps=args.steps,
                                    seed=rng.randrange(1 << 30))
            [out] = engine.generate([f"a shape number {index}"], [params], use_tqdm=False)
            if out.ok and time.perf_counter() < stop_at:
                counts[index] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    waves = [w for w in engine.wave_log.since(first_wave - 1) if w.num_requests]
    return {"images_per_s": sum(counts) / args.window_s, "elapsed_s": elapsed,
            "num_waves": len(waves),
            "mean_wave": statistics.mean(w.num_requests for w in waves) if waves else 0.0}


def measure_serving(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from diffbatch import Engine

    configs = {"mixed": True, "keyed": False, "twin": False}
    options = {} if args.max_num_seqs is None else {
        "max_num_seqs": args.max_num_seqs, "request_batch_max_wait_ms": 0}
    engines = {name: Engine(model, mixed_resolution=mixed, device=args.device, **options)
               for name, mixed in configs.items()}
    try:
        for engine in engines.values():  # warm: each engine's curve at the mix
            serve_window(engine, argparse.Namespace(**{**vars(args), "window_s": 2.0}), 0)
        rounds = []
        for r in range(args.rounds):
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            rounds.append({name: serve_window(engines[name], args, r + 1) for name in names})
            row = rounds[-1]
            print(f"{model:12s} round {r}: " + "  ".join(
                f"{n} {row[n]['images_per_s']:.2f} img/s wave {row[n]['mean_wave']:.2f}"
                for n in configs), flush=True)
        # the capacity each engine learned at the model's default size (mixed: in units)
        capacity = {name: engine.policy.cost.capacity(engine.policy.default_shape)
                    if args.max_num_seqs is None else args.max_num_seqs
                    for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()

    def ratio(name: str, what: str) -> float:
        return statistics.median(t[name][what] / t["keyed"][what] for t in rounds)

    result = {
        "rounds": rounds,
        "capacity_at_default_size": capacity,
        "mixed_over_keyed_throughput": ratio("mixed", "images_per_s"),
        "twin_over_keyed_throughput": ratio("twin", "images_per_s"),
        "mixed_over_keyed_mean_wave": ratio("mixed", "mean_wave"),
        "twin_over_keyed_mean_wave": ratio("twin", "mean_wave"),
    }
    print(f"{model:12s} throughput mixed/keyed {result['mixed_over_keyed_throughput']:.3f} "
          f"(twin {result['twin_over_keyed_throughput']:.3f}); mean wave mixed/keyed "
          f"{result['mixed_over_keyed_mean_wave']:.2f} "
          f"(twin {result['twin_over_keyed_mean_wave']:.2f}); capacity at the default size "
          f"{capacity}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-sd3", "tiny-pixart", "tiny-flux"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=15,
                        help="paired timings per round (each: separate, packed, twin)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    parser.add_argument("--serve", action="store_true",
                        help="measure serving a size mix with and without mixed_resolution")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="a fixed wave capacity (no admission wait) instead of auto")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    measure = measure_serving if args.serve else measure_model
    results: dict[str, Any] = {}
    # the file is rewritten after each model: a run cut short keeps what it measured
    for model in args.models:
        results[model] = measure(model, args)
        record = {
            "benchmark": "mixed_resolution",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit, "machine": platform.processor() or platform.machine(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
            and args.device != "cpu" else "cpu",
            "torch_threads": torch.get_num_threads(), "rounds": args.rounds,
            "repeats": args.repeats, "serve" if args.serve else "micro": results,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
        }
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
