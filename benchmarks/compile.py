"""Compiled forwards (`--compile`): served throughput, lone latency, mixed adapters, restart.

Per model of `--models` (a UNet and a transformer by default), three servers with the
same flags (`--max-num-seqs 16`, 4 LoRA adapters served by name): `eager`, `twin`
(eager again: its spread against `eager` is the noise floor) and `compiled`
(`--compile TARGET --compile-buckets B`). Rounds rotate the order; medians of
`--rounds`.

1. **Restart** (first): time from start to `/health` ready of an eager server, of a
   compiled one with an empty inductor cache (it compiles every bucket) and of the
   same compiled one started again (it reads the cache). Bar: the second compiled
   start <= 1.5x the eager start.
2. **Closed loop**: 16 clients; throughput and the server's mean wave. Bar: compiled /
   eager >= 1.8x with the same mean wave.
3. **Lone request**: one client; p50 latency. Bar: compiled <= 0.6x eager.
4. **Mixed adapters**: Poisson arrivals at 0.7x the eager server's closed-loop
   throughput, each request with one of 4 adapters; mean latency, and the compiled
   server's recompiles after warm-up. Bar: eager / compiled mean latency >= 1.5x,
   no recompile.
5. **On a device** (`--parts device`, `scripts/gpu_check.sh`): the denoiser forward
   alone at wave sizes `--device-waves` (1, 4, 16, 32), eager against compiled
   (`CompiledForward`, inductor) against compiled with CUDA graphs
   (`reduce-overhead`), on the built-in tiny-sd UNet and a PixArt-Sigma-sized
   transformer with random weights (28 blocks, width 1152) at `--device-size`. On a
   CPU, `--device-modes eager default dynamic` compares buckets with a dynamic batch
   dimension.

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/compile.py \\
        --out benchmarks/results/compile.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
from peers_servers import harness  # noqa: E402

from diffbatch.bench.serve import BenchConfig, run_benchmark  # noqa: E402

CLIENTS = 16
ADAPTERS = ("a0", "a1", "a2", "a3")
NAMES = ("eager", "twin", "compiled")


def adapters(model: str, folder: Path) -> list[str]:
    """`--lora-modules` entries for 4 random adapters of `model`."""
    from diffbatch.pipelines.registry import resolve_model_path
    from diffbatch.pipelines.tiny_lora import make_tiny_lora

    path = resolve_model_path(model)
    return [f"{name}={make_tiny_lora(path, folder / name, seed=i + 1)}"
            for i, name in enumerate(ADAPTERS)]


def spec(model: str, name: str, args: argparse.Namespace, loras: list[str],
         cache_dir: str) -> harness.ServerSpec:
    extra = ["--max-num-seqs", str(args.max_num_seqs), "--lora-modules", *loras]
    if name == "compiled":
        extra += ["--compile", args.target, "--compile-buckets", args.buckets,
                  "--compile-backend", args.backend]
    server = harness.diffbatch_defaults_spec(model, name=name, log_level="info",
                                             extra_args=extra)
    server.env["DIFFBATCH_CACHE_DIR"] = cache_dir
    return server


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# -- 1. restart ----------------------------------------------------------------------------
def restart(model: str, args: argparse.Namespace, loras: list[str],
            cache_dir: str) -> dict[str, Any]:
    """Seconds to ready: eager, compiled with an empty cache, compiled again, eager again."""
    seconds: dict[str, float] = {}
    hits: dict[str, float] = {}
    for label, name in (("eager", "eager"), ("compiled_cold", "compiled"),
                        ("compiled_warm", "compiled"), ("eager_again", "eager")):
        start = time.perf_counter()
        with harness.running([spec(model, name, args, loras, cache_dir)],
                             startup_timeout_s=args.startup_timeout_s) as servers:
            seconds[label] = time.perf_counter() - start
            hits[label] = metric(servers[name].base_url, "diffbatch_compile_cache_hits_total")
        print(f"{model} start {label}: {seconds[label]:.1f} s to ready (inductor cache hits "
              f"{hits[label]:.0f})", flush=True)
    eager = statistics.fmean([seconds["eager"], seconds["eager_again"]])
    return {"seconds": seconds, "cache_hits": hits,
            "warm_over_eager": seconds["compiled_warm"] / eager,
            "cold_over_eager": seconds["compiled_cold"] / eager}


# -- 2-4. served ---------------------------------------------------------------------------
def run(base_url: str, args: argparse.Namespace, seed: int, **kwargs: Any) -> dict[str, Any]:
    result = run_benchmark(BenchConfig(base_url=base_url, steps=args.steps, seed=seed,
                                       disable_tqdm=True, **kwargs))
    metrics = result.get("server_metrics") or {}
    return {"throughput": float(result["request_throughput"]),
            "p50_ms": result["p50_e2e_ms"], "mean_ms": result["mean_e2e_ms"],
            "mean_wave": metrics.get("mean_wave_size"), "failed": result["failed"]}


def served(model: str, args: argparse.Namespace, loras: list[str],
           cache_dir: str) -> dict[str, Any]:
    specs = [spec(model, name, args, loras, cache_dir) for name in NAMES]
    with harness.running(specs, one_at_a_time=True,
                         startup_timeout_s=args.startup_timeout_s) as servers:
        urls = {name: servers[name].base_url for name in NAMES}
        capacity = 0.0
        for name, url in urls.items():  # warm-up: waves of each size, every adapter loaded
            closed = run(url, args, 1, num_prompts=CLIENTS, max_concurrency=CLIENTS)
            run(url, args, 2, num_prompts=2 * len(ADAPTERS), max_concurrency=len(ADAPTERS),
                loras=ADAPTERS)
            if name == "eager":
                capacity = closed["throughput"]
        recompiles_before = metric(urls["compiled"], "diffbatch_compile_recompiles_total")
        rounds = []
        for r in range(args.rounds):
            order = list(NAMES[r % 3:] + NAMES[:r % 3])
            row: dict[str, Any] = {"order": order}
            for name in order:
                url = urls[name]
                row[name] = {
                    "closed": run(url, args, 100 + r, num_prompts=args.requests,
                                  max_concurrency=CLIENTS),
                    "lone": run(url, args, 200 + r, num_prompts=args.lone_requests,
                                max_concurrency=1),
                    "mixed": run(url, args, 300 + r, num_prompts=args.requests,
                                 request_rate=0.7 * capacity, loras=ADAPTERS),
                }
            rounds.append(row)
            print(f"{model} round {r} ({', '.join(order)}): " + "; ".join(
                f"{n} closed {row[n]['closed']['throughput']:.2f}/s wave "
                f"{row[n]['closed']['mean_wave'] or 0:.1f}, lone p50 "
                f"{row[n]['lone']['p50_ms']:.0f} ms, mixed mean "
                f"{row[n]['mixed']['mean_ms']:.0f} ms" for n in NAMES), flush=True)
        recompiles = metric(urls["compiled"], "diffbatch_compile_recompiles_total") \
            - recompiles_before
        eager_lora = metric(urls["compiled"], 'diffbatch_compile_eager_forwards_total'
                                              '{reason="lora"}')
    return summarize(rounds, capacity, recompiles, eager_lora)


def summarize(rounds: list[dict[str, Any]], capacity: float, recompiles: float,
              eager_lora: float) -> dict[str, Any]:
    def ratios(part: str, field: str, over: str, of: str = "eager") -> list[float]:
        return sorted(r[over][part][field] / r[of][part][field] for r in rounds)

    closed = ratios("closed", "throughput", "compiled")
    lone = ratios("lone", "p50_ms", "compiled")
    mixed = ratios("mixed", "mean_ms", "eager", of="compiled")  # eager / compiled latency
    return {
        "rounds": rounds,
        "eager_capacity_rps": capacity,
        "closed_compiled_over_eager": statistics.median(closed),
        "closed_twin_over_eager": ratios("closed", "throughput", "twin"),
        "mean_wave": {n: statistics.median(r[n]["closed"]["mean_wave"] or 0 for r in rounds)
                      for n in NAMES},
        "lone_p50_compiled_over_eager": statistics.median(lone),
        "lone_p50_twin_over_eager": ratios("lone", "p50_ms", "twin"),
        "mixed_eager_over_compiled_latency": statistics.median(mixed),
        "mixed_eager_over_twin_latency": ratios("mixed", "mean_ms", "eager", of="twin"),
        "mixed_recompiles_after_warmup": recompiles,
        "compiled_eager_forwards_lora": eager_lora,
    }


# -- 5. on a device ------------------------------------------------------------------------
def device(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from diffusers import PixArtTransformer2DModel

    from diffbatch.compile import CompileSettings
    from diffbatch.pipelines.interception.compiled import (
        CompiledForward,
        CompileStats,
        structural_twin,
    )
    from diffbatch.pipelines.registry import load_pipeline

    on = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if on == "cuda" else torch.float32
    waves = tuple(args.device_waves)
    side = args.device_size // 8
    unet = load_pipeline("tiny-sd").pipe.unet.to(on, dtype).eval()  # type: ignore[attr-defined]
    with torch.device(on):
        torch.manual_seed(0)
        dit = PixArtTransformer2DModel(
            sample_size=side, num_layers=args.device_layers, use_additional_conditions=False,
            caption_channels=4096, norm_type="ada_norm_single").to(dtype).eval()

    def unet_inputs(b: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(b, 4, 8, 8, device=on, dtype=dtype), torch.tensor(500, device=on)), \
            {"encoder_hidden_states": torch.randn(b, 77, 32, device=on, dtype=dtype),
             "return_dict": False}

    def dit_inputs(b: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(b, 4, side, side, device=on, dtype=dtype),), {
            "encoder_hidden_states": torch.randn(b, 120, 4096, device=on, dtype=dtype),
            "timestep": torch.full((b,), 500.0, device=on),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
            "return_dict": False}

    def timed_ms(module: torch.nn.Module, b: int, make: Any) -> float:
        times = []
        with torch.inference_mode():  # (as the worker runs: inference tensors throughout)
            call_args, call_kwargs = make(b)
            for i in range(args.device_iters + 2):
                if on == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                module(*call_args, **call_kwargs)
                if on == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:
                    times.append((time.perf_counter() - start) * 1000.0)
        return statistics.median(times)

    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if on == "cuda" else "cpu",
                              "size": args.device_size, "waves": list(waves)}
    models = (("tiny-sd unet", unet, unet_inputs),
              (f"pixart-sized {args.device_layers} blocks", dit, dit_inputs))
    for label, module, make in models[:args.device_models]:
        targets: dict[str, torch.nn.Module] = {}
        rows: dict[str, Any] = {}
        for mode in args.device_modes:
            if mode == "reduce-overhead" and on != "cuda":
                continue
            target = module
            start = time.perf_counter()
            if mode != "eager":
                target = structural_twin(module)
                dynamic = mode == "dynamic"
                settings = CompileSettings("denoiser", () if dynamic else waves, dynamic,
                                           args.backend, "default" if dynamic else mode, "")
                forward = CompiledForward(target, label, settings, CompileStats())
                with forward.capture(), torch.inference_mode():
                    call_args, call_kwargs = make(1)
                    target(*call_args, **call_kwargs)
                forward.warm()
            targets[mode] = target
            rows[mode] = {"compile_s": time.perf_counter() - start, "rounds": []}
        # the modes take turns within each round (the machine's load drifts)
        for r in range(args.rounds):
            for mode in list(targets)[r % len(targets):] + list(targets)[:r % len(targets)]:
                rows[mode]["rounds"].append({b: timed_ms(targets[mode], b, make) for b in waves})
        for mode, row in rows.items():
            row["ms"] = {b: statistics.median(rd[b] for rd in row["rounds"]) for b in waves}
            print(f"device {label} {mode}: " + ", ".join(
                f"b{b} {ms:.1f} ms" for b, ms in row["ms"].items())
                + f" (compile {row['compile_s']:.0f} s)", flush=True)
        result[label] = rows
    return result


def pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """The whole diffusers call of tiny-sd (text encoder, every UNet step, VAE decode) at
    each wave size, eager against `torch.compile` of its UNet with a static batch: the
    most that compiling the denoiser can give a request on this device, before HTTP,
    PNG encoding and scheduling add their share."""
    import torch

    from diffbatch.pipelines.registry import load_pipeline

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline("tiny-sd").pipe  # type: ignore[attr-defined]
    pipe.set_progress_bar_config(disable=True)
    unets = {"eager": pipe.unet, "compiled": torch.compile(pipe.unet, backend=args.backend)}
    waves = tuple(args.device_waves)

    def call_ms(b: int) -> float:
        generators = [torch.Generator().manual_seed(i) for i in range(b)]
        start = time.perf_counter()
        pipe(["a red circle on a white background"] * b, num_inference_steps=args.steps,
             height=args.pipeline_size, width=args.pipeline_size, generator=generators,
             output_type="pt")
        return (time.perf_counter() - start) * 1000.0

    rows: dict[str, Any] = {}
    for mode, unet in unets.items():
        pipe.unet = unet
        start = time.perf_counter()
        for b in waves:  # (compiles each wave size once)
            call_ms(b)
        rows[mode] = {"first_calls_s": time.perf_counter() - start, "rounds": []}
    for r in range(args.rounds):  # the modes take turns within each round
        for mode in list(unets)[r % 2:] + list(unets)[:r % 2]:
            pipe.unet = unets[mode]
            rows[mode]["rounds"].append(
                {b: statistics.median(call_ms(b) for _ in range(args.device_iters))
                 for b in waves})
    for row in rows.values():
        row["ms"] = {b: statistics.median(rd[b] for rd in row["rounds"]) for b in waves}
    rows["compiled_over_eager_speedup"] = {
        b: rows["eager"]["ms"][b] / rows["compiled"]["ms"][b] for b in waves}
    print("pipeline tiny-sd eager/compiled: " + ", ".join(
        f"b{b} {rows['eager']['ms'][b]:.0f}/{rows['compiled']['ms'][b]:.0f} ms ({x:.2f}x)"
        for b, x in rows["compiled_over_eager_speedup"].items()), flush=True)
    return {"size": args.pipeline_size, "steps": args.steps, "waves": list(waves), **rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-sd", "tiny-pixart"])
    parser.add_argument("--parts", nargs="+", default=["restart", "served"],
                        choices=["restart", "served", "device", "pipeline"],
                        help="device: the denoiser forward alone; pipeline: the whole "
                        "diffusers call, eager against a compiled UNet")
    parser.add_argument("--target", default="denoiser", choices=["denoiser", "denoiser+vae"])
    parser.add_argument("--buckets", default="2,8,32",
                        help="--compile-buckets of the compiled server")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48, help="per server per round")
    parser.add_argument("--lone-requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--startup-timeout-s", type=float, default=1800.0,
                        help="a compiled server's cold start compiles every bucket")
    parser.add_argument("--cache-dir", default=None,
                        help="DIFFBATCH_CACHE_DIR of the servers (default: a new empty one)")
    parser.add_argument("--device-size", type=int, default=512)
    parser.add_argument("--pipeline-size", type=int, default=64)
    parser.add_argument("--threads", type=harness.threads_arg, default=1,
                        help="torch threads of the pipeline part ('none': torch's default)")
    parser.add_argument("--device-layers", type=int, default=28)
    parser.add_argument("--device-waves", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--device-iters", type=int, default=5)
    parser.add_argument("--device-modes", nargs="+",
                        default=["eager", "default", "reduce-overhead"],
                        choices=["eager", "default", "reduce-overhead", "dynamic"],
                        help="default: buckets (--device-waves); dynamic: one graph with a "
                        "symbolic batch dimension")
    parser.add_argument("--device-models", type=int, default=2, choices=[1, 2],
                        help="1: the tiny-sd UNet only")
    parser.add_argument("--out", default="benchmarks/results/compile.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start_s = time.perf_counter()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="diffbatch-compile-cache-")
    report = harness.report_header("compile", args)
    if "device" in args.parts:
        report["device"] = device(args)
    if "pipeline" in args.parts:
        report["pipeline"] = pipeline(args)
    server_parts = {"restart", "served"} & set(args.parts)
    for model in args.models if server_parts else []:
        loras = adapters(model, Path(tempfile.mkdtemp(prefix=f"compile-loras-{model}-")))
        report[model] = {}
        if "restart" in args.parts:
            report[model]["restart"] = restart(model, args, loras, cache_dir)
        if "served" in args.parts:
            report[model]["served"] = result = served(model, args, loras, cache_dir)
            print(f"{model}: closed compiled/eager {result['closed_compiled_over_eager']:.2f}x "
                  f"(twin {', '.join(f'{x:.2f}' for x in result['closed_twin_over_eager'])}); "
                  f"lone p50 {result['lone_p50_compiled_over_eager']:.2f}x; mixed latency "
                  f"eager/compiled {result['mixed_eager_over_compiled_latency']:.2f}x, "
                  f"recompiles {result['mixed_recompiles_after_warmup']:.0f}", flush=True)
    harness.finish_report(report, args, plot, start_s=start_s)


def plot(report: dict[str, Any], path: str) -> None:
    """The four ratios per model, against their bars."""
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, values = [], []
    for model in report["args"]["models"]:
        part = report.get(model, {})
        if "served" in part:
            s = part["served"]
            for name, key in (("closed", "closed_compiled_over_eager"),
                              ("lone p50", "lone_p50_compiled_over_eager"),
                              ("mixed", "mixed_eager_over_compiled_latency")):
                labels.append(f"{model}\n{name}")
                values.append(s[key])
        if "restart" in part:
            labels.append(f"{model}\nrestart")
            values.append(part["restart"]["warm_over_eager"])
    for b, speedup in report.get("pipeline", {}).get("compiled_over_eager_speedup", {}).items():
        labels.append(f"pipeline\nb{b} speed-up")
        values.append(speedup)
    ax.bar(labels, values)
    ax.axhline(1.0, linestyle="--", color="grey")
    ax.set_ylabel("ratio (see docs/benchmarks.md)")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
