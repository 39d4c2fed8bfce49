"""Smoke test of `scripts/train_default_model.py --quick`: every stage runs and writes a
stock diffusers folder that `StableDiffusionPipeline.from_pretrained` loads and samples.

Keeps the training script (the recipe behind the shipped `shapes` model) from rotting;
about half a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_quick_training_run_writes_a_loadable_pipeline(tmp_path):
    out = tmp_path / "shapes"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train_default_model.py"), "--quick",
         "--threads", "1", "--out", str(out), "--loss-plot", str(tmp_path / "loss.png"),
         "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    defaults = json.loads((out / "diffbatch_defaults.json").read_text())
    assert defaults == {"height": 64, "width": 64, "num_inference_steps": 15,
                        "guidance_scale": 5.0, "model_max_pixels": 256 * 256}
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        assert (tmp_path / "loss.png").stat().st_size > 0
    else:
        assert "matplotlib missing: no loss plot" in done.stdout

    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(out))
    images = pipe(["a red circle on a white background"], num_inference_steps=2,
                  height=64, width=64, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 64, 64)
    assert torch.isfinite(images).all()
