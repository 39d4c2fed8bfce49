"""Tiny random-weight models of the diffusers families users serve, built offline.

Each builder follows the recipe of diffusers' own pipeline tests
(`tests/pipelines/<family>/test_*.py`, `get_dummy_components`): the same component
classes at toy sizes, so the real pipeline code runs end to end in well under a
second per call. Tokenizers are generated here rather than downloaded: byte-level or
sentencepiece-style BPE vocabularies of the common words in `tiny._WORDS` (with each
family's special tokens), a WordPiece vocabulary for BERT, and `tiny`'s Unigram T5.

Importing this module registers the builders in `tiny.BUILDERS` next to its own four
(`tiny-sdxl`, ...), so they are cached and loaded back through `from_pretrained(folder)`
like any `tiny-*` model; the registry imports it for the built-in names.
The model matrix (`tests/pipelines/test_model_matrix.py`) and `diffbatch check-model`
(`model_check.py`) run each through batching and parity checks.
"""

from __future__ import annotations

import os
import string
from typing import Any

from diffbatch.pipelines import tiny

# Every builder's pipeline, its serving defaults (`diffbatch_defaults.json`).
Built = tuple[Any, dict[str, Any]]


# -- tokenizers ------------------------------------------------------------------------
def _word_bpe(symbols: list[str], prefix: str) -> tuple[dict[str, int], list[str]]:
    """A BPE vocabulary over `symbols` whose merges make `prefix + word` one token for
    each common word (and the bare word, for text that starts without a space)."""
    vocab = list(dict.fromkeys(symbols))
    ranks: dict[tuple[str, str], int] = {}
    for word in tiny._WORDS:
        for text in (prefix + word, word):
            parts = tiny._bpe(list(text), ranks)
            while len(parts) > 1:
                ranks[(parts[0], parts[1])] = len(ranks)
                if parts[0] + parts[1] not in vocab:
                    vocab.append(parts[0] + parts[1])
                parts = [parts[0] + parts[1], *parts[2:]]
    return {token: i for i, token in enumerate(vocab)}, [f"{a} {b}" for a, b in ranks]


def build_byte_bpe_tokenizer(folder: str, cls_name: str, specials: list[str],
                             **kwargs: Any) -> Any:
    """A GPT-2-style byte-level BPE tokenizer (Qwen2, GLM) saved into `folder` and
    loaded back; `specials` are added as special tokens after the vocabulary."""
    import transformers

    vocab, merges = _word_bpe(list(tiny.bytes_to_unicode().values()), "Ġ")
    merge_pairs = [(m.split()[0], m.split()[1]) for m in merges]
    cls = getattr(transformers, cls_name)
    if cls_name == "PreTrainedTokenizerFast":
        tokenizer = _fast_byte_bpe(vocab, merge_pairs, prefix=specials, **kwargs)
    else:
        tokenizer = cls(vocab=vocab, merges=merge_pairs, **kwargs)
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.save_pretrained(folder)
    return getattr(transformers, cls_name).from_pretrained(folder)


def _fast_byte_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], *, prefix: list[str],
                   **kwargs: Any) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` that starts every text with the
    `prefix` tokens (GLM-4 starts with `[gMASK]<sop>`, so "" is not zero tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {**vocab, **{t: len(vocab) + i for i, t in enumerate(prefix)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*prefix, "$A"]), pair=" ".join([*prefix, "$A", "$B"]),
        special_tokens=[(t, vocab[t]) for t in prefix])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tokenizer.add_special_tokens({"additional_special_tokens": prefix})
    return tokenizer


def build_gemma_tokenizer(folder: str) -> Any:
    """A Gemma tokenizer ("▁"-prefixed BPE with <pad>/<eos>/<bos>/<unk>)."""
    from transformers import GemmaTokenizer

    chars = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁",
             *string.ascii_letters, *string.digits, *tiny._PUNCT]
    vocab, merges = _word_bpe(chars, "▁")
    GemmaTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges]).save_pretrained(folder)
    return GemmaTokenizer.from_pretrained(folder)


def build_bert_tokenizer(folder: str) -> Any:
    """A lower-casing WordPiece BERT tokenizer over the common words and characters."""
    from transformers import BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
              *string.ascii_lowercase, *string.digits, *tiny._PUNCT,
              *(f"##{c}" for c in string.ascii_lowercase + string.digits), *tiny._WORDS]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    BertTokenizer(vocab=vocab).save_pretrained(folder)
    return BertTokenizer.from_pretrained(folder)


# Qwen's chat format (Z-Image and Flux.2 Klein wrap the prompt in it).
_QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_tokenizer(tmp: str) -> Any:
    return build_byte_bpe_tokenizer(
        os.path.join(tmp, "_tok"), "Qwen2Tokenizer",
        ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
         "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
        chat_template=_QWEN_CHAT_TEMPLATE,
    )


# -- UNet families ---------------------------------------------------------------------
def build_sdxl(tmp: str) -> Built:
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = tiny.build_clip_tokenizer(os.path.join(tmp, "_tok"))
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=80,  # 6 * 8 + the pooled 32
        cross_attention_dim=64, norm_num_groups=4,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=32,
    )
    pipe = StableDiffusionXLPipeline(
        unet=unet, vae=vae,
        text_encoder=CLIPTextModel(tiny._clip_text_config(tokenizer)), tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(tiny._clip_text_config(tokenizer)),
        tokenizer_2=tokenizer,
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                         beta_schedule="scaled_linear",
                                         timestep_spacing="leading"),
        image_encoder=None, feature_extractor=None,
    )
    return pipe, {"height": 32, "width": 32, "guidance_scale": 5.0}


def build_lcm(tmp: str) -> Built:
    from diffusers import (
        AutoencoderKL,
        LatentConsistencyModelPipeline,
        LCMScheduler,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel

    tokenizer = tiny.build_clip_tokenizer(os.path.join(tmp, "_tok"))
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        norm_num_groups=4, time_cond_proj_dim=32,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        layers_per_block=1,
    )
    pipe = LatentConsistencyModelPipeline(
        unet=unet, vae=vae, text_encoder=CLIPTextModel(tiny._clip_text_config(tokenizer)),
        tokenizer=tokenizer,
        scheduler=LCMScheduler(beta_start=0.00085, beta_end=0.012,
                               beta_schedule="scaled_linear", clip_sample=False,
                               set_alpha_to_one=False),
        safety_checker=None, feature_extractor=None, image_encoder=None,
        requires_safety_checker=False,
    )
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 8.5}


# -- transformer families ----------------------------------------------------------------
def build_sd35(tmp: str) -> Built:
    """SD3.5: SD3's MMDiT with RMS q/k norms and dual-attention layers, and all three
    text encoders (two CLIPs and T5)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = tiny.build_clip_tokenizer(os.path.join(tmp, "_tok"))
    tokenizer_3 = tiny.build_t5_tokenizer(os.path.join(tmp, "_tok3"))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32,
        qk_norm="rms_norm", dual_attention_layers=(0,),
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=16, norm_num_groups=4,
        layers_per_block=1, shift_factor=0.0609, scaling_factor=1.5305,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    # T5's width is the joint width: the CLIP embeddings are padded to it.
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_3), d_model=64, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer_3.pad_token_id,
        eos_token_id=tokenizer_3.eos_token_id, decoder_start_token_id=tokenizer_3.pad_token_id,
    )).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae,
        text_encoder=CLIPTextModelWithProjection(tiny._clip_text_config(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(tiny._clip_text_config(tokenizer)),
        tokenizer_2=tokenizer, text_encoder_3=t5, tokenizer_3=tokenizer_3,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    return pipe, {"height": 32, "width": 32, "guidance_scale": 5.0}


def build_qwen_image(tmp: str) -> Built:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _qwen_tokenizer(tmp)
    ids = tokenizer.convert_tokens_to_ids
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
        temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                             "type": "default"},
            "rope_theta": 1000000.0, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None,
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16,
                       "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), vision_token_id=ids("<|vision_pad|>"),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
    )
    pipe = QwenImagePipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(), tokenizer=tokenizer,
    )
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2}


def build_z_image(tmp: str) -> Built:
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = _qwen_tokenizer(tmp)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # initialised with torch.empty (diffusers' tests fix them too)
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=16, norm_num_groups=4,
        layers_per_block=1, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
    )
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
        max_position_embeddings=512,
    ))
    pipe = ZImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler())
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 5.0}


def build_flux2_klein(tmp: str) -> Built:
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen_tokenizer(tmp)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
        timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False,
    )
    # 28 layers: the call reads hidden states 9, 18 and 27 (`text_encoder_out_layers`)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=16, intermediate_size=16, num_hidden_layers=28, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
        max_position_embeddings=512,
    ))
    vae = AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(4, 8), layers_per_block=1, latent_channels=1, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    pipe = Flux2KleinPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler())
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 4.0}


def build_sana(tmp: str) -> Built:
    """Sana with `sample_size` 16: its own 512 px resolution bins apply."""
    from diffusers import (
        AutoencoderDC,
        FlowMatchEulerDiscreteScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = build_gemma_tokenizer(os.path.join(tmp, "_tok"))
    transformer = SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2,
        attention_head_dim=4, num_cross_attention_heads=2, cross_attention_head_dim=4,
        cross_attention_dim=8, caption_channels=8, sample_size=16,
    )
    # A DC-AE with six stages compresses 32x, like Sana's: the 512 px bins it
    # generates at are 16x16 latents.
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        encoder_block_types=("ResBlock",) * 5 + ("EfficientViTBlock",),
        decoder_block_types=("ResBlock",) * 5 + ("EfficientViTBlock",),
        encoder_block_out_channels=(4, 4, 4, 4, 4, 8),
        decoder_block_out_channels=(4, 4, 4, 4, 4, 8),
        encoder_qkv_multiscales=((),) * 5 + ((5,),), decoder_qkv_multiscales=((),) * 5 + ((5,),),
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=[1] * 6,
        downsample_block_type="conv", upsample_block_type="interpolate",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    )
    text_encoder = Gemma2Model(Gemma2Config(
        head_dim=16, hidden_size=8, intermediate_size=64, max_position_embeddings=8192,
        num_attention_heads=2, num_hidden_layers=1, num_key_value_heads=2,
        vocab_size=len(tokenizer), attn_implementation="eager",
    ))
    pipe = SanaPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                        tokenizer=tokenizer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    return pipe, {"height": 512, "width": 512, "num_inference_steps": 2, "guidance_scale": 4.5}


def build_chroma(tmp: str) -> Built:
    from diffusers import (
        AutoencoderKL,
        ChromaPipeline,
        ChromaTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )

    tokenizer = tiny.build_t5_tokenizer(os.path.join(tmp, "_tok"))
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32, approximator_layers=1,
        approximator_num_channels=16,
    )
    vae = AutoencoderKL(
        sample_size=32, block_out_channels=(4, 8), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = ChromaPipeline(transformer=transformer, vae=vae,
                          text_encoder=tiny._t5_encoder(tokenizer).eval(), tokenizer=tokenizer,
                          scheduler=FlowMatchEulerDiscreteScheduler(),
                          image_encoder=None, feature_extractor=None)
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 5.0}


def build_lumina2(tmp: str) -> Built:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Lumina2Pipeline,
        Lumina2Transformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = build_gemma_tokenizer(os.path.join(tmp, "_tok"))
    transformer = Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=2,
        num_attention_heads=1, num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None,
        norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=[4, 2, 2], cap_feat_dim=8,
    )
    # Lumina2 assumes a VAE scale factor of 8
    vae = tiny._vae(4, shift_factor=0.0609, scaling_factor=1.5035,
                    use_quant_conv=False, use_post_quant_conv=False)
    text_encoder = Gemma2Model(Gemma2Config(
        head_dim=4, hidden_size=8, intermediate_size=8, num_attention_heads=2,
        num_hidden_layers=2, num_key_value_heads=2, sliding_window=2,
        vocab_size=len(tokenizer),
    ))
    pipe = Lumina2Pipeline(transformer=transformer, vae=vae.eval(), text_encoder=text_encoder,
                           tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler())
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 4.0}


def build_cogview4(tmp: str) -> Built:
    from diffusers import (
        AutoencoderKL,
        CogView4Pipeline,
        CogView4Transformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import GlmConfig, GlmModel

    # GLM-4's tokenizer pads on the left, as CogView4's own padding does.
    tokenizer = build_byte_bpe_tokenizer(
        os.path.join(tmp, "_tok"), "PreTrainedTokenizerFast", ["[gMASK]", "<sop>"],
        pad_token="<|endoftext|>", eos_token="<|endoftext|>", padding_side="left",
    )
    transformer = CogView4Transformer2DModel(
        patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
        num_attention_heads=4, out_channels=4, text_embed_dim=32, time_embed_dim=8,
        condition_dim=4,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=32,
    )
    text_encoder = GlmModel(GlmConfig(
        hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        head_dim=8, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
    ))
    pipe = CogView4Pipeline(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
            use_dynamic_shifting=True, time_shift_type="linear"),
    )
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 5.0}


def build_auraflow(tmp: str) -> Built:
    from diffusers import (
        AuraFlowPipeline,
        AuraFlowTransformer2DModel,
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny.build_t5_tokenizer(os.path.join(tmp, "_tok"))
    transformer = AuraFlowTransformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, num_mmdit_layers=1,
        num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, out_channels=4,
        pos_embed_max_size=256,
    )
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        layers_per_block=1, sample_size=32,
    )
    pipe = AuraFlowPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                            tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler())
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.5}


def build_hunyuandit(tmp: str) -> Built:
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel

    tokenizer = build_bert_tokenizer(os.path.join(tmp, "_tok"))
    tokenizer_2 = tiny.build_t5_tokenizer(os.path.join(tmp, "_tok2"))
    transformer = HunyuanDiT2DModel(
        sample_size=4, num_layers=2, patch_size=2, attention_head_dim=8,
        num_attention_heads=3, in_channels=4, cross_attention_dim=32,
        cross_attention_dim_t5=32, pooled_projection_dim=16, hidden_size=24,
        activation_fn="gelu-approximate",
    )
    text_encoder = BertModel(BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=512, pad_token_id=0,
    ))
    vae = tiny._vae(4)  # its rotary positions assume a VAE scale factor of 8
    pipe = HunyuanDiTPipeline(
        transformer=transformer.eval(), vae=vae.eval(), scheduler=DDPMScheduler(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        text_encoder_2=tiny._t5_encoder(tokenizer_2).eval(), tokenizer_2=tokenizer_2,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return pipe, {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 5.0}


# Tiny model name -> builder, registered in `tiny.BUILDERS` below.
FAMILY_BUILDERS = {
    "tiny-sdxl": build_sdxl,
    "tiny-qwen-image": build_qwen_image,
    "tiny-z-image": build_z_image,
    "tiny-flux2-klein": build_flux2_klein,
    "tiny-sana": build_sana,
    "tiny-chroma": build_chroma,
    "tiny-lumina2": build_lumina2,
    "tiny-cogview4": build_cogview4,
    "tiny-auraflow": build_auraflow,
    "tiny-hunyuandit": build_hunyuandit,
    "tiny-sd35": build_sd35,
    "tiny-lcm": build_lcm,
}
tiny.BUILDERS.update(FAMILY_BUILDERS)
