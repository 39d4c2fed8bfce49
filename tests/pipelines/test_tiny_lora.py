"""`make_tiny_lora`: a random LoRA adapter for `tiny-sd`, saved as diffusers saves one."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from diffbatch.pipelines.tiny import ensure_tiny_model
from diffbatch.pipelines.tiny_lora import make_tiny_lora


def test_make_tiny_lora_saves_a_diffusers_lora(tmp_path: Path) -> None:
    from diffusers import StableDiffusionPipeline

    out = make_tiny_lora(ensure_tiny_model("tiny-sd"), tmp_path / "lora", rank=2)
    assert out == str(tmp_path / "lora")
    state = load_file(Path(out) / "pytorch_lora_weights.safetensors")
    assert state and all(k.startswith("unet.") for k in state)
    lora_b = [v for k, v in state.items() if "lora_B" in k or "lora.up" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)
    assert {min(v.shape) for k, v in state.items() if "lora_A" in k or "lora.down" in k} == {2}
    pipe = StableDiffusionPipeline.from_pretrained(
        ensure_tiny_model("tiny-sd"), safety_checker=None, requires_safety_checker=False
    )
    pipe.load_lora_weights(out, adapter_name="test")
    assert "test" in pipe.get_list_adapters()["unet"]
