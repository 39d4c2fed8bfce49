"""Small random LoRA adapters for the built-in tiny models, built offline.

The companion of `tiny.py`: tests and benchmarks that exercise adapters get them
without a hub. What `make_tiny_lora` saves is a diffusers LoRA folder, loaded through
the normal `load_lora_weights` path like a downloaded adapter.
"""

from __future__ import annotations

import json
import os

import torch

# The denoiser's attention projections (UNet and DiT blocks name them alike) and a
# CLIP/T5 text encoder's.
_DENOISER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
_TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def make_tiny_lora(
    model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, seed: int = 0,
    rank: int = 4, text_encoder: bool = False, std: float = 0.5,
) -> str:
    """Create a small random LoRA adapter for the diffusers model in `model_dir` and
    save it in `out_dir` (`pytorch_lora_weights.safetensors`).

    It targets the denoiser's attention projections (and, with `text_encoder`, the
    first text encoder's) with a nonzero random `lora_B`, so it changes images.
    Pipelines with a LoRA loader save it with their own `save_lora_weights`; others
    (PixArt) get the same PEFT keys under the `transformer.` prefix. Returns `out_dir`.
    """
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    with open(os.path.join(model_dir, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    pipe_class = getattr(diffusers, index["_class_name"])
    denoiser_name = "unet" if "unet" in index else "transformer"
    denoiser_class = getattr(diffusers, index[denoiser_name][1])
    denoiser = denoiser_class.from_pretrained(model_dir, subfolder=denoiser_name)
    modules = {denoiser_name: (denoiser, _DENOISER_TARGETS)}
    if text_encoder:
        import transformers

        encoder_class = getattr(transformers, index["text_encoder"][1])
        modules["text_encoder"] = (
            encoder_class.from_pretrained(model_dir, subfolder="text_encoder"), _TEXT_TARGETS)
    layers = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, (module, targets) in modules.items():
            config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=True,
                                target_modules=targets)
            if hasattr(module, "add_adapter") and name != "text_encoder":
                module.add_adapter(config)
            else:
                from peft import inject_adapter_in_model

                inject_adapter_in_model(config, module)
            for pname, param in module.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0.0, std)
            state = get_peft_model_state_dict(module)
            layers[name] = convert_state_dict_to_diffusers(state) \
                if hasattr(module, "add_adapter") and name != "text_encoder" else state
    os.makedirs(out_dir, exist_ok=True)
    if hasattr(pipe_class, "save_lora_weights"):
        pipe_class.save_lora_weights(
            save_directory=str(out_dir), safe_serialization=True,
            **{f"{name}_lora_layers": value for name, value in layers.items()})
    else:
        from safetensors.torch import save_file

        save_file({f"{name}.{k}": v.contiguous() for name, value in layers.items()
                   for k, v in value.items()},
                  os.path.join(out_dir, "pytorch_lora_weights.safetensors"))
    return str(out_dir)
