"""Test helper: a small random LoRA adapter for `tiny-sd`, built offline.

Lives with the tests (nothing in `diffbatch/` or `benchmarks/` needs it): the LoRA
tests of the pipeline and of the engine load what it saves through the normal
`load_lora_weights` path, like a downloaded adapter.
"""

from __future__ import annotations

import os

import torch


def make_tiny_lora(
    model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, seed: int = 0,
    rank: int = 4,
) -> str:
    """Create a small random LoRA adapter for `tiny-sd`'s UNet and save it in `out_dir`.

    The adapter targets the UNet attention projections with a nonzero random `lora_B`
    (so it changes images) and is saved with `StableDiffusionPipeline.save_lora_weights`,
    so `pipe.load_lora_weights(out_dir, adapter_name=...)` loads it. Returns `out_dir`.
    """
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet")
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=True,
                        target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    unet.add_adapter(config)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(
        save_directory=str(out_dir), unet_lora_layers=layers, safe_serialization=True
    )
    return str(out_dir)
