"""The procedural shapes dataset, its pixel judge, and the shipped default model folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scripts import shapes_data as sd

MODEL_DIR = Path(__file__).resolve().parents[2] / "diffbatch" / "models" / "shapes"


def test_judge_agrees_with_ground_truth_on_generated_data():
    rng = np.random.default_rng(0)
    n, hits = 400, {"colour": 0, "shape": 0, "background": 0}
    for _ in range(n):
        image, _caption, scene = sd.make_example(rng, "all")
        got = sd.judge(image)
        hits["colour"] += got["colour"] == scene.colour
        hits["shape"] += got["shape"] == scene.shape
        hits["background"] += got["background"] == scene.background
    for k, v in hits.items():
        assert v / n >= 0.95, (k, v / n)


def test_judge_matches_follows_the_caption():
    rng = np.random.default_rng(1)
    agree = 0
    for _ in range(200):
        image, caption, _ = sd.make_example(rng, "train")
        m = sd.judge_matches(image, caption)
        agree += all(v is not False for v in m.values())
    assert agree >= 190


def test_judge_functions_on_pil_and_blank_images():
    from PIL import Image

    scene = sd.sample_scene(
        np.random.default_rng(2), "all", colour="blue", shape="triangle", background="white"
    )
    img = Image.fromarray(sd.render_scene(scene))
    assert sd.judge_colour(img) == "blue"
    assert sd.judge_shape(img) == "triangle"
    assert sd.judge_background(img) == "white"
    blank = np.full((64, 64, 3), 128, dtype=np.uint8)
    assert sd.judge_shape(blank) == "none"
    assert sd.judge_colour(blank) == "none"


def test_heldout_split_is_disjoint_from_training():
    assert len(sd.HELDOUT_TRIPLES) >= 10
    rng = np.random.default_rng(3)
    for _ in range(3000):
        scene = sd.sample_scene(rng, "train", free_position_prob=0.15)
        assert scene.triple not in sd.HELDOUT_TRIPLES
    for _ in range(200):
        assert sd.sample_scene(rng, "heldout").triple in sd.HELDOUT_TRIPLES
    prompts = sd.heldout_prompts(120)
    assert len(prompts) == len(set(prompts)) == 120
    assert all(sd.caption_split(p) == "heldout" for p in prompts)
    with pytest.raises(ValueError):
        c, s, b = sorted(sd.HELDOUT_TRIPLES)[0]
        sd.sample_scene(rng, "train", colour=c, shape=s, background=b)
    # every colour, shape and background still occurs in training
    seen = {t for t in _all_triples() if t not in sd.HELDOUT_TRIPLES}
    assert {t[0] for t in seen} == set(sd.SHAPE_COLOURS)
    assert {t[1] for t in seen} == set(sd.SHAPES)
    assert {t[2] for t in seen} == set(sd.BACKGROUNDS)


def _all_triples():
    return {(c, s, b) for c in sd.SHAPE_COLOURS for s in sd.SHAPES for b in sd.BACKGROUNDS}


def test_parse_caption_round_trip():
    rng = np.random.default_rng(4)
    for _ in range(300):
        scene = sd.sample_scene(rng, "all")
        parsed = sd.parse_caption(sd.caption_for(scene))
        assert parsed == {
            "shape": scene.shape,
            "colour": scene.colour,
            "background": scene.background,
            "size": scene.size,
            "position": scene.position,
        }
    p = sd.parse_caption("A Grey circle.")
    assert p["colour"] == "gray" and p["shape"] == "circle" and p["background"] is None


@pytest.mark.skipif(
    not (MODEL_DIR / "model_index.json").exists(), reason="default model not trained"
)
def test_shipped_model_loads_with_stock_diffusers():
    import torch
    from diffusers import StableDiffusionPipeline

    defaults = json.loads((MODEL_DIR / "diffbatch_defaults.json").read_text())
    assert defaults["height"] == defaults["width"] == 64
    assert 10 <= defaults["num_inference_steps"] <= 20
    pipe = StableDiffusionPipeline.from_pretrained(str(MODEL_DIR))
    pipe.set_progress_bar_config(disable=True)
    tok = pipe.tokenizer
    # a tokenizer that silently ignored its files has 3 tokens; ours is word-level
    assert len(tok) > 500
    for word in sd.caption_vocabulary():
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    weights = sum(p.stat().st_size for p in MODEL_DIR.rglob("*.safetensors"))
    assert weights <= 25 * 2**20
    out = pipe(
        ["a red circle on a white background", "a small blue square in the top left"],
        num_inference_steps=2,
        guidance_scale=defaults["guidance_scale"],
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert out.shape == (2, 64, 64, 3)
    assert np.isfinite(out).all()
