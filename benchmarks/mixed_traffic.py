"""Does traffic that mixes LoRA adapters batch as well as traffic on one adapter?

tiny-sd, 64x64, 4 steps, eight random rank-8 adapters served by name. Mixed traffic
picks an adapter with Zipf(1.0) popularity, and no adapter for 20% of requests; the
baseline sends the same load all on one adapter. One engine (worker process, default
batching) serves every configuration, in alternating order within each round, so
each ratio is paired inside one run; a second copy of the baseline ("twin") is the
noise floor.

  (a) closed loop: `--clients` clients, each sending its next request when its last
      one is answered, for `--seconds` per configuration. Bars: mixed throughput
      >= 0.85x one-adapter, mixed mean wave >= 0.8x, mixed p50 <= 1.2x.
  (b) Poisson arrivals at `--load` x the round's one-adapter closed-loop throughput,
      the same arrival times for every configuration. Reported with the same ratios.
  (c) wave cost: one wave of 8 requests on 8 distinct adapters, against the same 8
      requests as 8 waves of one (bar: <= 0.5x), the same wave all on one adapter and
      the same wave without adapters (reported), through the model runner in process.
  (d) without bars: mixed adapters with three sizes (64, 96, 128) and with step
      counts 2/4/8, in request mode and in step mode (a second engine), against the
      same mixes without adapters.

Run under the benchmark lock, as every benchmark here:

    flock /tmp/diffbatch-bench.lock .venv/bin/python benchmarks/mixed_traffic.py \\
        --out benchmarks/results/mixed_traffic.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from diffbatch import Engine, SamplingParams
from diffbatch.pipelines.registry import resolve_model_path

MODEL = "tiny-sd"
PROMPTS = ["a red circle", "a blue square", "a green cat", "a yellow dog", "a small house",
           "a tall tree", "a white boat", "a black car"]
NUM_ADAPTERS = 8
RANK = 8


# -- adapters ------------------------------------------------------------------------
def make_adapters(folder: str, count: int, rank: int) -> dict[str, str]:
    """`count` random LoRA adapters for tiny-sd's UNet attention, saved as diffusers
    writes them; returns name -> folder."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = resolve_model_path(MODEL)
    adapters = {}
    for i in range(count):
        unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
        unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=True,
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        with torch.no_grad():
            torch.manual_seed(100 + i)
            for name, param in unet.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.3)
        out = os.path.join(folder, f"style{i}")
        StableDiffusionPipeline.save_lora_weights(
            out, unet_lora_layers=convert_state_dict_to_diffusers(
                get_peft_model_state_dict(unet)), safe_serialization=True)
        adapters[f"style{i}"] = out
    return adapters


def zipf_choice(rng: random.Random, names: list[str], no_adapter: float) -> str | None:
    """An adapter by Zipf(1.0) popularity (the i-th name with weight 1/i), or None
    with probability `no_adapter`."""
    if rng.random() < no_adapter:
        return None
    return rng.choices(names, weights=[1.0 / (i + 1) for i in range(len(names))])[0]


# -- workloads -----------------------------------------------------------------------
def request_maker(kind: str, names: list[str], seed: int):
    """params(i) of workload `kind`: "mixed", "one" (all on names[0]), "sizes"/"steps"
    (mixed adapters with mixed sizes or step counts), "sizes-base"/"steps-base" (the
    same without adapters)."""
    rng = random.Random(seed)

    def params(i: int) -> SamplingParams:
        lora = None
        if kind in ("mixed", "sizes", "steps"):
            lora = zipf_choice(rng, names, 0.2)
        elif kind == "one":
            lora = names[0]
        size = rng.choice((64, 96, 128)) if kind.startswith("sizes") else 64
        steps = rng.choice((2, 4, 8)) if kind.startswith("steps") else 4
        return SamplingParams(height=size, width=size, num_inference_steps=steps, seed=i,
                              lora=lora)

    return params


async def closed_loop(engine: Engine, params: Any, clients: int, seconds: float
                      ) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    latencies: list[float] = []
    batches: list[int] = []
    counter = iter(range(10**9))

    async def client() -> None:
        while loop.time() < deadline:
            i = next(counter)
            start = loop.time()
            out = await engine.generate_async(PROMPTS[i % len(PROMPTS)], params(i))
            if not out.ok:
                raise RuntimeError(f"request failed: {out.error}")
            latencies.append(loop.time() - start)
            batches.append(out.batch_size)

    waves = engine.metrics.wave_sizes_sum_count()
    start = loop.time()
    await asyncio.gather(*(client() for _ in range(clients)))
    return _summary(engine, waves, latencies, batches, loop.time() - start)


async def open_loop(engine: Engine, params: Any, arrivals_s: list[float]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    batches: list[int] = []

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + arrivals_s[i] - loop.time()))
        submitted = loop.time()
        out = await engine.generate_async(PROMPTS[i % len(PROMPTS)], params(i))
        if not out.ok:
            raise RuntimeError(f"request failed: {out.error}")
        latencies.append(loop.time() - submitted)
        batches.append(out.batch_size)

    waves = engine.metrics.wave_sizes_sum_count()
    start = loop.time()
    await asyncio.gather(*(one(i) for i in range(len(arrivals_s))))
    return _summary(engine, waves, latencies, batches, loop.time() - start)


def _summary(engine: Engine, waves_before: tuple[float, float], latencies: list[float],
             batches: list[int], elapsed_s: float) -> dict[str, Any]:
    total, count = engine.metrics.wave_sizes_sum_count()
    num_waves = count - waves_before[1]
    return {
        "num_requests": len(latencies),
        "throughput_req_per_s": len(latencies) / elapsed_s,
        "p50_s": statistics.median(latencies),
        "p99_s": sorted(latencies)[int(0.99 * (len(latencies) - 1))],
        # request mode: requests per wave (metrics); step mode: the mean largest
        # denoiser batch each request was part of
        "mean_wave": (total - waves_before[0]) / num_waves if num_waves
        else statistics.fmean(batches),
        "mean_batch_per_request": statistics.fmean(batches),
    }


# -- wave cost -----------------------------------------------------------------------
def wave_cost(adapters: dict[str, str], rounds: int) -> dict[str, Any]:
    """Forward time of 8 requests (16 samples with CFG) in one wave on 8 distinct
    adapters vs 8 separate waves, vs one adapter for all, vs no adapter."""
    from diffbatch.config import EngineConfig
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParamsKey
    from diffbatch.sched.output import SchedulerOutput
    from diffbatch.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(EngineConfig(model=MODEL, max_loras=NUM_ADAPTERS))
    paths = [os.path.realpath(p) for p in adapters.values()]

    def requests(loras: list[str | None]) -> list[DiffusionRequest]:
        out = []
        for i, lora in enumerate(loras):
            params = SamplingParams(height=64, width=64, num_inference_steps=4,
                                    guidance_scale=5.0, seed=i, output_type="pt", lora=lora)
            request = DiffusionRequest(f"r{i}", PROMPTS[i], params)
            request.key = SamplingParamsKey.from_params(params, cfg_enabled=True,
                                                        per_request_guidance=True)
            out.append(request)
        return out

    def timed(waves: list[list[DiffusionRequest]]) -> float:
        start = time.perf_counter()
        for wave in waves:
            result = runner.execute_batch(SchedulerOutput(1, wave, wave[0].key))
            assert all(o.ok for o in result.outputs.values())
        return (time.perf_counter() - start) * 1000.0

    configs = {
        "mixed_one_wave": lambda: [requests(paths)],
        "mixed_eight_waves": lambda: [[r] for r in requests(paths)],
        "one_adapter_wave": lambda: [requests([paths[0]] * 8)],
        "no_adapter_wave": lambda: [requests([None] * 8)],
    }
    for make in configs.values():  # load every adapter, warm every path
        timed(make())
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            times[name].append(timed(configs[name]()))
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "ms": median, "ms_all": times,
        "vs_eight_waves": median["mixed_one_wave"] / median["mixed_eight_waves"],
        "vs_one_adapter": median["mixed_one_wave"] / median["one_adapter_wave"],
        "vs_no_adapter": median["mixed_one_wave"] / median["no_adapter_wave"],
    }


# -- the run -------------------------------------------------------------------------
def ratios(rows: list[dict[str, Any]], a: str, b: str) -> dict[str, float]:
    """Per-round ratios a/b of throughput, mean wave and p50; their medians."""
    out = {}
    for metric in ("throughput_req_per_s", "mean_wave", "p50_s"):
        out[metric] = statistics.median(r[a][metric] / r[b][metric] for r in rows)
    return out


def spread(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The twin's per-round ratios to the baseline: the noise floor."""
    return {metric: sorted(round(r["twin"][metric] / r["one"][metric], 3) for r in rows)
            for metric in ("throughput_req_per_s", "mean_wave", "p50_s")}


async def run(args: argparse.Namespace, adapters: dict[str, str]) -> dict[str, Any]:
    names = list(adapters)
    report: dict[str, Any] = {}
    with Engine(MODEL, lora_modules=adapters, max_loras=NUM_ADAPTERS,
                torch_num_threads=1) as engine:
        closed, poisson = [], []
        for r in range(args.rounds):
            configs = ["mixed", "one", "twin"]
            order = configs if r % 2 == 0 else list(reversed(configs))
            row: dict[str, Any] = {}
            for name in order:
                kind = "one" if name == "twin" else name
                row[name] = await closed_loop(engine, request_maker(kind, names, r),
                                              args.clients, args.seconds)
            closed.append(row)
            rate = args.load * row["one"]["throughput_req_per_s"]
            rng = random.Random(1000 + r)
            arrivals, t = [], 0.0
            while t < args.seconds:
                t += rng.expovariate(rate)
                arrivals.append(t)
            row = {"rate_req_per_s": rate}
            for name in order:
                kind = "one" if name == "twin" else name
                row[name] = await open_loop(engine, request_maker(kind, names, r), arrivals)
            poisson.append(row)
            print(f"round {r}: closed mixed/one throughput "
                  f"{closed[-1]['mixed']['throughput_req_per_s']:.2f}/"
                  f"{closed[-1]['one']['throughput_req_per_s']:.2f} req/s", flush=True)
        report["closed_loop"] = {"rounds": closed, "mixed_vs_one": ratios(closed, "mixed", "one"),
                                 "twin_vs_one": spread(closed)}
        report["poisson"] = {"rounds": poisson, "mixed_vs_one": ratios(poisson, "mixed", "one"),
                             "twin_vs_one": spread(poisson)}
        report["sizes_request_mode"] = await _mixes(engine, names, "sizes", args)
        report["steps_request_mode"] = await _mixes(engine, names, "steps", args)
    with Engine(MODEL, lora_modules=adapters, max_loras=NUM_ADAPTERS, torch_num_threads=1,
                step_execution=True, max_num_seqs=16) as engine:
        report["steps_step_mode"] = await _mixes(engine, names, "steps", args)
    return report


async def _mixes(engine: Engine, names: list[str], kind: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for r in range(args.mix_rounds):
        row = {}
        for name in ([kind, f"{kind}-base"] if r % 2 == 0 else [f"{kind}-base", kind]):
            row[name] = await closed_loop(engine, request_maker(name, names, r),
                                          args.clients, args.seconds)
        rows.append(row)
    return {"rounds": rows, "mixed_vs_base": ratios(rows, kind, f"{kind}-base")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mix-rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--wave-rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/mixed_traffic.json")
    args = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_adapters(folder, NUM_ADAPTERS, RANK)
        report: dict[str, Any] = {"started": started, "args": vars(args)}
        report["wave_cost"] = wave_cost(adapters, args.wave_rounds)
        print("wave cost:", json.dumps({k: round(v, 3) for k, v in report["wave_cost"].items()
                                        if isinstance(v, float)}), flush=True)
        report.update(asyncio.run(run(args, adapters)))
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    closed, poisson = report["closed_loop"]["mixed_vs_one"], report["poisson"]["mixed_vs_one"]
    report["bars"] = {
        "closed_throughput_ge_0.85": closed["throughput_req_per_s"] >= 0.85,
        "closed_mean_wave_ge_0.8": closed["mean_wave"] >= 0.8,
        "closed_p50_le_1.2": closed["p50_s"] <= 1.2,
        "poisson_mean_wave_ge_0.8": poisson["mean_wave"] >= 0.8,
        "poisson_p50_le_1.2": poisson["p50_s"] <= 1.2,
        "wave_vs_eight_waves_le_0.5": report["wave_cost"]["vs_eight_waves"] <= 0.5,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"closed": closed, "closed_twin": report["closed_loop"]["twin_vs_one"],
                      "poisson": poisson, "poisson_twin": report["poisson"]["twin_vs_one"],
                      "bars": report["bars"]}, indent=1))


if __name__ == "__main__":
    main()
