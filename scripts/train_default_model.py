"""Train diffbatch's built-in default model ("shapes") from scratch, on CPU, offline.

Writes a stock diffusers ``StableDiffusionPipeline`` folder (tokenizer, text encoder, UNet,
VAE, scheduler) plus ``diffbatch_defaults.json`` to ``diffbatch/models/shapes/`` and the loss
curve to ``docs/images/shapes_loss.png``. See docs/default_model.md.

Stages (all from a fixed seed):
  1. a word-level CLIP BPE tokenizer over the caption words (byte symbols kept as fallback);
  2. the autoencoder (AutoencoderKL, 64x64x3 <-> 16x16x4) on rendered scenes;
  3. a pool of training scenes is rendered once and encoded to latents;
  4. the UNet and the CLIP text encoder jointly, v-prediction on a zero-terminal-SNR
     schedule, 10% empty captions (for classifier-free guidance), EMA weights are saved.

Usage:  python scripts/train_default_model.py            # the full run (~1 h on 2 idle cores)
        python scripts/train_default_model.py --quick    # a smoke test (~15 s)
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffbatch.pipelines.tiny import bytes_to_unicode  # noqa: E402
from scripts import shapes_data as sd  # noqa: E402

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_LEN = 20


# ----------------------------------------------------------------------------- tokenizer


def learn_word_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges (most frequent pair first) until every word is one symbol."""
    segs = {w: [*w[:-1], w[-1] + "</w>"] for w in words}
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in segs.values()):
        pairs: Counter[tuple[str, str]] = Counter()
        for s in segs.values():
            for a, b in itertools.pairwise(s):
                pairs[(a, b)] += 1
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for w, s in segs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            segs[w] = out
    return merges


def tokenizer_files() -> dict[str, str]:
    """vocab.json and merges.txt of the word-level CLIP BPE tokenizer (deterministic)."""
    words = sd.caption_vocabulary()
    merges = learn_word_merges(words)
    symbols = list(bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols]
    for a, b in merges:
        if a + b not in vocab_list:
            vocab_list.append(a + b)
    vocab_list += [BOS, EOS]
    return {
        "vocab.json": json.dumps({t: i for i, t in enumerate(vocab_list)}),
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
    }


def build_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    files = tokenizer_files()
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    vocab = json.loads(files["vocab.json"])
    words = sd.caption_vocabulary()
    tok = CLIPTokenizer.from_pretrained(
        str(folder),
        model_max_length=MAX_LEN,
        pad_token=EOS,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=EOS,
    )
    # The transformers-5 trap: a tokenizer that silently ignored its files.
    assert len(tok) == len(vocab), (len(tok), len(vocab))
    for w in words:
        ids = tok(w, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] == vocab[w + "</w>"], (w, ids)
    return tok


# ----------------------------------------------------------------------------- models


def build_models(vocab_size: int, bos_id: int, eos_id: int, args):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    text_cfg = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=args.text_dim,
        intermediate_size=args.text_dim * 2,
        num_hidden_layers=args.text_layers,
        num_attention_heads=4,
        max_position_embeddings=MAX_LEN,
        projection_dim=args.text_dim,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    text_encoder = CLIPTextModel(text_cfg)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=tuple(args.vae_channels),
        layers_per_block=1,
        latent_channels=args.latent_channels,
        # Few groups (several channels each): a GroupNorm with 1-2 channels per group before
        # conv_out normalises the absolute colour away and the decoder cannot recover it.
        norm_num_groups=4,
        sample_size=sd.IMAGE_SIZE,
        mid_block_add_attention=False,
    )
    ch = tuple(args.unet_channels)
    unet = UNet2DConditionModel(
        sample_size=sd.IMAGE_SIZE // 4,
        in_channels=args.latent_channels,
        out_channels=args.latent_channels,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=ch,
        layers_per_block=args.unet_layers,
        cross_attention_dim=args.text_dim,
        attention_head_dim=4,  # diffusers' legacy name: the number of heads
        norm_num_groups=8,
    )
    return text_encoder, vae, unet


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- data


def render_batch(rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [-1, 1] (n, 3, 64, 64) and their shape masks (n, 1, 64, 64)."""
    imgs = np.stack([sd.make_example(rng)[0] for _ in range(n)])
    mask = (imgs != imgs[:, :1, :1, :]).any(axis=3)  # the corner pixel is always background
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    return x, torch.from_numpy(mask)[:, None].float()


def latent_shape_weights(scenes: list, weight: float) -> torch.Tensor:
    """Per-scene loss weights at latent resolution, (n, 1, 16, 16): ``weight`` on every latent
    cell the shape touches, 1 elsewhere. The background is one flat colour the UNet learns in a
    few hundred steps; the shape's outline (corners, points) is what it is slow to learn."""
    side = sd.IMAGE_SIZE // 4
    out = torch.ones(len(scenes), 1, side, side)
    for i, s in enumerate(scenes):
        m = torch.from_numpy(sd.shape_mask(s.shape, s.cx, s.cy, s.r, sd.IMAGE_SIZE))
        touched = F.max_pool2d(m[None, None].float(), 4)[0]
        out[i] += (weight - 1.0) * touched
    return out


def scheduler_config() -> dict:
    return {
        "num_train_timesteps": 1000,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "prediction_type": "v_prediction",
        "rescale_betas_zero_snr": True,
        "timestep_spacing": "trailing",
        "steps_offset": 1,
    }


def refine_decoder(vae, args, cache: Path, t_start: float):
    """Stage 2b: train the decoder longer with the encoder frozen. The latents (and so the
    UNet's training data) do not change; the decoder draws sharper edges. Cached."""
    from diffusers import AutoencoderKL

    out = cache / f"decoder-{args.decoder_steps}"
    if (out / "losses.pt").exists():
        print(f"reusing the refined decoder from {out}", flush=True)
        return AutoencoderKL.from_pretrained(str(out / "vae")), torch.load(out / "losses.pt")
    rng = np.random.default_rng([args.seed, 4])
    gen = torch.Generator().manual_seed(args.seed + 4)
    for p in vae.parameters():
        p.requires_grad_(False)
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.decoder_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, args.decoder_steps, args.decoder_lr / 20
    )
    vae.eval()
    vae.decoder.train()
    losses: list[float] = []
    bar = tqdm(range(args.decoder_steps), desc="decoder", mininterval=5, file=sys.stdout)
    for _ in bar:
        x, mask = render_batch(rng, args.vae_batch)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mode()
            # a little latent noise: the UNet's latents are never exact
            z = z + 0.05 * z.std() * torch.randn(z.shape, generator=gen)
        rec = vae.decode(z).sample
        w = 1.0 + 9.0 * mask
        loss = (w * ((rec - x) ** 2 + 0.5 * (rec - x).abs())).sum() / (w.sum() * 3)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(F.mse_loss(rec, x).item())
        bar.set_postfix(mse=f"{np.mean(losses[-50:]):.5f}")
        if args.max_minutes and (time.time() - t_start) / 60 > args.max_minutes:
            print(f"\ntime budget reached at decoder step {len(losses)}", flush=True)
            break
    vae.eval()
    for p in vae.parameters():
        p.requires_grad_(False)
    out.mkdir(parents=True, exist_ok=True)
    vae.save_pretrained(str(out / "vae"))
    torch.save(losses, out / "losses.pt")
    return vae, losses


# ----------------------------------------------------------------------------- saving


def save_pipeline(out: Path, tok, text_encoder, vae, unet, defaults: dict) -> None:
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    sched = DPMSolverMultistepScheduler(
        **scheduler_config(),
        algorithm_type="dpmsolver++",
        solver_order=2,
        final_sigmas_type="zero",
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        unet=unet,
        scheduler=sched,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    # transformers 5 writes only tokenizer.json; older versions' slow CLIPTokenizer reads these
    for name, text in tokenizer_files().items():
        (tmp / "tokenizer" / name).write_text(text)
    (tmp / "diffbatch_defaults.json").write_text(json.dumps(defaults, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def plot_losses(
    path: Path, vae_losses: list[float], unet_losses: list[float], dec_losses: list[float]
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("matplotlib missing: no loss plot")
        return

    def smooth(xs: list[float], k: int = 50) -> np.ndarray:
        a = np.asarray(xs, dtype=np.float64)
        if len(a) < k:
            return a
        return np.convolve(a, np.ones(k) / k, mode="valid")

    panels = [(vae_losses, "autoencoder (MSE, pixels in [-1,1])")]
    if dec_losses:
        panels.append((dec_losses, "decoder refinement, encoder frozen (MSE)"))
    panels.append((unet_losses, "UNet + text encoder (v-prediction loss)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (xs, title) in zip(axes, panels, strict=True):
        ax.plot(xs, alpha=0.25, lw=0.6, color="C0")
        s = smooth(xs)
        ax.plot(np.arange(len(s)) + (len(xs) - len(s)), s, color="C1", lw=1.5, label="moving avg")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "diffbatch/models/shapes")
    ap.add_argument("--loss-plot", type=Path, default=ROOT / "docs/images/shapes_loss.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vae-steps", type=int, default=500)
    ap.add_argument("--vae-batch", type=int, default=16)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--vae-channels", type=int, nargs=3, default=[16, 32, 32])
    ap.add_argument("--latent-channels", type=int, default=8)
    ap.add_argument("--pool", type=int, default=10000, help="training scenes encoded once")
    ap.add_argument("--unet-steps", type=int, default=9000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--unet-channels", type=int, nargs=3, default=[32, 64, 64])
    ap.add_argument("--unet-layers", type=int, default=1)
    ap.add_argument("--text-dim", type=int, default=64)
    ap.add_argument("--text-layers", type=int, default=2)
    ap.add_argument("--cfg-drop", type=float, default=0.1)
    ap.add_argument(
        "--shape-weight",
        type=float,
        default=4.0,
        help="UNet loss weight on the latent cells a shape touches (1: unweighted)",
    )
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="also copy every checkpoint to <out>.step<N> (to compare them afterwards)",
    )
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--init-from", type=Path, default=None, help="continue from this pipeline")
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop the UNet stage early after this many minutes in total (0: off)",
    )
    ap.add_argument("--steps", type=int, default=15, help="default inference steps")
    ap.add_argument("--guidance", type=float, default=5.0, help="default guidance scale")
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "diffbatch_shapes_train",
        help="cache for the trained autoencoder and the encoded pool",
    )
    ap.add_argument("--stop-after-vae", action="store_true")
    ap.add_argument("--decoder-steps", type=int, default=2500, help="stage 2b (0: off)")
    ap.add_argument("--decoder-lr", type=float, default=1e-3)
    ap.add_argument("--only-decoder", action="store_true", help="stop after stage 2b")
    ap.add_argument(
        "--assemble",
        action="store_true",
        help="swap the cached refined autoencoder into the pipeline already in --out",
    )
    ap.add_argument("--quick", action="store_true", help="tiny smoke-test run")
    args = ap.parse_args()
    if args.quick:
        args.vae_steps, args.unet_steps, args.pool, args.ckpt_every = 8, 8, 256, 5
        args.decoder_steps, args.vae_batch, args.batch = 8, 8, 8

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    from diffusers import DDPMScheduler

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp) / "tokenizer")
    bos_id, eos_id = tok.convert_tokens_to_ids(BOS), tok.convert_tokens_to_ids(EOS)
    text_encoder, vae, unet = build_models(len(tok), bos_id, eos_id, args)
    print(
        f"params: text {n_params(text_encoder) / 1e6:.2f}M  vae {n_params(vae) / 1e6:.2f}M  "
        f"unet {n_params(unet) / 1e6:.2f}M  vocab {len(tok)}",
        flush=True,
    )
    defaults = {
        "height": sd.IMAGE_SIZE,
        "width": sd.IMAGE_SIZE,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance,
        # A 64x64 model: refuse sizes that would hold the worker for minutes (256x256).
        "model_max_pixels": (4 * sd.IMAGE_SIZE) ** 2,
    }

    # --- stages 1-2 are cached in --work-dir (keyed by their arguments) -----------------
    key = (
        f"s{args.seed}-v{args.vae_steps}x{args.vae_batch}-lr{args.vae_lr}-"
        + "-".join(map(str, args.vae_channels))
        + f"-p{args.pool}-det-g4-fg-l{args.latent_channels}"
    )
    cache = args.work_dir / key
    vae_losses: list[float] = []
    pool_rng = np.random.default_rng([args.seed, 2])
    scenes = [sd.sample_scene(pool_rng, "train", free_position_prob=0.15) for _ in range(args.pool)]
    if (cache / "latents.pt").exists():
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(str(cache / "vae"))
        saved = torch.load(cache / "latents.pt")
        latents, vae_losses = saved["latents"], saved["vae_losses"]
        print(f"reusing stages 1-2 from {cache}", flush=True)
    else:
        # --- stage 1: autoencoder ---------------------------------------------------------
        rng = np.random.default_rng([args.seed, 1])
        opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=args.vae_lr, total_steps=args.vae_steps, pct_start=0.05
        )
        vae.train()
        bar = tqdm(range(args.vae_steps), desc="vae", mininterval=5, file=sys.stdout)
        for _ in bar:
            x, mask = render_batch(rng, args.vae_batch)
            # The shape covers 5-30% of the pixels: weight it so its colour is learned early.
            w = 1.0 + 9.0 * mask
            post = vae.encode(x).latent_dist
            # A deterministic autoencoder (the posterior mean): with the tiny KL weight, sampled
            # latents stay noisy for too long in a short run and wash the colours out.
            rec = vae.decode(post.mode()).sample
            mse = F.mse_loss(rec, x)
            err = (w * ((rec - x) ** 2 + 0.5 * (rec - x).abs())).sum() / (w.sum() * 3)
            loss = err + 1e-6 * post.kl().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            sched.step()
            vae_losses.append(mse.item())
            bar.set_postfix(mse=f"{np.mean(vae_losses[-50:]):.5f}")
        vae.eval()
        print(
            f"vae done at {(time.time() - t_start) / 60:.1f} min, "
            f"mse {np.mean(vae_losses[-100:]):.5f}",
            flush=True,
        )

        # --- stage 2: encode the pool of training scenes ----------------------------------
        lat_side = sd.IMAGE_SIZE // 4
        latents = torch.empty(args.pool, args.latent_channels, lat_side, lat_side)
        with torch.no_grad():
            for i in tqdm(range(0, args.pool, 256), desc="encode", mininterval=5, file=sys.stdout):
                chunk = scenes[i : i + 256]
                x = torch.from_numpy(np.stack([sd.render_scene(s) for s in chunk]))
                x = x.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
                latents[i : i + len(chunk)] = vae.encode(x).latent_dist.mode()
        cache.mkdir(parents=True, exist_ok=True)
        vae.save_pretrained(str(cache / "vae"))
        torch.save({"latents": latents, "vae_losses": vae_losses}, cache / "latents.pt")
    dec_losses: list[float] = []
    if args.decoder_steps:
        vae, dec_losses = refine_decoder(vae, args, cache, t_start)
        if args.only_decoder:
            return
    vae.eval()
    for p in vae.parameters():
        p.requires_grad_(False)
    scale = float(1.0 / latents.std())
    vae.register_to_config(scaling_factor=scale)
    latents = latents * scale
    print(f"latent scaling_factor {scale:.4f}", flush=True)
    if args.stop_after_vae:
        return
    if args.assemble:
        # Put this (refined) autoencoder into an already trained pipeline folder.
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(str(args.out))
        old = pipe.vae.config.scaling_factor
        assert abs(old - scale) < 1e-4, (old, scale)
        save_pipeline(args.out, pipe.tokenizer, pipe.text_encoder, vae, pipe.unet, defaults)
        print(f"assembled {args.out} with the refined decoder", flush=True)
        return

    # --- stage 3: UNet + text encoder ----------------------------------------------------
    if args.init_from:
        # Continue training from a saved pipeline (its UNet and text encoder).
        from diffusers import UNet2DConditionModel
        from transformers import CLIPTextModel

        unet = UNet2DConditionModel.from_pretrained(str(args.init_from), subfolder="unet")
        text_encoder = CLIPTextModel.from_pretrained(str(args.init_from), subfolder="text_encoder")
        print(f"continuing from {args.init_from}", flush=True)
    noise_sched = DDPMScheduler(**scheduler_config())
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    warm = args.warmup

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, args.unet_steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    ema_unet, ema_text = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
    ema_params = list(ema_unet.parameters()) + list(ema_text.parameters())
    for p in ema_params:
        p.requires_grad_(False)
    unet.train()
    text_encoder.train()
    rng = np.random.default_rng([args.seed, 3])
    gen = torch.Generator().manual_seed(args.seed)
    unet_losses: list[float] = []
    shape_w = latent_shape_weights(scenes, args.shape_weight) if args.shape_weight != 1 else None

    def checkpoint(step: int) -> None:
        save_pipeline(args.out, tok, ema_text, vae, ema_unet, defaults)
        if args.keep_checkpoints:
            kept = args.out.with_name(f"{args.out.name}.step{step}")
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(args.out, kept)
        plot_losses(args.loss_plot, vae_losses, unet_losses, dec_losses)
        print(f"\ncheckpoint at step {step} ({(time.time() - t_start) / 60:.1f} min)", flush=True)

    bar = tqdm(range(args.unet_steps), desc="unet", mininterval=5, file=sys.stdout)
    for step in bar:
        idx = rng.integers(0, args.pool, size=args.batch)
        caps = ["" if rng.random() < args.cfg_drop else sd.caption_for(scenes[i], rng) for i in idx]
        ids = tok(
            caps, padding="max_length", max_length=MAX_LEN, truncation=True, return_tensors="pt"
        ).input_ids
        x0 = latents[torch.from_numpy(idx)]
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (args.batch,), generator=gen)
        xt = noise_sched.add_noise(x0, noise, t)
        target = noise_sched.get_velocity(x0, noise, t)
        cond = text_encoder(ids)[0]
        pred = unet(xt, t, encoder_hidden_states=cond).sample
        if shape_w is None:
            loss = F.mse_loss(pred, target)
        else:
            w = shape_w[torch.from_numpy(idx)]
            loss = (w * (pred - target) ** 2).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        lr_sched.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        unet_losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(unet_losses[-100:]):.4f}")
        if (step + 1) % args.ckpt_every == 0 and step + 1 < args.unet_steps:
            checkpoint(step + 1)
        if args.max_minutes and (time.time() - t_start) / 60 > args.max_minutes:
            print(f"\ntime budget reached at step {step + 1}", flush=True)
            break
    checkpoint(len(unet_losses))
    total = (time.time() - t_start) / 60
    print(f"done: {len(unet_losses)} UNet steps, {total:.1f} min, wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
