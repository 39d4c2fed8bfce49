"""Edits end to end through the worker process: image-to-image and inpainting waves on
tiny-sd, batch invariance through the whole engine, tasks never sharing a wave, and the
admission checks that keep an edit a model cannot run from reaching a worker."""

from __future__ import annotations

import pytest
import torch

from diffbatch import Engine, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white boat"]
SIZE = 64


def image(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(SIZE, SIZE, 3, generator=g) * 255).round().to(torch.uint8)


def mask(seed: int) -> torch.Tensor:
    out = torch.zeros(SIZE, SIZE, dtype=torch.uint8)
    top = 8 * (seed % 4)
    out[top:top + 32, top:top + 32] = 255
    return out


def edit(seed: int, task: str, **changes) -> SamplingParams:
    return SamplingParams(num_inference_steps=4, seed=seed, output_type="pt", image=image(seed),
                          mask=mask(seed) if task == "inpaint" else None, **changes)


@pytest.fixture(scope="module")
def sd_engine():
    with Engine("tiny-sd", max_num_seqs=4, request_batch_max_wait_ms=50, executor="mp",
                torch_num_threads=1) as engine:
        yield engine


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
def test_edit_waves_are_batch_invariant(sd_engine, task):
    batched = sd_engine.generate(PROMPTS, [edit(100 + i, task, strength=0.75) for i in range(4)])
    assert all(o.ok for o in batched), [o.error for o in batched]
    assert {o.batch_size for o in batched} == {4}
    for i, out in enumerate(batched):
        alone = sd_engine.generate([PROMPTS[i]], [edit(100 + i, task, strength=0.75)])[0]
        assert alone.batch_size == 1
        diff = (out.images - alone.images).abs().max().item()
        assert diff <= 1e-4, f"{task} request {i} differs from its solo run by {diff}"
    # the input image matters: another image with the same prompt and seed differs
    other = edit(100, task, strength=0.75)
    other.image = image(999)
    moved = sd_engine.generate([PROMPTS[0]], [other])[0]
    assert (moved.images - batched[0].images).abs().max().item() > 1e-3


def test_tasks_and_strengths_never_share_a_wave(sd_engine):
    params = [SamplingParams(num_inference_steps=4, seed=1, output_type="pt"),
              edit(2, "image-to-image"), edit(3, "inpaint"), edit(4, "image-to-image"),
              edit(5, "image-to-image", strength=0.5)]
    outs = sd_engine.generate(["a cat"] * len(params), params)
    assert all(o.ok for o in outs), [o.error for o in outs]
    # one wave per task and strength: t2i | i2i + i2i | inpaint | i2i@0.5
    assert [o.batch_size for o in outs] == [1, 2, 1, 2, 1]


def test_an_edit_takes_its_images_size_and_the_tasks_default_strength(sd_engine):
    resolved = sd_engine.resolve_params(SamplingParams(image=torch.zeros(32, 48, 3,
                                                                        dtype=torch.uint8)))
    assert (resolved.height, resolved.width, resolved.strength) == (32, 48, 0.8)
    inpaint = sd_engine.resolve_params(edit(1, "inpaint"))
    assert inpaint.strength == 1.0
    out = sd_engine.generate(["a cat"], SamplingParams(
        image=torch.zeros(32, 48, 3, dtype=torch.uint8), num_inference_steps=2, seed=1))[0]
    assert out.ok and out.images[0].size == (48, 32)


def test_a_small_strength_runs_one_step(sd_engine):
    light, lightest = sd_engine.generate(["a cat"] * 2, [
        edit(1, "image-to-image", strength=0.1), edit(1, "image-to-image", strength=0.25)])
    assert light.ok and lightest.ok, (light.error, lightest.error)
    assert (light.images - lightest.images).abs().max().item() <= 1e-4  # both one step of 4


def test_an_edit_the_model_cannot_run_is_refused_at_admission(sd_engine):
    with pytest.raises(InvalidRequestError, match="multiple of 16"):
        sd_engine.generate(["a cat"], SamplingParams(
            image=torch.zeros(40, 40, 3, dtype=torch.uint8)))


def test_a_family_without_edit_pipelines_refuses_edits_by_name():
    with Engine("tiny-pixart", executor="inproc", max_num_seqs=1,
                request_batch_max_wait_ms=0) as engine:
        for task in ("image-to-image", "inpaint"):
            with pytest.raises(InvalidRequestError) as info:
                engine.generate(["a cat"], edit(1, task))
            assert "PixArtSigmaPipeline" in info.value.message and task in info.value.message
            assert info.value.param == ("mask" if task == "inpaint" else "image")
        assert engine.num_unfinished == 0
