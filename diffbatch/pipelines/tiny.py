"""Built-in tiny diffusers models, built offline from config objects with fixed seeds.

Each name (`tiny-sd`, `tiny-sd3`, `tiny-flux`, `tiny-pixart`) is a real diffusers
pipeline with random weights (1-4 MB, built in well under a second) that is saved with
`save_pretrained` into `$DIFFBATCH_CACHE_DIR/models/<name>` and then loaded back only
through the normal `from_pretrained(folder)` path, exactly like a downloaded model.
They exist so the engine, tests and benchmarks run anywhere without a hub.

Tokenizers are generated locally too: a byte-level CLIP BPE vocabulary with merges of
common English words, and a Unigram T5 vocabulary built from (piece, score) pairs.
Every folder also gets `diffbatch_defaults.json`, the serving defaults that
`DiffusersT2IPipeline.info()` reads.

Building is safe when several processes build the same model at once: each builds
into its own temporary folder next to the target and renames it into place; a loser
of the race discards its copy.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffbatch.pipelines.model_folder import DEFAULTS_FILE

# Bump when a builder changes: cached folders of another version are rebuilt.
TINY_BUILD_VERSION = 1
_SEED = 0

# Words that get their own tokens, so different prompts give different token ids.
_WORD_TEXT = (
    "a an the of and in on at with to for by from is are this that it its under over "
    "red blue green yellow orange purple pink black white gray brown gold silver dark "
    "light bright small big large tiny huge old new young happy sad cute "
    "cat dog bird fish horse cow lion tiger bear fox wolf mouse rabbit dragon robot "
    "man woman boy girl child person people face portrait photo painting drawing sketch "
    "house tree forest mountain river lake sea ocean beach sky cloud sun moon star night "
    "day city street car road bridge castle flower garden field snow rain fire water "
    "circle square triangle shape shapes line lines pattern background style art "
    "oil watercolor digital realistic cartoon anime high quality detailed blurry ugly bad"
)
_WORDS = tuple(_WORD_TEXT.split())
_PUNCT = ".,!?'-:;()"


# -- tokenizers ------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable unicode symbols."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _bpe(parts: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges (lowest rank first, every occurrence) to one word's symbols."""
    while len(parts) > 1:
        pair = min(itertools.pairwise(parts), key=lambda p: ranks.get(p, len(ranks)))
        if pair not in ranks:
            return parts
        merged, i = [], 0
        while i < len(parts):
            if tuple(parts[i:i + 2]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def build_clip_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """Write a byte-level CLIP BPE vocabulary into `folder` and load it from there.

    NOTE: `CLIPTokenizer(vocab_file=..., merges_file=...)` silently builds a 3-token
    vocabulary in transformers 5; only `from_pretrained(folder)` reads the files.
    """
    from transformers import CLIPTokenizer

    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols]
    ranks: dict[tuple[str, str], int] = {}
    for word in _WORDS:
        # Segment the word with the merges so far (as BPE would), then merge what is
        # left from the left, so every listed word ends up as one token.
        parts = _bpe([*word[:-1], word[-1] + "</w>"], ranks)
        while len(parts) > 1:
            ranks[(parts[0], parts[1])] = len(ranks)
            vocab.append(parts[0] + parts[1])
            parts = [parts[0] + parts[1], *parts[2:]]
    merges = [f"{a} {b}" for a, b in ranks]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=77)


def build_t5_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """Build a Unigram T5 tokenizer from (piece, score) pairs, save it and reload it."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in string.ascii_letters + string.digits + _PUNCT:
        pieces += [(c, -6.0), ("▁" + c, -7.0)]
    pieces += [("▁" + w, -3.0) for w in _WORDS if len(w) > 1]
    T5Tokenizer(vocab=pieces, extra_ids=0).save_pretrained(folder)
    return T5Tokenizer.from_pretrained(folder, model_max_length=512)


def _clip_text_config(tokenizer: Any, *, projection_dim: int = 32) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(tokenizer: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    ))


def _vae(latent_channels: int, **kwargs: Any) -> Any:
    """A 4-block VAE: scale factor 8, like the real ones."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels, sample_size=64, **kwargs,
    )


# -- builders: each returns (pipeline, serving defaults) --------------------------------
def _build_sd(tmp: str) -> tuple[Any, dict[str, Any]]:
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    tokenizer = build_clip_tokenizer(os.path.join(tmp, "_tok"))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    pipe = StableDiffusionPipeline(
        vae=_vae(4), text_encoder=CLIPTextModel(_clip_text_config(tokenizer)),
        tokenizer=tokenizer, unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012,
                                beta_schedule="scaled_linear", clip_sample=False,
                                set_alpha_to_one=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return pipe, {"guidance_scale": 5.0}


def _build_sd3(tmp: str) -> tuple[Any, dict[str, Any]]:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    tokenizer = build_clip_tokenizer(os.path.join(tmp, "_tok"))
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(tokenizer))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer))
    # NOTE: joint_attention_dim >= sum of both CLIP hidden sizes, pooled_projection_dim =
    # sum of both projection dims, caption_projection_dim = heads * head_dim.
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=_vae(16, shift_factor=0.0609, scaling_factor=1.5305,
                 use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    return pipe, {"guidance_scale": 5.0}


def _build_flux(tmp: str) -> tuple[Any, dict[str, Any]]:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer = build_clip_tokenizer(os.path.join(tmp, "_tok"))
    tokenizer_2 = build_t5_tokenizer(os.path.join(tmp, "_tok2"))
    # NOTE: Flux reads CLIP's pooler_output (CLIPTextModel, not ...WithProjection), and
    # axes_dims_rope must sum to attention_head_dim.
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8),
    )
    pipe = FluxPipeline(
        transformer=transformer,
        vae=_vae(4, shift_factor=0.1159, scaling_factor=0.3611,
                 use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=CLIPTextModel(_clip_text_config(tokenizer)), tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(tokenizer_2), tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        ),
    )
    return pipe, {"guidance_scale": 3.5}  # embedded guidance: no CFG batch doubling


def _build_pixart(tmp: str) -> tuple[Any, dict[str, Any]]:
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    tokenizer = build_t5_tokenizer(os.path.join(tmp, "_tok"))
    transformer = PixArtTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=8, num_layers=2,
        attention_head_dim=8, num_attention_heads=3, cross_attention_dim=24,
        caption_channels=32, norm_num_groups=4,
    )
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=_t5_encoder(tokenizer), vae=_vae(4),
        transformer=transformer, scheduler=DDIMScheduler(steps_offset=1),
    )
    return pipe, {"guidance_scale": 5.0}


def _build_wan(tmp: str) -> tuple[Any, dict[str, Any]]:
    """Wan 2.1 text-to-video: a UMT5 text encoder, a 3D transformer and Wan's causal
    video VAE (4x temporal, 8x spatial compression, like the released models)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_t5_tokenizer(os.path.join(tmp, "_tok"))
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    ))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    # 9 frames (two latent frames after the first) at 16 fps: about half a second
    return pipe, {"height": 32, "width": 32, "num_frames": 9, "fps": 16,
                  "guidance_scale": 5.0, "max_sequence_length": 64}


def _build_ltx(tmp: str) -> tuple[Any, dict[str, Any]]:
    """LTX-Video text-to-video: a T5 text encoder, LTX's transformer and its video VAE
    (4x temporal and spatial compression here; the released one compresses 8x and 32x)."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    tokenizer = build_t5_tokenizer(os.path.join(tmp, "_tok"))
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
        attention_head_dim=8, cross_attention_dim=32, num_layers=1, caption_channels=32,
    )
    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1, patch_size_t=1,
    )
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                       text_encoder=_t5_encoder(tokenizer), tokenizer=tokenizer,
                       transformer=transformer)
    return pipe, {"height": 32, "width": 32, "num_frames": 9, "guidance_scale": 3.0,
                  "max_sequence_length": 64}


BUILDERS: dict[str, Callable[[str], tuple[Any, dict[str, Any]]]] = {
    "tiny-sd": _build_sd,
    "tiny-sd3": _build_sd3,
    "tiny-flux": _build_flux,
    "tiny-pixart": _build_pixart,
    "tiny-wan": _build_wan,
    "tiny-ltx": _build_ltx,
}
# NOTE: importing `tiny_families` adds the other diffusers families (`tiny-sdxl`, ...).


# -- cache -----------------------------------------------------------------------------
def cache_dir() -> Path:
    """`$DIFFBATCH_CACHE_DIR`, default `~/.cache/diffbatch`."""
    return Path(os.environ.get("DIFFBATCH_CACHE_DIR") or "~/.cache/diffbatch").expanduser()


def _is_current(folder: Path) -> bool:
    try:
        with open(folder / DEFAULTS_FILE, encoding="utf-8") as f:
            version = json.load(f).get("diffbatch_tiny_version")
    except (OSError, ValueError):
        return False
    return version == TINY_BUILD_VERSION and (folder / "model_index.json").is_file()


def build_tiny_model(name: str, folder: str | os.PathLike[str]) -> None:
    """Build tiny model `name` with fixed seeds and `save_pretrained` it into `folder`."""
    if name not in BUILDERS:
        raise KeyError(f"unknown tiny model {name!r}; known: {sorted(BUILDERS)}")
    from diffusers.utils import logging as diffusers_logging

    scratch = tempfile.mkdtemp(prefix=".build-", dir=folder)
    verbosity = diffusers_logging.get_verbosity()
    try:
        # Quiet: SD3 without T5 warns that its None components "cannot be saved".
        diffusers_logging.set_verbosity_error()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            pipe, defaults = BUILDERS[name](scratch)
        pipe.save_pretrained(folder, safe_serialization=True)
    finally:
        diffusers_logging.set_verbosity(verbosity)
        shutil.rmtree(scratch, ignore_errors=True)
    defaults = {"height": 64, "width": 64, "num_inference_steps": 4, **defaults,
                "diffbatch_tiny_version": TINY_BUILD_VERSION}
    with open(os.path.join(folder, DEFAULTS_FILE), "w", encoding="utf-8") as f:
        json.dump(defaults, f, indent=2)


def ensure_tiny_model(name: str) -> str:
    """Build `name` into the cache unless it is already there; return its folder.

    Safe across processes: each builds into a temporary folder in the same parent and
    `os.rename`s it into place; if the target appeared meanwhile, its copy is discarded.
    """
    target = cache_dir() / "models" / name
    if _is_current(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        build_tiny_model(name, tmp)
        if target.exists() and not _is_current(target):  # stale build of another version
            stale = tempfile.mkdtemp(prefix=f".{name}.stale-", dir=target.parent)
            with contextlib.suppress(OSError):  # another process moved it first
                os.rename(target, os.path.join(stale, name))
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for leftover in target.parent.glob(f".{name}.stale-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return str(target)
