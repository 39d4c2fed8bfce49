"""LoRA through the engine: requests with different adapters share one forward.

Every built-in family, request mode and step mode: a wave mixing adapters, scales, a
stack of two and the base model runs as ONE wave, and each image equals the same
request run alone (within 1e-4), while the adapters visibly change the images.
"""

from __future__ import annotations

import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.errors import InvalidRequestError
from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.pipelines.tiny_lora import make_tiny_lora

pytestmark = pytest.mark.slow

FAMILIES = ["tiny-sd", "tiny-sd3", "tiny-flux", "tiny-pixart", "shapes"]
# Families whose diffusers loader takes text-encoder LoRA too (PixArt's has none).
_TEXT_ENCODER_LORA = {"tiny-sd", "tiny-sd3", "tiny-flux", "shapes"}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Per family, a folder with adapters "style" (denoiser and, where the family's
    loader takes it, text encoder; rank 4) and "character" (denoiser, rank 8)."""
    folders = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"loras-{family}")
        model = resolve_model_path(family)
        make_tiny_lora(model, root / "style", seed=1, text_encoder=family in _TEXT_ENCODER_LORA)
        make_tiny_lora(model, root / "character", seed=2, rank=8)
        folders[family] = root
    return folders


def params(seed: int = 3, **kwargs) -> SamplingParams:
    return SamplingParams(num_inference_steps=2, seed=seed, output_type="pt", height=64,
                          width=64, **kwargs)


MIX = [
    params(lora="style"),
    params(lora="character", lora_scale=0.5, seed=4),
    params(seed=5),
    params(lora=[{"name": "style", "scale": 0.7}, {"name": "character", "scale": -1.0}],
           seed=6),
    params(lora="style", lora_scale=-0.8, seed=7),
]


@pytest.mark.parametrize("step_execution", [False, True], ids=["request", "step"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_wave_equals_each_request_alone(adapters, family, step_execution):
    with Engine(family, executor="inproc", max_num_seqs=8, lora_dir=str(adapters[family]),
                torch_num_threads=1, step_execution=step_execution,
                request_batch_max_wait_ms=200, warmup=False) as engine:
        alone = [engine.generate(["a cat"], p)[0] for p in MIX]
        base = [engine.generate(["a cat"], p.clone(lora=None, lora_scale=1.0))[0]
                for p in MIX]
        mixed = engine.generate(["a cat"] * len(MIX), MIX)
    for i, (solo, out) in enumerate(zip(alone, mixed, strict=True)):
        assert out.ok and solo.ok, (out.error, solo.error)
        assert out.batch_size == len(MIX), "the mixed requests did not share one batch"
        assert (out.images - solo.images).abs().max().item() <= TOLERANCE, i
        if MIX[i].lora is not None:  # a test that ignored adapters would fail here
            assert (solo.images - base[i].images).abs().max().item() > 1e-2, i


def test_a_corrupt_adapter_fails_only_its_requests(adapters):
    """A --lora-dir file that is corrupt at start-up is refused at admission with its
    reason; one that turns up later is read at its first use, in the wave: a 400
    naming `lora` and the adapter, and its wave mates run in the same wave."""
    root = adapters["tiny-sd"]
    junk = b"\x00\x17not a safetensors file" * 40
    (root / "junk.safetensors").write_bytes(junk)
    with Engine("tiny-sd", executor="inproc", max_num_seqs=4, lora_dir=str(root),
                torch_num_threads=1, request_batch_max_wait_ms=200) as engine:
        with pytest.raises(InvalidRequestError, match=r"'junk\.safetensors' is not a safe"):
            engine.generate(["a cat"], params(lora="junk.safetensors"))
        (root / "late.safetensors").write_bytes(junk)
        late, plain, styled = engine.generate(
            ["a cat"] * 3, [params(lora="late.safetensors"), params(), params(lora="style")])
        assert late.error is not None and plain.ok and styled.ok, (late.error, plain.error)
        assert (late.error.status_code, late.error.type, late.error.param) == (
            400, "invalid_request_error", "lora")
        assert "'late.safetensors' is not a safetensors file" in late.error.message
        assert plain.batch_size == styled.batch_size == 3  # one wave, its mates ran
        assert engine.generate(["a cat"], params(lora="style"))[0].ok


def test_an_adapter_that_fails_half_loaded_leaves_the_model_as_it_was(adapters):
    """diffusers loads an adapter part by part: one whose UNet part loads and whose
    text-encoder part does not must leave nothing behind for later requests."""
    import os

    import torch
    from safetensors.torch import load_file, save_file

    root = adapters["tiny-sd"]
    weights = load_file(os.path.join(root / "character", "pytorch_lora_weights.safetensors"))
    prefix = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    wrong = {f"{prefix}.lora_A.weight": torch.randn(4, 999),
             f"{prefix}.lora_B.weight": torch.randn(999, 4)}
    with Engine("tiny-sd", executor="inproc", max_num_seqs=4, lora_dir=str(root),
                request_batch_max_wait_ms=0, torch_num_threads=1) as engine:
        base = engine.generate(["a cat"], params())[0]
        (root / "half").mkdir()  # after start-up: read at its first use
        save_file({**weights, **wrong}, str(root / "half" / "pytorch_lora_weights.safetensors"))
        failed = engine.generate(["a cat"] * 3, params(lora="half"))
        assert all(o.error is not None and o.error.param == "lora" for o in failed)
        assert "'half' does not fit this model: its weight for `encoder.layers.0.self_attn" \
            in failed[0].error.message
        after = engine.generate(["a cat"], params())[0]
        assert (after.images - base.images).abs().max() <= 1e-5
        styled = engine.generate(["a cat"], params(lora="character"))[0]
        assert styled.ok and (styled.images - base.images).abs().max() > 1e-3


@pytest.mark.parametrize("step_execution", [False, True], ids=["request", "step"])
def test_four_adapters_under_max_loras_two_lose_no_request(tmp_path, step_execution):
    """Eviction under pressure: every request completes with its own adapter's image
    (an adapter evicted while its wave ran would change the image or fail it)."""
    model = resolve_model_path("tiny-sd")
    names = [f"s{i}" for i in range(4)]
    for i, name in enumerate(names):
        make_tiny_lora(model, tmp_path / name, seed=10 + i)
    wanted = [params(lora=names[i % 4], seed=i) for i in range(12)]
    with Engine("tiny-sd", executor="inproc", max_num_seqs=8, lora_dir=str(tmp_path),
                max_loras=2, torch_num_threads=1, step_execution=step_execution,
                request_batch_max_wait_ms=100, warmup=False) as engine:
        alone = [engine.generate(["a cat"], p)[0] for p in wanted[:4]]
        outs = engine.generate(["a cat"] * 12, wanted)
        sample = engine.metrics.registry.get_sample_value
        evictions = sample("diffbatch_lora_adapter_evictions_total")
        loads = sample("diffbatch_lora_adapter_loads_total")
        one_adapter = sample("diffbatch_lora_adapters_per_wave_bucket", {"le": "1.0"})
        waves = sample("diffbatch_lora_adapters_per_wave_count")
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    for i in range(4):
        assert (outs[i].images - alone[i].images).abs().max().item() <= TOLERANCE
    assert evictions and evictions >= 2 and loads and loads >= 4
    assert waves and one_adapter < waves  # some wave (or step) mixed adapters


def test_step_mode_never_evicts_the_adapter_of_a_running_request(tmp_path):
    """--max-loras 2 in step mode: `long` (adapter a, 6 steps) and `short` (b, 1 step)
    run together; `late` (c) waits for room, joins once `short` left, and its load
    evicts one adapter. a heads the LRU list then, but `long` still runs with it: b
    goes, and `long` ends with the image it has alone."""
    model = resolve_model_path("tiny-sd")
    for i, name in enumerate("abc"):
        make_tiny_lora(model, tmp_path / name, seed=20 + i)
    long = params(lora="a", seed=1).clone(num_inference_steps=6)
    wanted = [long, params(lora="b", seed=2).clone(num_inference_steps=1),
              params(lora="c", seed=3)]
    with Engine("tiny-sd", executor="inproc", max_num_seqs=4, lora_dir=str(tmp_path),
                max_loras=2, torch_num_threads=1, step_execution=True,
                warmup=False) as engine:
        alone = engine.generate(["a cat"], long)[0]
        sample = engine.metrics.registry.get_sample_value
        evictions = sample("diffbatch_lora_adapter_evictions_total") or 0.0
        outs = engine.generate(["a cat"] * 3, wanted)
        evictions = sample("diffbatch_lora_adapter_evictions_total") - evictions
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    assert outs[0].batch_size >= 2, "long and short did not share the running batch"
    # c's load evicted an adapter while a headed the LRU list (start-up loads every
    # --lora-dir entry, so how many loads came before it depends on the folder)
    assert evictions >= 1
    assert (outs[0].images - alone.images).abs().max().item() <= TOLERANCE
