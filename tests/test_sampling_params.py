"""SamplingParams validation and the batch-compatibility key."""

from __future__ import annotations

import dataclasses
import math

import pytest

from diffbatch import InvalidRequestError, SamplingParams, SamplingParamsKey
from diffbatch.sampling_params import MAX_ABS_LORA_SCALE, MAX_GUIDANCE_SCALE


def key(cfg: bool = True, **overrides) -> SamplingParamsKey:
    base = dict(height=64, width=64, num_inference_steps=4, guidance_scale=5.0, seed=1)
    base.update(overrides)
    return SamplingParamsKey.from_params(SamplingParams(**base), cfg_enabled=cfg)


@pytest.mark.parametrize(
    "change",
    [
        {"height": 128},
        {"width": 128},
        {"num_inference_steps": 5},
        {"guidance_scale": 7.5},
        {"num_outputs_per_prompt": 2},
        {"output_type": "pt"},
        {"sigmas": (1.0, 0.5)},
        {"extra": {"eta": 0.5}},
    ],
)
def test_key_distinguishes_computation_fields(change):
    assert key() != key(**change)


def test_key_distinguishes_cfg_on_off():
    assert key(cfg=True) != key(cfg=False)


def test_key_leaves_the_lora_stack_out():
    """Adapters are applied per sample inside the forward: requests that differ in
    adapter, scale, stack or in using one at all share a wave."""
    assert key(lora="/a") == key(lora="/b") == key() == key(lora="/a", lora_scale=0.5)
    assert key(lora=[("/a", 0.5), ("/b", 1.0)]) == key()


def test_lora_stacks_are_normalised_and_checked():
    assert SamplingParams(lora="a", lora_scale=0.5).lora_stack == (("a", 0.5),)
    assert SamplingParams().lora_stack == ()
    given = [{"name": "a", "scale": 0.5}, {"name": "b"}, ("c", -1)]
    params = SamplingParams(lora=given)
    assert params.lora == (("a", 0.5), ("b", 1.0), ("c", -1.0)) == params.lora_stack
    for bad, match, param in [
        ([], "list of 1 to", "lora"),
        ([{"name": "a", "weight": 1}], "unknown field 'weight'", "lora[0].weight"),
        ([{"name": "a", "scale": 6}, {"name": "a", "scale": 6}], "between", "lora"),
        ([{"name": "a"}, {"name": "b", "scale": 1e9}], "between", "lora[1].scale"),
        ([{"name": "a", "scale": float("nan")}], "finite", "lora[0].scale"),
        ([{"name": "a", "scale": "1"}], "a string", "lora[0].scale"),
        ([{"name": ""}], "name an adapter", "lora[0].name"),
        ([{"name": None}], "got null", "lora[0].name"),
        (["a"], "pair", "lora[0]"),
    ]:
        with pytest.raises(InvalidRequestError, match=match) as info:
            SamplingParams(lora=bad)
        assert info.value.param == param
    # an adapter named twice adds up; lora_scale scales the stack (once: clone keeps it)
    scaled = SamplingParams(lora=[("a", 1.0), ("b", 2.0), ("a", 0.5)], lora_scale=0.5)
    assert scaled.lora_stack == (("a", 0.75), ("b", 1.0)) and scaled.lora_scale == 1.0
    assert scaled.clone(seed=3).lora_stack == scaled.lora_stack


def test_key_ignores_prompt_side_fields():
    assert key(seed=1) == key(seed=2)
    assert key(negative_prompt="blurry") == key(negative_prompt=None)
    # lora_scale without a lora does not change the computation
    assert key(lora_scale=0.3) == key()


def test_key_is_hashable_and_usable_as_dict_key():
    buckets = {key(): "a", key(height=128): "b"}
    assert buckets[key(seed=99, negative_prompt="x")] == "a"
    assert len({key(), key(seed=5), key(height=128)}) == 2


def test_default_and_explicit_equal_values_make_one_key():
    # Resolution fills defaults; an explicit equal value must give the same key.
    implicit = SamplingParams().clone(height=64, width=64, num_inference_steps=4,
                                      guidance_scale=5.0)
    explicit = SamplingParams(height=64, width=64, num_inference_steps=4, guidance_scale=5.0)
    assert SamplingParamsKey.from_params(implicit, cfg_enabled=True) == \
        SamplingParamsKey.from_params(explicit, cfg_enabled=True)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"height": 0}, "height"),
        ({"width": -8}, "width"),
        ({"height": 64.0}, "height"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 10_000}, "num_inference_steps"),
        ({"guidance_scale": math.nan}, "guidance_scale"),
        ({"guidance_scale": math.inf}, "guidance_scale"),
        ({"num_outputs_per_prompt": 0}, "num_outputs_per_prompt"),
        ({"seed": -1}, "seed"),
        ({"output_type": "latent"}, "output_type"),
        ({"negative_prompt": ["a", "b"]}, "negative_prompt"),
        ({"lora": ""}, "lora"),
        ({"lora_scale": math.nan}, "lora_scale"),
        # Text that cannot reach a tokenizer or a file system.
        ({"negative_prompt": "blurry \ud800"}, "negative_prompt"),
        ({"lora": "style\x00/../x"}, "lora"),
        ({"lora": "style\udc80"}, "lora"),
        # Scales whose images would not be finite.
        ({"guidance_scale": 1e308}, "guidance_scale"),
        ({"guidance_scale": MAX_GUIDANCE_SCALE + 0.5}, "guidance_scale"),
        ({"lora_scale": 1e308}, "lora_scale"),
        ({"lora_scale": -MAX_ABS_LORA_SCALE - 1}, "lora_scale"),
    ],
)
def test_invalid_params_fail_on_construction_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert f"`{param}`" in str(info.value)
    assert info.value.status_code == 400


def test_an_unknown_option_is_refused_naming_it_and_the_closest_known_one():
    with pytest.raises(InvalidRequestError, match="did you mean `num_inference_steps`") as info:
        SamplingParams(num_inference_step=4)
    assert info.value.param == "num_inference_step"
    with pytest.raises(InvalidRequestError, match=r"unknown sampling option `foo`\. ") as info:
        SamplingParams(foo=1)
    assert "extra={...}" in str(info.value)
    # known options by name, and `replace`, work as before; none is positional
    params = SamplingParams(height=64, width=32, seed=3)
    assert (params.height, params.width, params.seed) == (64, 32, 3)
    assert dataclasses.replace(params, seed=4).seed == 4
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(4)


def test_short_form_names_shape_steps_guidance():
    assert key().short() == "64x64/s4/g5/n1"
    # Metric labels and log lines use the short form; /metrics needs no key, and an
    # adapter (a server path) is never part of it.
    assert key(lora="/srv/private/loras/style/", lora_scale=0.5).short() == "64x64/s4/g5/n1"


def test_scales_at_their_bounds_are_valid():
    SamplingParams(guidance_scale=MAX_GUIDANCE_SCALE, lora_scale=-MAX_ABS_LORA_SCALE)
    SamplingParams(guidance_scale=0, lora_scale=MAX_ABS_LORA_SCALE)


@pytest.mark.slow
def test_tiny_sd_images_stay_finite_at_the_guidance_bound():
    np = pytest.importorskip("numpy")
    from diffbatch import Engine

    params = SamplingParams(guidance_scale=MAX_GUIDANCE_SCALE, num_inference_steps=4, seed=1,
                            output_type="np")
    with Engine("tiny-sd", executor="inproc", calibration_budget_s=0) as engine:
        images = engine.generate(["a red circle"], params, use_tqdm=False)[0].images
    assert np.isfinite(images).all()
    assert images.max() > 0  # not the all-black image a non-finite forward encodes to


def test_per_request_guidance_pipelines_share_keys_across_guidance_scales():
    a = SamplingParams(height=64, width=64, num_inference_steps=4, guidance_scale=5.0)
    b = a.clone(guidance_scale=7.5)
    assert SamplingParamsKey.from_params(a, cfg_enabled=True, per_request_guidance=True) == \
        SamplingParamsKey.from_params(b, cfg_enabled=True, per_request_guidance=True)
    assert SamplingParamsKey.from_params(a, cfg_enabled=True) != \
        SamplingParamsKey.from_params(b, cfg_enabled=True)
    # CFG off vs on never share, even with per-request guidance
    off = a.clone(guidance_scale=1.0)
    assert SamplingParamsKey.from_params(off, cfg_enabled=False, per_request_guidance=True) != \
        SamplingParamsKey.from_params(a, cfg_enabled=True, per_request_guidance=True)
    assert SamplingParamsKey.from_params(a, cfg_enabled=True, per_request_guidance=True) \
        .short() == "64x64/s4/g*/n1"


# -- edits: image, mask, strength -------------------------------------------------------
def image(height: int = 64, width: int = 64):
    import torch

    return torch.zeros(height, width, 3, dtype=torch.uint8)


def mask(height: int = 64, width: int = 64):
    import torch

    return torch.full((height, width), 255, dtype=torch.uint8)


def test_the_task_follows_the_inputs():
    assert SamplingParams().task == "text-to-image"
    assert SamplingParams(image=image()).task == "image-to-image"
    assert SamplingParams(image=image(), mask=mask()).task == "inpaint"


def test_key_distinguishes_task_and_strength_but_not_pixels():
    import torch

    base = dict(height=64, width=64, num_inference_steps=4, guidance_scale=5.0, seed=1)
    i2i = key(image=image(), strength=0.5)
    assert i2i != key()
    assert i2i != key(image=image(), mask=mask(), strength=0.5)
    assert i2i != key(image=image(), strength=0.75)
    other_pixels = torch.full((64, 64, 3), 7, dtype=torch.uint8)
    assert i2i == key(image=other_pixels, strength=0.5)
    assert (i2i.task, i2i.strength, i2i.num_denoising_steps) == ("image-to-image", 0.5, 2)
    assert key().strength is None and key().num_denoising_steps == 4
    assert SamplingParamsKey.from_params(SamplingParams(**base), cfg_enabled=True).task \
        == "text-to-image"
    assert key(image=image(), mask=mask(), strength=1.0).short() == "64x64/s4/g5/n1/inpaint@1"


def test_a_pil_image_and_mask_become_uint8_tensors():
    from PIL import Image

    params = SamplingParams(image=Image.new("RGBA", (32, 16), (255, 0, 0, 255)),
                            mask=Image.new("L", (32, 16), 255))
    assert params.image.shape == (16, 32, 3) and params.image[0, 0].tolist() == [255, 0, 0]
    assert params.mask.shape == (16, 32) and int(params.mask.min()) == 255


def test_params_with_images_compare_and_print_without_pixels():
    a = SamplingParams(image=image(), seed=1)
    assert a == a.clone() and " image=" not in repr(a) and "tensor" not in repr(a)
    assert a.clone(seed=2).image is a.image


def test_clone_replaces_or_copies_the_extras():
    a = SamplingParams(seed=1, extra={"eta": 0.5})
    b = a.clone(extra={"eta": 0.0})
    assert (a.extra, b.extra) == ({"eta": 0.5}, {"eta": 0.0})
    c = a.clone(seed=2)
    assert c.extra == a.extra and c.extra is not a.extra  # a copy, not the same dict
    with pytest.raises(InvalidRequestError):
        a.clone(extra=["eta"])  # validated like the constructor's


def test_partial_images_are_checked_and_stay_out_of_the_key():
    with pytest.raises(InvalidRequestError, match="`partial_images` must be between 0") as info:
        SamplingParams(partial_images=-1)
    assert info.value.param == "partial_images"
    resolved = SamplingParams(height=64, width=64, num_inference_steps=4, guidance_scale=5.0)
    key = SamplingParamsKey.from_params(resolved, cfg_enabled=True)
    assert SamplingParamsKey.from_params(resolved.clone(partial_images=3),
                                         cfg_enabled=True) == key


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"image": "a.png"}, "image"),
        ({"image": [[0]]}, "image"),
        ({"image": "float"}, "image"),
        ({"image": "gray"}, "image"),
        ({"image": image(), "height": 32}, "height"),
        ({"image": image(), "width": 32}, "width"),
        ({"mask": mask()}, "mask"),
        ({"image": image(), "mask": mask(32, 64)}, "mask"),
        ({"image": image(), "mask": "rgb"}, "mask"),
        ({"strength": 0.5}, "strength"),
        ({"image": image(), "strength": 0}, "strength"),
        ({"image": image(), "strength": 1.5}, "strength"),
        ({"image": image(), "strength": math.nan}, "strength"),
    ],
)
def test_invalid_edit_inputs_fail_on_construction_naming_the_field(kwargs, param):
    import torch

    special = {"float": torch.zeros(8, 8, 3), "gray": torch.zeros(8, 8, dtype=torch.uint8),
               "rgb": torch.zeros(64, 64, 3, dtype=torch.uint8)}
    kwargs = {k: special.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert f"`{param}`" in str(info.value)
