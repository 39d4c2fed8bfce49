"""Family rules (`family_rules.py`): what the adapter passes and keys per family, so
that a request alone equals plain diffusers and its batch mates change nothing.

Built on the tiny family models (`tiny_families.py`); the end-to-end matrix is in
tests/pipelines/test_model_matrix_*.py.
"""

from __future__ import annotations

import pytest

import diffbatch.pipelines.tiny_families  # noqa: F401 - registers the family builders
from diffbatch.pipelines import family_rules
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey
from tests.pipelines.conftest import make_batch, make_request


def _transformer_rows(pipeline, batch) -> int:
    """Samples the transformer saw in one forward of `batch`, summed over its calls."""
    rows = []
    handle = pipeline.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]),
        with_kwargs=True)
    try:
        pipeline.forward(batch)
    finally:
        handle.remove()
    return sum(rows)


def test_qwen_image_without_negative_prompts_runs_no_true_cfg(load_tiny):
    pipeline = load_tiny("tiny-qwen-image")
    size = {"height": 32, "width": 32, "num_inference_steps": 2}
    plain = [make_request(pipeline, f"r{i}", p, seed=i, **size)
             for i, p in enumerate(["a red cat", "a blue dog"])]
    # one denoiser row per sample per step: 2 samples x 2 steps
    assert _transformer_rows(pipeline, make_batch(plain)) == 4
    negative = [make_request(pipeline, f"n{i}", p, seed=i, negative_prompt="blurry", **size)
                for i, p in enumerate(["a red cat", "a blue dog"])]
    assert all(r.key.cfg_enabled for r in negative) and not plain[0].key.cfg_enabled
    assert _transformer_rows(pipeline, make_batch(negative)) == 8  # true CFG: twice


def test_qwen_image_guidance_scale_is_not_in_the_key(load_tiny):
    info = load_tiny("tiny-qwen-image").info()
    assert not info.uses_guidance_scale
    keys = {SamplingParamsKey.from_params(
        SamplingParams(height=32, width=32, num_inference_steps=2, guidance_scale=g, seed=0),
        cfg_enabled=False, guidance_used=info.uses_guidance_scale) for g in (1.0, 4.0, 7.5)}
    assert len(keys) == 1


def test_sdxl_keys_requests_without_a_negative_prompt_apart(load_tiny):
    info = load_tiny("tiny-sdxl").info()
    assert info.negative_prompt_none_differs  # force_zeros_for_empty_prompt
    layouts = {family_rules.prompt_layout(info, "a cat", SamplingParams(negative_prompt=n))
               for n in (None, "", "blurry")}
    assert layouts == {(False,), (True,)}
    sd = load_tiny("tiny-sd").info()  # None and "" encode alike: one layout
    assert family_rules.prompt_layout(sd, "a cat", SamplingParams()) == ()


def test_cogview4_keys_prompts_by_their_padded_length(load_tiny):
    info = load_tiny("tiny-cogview4").info()
    assert info.prompt_pad_multiple == 16 and info.prompt_pad_tokenizer

    def layout(prompt: str, negative: str | None = None) -> tuple:
        return family_rules.prompt_layout(info, prompt, SamplingParams(negative_prompt=negative))

    assert layout("a red cat") == layout("a blue dog") == (16, 16)
    long = "a big old castle on a mountain " * 4
    assert layout(long)[0] > 16 and layout(long) != layout("a red cat")
    assert layout("a red cat", long)[1] > 16


def test_resolution_bins_come_from_the_pipeline(load_tiny):
    # Sana's table has sample size 16 (512 px bins); PixArt's has no bins for tiny-pixart's 8
    assert family_rules.resolution_binning(load_tiny("tiny-sana").pipe) is None
    assert family_rules.resolution_binning(load_tiny("tiny-pixart").pipe) is False
    # HunyuanDiT's binning returns another size than the one asked for
    assert family_rules.resolution_binning(load_tiny("tiny-hunyuandit").pipe) is False
    assert family_rules.resolution_binning(load_tiny("tiny-sd").pipe) is None


@pytest.mark.parametrize("name", ["tiny-qwen-image", "tiny-sdxl"])
def test_a_wave_without_negative_prompts_passes_none(load_tiny, name):
    pipeline = load_tiny(name)
    request = make_request(pipeline, "r", "a cat", height=32, width=32)
    assert "negative_prompt" not in pipeline.call_kwargs(make_batch([request]))


def test_sana_bins_a_size_outside_its_table_as_diffusers_does(load_tiny):
    """256x256 generates at Sana's 512 px bin and is resized back: the request equals
    plain diffusers (binning on, its default), which differs from unbinned."""
    import torch

    from diffbatch.entrypoints.check_model import levels

    pipeline = load_tiny("tiny-sana")
    request = make_request(pipeline, "r", "a red cat", seed=3, height=256, width=256)
    served = pipeline.forward(make_batch([request]))[0].images

    def plain(**kwargs) -> torch.Tensor:
        return pipeline.pipe(prompt="a red cat", height=256, width=256, num_inference_steps=2,
                             guidance_scale=request.sampling_params.guidance_scale,
                             generator=torch.Generator().manual_seed(3), output_type="pt",
                             **kwargs).images

    assert levels(served, plain()) <= 1
    assert levels(served, plain(use_resolution_binning=False)) > 1


def test_a_start_up_check_finds_an_encoder_that_pads_without_a_mask(load_tiny, monkeypatch):
    from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline

    cogview = load_tiny("tiny-cogview4")
    assert family_rules.encoding_depends_on_batch(cogview.pipe) is True
    for name in ("tiny-sd", "tiny-sd3", "tiny-sdxl", "tiny-qwen-image", "tiny-sana"):
        assert family_rules.encoding_depends_on_batch(load_tiny(name).pipe) is False, name
    # a family without a rule: the check keys its requests by exact token counts
    monkeypatch.setattr(family_rules, "_UNMASKED_PADDING", {})
    info = DiffusersT2IPipeline(cogview.pipe, device="cpu").info()
    assert info.prompt_pad_multiple == 1
    layouts = {family_rules.prompt_layout(info, p, SamplingParams())
               for p in ("a red cat", "a blue dog", "a red cat on a tree")}
    assert len(layouts) == 2
