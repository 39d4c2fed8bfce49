"""Edits on the diffusers adapter: image-to-image and inpainting pipelines built from the
loaded model's own components, one call per wave, batch invariance per task."""

from __future__ import annotations

import pytest
import torch

from diffbatch.pipelines.diffusers_edit import edit_inputs
from tests.pipelines.conftest import SIZE, TOLERANCE, make_batch, make_request

EDIT_MODELS = ("tiny-sd", "tiny-sd3")
PROMPTS = [("a red cat", None), ("a blue dog", "blurry"), ("a green tree photo", "ugly bad")]


def _image(seed: int) -> torch.Tensor:
    """A uint8 [SIZE, SIZE, 3] input image of its own (noise, one per seed)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(SIZE, SIZE, 3, generator=g) * 255).round().to(torch.uint8)


def _mask(top: int) -> torch.Tensor:
    """A uint8 [SIZE, SIZE] mask painting a square from row/column `top`."""
    mask = torch.zeros(SIZE, SIZE, dtype=torch.uint8)
    mask[top:top + SIZE // 2, top:top + SIZE // 2] = 255
    return mask


def _edits(pipeline, task: str, n: int = 1, strength: float = 0.75) -> list:
    return [
        make_request(pipeline, f"req-{i}", prompt, seed=100 + 10 * i, negative_prompt=negative,
                     n=n, image=_image(i), strength=strength,
                     **({"mask": _mask(4 * i)} if task == "inpaint" else {}))
        for i, (prompt, negative) in enumerate(PROMPTS)
    ]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", EDIT_MODELS)
def test_edit_pipelines_share_the_loaded_modules(name: str, load_tiny) -> None:
    pipeline = load_tiny(name)
    assert set(pipeline.task_pipes) == {"text-to-image", "image-to-image", "inpaint"}
    base = pipeline.pipe.components
    for task in ("image-to-image", "inpaint"):
        components = pipeline.task_pipes[task].components
        for component, module in base.items():
            if isinstance(module, torch.nn.Module):
                assert components[component] is module, (task, component)
    defaults = pipeline.info().default_strengths
    assert defaults == ({"image-to-image": 0.8, "inpaint": 1.0} if name == "tiny-sd"
                        else {"image-to-image": 0.6, "inpaint": 0.6})


def test_a_family_without_edit_pipelines_declares_none(load_tiny) -> None:
    info = load_tiny("tiny-pixart").info()
    assert info.default_strengths == {}
    assert info.supports_task("text-to-image") and not info.supports_task("image-to-image")


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
@pytest.mark.parametrize("name", EDIT_MODELS)
def test_edit_batch_invariance(name: str, task: str, load_tiny) -> None:
    """Each edit's images equal the same edit run alone, n = 1 and n = 2."""
    pipeline = load_tiny(name)
    for n in (1, 2):
        requests = _edits(pipeline, task, n=n)
        batched = pipeline.forward(make_batch(requests))
        assert [o.images.shape for o in batched] == [(n, 3, SIZE, SIZE)] * len(requests)
        for request, out in zip(requests, batched, strict=True):
            alone = pipeline.forward(make_batch([request]))[0]
            assert _max_diff(out.images, alone.images) <= TOLERANCE, (request.request_id, n)


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
def test_the_input_image_and_mask_change_the_output(task: str, load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    extra = {"mask": _mask(0)} if task == "inpaint" else {}
    one, other = (make_request(pipeline, "r", "a red cat", seed=1, image=_image(i),
                               strength=0.5, **extra) for i in (1, 2))
    out_one = pipeline.forward(make_batch([one]))[0].images
    out_other = pipeline.forward(make_batch([other]))[0].images
    assert _max_diff(out_one, out_other) > 1e-2
    if task == "inpaint":
        moved = make_request(pipeline, "r", "a red cat", seed=1, image=_image(1), strength=0.5,
                             mask=_mask(SIZE // 2))
        assert _max_diff(pipeline.forward(make_batch([moved]))[0].images, out_one) > 1e-2


def test_edit_inputs_repeat_each_request_n_times_in_order(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    requests = _edits(pipeline, "inpaint", n=2)
    inputs = edit_inputs(make_batch(requests))
    assert inputs["image"].shape == (6, 3, SIZE, SIZE)
    assert inputs["mask_image"].shape == (6, 1, SIZE, SIZE)
    for i, request in enumerate(requests):
        expected = request.sampling_params.image.permute(2, 0, 1).float() / 255.0
        for j in (2 * i, 2 * i + 1):
            assert torch.equal(inputs["image"][j], expected)
            assert torch.equal(inputs["mask_image"][j, 0] * 255.0,
                               request.sampling_params.mask.float())


def test_strength_sets_the_steps_and_the_key(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    low, high = (make_request(pipeline, "r", "a cat", image=_image(0), strength=s,
                              num_inference_steps=4) for s in (0.5, 1.0))
    assert low.key != high.key
    assert (low.key.num_denoising_steps, high.key.num_denoising_steps) == (2, 4)
    assert low.key.task == "image-to-image" and low.key.short().endswith("/i2i@0.5")
    text = make_request(pipeline, "r", "a cat")
    assert text.key.task == "text-to-image" and text.key.strength is None


def test_probe_verdicts_are_cached_by_what_decides_them(load_tiny, tmp_path, monkeypatch) -> None:
    """A second start of the same model reads each edit pipeline's verdict instead of
    running its probe again; a model whose components differ is probed afresh; a damaged
    verdict file or a cache dir that cannot be written only means probing."""
    import diffbatch.pipelines.diffusers_edit as edit

    base = load_tiny("tiny-sd").pipe
    probed: list[str] = []
    real_probe = edit._probe

    def counting_probe(task_pipe, task: str, size: int) -> None:
        probed.append(task)
        real_probe(task_pipe, task, size)

    monkeypatch.setattr(edit, "_probe", counting_probe)
    monkeypatch.setenv("DIFFBATCH_CACHE_DIR", str(tmp_path / "cache"))
    assert set(edit.edit_pipes(base, 8)) == {"image-to-image", "inpaint"}
    assert probed == ["image-to-image", "inpaint"]
    assert set(edit.edit_pipes(base, 8)) == {"image-to-image", "inpaint"}  # read back
    assert probed == ["image-to-image", "inpaint"]

    # A failing verdict is kept too: a 5-channel UNet has no inpainting (4 or 9).
    unet = type(base.unet).from_config({**base.unet.config, "in_channels": 5})
    other = type(base)(**{**base.components, "unet": unet})
    assert set(edit.edit_pipes(other, 8)) == set()  # its image-to-image fails as well
    assert probed[2:] == ["image-to-image", "inpaint"]
    assert set(edit.edit_pipes(other, 8)) == set()
    assert len(probed) == 4

    for stored in (tmp_path / "cache" / "edit_probes").iterdir():  # damaged: probed again
        stored.write_text("[1, 2")
    assert set(edit.edit_pipes(base, 8)) == {"image-to-image", "inpaint"}
    assert len(probed) == 6
    for stored in (tmp_path / "cache" / "edit_probes").iterdir():
        stored.write_text("[1, 2]")
    assert set(edit.edit_pipes(base, 8)) == {"image-to-image", "inpaint"}
    assert len(probed) == 8

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("DIFFBATCH_CACHE_DIR", str(blocked))
    assert set(edit.edit_pipes(base, 8)) == {"image-to-image", "inpaint"}
    assert len(probed) == 10
