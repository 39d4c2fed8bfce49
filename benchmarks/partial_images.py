"""What does a partial image cost?

A partial image is the wave's predicted clean latents of one sample, decoded by the
model's own VAE inside the forward (`diffbatch/pipelines/diffusers_previews.py`). It
costs the wave one VAE decode per previewed image, which every request of the wave
waits for, so it is measured two ways:

1. **In a wave**: the model runner (the code the worker runs) runs a wave of B
   requests at the model's default size and steps, (a) none asking for previews,
   (b) one request asking for 3, (c) every request asking for 3. Configurations
   alternate within each round (order flipped every round), each point is the median
   of the rounds; cost per preview = (wave time with - without) / previews taken.
2. **The decode alone**: one `vae.decode` of one latent, the building block, for the
   built-in models and for an SD-1.5-sized VAE (random weights: the compute is the
   same as the trained one's) at 512x512, where a preview's real cost shows; with
   `--sd15-unet`, beside it one SD-1.5-sized UNet forward of the same image with
   classifier-free guidance (a batch of 2), the cost of one denoising step, to put the
   decode in proportion.

    .venv/bin/python benchmarks/partial_images.py --out benchmarks/results/partial_images.json
    .venv/bin/python benchmarks/partial_images.py --device cuda --models tiny-sd --out ...
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from peers_servers import harness

PROMPT = "a large red circle on a white background"
PREVIEWS = 3


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wave_costs(model: str, device: str, batch_size: int, rounds: int) -> dict[str, Any]:
    """Part 1: median wave times without previews, with one request's, with all."""
    from diffbatch.config import EngineConfig
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
    from diffbatch.sched.output import SchedulerOutput
    from diffbatch.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig.from_options(model=model, executor="inproc",
                                                   device=device))
    info = runner.info()

    def wave(previewing: int) -> SchedulerOutput:
        requests = []
        for i in range(batch_size):
            params = SamplingParams(
                height=info.default_height, width=info.default_width,
                num_inference_steps=info.default_num_inference_steps,
                guidance_scale=info.default_guidance_scale, seed=i,
                partial_images=PREVIEWS if i < previewing else 0)
            request = DiffusionRequest(f"r{i}", PROMPT, params)
            request.key = SamplingParamsKey.from_params(params,
                                                        cfg_enabled=info.cfg_enabled(params))
            requests.append(request)
        return SchedulerOutput(wave_id=1, requests=requests, key=requests[0].key)

    configs = {"none": 0, "one": 1, "all": batch_size}
    times: dict[str, list[float]] = {name: [] for name in configs}
    counts: dict[str, int] = {}
    runner.execute_batch(wave(batch_size), on_partial_image=lambda p: None)  # warm-up
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            got: list[Any] = []
            _sync(device)
            start = time.perf_counter()
            runner.execute_batch(wave(configs[name]), on_partial_image=got.append)
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
            counts[name] = len(got)
    medians = {name: statistics.median(values) for name, values in times.items()}
    per_preview = {name: (medians[name] - medians["none"]) / counts[name]
                   for name in ("one", "all") if counts[name]}
    return {"model": model, "size": f"{info.default_width}x{info.default_height}",
            "steps": info.default_num_inference_steps, "batch_size": batch_size,
            "previews": counts, "wave_ms": medians, "wave_ms_rounds": times,
            "ms_per_preview": per_preview,
            "wave_ratio_all_vs_none": medians["all"] / medians["none"]}


def decode_cost(vae: Any, latent_shape: tuple[int, ...], device: str,
                repeats: int) -> float:
    """Part 2: median ms of one `vae.decode` of one latent."""
    import torch

    latents = torch.randn(latent_shape, device=device, dtype=vae.dtype)
    samples = []
    with torch.inference_mode():
        vae.decode(latents, return_dict=False)  # warm-up
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            vae.decode(latents, return_dict=False)
            _sync(device)
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def decode_costs(models: list[str], device: str, repeats: int,
                 sd15_sides: list[int]) -> list[dict[str, Any]]:
    import torch
    from diffusers import AutoencoderKL

    from diffbatch.pipelines.registry import load_pipeline

    found = []
    for model in models:
        pipeline = load_pipeline(model, device=device)
        vae = pipeline.pipe.vae
        info = pipeline.info()
        scale = int(pipeline.pipe.vae_scale_factor)
        shape = (1, vae.config.latent_channels, info.default_height // scale,
                 info.default_width // scale)
        found.append({"vae": model, "image": f"{info.default_width}x{info.default_height}",
                      "ms": decode_cost(vae, shape, device, repeats)})
    # SD 1.5's VAE layout (diffusers' AutoencoderKL config of runwayml/stable-diffusion-v1-5).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        sd15 = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512,
        ).to(device).eval()
    for side in sd15_sides:
        found.append({"vae": "sd15-layout", "image": f"{side}x{side}",
                      "ms": decode_cost(sd15, (1, 4, side // 8, side // 8), device,
                                        max(1, repeats // 3))})
    return found


def unet_step_cost(side: int, device: str, repeats: int) -> dict[str, Any]:
    """One SD-1.5-sized UNet forward with CFG (batch 2) at `side`: one denoising step."""
    import torch
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(  # runwayml/stable-diffusion-v1-5's UNet config
            block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
            attention_head_dim=8, layers_per_block=2, sample_size=side // 8,
        ).to(device).eval()
    latents = torch.randn(2, 4, side // 8, side // 8, device=device)
    text = torch.randn(2, 77, 768, device=device)
    samples = []
    with torch.inference_mode():
        unet(latents, 500, text)  # warm-up
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            unet(latents, 500, text)
            _sync(device)
            samples.append((time.perf_counter() - start) * 1e3)
    return {"unet": "sd15-layout, CFG batch 2", "image": f"{side}x{side}",
            "ms": statistics.median(samples)}


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()

    waves = report["waves"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.25
    labels = {"none": "no previews", "one": f"one request: {PREVIEWS}",
              "all": f"every request: {PREVIEWS}"}
    for k, (name, label) in enumerate(labels.items()):
        ratios = [w["wave_ms"][name] / w["wave_ms"]["none"] for w in waves]
        ax.bar([i + (k - 1) * width for i in range(len(waves))], ratios, width, label=label)
    ax.set_xticks(range(len(waves)),
                  [f"{w['model']} {w['size']}, {w['steps']} steps, B={w['batch_size']}"
                   for w in waves])
    ax.set_ylabel("wave time / wave without previews")
    ax.legend(fontsize=8)
    ax.set_title("What partial images add to a wave")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["shapes", "tiny-sd"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decode-repeats", type=int, default=9)
    parser.add_argument("--sd15-sides", nargs="*", type=int, default=[512],
                        help="image sides to decode with the SD-1.5-sized VAE (none: skip)")
    parser.add_argument("--sd15-unet", action="store_true",
                        help="also time one SD-1.5-sized UNet step at each --sd15-sides")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--out", default="benchmarks/results/partial_images.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    harness.set_thread_env(args.threads)
    report = harness.report_header("partial_images", args)
    report["waves"] = [wave_costs(m, args.device, args.batch_size, args.rounds)
                       for m in args.models]
    report["decodes"] = decode_costs(args.models, args.device, args.decode_repeats,
                                     args.sd15_sides)
    report["unet_steps"] = [unet_step_cost(side, args.device, 1) for side in args.sd15_sides
                            ] if args.sd15_unet else []
    for wave in report["waves"]:
        print(f"{wave['model']} {wave['size']} {wave['steps']} steps, B={wave['batch_size']}: "
              f"wave {wave['wave_ms']['none']:.1f} ms, with {wave['previews']['all']} "
              f"previews {wave['wave_ms']['all']:.1f} ms "
              f"(x{wave['wave_ratio_all_vs_none']:.3f}); per preview "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in wave["ms_per_preview"].items()))
    for decode in report["decodes"]:
        print(f"decode {decode['vae']} {decode['image']}: {decode['ms']:.2f} ms")
    for step in report["unet_steps"]:
        print(f"unet step {step['unet']} {step['image']}: {step['ms']:.2f} ms")
    harness.finish_report(report, args, plot)


if __name__ == "__main__":
    main()
