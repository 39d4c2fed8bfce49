"""Per-sample LoRA adapters in one forward, against PEFT's own application.

The reference is PEFT itself: each request run alone with diffusers' `set_adapters`
(PEFT's adapter application on, the mixer's rows off). The mixed wave (different
adapters, scales, a stack and the base model in one forward) must equal it per image.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.pipelines.tiny_lora import make_tiny_lora
from tests.pipelines.conftest import TOLERANCE, make_batch, make_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapter_paths(model_cache_dir: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, str]:
    """Adapters a (UNet and text encoder) and b (UNet) for tiny-sd."""
    model = resolve_model_path("tiny-sd")
    root = tmp_path_factory.mktemp("mixing-loras")
    return {"a": make_tiny_lora(model, root / "a", seed=1, text_encoder=True),
            "b": make_tiny_lora(model, root / "b", seed=2, rank=8)}


@pytest.fixture(scope="module")
def sd_with_adapters(adapter_paths: dict[str, str]) -> DiffusersT2IPipeline:
    """A fresh tiny-sd (not the shared one: adapters stay loaded) with adapters a and b."""
    pipeline = DiffusersT2IPipeline.from_pretrained(resolve_model_path("tiny-sd"), device="cpu")
    for name, path in adapter_paths.items():
        pipeline.load_lora(name, path)
    return pipeline


@pytest.fixture(scope="module")
def peft_sd(adapter_paths: dict[str, str]) -> DiffusersT2IPipeline:
    """The reference: tiny-sd with a and b loaded by diffusers alone, PEFT applying them."""
    reference = DiffusersT2IPipeline.from_pretrained(resolve_model_path("tiny-sd"), device="cpu")
    for name, path in adapter_paths.items():
        reference.pipe.load_lora_weights(path, adapter_name=name)
    return reference


STACKS = [(("a", 1.0),), (("b", 0.5),), (), (("a", 0.7), ("b", -1.0))]


def _peft_reference(reference: DiffusersT2IPipeline, request, stack) -> torch.Tensor:
    """The request alone, with PEFT applying `stack` (diffusers' `set_adapters`)."""
    pipe = reference.pipe
    if stack:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in stack], [scale for _, scale in stack])
    else:
        pipe.disable_lora()
    return reference.forward(make_batch([request]))[0].images


def test_a_mixed_wave_equals_peft_per_request(sd_with_adapters: DiffusersT2IPipeline,
                                              peft_sd: DiffusersT2IPipeline) -> None:
    pipeline = sd_with_adapters
    requests = [make_request(pipeline, f"r{i}", f"a prompt {i}", seed=10 + i,
                             negative_prompt="blurry" if i % 2 else None)
                for i in range(len(STACKS))]
    try:
        pipeline.set_lora_wave(STACKS, 1)
        mixed = pipeline.forward(make_batch(requests))
    finally:
        pipeline.set_lora_wave(None, 1)
    references = [_peft_reference(peft_sd, r, s) for r, s in zip(requests, STACKS, strict=True)]
    base = [_peft_reference(peft_sd, r, ()) for r in requests]
    for i, (out, ref) in enumerate(zip(mixed, references, strict=True)):
        assert (out.images - ref).abs().max().item() <= TOLERANCE, i
        if STACKS[i]:  # the adapters visibly change the image
            assert (out.images - base[i]).abs().max().item() > 1e-2, i


def test_n_images_per_request_follow_their_request(sd_with_adapters, peft_sd) -> None:
    pipeline = sd_with_adapters
    requests = [make_request(pipeline, f"n{i}", "a red cat", seed=3 + i, n=2) for i in range(2)]
    stacks = [(("a", 1.0),), ()]
    try:
        pipeline.set_lora_wave(stacks, 2)
        mixed = pipeline.forward(make_batch(requests))
    finally:
        pipeline.set_lora_wave(None, 1)
    for request, stack, out in zip(requests, stacks, mixed, strict=True):
        assert (out.images - _peft_reference(peft_sd, request, stack)).abs().max() <= TOLERANCE


def test_unloading_takes_the_adapter_out(model_cache_dir: str, tmp_path: Path) -> None:
    model = resolve_model_path("tiny-sd")
    pipeline = DiffusersT2IPipeline.from_pretrained(model, device="cpu")
    pipeline.load_lora("x", make_tiny_lora(model, tmp_path / "x", seed=4))
    peft_copies = [p for name, p in pipeline.pipe.unet.named_parameters()
                   if ".x." in name and "lora_" in name]
    assert peft_copies, "PEFT layers hold the adapter"
    # stacked by the mixer, PEFT's own copy keeps its shape but holds no storage
    assert all(p.untyped_storage().nbytes() <= p.element_size() for p in peft_copies)
    request = make_request(pipeline, "u", "a red cat", seed=1)
    base = pipeline.forward(make_batch([request]))[0].images  # no stack: the base model
    pipeline.set_lora_wave([(("x", 1.0),)], 1)
    styled = pipeline.forward(make_batch([request]))[0].images
    assert (styled - base).abs().max() > 1e-2
    pipeline.unload_lora("x")
    with pytest.raises(KeyError, match="not loaded"):
        pipeline.set_lora_wave([(("x", 1.0),)], 1)
    pipeline.set_lora_wave(None, 1)
    assert torch.equal(pipeline.forward(make_batch([request]))[0].images, base)
    assert not any("lora_A" in name for name, _ in pipeline.pipe.unet.named_parameters()
                   if ".x." in name)
