"""LoRA through the engine on `tiny-sd`: adapters change images and split waves."""

from __future__ import annotations

import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.pipelines.registry import resolve_model_path
from tests.lora_utils import make_tiny_lora

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    model = resolve_model_path("tiny-sd")
    make_tiny_lora(model, root / "style-a", seed=1)
    make_tiny_lora(model, root / "style-b", seed=2)
    return root


def params(seed: int = 3, **kwargs) -> SamplingParams:
    return SamplingParams(num_inference_steps=2, seed=seed, output_type="pt", **kwargs)


def test_lora_changes_images_and_waves_split_by_adapter_and_scale(lora_dir):
    with Engine("tiny-sd", executor="inproc", max_num_seqs=8, lora_dir=str(lora_dir),
                torch_num_threads=1) as engine:
        base = engine.generate(["a cat"], params())[0]
        outs = engine.generate(
            ["a cat"] * 7,
            [params(lora="style-a"), params(lora="style-a"),
             params(lora="style-b"), params(lora="style-b"),
             params(lora="style-a", lora_scale=0.5),
             params(), params()],
        )
        assert all(o.ok for o in outs), [o.error for o in outs]
        # same adapter and scale share a wave; a different adapter, scale or none do not
        assert [o.batch_size for o in outs] == [2, 2, 2, 2, 1, 2, 2]
        a, b, a_half, plain = outs[0].images, outs[2].images, outs[4].images, outs[5].images
        assert (a - base.images).abs().max() > 1e-3, "the adapter did not change the image"
        assert (a - b).abs().max() > 1e-3 and (a - a_half).abs().max() > 1e-3
        assert (outs[0].images - outs[1].images).abs().max() <= 1e-4
        # a request without LoRA right after LoRA waves is exactly the base model's
        assert (plain - base.images).abs().max() <= 1e-5


def test_a_corrupt_adapter_file_is_the_callers_error_and_harms_nothing(lora_dir):
    """A file that passes the admission check (a .safetensors name) but does not load:
    a 400-class error naming `lora`, and the engine goes on serving."""
    (lora_dir / "junk.safetensors").write_bytes(b"\x00\x17not a safetensors file" * 40)
    with Engine("tiny-sd", executor="inproc", max_num_seqs=4, lora_dir=str(lora_dir),
                torch_num_threads=1) as engine:
        junk, plain = engine.generate(["a cat", "a dog"],
                                      [params(lora="junk.safetensors"), params()])
        assert junk.error is not None and plain.ok, (junk.error, plain.error)
        assert (junk.error.status_code, junk.error.type, junk.error.param) == (
            400, "invalid_request_error", "lora")
        assert "'junk.safetensors' could not be loaded" in junk.error.message
        again = engine.generate(["a cat"], params(lora="style-a"))[0]
        assert again.ok, again.error


def test_an_adapter_that_fails_half_loaded_leaves_the_base_model_as_it_was(lora_dir):
    """diffusers loads an adapter part by part: one whose UNet part loads and whose
    text-encoder part does not must not stay in the UNet for later requests; its wave
    fails as one (the reason, not a second load's complaint)."""
    import os

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(lora_dir / "style-a", "pytorch_lora_weights.safetensors"))
    prefix = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    wrong = {f"{prefix}.lora_A.weight": torch.randn(4, 999),
             f"{prefix}.lora_B.weight": torch.randn(999, 4)}
    (lora_dir / "half").mkdir()
    save_file({**weights, **wrong}, str(lora_dir / "half" / "pytorch_lora_weights.safetensors"))
    with Engine("tiny-sd", executor="inproc", max_num_seqs=4, lora_dir=str(lora_dir),
                request_batch_max_wait_ms=0, torch_num_threads=1) as engine:
        base = engine.generate(["a cat"], params())[0]
        failed = engine.generate(["a cat"] * 3, params(lora="half"))
        assert all(o.error is not None and o.error.param == "lora" for o in failed)
        assert len({o.error.message for o in failed}) == 1, [o.error for o in failed]
        assert "'half' could not be loaded" in failed[0].error.message
        after = engine.generate(["a cat"], params())[0]
        assert (after.images - base.images).abs().max() <= 1e-5
        styled = engine.generate(["a cat"], params(lora="style-a"))[0]
        assert styled.ok and (styled.images - base.images).abs().max() > 1e-3
