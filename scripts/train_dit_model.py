"""Train the built-in diffusion transformer ("shapes-dit") on CPU, offline, resumably.

Writes a stock diffusers ``PixArtSigmaPipeline`` folder to ``diffbatch/models/shapes-dit/``:
a ``PixArtTransformer2DModel`` trained with flow matching (rectified flow: the model predicts
``noise - x0`` at ``x_t = (1 - sigma) x0 + sigma noise``), a ``CLIPTextModel`` that reads
300 tokens (PixArt-Sigma's ``max_sequence_length``) over the shapes tokenizer's vocabulary,
the trained ``shapes`` autoencoder reused as is, and ``DPMSolverMultistepScheduler`` in its
flow-matching mode (``use_flow_sigmas``, ``flow_prediction``). See docs/default_model.md.

Stages (all from a fixed seed):
  1. the tokenizer of scripts/train_default_model.py (one token per caption word), saved with
     ``model_max_length`` 300;
  2. a pool of training scenes (held-out triples never rendered) encoded once with the
     ``shapes`` autoencoder (cached in --work-dir);
  3. the transformer and the text encoder jointly, 10% empty captions (for classifier-free
     guidance), the loss weighted on the latent cells the shape touches, EMA weights saved.

The run writes a checkpoint every --ckpt-every steps (the EMA pipeline into --out, and the
whole training state into --work-dir); started again with the same arguments it resumes
from the last one. With --budget-minutes the learning-rate schedule follows whichever
ends first, the steps or the time, so a run on a busy machine still ends decayed.
With --init-from FOLDER the run starts from the transformer and text encoder weights of a
saved shapes-dit pipeline folder (same architecture) instead of fresh ones, with a fresh
optimizer, warm-up and cosine schedule (to train a shipped model further).

Usage:  python scripts/train_dit_model.py --threads 1           # the full run
        python scripts/train_dit_model.py --quick                # a smoke test (seconds)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import shapes_data as sd  # noqa: E402
from scripts.train_default_model import (  # noqa: E402
    BOS,
    EOS,
    latent_shape_weights,
    n_params,
    plot_losses,
    tokenizer_files,
)

# PixArt-Sigma pads every prompt to 300 tokens (its `max_sequence_length`), so the text
# encoder has 300 positions and the tokenizer declares 300 as its limit.
MAX_LEN = 300


def build_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files().items():
        (folder / name).write_text(text)
    tok = CLIPTokenizer.from_pretrained(
        str(folder), model_max_length=MAX_LEN, pad_token=EOS, bos_token=BOS, eos_token=EOS,
        unk_token=EOS,
    )
    vocab = json.loads((folder / "vocab.json").read_text())
    assert len(tok) == len(vocab), (len(tok), len(vocab))  # the files were read
    for w in sd.caption_vocabulary():
        ids = tok(w, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] == vocab[w + "</w>"], (w, ids)
    return tok


def build_models(tok, args):
    from diffusers import PixArtTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    bos, eos = tok.convert_tokens_to_ids(BOS), tok.convert_tokens_to_ids(EOS)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=args.text_dim, intermediate_size=args.text_dim * 2,
        num_hidden_layers=args.text_layers, num_attention_heads=4,
        max_position_embeddings=MAX_LEN, projection_dim=args.text_dim,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
    ))
    transformer = PixArtTransformer2DModel(
        sample_size=sd.IMAGE_SIZE // 4, patch_size=args.patch, in_channels=8, out_channels=8,
        num_layers=args.layers, attention_head_dim=args.dim // args.heads,
        num_attention_heads=args.heads, cross_attention_dim=args.dim,
        caption_channels=args.text_dim, norm_type="ada_norm_single",
        # 1 for a 16x16 latent (PixArt scales its position grid by sample_size / 64)
        interpolation_scale=1,
    )
    return text_encoder, transformer


def scheduler():
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, prediction_type="flow_prediction",
        flow_shift=1.0, algorithm_type="dpmsolver++", solver_order=2,
    )


def store_half(folder: Path) -> None:
    """Rewrite the transformer's and the text encoder's weights as float16 (half the wheel
    size); diffusers and transformers load them into the float32 models as float32."""
    from safetensors.torch import load_file, save_file

    for name in ("transformer/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors"):
        weights = load_file(folder / name)
        save_file({k: v.half() for k, v in weights.items()}, folder / name,
                  metadata={"format": "pt"})


def save_pipeline(out: Path, tok, text_encoder, vae, transformer, defaults: dict) -> None:
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae,
                               transformer=transformer, scheduler=scheduler())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    # transformers 5 writes only tokenizer.json; older versions' slow CLIPTokenizer reads these
    for name, text in tokenizer_files().items():
        (tmp / "tokenizer" / name).write_text(text)
    (tmp / "diffbatch_defaults.json").write_text(json.dumps(defaults, indent=2) + "\n")
    store_half(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def load_init_weights(folder: Path, text_encoder, transformer) -> str:
    """Load a saved pipeline's transformer and text encoder weights (stored as float16)
    into the freshly built float32 models; the architecture must match exactly. Returns a
    short digest of the weights, which names the run (so it never resumes another's state)."""
    import hashlib

    from safetensors.torch import load_file

    digest = hashlib.sha1()
    for model, name in ((transformer, "transformer/diffusion_pytorch_model.safetensors"),
                        (text_encoder, "text_encoder/model.safetensors")):
        path = folder / name
        digest.update(path.read_bytes())
        weights = {k: v.float() for k, v in load_file(path).items()}
        model.load_state_dict(weights, strict=True)
    return digest.hexdigest()[:8]


def encode_pool(vae, scenes: list, cache: Path) -> torch.Tensor:
    """The training scenes encoded once with the autoencoder (posterior mean), cached."""
    path = cache / "latents.pt"
    if path.exists():
        print(f"reusing the encoded pool {path}", flush=True)
        return torch.load(path)
    side = sd.IMAGE_SIZE // 4
    latents = torch.empty(len(scenes), vae.config.latent_channels, side, side)
    with torch.no_grad():
        for i in tqdm(range(0, len(scenes), 256), desc="encode", mininterval=5,
                      file=sys.stdout):
            chunk = scenes[i: i + 256]
            x = torch.from_numpy(np.stack([sd.render_scene(s) for s in chunk]))
            x = x.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
            latents[i: i + len(chunk)] = vae.encode(x).latent_dist.mode()
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(latents, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return latents


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "diffbatch/models/shapes-dit")
    ap.add_argument("--vae-from", type=Path, default=ROOT / "diffbatch/models/shapes",
                    help="the pipeline folder whose trained autoencoder is reused")
    ap.add_argument("--loss-plot", type=Path, default=ROOT / "docs/images/shapes_dit_loss.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool", type=int, default=10000, help="training scenes encoded once")
    ap.add_argument("--train-steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--dim", type=int, default=128, help="transformer width")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--patch", type=int, default=2)
    ap.add_argument("--text-dim", type=int, default=64)
    ap.add_argument("--text-layers", type=int, default=2)
    ap.add_argument("--cfg-drop", type=float, default=0.1)
    ap.add_argument("--shape-weight", type=float, default=4.0,
                    help="loss weight on the latent cells a shape touches (1: unweighted)")
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="also copy every checkpoint to <out>.step<N> (to compare them)")
    ap.add_argument("--budget-minutes", type=float, default=0.0,
                    help="end the run (its learning-rate decay included) after this many "
                         "minutes of training steps, if --train-steps takes longer (0: off)")
    ap.add_argument("--steps", type=int, default=10, help="default inference steps")
    ap.add_argument("--guidance", type=float, default=4.0, help="default guidance scale")
    ap.add_argument("--work-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "diffbatch_shapes_dit_train",
                    help="cache of the encoded pool and the resumable training state")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from the transformer and text encoder weights of this saved "
                         "shapes-dit pipeline folder (same architecture), with a fresh "
                         "optimizer, warm-up and cosine schedule")
    ap.add_argument("--quick", action="store_true", help="tiny smoke-test run")
    args = ap.parse_args()
    if args.quick:
        args.train_steps, args.pool, args.ckpt_every, args.batch = 6, 256, 3, 8

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    from diffusers import AutoencoderKL

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp) / "tokenizer")
    text_encoder, transformer = build_models(tok, args)
    init_key = ""
    if args.init_from:
        init_key = "-init" + load_init_weights(args.init_from, text_encoder, transformer)
        print(f"starting from the weights of {args.init_from}", flush=True)
    vae = AutoencoderKL.from_pretrained(str(args.vae_from), subfolder="vae").eval()
    for p in vae.parameters():
        p.requires_grad_(False)
    print(f"params: text {n_params(text_encoder) / 1e6:.2f}M  transformer "
          f"{n_params(transformer) / 1e6:.2f}M  vae {n_params(vae) / 1e6:.2f}M  "
          f"vocab {len(tok)}", flush=True)
    defaults = {
        "height": sd.IMAGE_SIZE,
        "width": sd.IMAGE_SIZE,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance,
        # A 64x64 model: refuse sizes that would hold the worker for minutes (256x256).
        "model_max_pixels": (4 * sd.IMAGE_SIZE) ** 2,
    }

    # --- stage 2: the encoded pool (cached) -------------------------------------------
    pool_rng = np.random.default_rng([args.seed, 2])
    scenes = [sd.sample_scene(pool_rng, "train", free_position_prob=0.15)
              for _ in range(args.pool)]
    cache = args.work_dir / f"pool-s{args.seed}-p{args.pool}"
    latents = encode_pool(vae, scenes, cache) * vae.config.scaling_factor
    shape_w = latent_shape_weights(scenes, args.shape_weight) if args.shape_weight != 1 else None

    # --- stage 3: transformer + text encoder, flow matching ------------------------------
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)

    def progress(step: int, train_s: float) -> float:
        """How far the run is, 0..1: by steps, or by time when --budget-minutes runs out
        first (so that the learning rate has decayed when the time is up)."""
        p = step / args.train_steps
        if args.budget_minutes:
            p = max(p, train_s / 60 / args.budget_minutes)
        return min(1.0, p)

    def lr_at(step: int, train_s: float) -> float:
        """Linear warm-up, then cosine from 1 to 0.1 (times --lr) over the run's progress."""
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p0 = args.warmup / args.train_steps
        frac = max(0.0, (progress(step, train_s) - p0) / (1 - p0))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    ema_tr, ema_text = copy.deepcopy(transformer).eval(), copy.deepcopy(text_encoder).eval()
    ema_params = list(ema_tr.parameters()) + list(ema_text.parameters())
    for p in ema_params:
        p.requires_grad_(False)
    rng = np.random.default_rng([args.seed, 3])
    gen = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    start, train_s = 0, 0.0  # steps done, seconds spent in them (over all resumptions)
    run_key = (f"{args.out.name}-s{args.seed}-d{args.dim}x{args.layers}h{args.heads}"
               f"p{args.patch}-t{args.text_dim}x{args.text_layers}-b{args.batch}"
               f"-lr{args.lr}-n{args.train_steps}{init_key}")
    state_path = args.work_dir / run_key / "state.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        transformer.load_state_dict(state["transformer"])
        text_encoder.load_state_dict(state["text_encoder"])
        ema_tr.load_state_dict(state["ema_transformer"])
        ema_text.load_state_dict(state["ema_text_encoder"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        gen.set_state(state["gen"])
        losses, start, train_s = state["losses"], state["step"], state["train_s"]
        print(f"resuming from {state_path} at step {start}", flush=True)
    transformer.train()
    text_encoder.train()

    def checkpoint(step: int) -> None:
        state_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({
            "transformer": transformer.state_dict(), "text_encoder": text_encoder.state_dict(),
            "ema_transformer": ema_tr.state_dict(), "ema_text_encoder": ema_text.state_dict(),
            "opt": opt.state_dict(), "train_s": train_s,
            "rng": rng.bit_generator.state, "gen": gen.get_state(), "losses": losses,
            "step": step,
        }, state_path.with_suffix(".tmp"))
        os.replace(state_path.with_suffix(".tmp"), state_path)
        save_pipeline(args.out, tok, ema_text, vae, ema_tr, defaults)
        if args.keep_checkpoints:
            kept = args.out.with_name(f"{args.out.name}.step{step}")
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(args.out, kept)
        plot_losses(args.loss_plot, [], losses, [])
        print(f"\ncheckpoint at step {step} ({(time.time() - t_start) / 60:.1f} min)",
              flush=True)

    no_cond = {"resolution": None, "aspect_ratio": None}
    bar = tqdm(range(start, args.train_steps), desc="transformer", mininterval=5,
               file=sys.stdout, initial=start, total=args.train_steps)
    for step in bar:
        if progress(step, train_s) >= 1.0:
            print(f"\ntime budget reached at step {step}", flush=True)
            break
        t_step = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train_s)
        idx = rng.integers(0, args.pool, size=args.batch)
        caps = ["" if rng.random() < args.cfg_drop else sd.caption_for(scenes[i], rng)
                for i in idx]
        # Pad to the batch's longest caption, not to 300: the text encoder is causal and
        # the transformer masks the padding, so real tokens see the same thing either way.
        enc = tok(caps, padding="longest", truncation=True, return_tensors="pt")
        x0 = latents[torch.from_numpy(idx)]
        noise = torch.randn(x0.shape, generator=gen)
        # logit-normal noise levels (as SD3): most weight on the middle of the path
        sigma = torch.sigmoid(torch.randn(args.batch, generator=gen))
        s = sigma[:, None, None, None]
        xt = (1 - s) * x0 + s * noise
        target = noise - x0
        cond = text_encoder(enc.input_ids, attention_mask=enc.attention_mask)[0]
        pred = transformer(xt, encoder_hidden_states=cond,
                           encoder_attention_mask=enc.attention_mask, timestep=sigma * 1000,
                           added_cond_kwargs=no_cond).sample
        if shape_w is None:
            loss = ((pred - target) ** 2).mean()
        else:
            w = shape_w[torch.from_numpy(idx)]
            loss = (w * (pred - target) ** 2).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        losses.append(loss.item())
        train_s += time.time() - t_step
        bar.set_postfix(loss=f"{np.mean(losses[-100:]):.4f}", lr=f"{lr_at(step, train_s):.1e}")
        if (step + 1) % args.ckpt_every == 0 and step + 1 < args.train_steps:
            checkpoint(step + 1)
    checkpoint(len(losses))
    total = (time.time() - t_start) / 60
    print(f"done: {len(losses)} transformer steps, {total:.1f} min, wrote {args.out}",
          flush=True)


if __name__ == "__main__":
    main()
