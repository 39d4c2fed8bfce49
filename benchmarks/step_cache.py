"""Step caching: what it costs in quality, what it saves in compute and throughput.

Three questions, on the trained transformer `shapes-dit` (`--model`, a diffusers folder):

1. **Quality and compute** (in process, the diffbatch pipeline, waves of `--batch`):
   the judge's scores (`scripts/shapes_data.py`) on the 120 held-out prompts without
   caching and with each of `--policies` at each of `--thresholds`, at the model's default
   steps and at twice them; and the share of request-steps whose tail blocks ran
   (computed / (computed + cached)). Bars: scores within 2 points of no caching; at
   2x default steps, tail blocks run for at most 0.6x of the request-steps.
2. **Served throughput** (`diffbatch serve`, 16 closed-loop clients): three servers
   per mode, `off`, `twin` (the same flags: its spread against `off` is the noise
   floor) and `cache` (`--step-cache first_block:T`, T = `--serve-threshold`), in
   request mode and in step mode (`--step-execution`); rounds rotate the order,
   median of `--rounds`. Bar: cache/off >= 1.4x in both modes.
3. **Mixed traffic** (request mode, the `cache` server): a closed-loop stream where
   every other request sends `"step_cache": "off"`, against a stream where all cache;
   mean wave from the server's `/metrics`. Bar: mixed >= 0.9x all-caching.
4. **On a device** (`--parts device`, `scripts/gpu_check.sh`): a PixArt-Sigma-sized
   transformer (28 blocks, width 1152) with random weights, built where it runs, at
   `--device-size` (1024); a wave of `--device-wave` requests denoised for
   `--device-steps` steps through the per-request step cache, half of them caching
   and half not, against the same wave without caching: wall time and the share of
   request-steps whose tail blocks ran. (Random weights say what the machinery costs
   and saves at that size, not what a trained model would cache.)

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/step_cache.py \\
        --model diffbatch/models/shapes-dit --out benchmarks/results/step_cache.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers_servers import harness  # noqa: E402

from diffbatch.bench.serve import BenchConfig, run_benchmark  # noqa: E402
from scripts import shapes_data as sd  # noqa: E402

CLIENTS = 16


# -- 1. quality and compute ----------------------------------------------------------------
def quality(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
    from diffbatch.pipelines.interface import DiffusionRequestBatch
    from diffbatch.pipelines.registry import resolve_model_path
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParams, SamplingParamsKey

    torch.set_num_threads(args.threads)
    pipeline = DiffusersT2IPipeline.from_pretrained(resolve_model_path(str(args.model)))
    info = pipeline.info()
    prompts = sd.heldout_prompts(args.num_prompts)
    results: dict[str, Any] = {}
    for steps in (info.default_num_inference_steps, 2 * info.default_num_inference_steps):
        for spec in ["off", *(f"{policy}:{t:g}" for policy in args.policies
                              for t in args.thresholds)]:
            hits = {"colour": 0, "shape": 0, "background": 0, "all": 0}
            computed = cached = 0
            start = time.perf_counter()
            for first in range(0, len(prompts), args.batch):
                requests = []
                for i, prompt in enumerate(prompts[first:first + args.batch], first):
                    params = SamplingParams(
                        height=info.default_height, width=info.default_width,
                        num_inference_steps=steps, guidance_scale=info.default_guidance_scale,
                        seed=args.seed + i, output_type="pt", step_cache=spec)
                    request = DiffusionRequest(f"q{i}", prompt, params)
                    request.key = SamplingParamsKey.from_params(
                        params, cfg_enabled=info.cfg_enabled(params))
                    requests.append(request)
                generators = [torch.Generator().manual_seed(r.sampling_params.seed)
                              for r in requests]
                outputs = pipeline.forward(DiffusionRequestBatch(requests, generators))
                for request, output in zip(requests, outputs, strict=True):
                    image = (output.images[0].permute(1, 2, 0).clamp(0, 1) * 255).round()
                    verdict = sd.judge_matches(image.to(torch.uint8).numpy(), request.prompt)
                    for name in ("colour", "shape", "background"):
                        hits[name] += bool(verdict[name])
                    hits["all"] += all(bool(verdict[n]) for n in ("colour", "shape",
                                                                   "background"))
                    computed += output.computed_steps or steps
                    cached += output.cached_steps or 0
            scores = {k: 100.0 * v / len(prompts) for k, v in hits.items()}
            row = {"steps": steps, "step_cache": spec, "scores": scores,
                   "tail_share": computed / (computed + cached),
                   "seconds": time.perf_counter() - start}
            results[f"{spec}@{steps}"] = row
            print(f"quality {spec:>18} @ {steps:>2} steps: all {scores['all']:5.1f} colour "
                  f"{scores['colour']:5.1f} shape {scores['shape']:5.1f} background "
                  f"{scores['background']:5.1f}; tail blocks ran {row['tail_share']:.2f} of "
                  f"request-steps ({row['seconds']:.0f} s)", flush=True)
    return results


# -- 2. served throughput ------------------------------------------------------------------
def specs(args: argparse.Namespace, step_mode: bool) -> list[harness.ServerSpec]:
    mode = ["--step-execution"] if step_mode else []
    common = ["--max-num-seqs", str(args.max_num_seqs), *mode]
    cache = ["--step-cache", f"first_block:{args.serve_threshold:g}"]
    return [harness.diffbatch_defaults_spec(str(args.model), name=name, log_level="warning",
                                            extra_args=[*common, *extra])
            for name, extra in (("off", []), ("twin", []), ("cache", cache))]


def served(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for mode in args.modes:
        with harness.running(specs(args, mode == "step"), one_at_a_time=True) as servers:
            names = list(servers)
            for server in servers.values():  # warm-up: a wave of each size
                run_benchmark(BenchConfig(base_url=server.base_url, num_prompts=CLIENTS,
                                          max_concurrency=CLIENTS, steps=args.steps,
                                          disable_tqdm=True))
            rounds = []
            for r in range(args.rounds):
                order = names[r % 3:] + names[:r % 3]
                rps = {}
                for name in order:
                    result = run_benchmark(BenchConfig(
                        base_url=servers[name].base_url, num_prompts=args.requests,
                        max_concurrency=CLIENTS, steps=args.steps, seed=1000 * r,
                        disable_tqdm=True))
                    rps[name] = float(result["request_throughput"])
                rounds.append(rps)
                print(f"{mode} round {r} ({', '.join(order)}): " + ", ".join(
                    f"{n} {rps[n]:.2f}/s" for n in names), flush=True)
            if mode == "request" and args.mixed:
                report["mixed"] = mixed(servers["cache"].base_url, args)
        report[mode] = {
            "rounds": rounds,
            "cache_over_off": statistics.median(r["cache"] / r["off"] for r in rounds),
            "twin_over_off": sorted(r["twin"] / r["off"] for r in rounds),
        }
        print(f"{mode} mode: cache/off {report[mode]['cache_over_off']:.2f}x (median), twin/off "
              + ", ".join(f"{x:.2f}" for x in report[mode]["twin_over_off"]), flush=True)
    return report


# -- 3. mixed traffic --------------------------------------------------------------------------
async def _closed_loop(base_url: str, num: int, steps: int | None,
                       every_other_off: bool) -> tuple[float, float]:
    """`num` requests from 16 clients; the waves' (sum of sizes, count) over the run."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        before = _waves((await client.get("/metrics")).text)
        counter = iter(range(num))

        async def worker() -> None:
            for i in counter:
                body: dict[str, Any] = {"prompt": sd.heldout_prompts(16)[i % 16],
                                        "size": "64x64", "seed": i}
                if steps is not None:
                    body["num_inference_steps"] = steps
                if every_other_off and i % 2:
                    body["step_cache"] = "off"
                response = await client.post("/v1/images/generations", json=body)
                response.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
        after = _waves((await client.get("/metrics")).text)
    return after[0] - before[0], after[1] - before[1]


def _waves(text: str) -> tuple[float, float]:
    values = {}
    for line in text.splitlines():
        for name in ("diffbatch_wave_size_requests_sum", "diffbatch_wave_size_requests_count"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return (values.get("diffbatch_wave_size_requests_sum", 0.0),
            values.get("diffbatch_wave_size_requests_count", 0.0))


def mixed(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    for r in range(args.rounds):
        means = {}
        for name in (("all", "half") if r % 2 == 0 else ("half", "all")):
            total, count = asyncio.run(_closed_loop(base_url, args.requests, args.steps,
                                                    every_other_off=name == "half"))
            means[name] = total / count if count else 0.0
        rounds.append(means)
        print(f"mixed round {r}: mean wave all-caching {means['all']:.2f}, half caching "
              f"{means['half']:.2f}", flush=True)
    return {"rounds": rounds,
            "half_over_all": statistics.median(r["half"] / r["all"] for r in rounds)}


# -- 4. on a device ---------------------------------------------------------------------------
def device(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from diffusers import PixArtTransformer2DModel

    from diffbatch.pipelines.interception.rows import RowPlan, row_plan
    from diffbatch.pipelines.interception.step_cache import StepCache
    from diffbatch.step_cache import StepCacheConfig

    on = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if on == "cuda" else torch.float32
    side = args.device_size // 8  # latent side (an 8x VAE)
    torch.manual_seed(0)
    with torch.device(on):
        model = PixArtTransformer2DModel(
            sample_size=side, num_layers=args.device_layers, use_additional_conditions=False,
            caption_channels=4096, norm_type="ada_norm_single").to(dtype).eval()
    cache = StepCache(model)
    wave = args.device_wave
    ids = tuple(f"d{i}" for i in range(wave))
    latents = torch.randn(wave, 4, side, side, device=on, dtype=dtype)
    text = torch.randn(wave, 120, 4096, device=on, dtype=dtype)
    spec = StepCacheConfig.parse(f"first_block:{args.serve_threshold:g}")

    def run(caching: tuple[str, ...]) -> tuple[float, float]:
        x = latents.clone()
        plan = RowPlan(ids, ((),) * wave, 1, 1)
        with torch.inference_mode(), row_plan(plan), cache.open(
                {rid: spec for rid in caching}) as caches:
            if on == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for step in range(args.device_steps):
                t = torch.full((wave,), 999.0 * (1 - step / args.device_steps), device=on)
                out = model(x, encoder_hidden_states=text, timestep=t,
                            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                            return_dict=False)[0][:, :4]
                x = x - out / args.device_steps
            if on == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        computed = sum(c.computed_steps for c in caches.values()) + \
            (wave - len(caching)) * args.device_steps
        return seconds, computed / (wave * args.device_steps)

    run(())  # warm-up
    rounds = []
    for _ in range(args.rounds):
        off_s, _ = run(())
        half_s, half_share = run(ids[: wave // 2])
        all_s, all_share = run(ids)
        twin_s, _ = run(())
        rounds.append({"off_s": off_s, "twin_s": twin_s, "half_s": half_s, "all_s": all_s,
                       "half_tail_share": half_share, "all_tail_share": all_share})
    result = {"device": torch.cuda.get_device_name() if on == "cuda" else "cpu",
              "size": args.device_size, "wave": wave, "steps": args.device_steps,
              "threshold": args.serve_threshold, "rounds": rounds}
    for name in ("twin", "half", "all"):
        result[f"off_over_{name}"] = statistics.median(r["off_s"] / r[f"{name}_s"]
                                                       for r in rounds)
    print(f"device {result['device']} {args.device_size}^2, wave {wave}, "
          f"{args.device_steps} steps: speed-up all caching {result['off_over_all']:.2f}x "
          f"(tail share {rounds[-1]['all_tail_share']:.2f}), half caching "
          f"{result['off_over_half']:.2f}x, twin {result['off_over_twin']:.2f}x", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "diffbatch/models/shapes-dit")
    parser.add_argument("--parts", nargs="+", default=["quality", "served"],
                        choices=["quality", "served", "device"])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--policies", nargs="+", default=["first_block"],
                        choices=["first_block", "taylorseer"], help="quality part")
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="quality part's torch threads")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--serve-threshold", type=float, default=0.2)
    parser.add_argument("--modes", nargs="+", default=["request", "step"],
                        choices=["request", "step"])
    parser.add_argument("--steps", type=int, default=None,
                        help="served: steps per request (default: the model's)")
    parser.add_argument("--requests", type=int, default=48, help="served: per server per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--no-mixed", dest="mixed", action="store_false")
    parser.add_argument("--device-size", type=int, default=1024)
    parser.add_argument("--device-layers", type=int, default=28)
    parser.add_argument("--device-wave", type=int, default=8)
    parser.add_argument("--device-steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/step_cache.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start_s = time.perf_counter()
    args.model = str(args.model)
    report = harness.report_header("step_cache", args)
    if "quality" in args.parts:
        report["quality"] = quality(args)
    if "served" in args.parts:
        report["served"] = served(args)
    if "device" in args.parts:
        report["device"] = device(args)
    harness.finish_report(report, args, plot, start_s=start_s)


def plot(report: dict[str, Any], path: str) -> None:
    """The share of request-steps whose tail blocks ran, per setting (quality part),
    and the speed-ups measured (served and device parts)."""
    plt = harness.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rows = report.get("quality", {})
    left.bar(list(rows), [r["tail_share"] for r in rows.values()])
    left.set_ylabel("tail blocks ran / request-steps")
    left.tick_params(axis="x", labelrotation=60, labelsize=7)
    speedups = {f"{m} cache/off": report["served"][m]["cache_over_off"]
                for m in ("request", "step") if m in report.get("served", {})}
    if "device" in report:
        speedups["device all/off"] = report["device"]["off_over_all"]
        speedups["device half/off"] = report["device"]["off_over_half"]
    right.bar(list(speedups), list(speedups.values()))
    right.axhline(1.4, linestyle="--", color="grey")
    right.set_ylabel("speed-up")
    right.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
