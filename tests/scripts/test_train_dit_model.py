"""Smoke test of `scripts/train_dit_model.py --quick`: the recipe behind the shipped
`shapes-dit` model runs, writes a stock PixArt-Sigma folder that diffusers loads and
samples, a second start resumes from its saved state instead of starting over, and
`--init-from` starts a new run from a saved folder's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/train_dit_model.py"), "--quick", "--threads", "1",
         "--out", str(tmp_path / "shapes-dit"), "--loss-plot", str(tmp_path / "loss.png"),
         "--work-dir", str(tmp_path / "work"), "--vae-from", str(ROOT / "diffbatch/models/shapes"),
         *extra],
        capture_output=True, text=True, timeout=600,
    )


def test_quick_training_run_writes_a_loadable_pipeline_and_resumes(tmp_path):
    done = train(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "shapes-dit"
    defaults = json.loads((out / "diffbatch_defaults.json").read_text())
    assert defaults == {"height": 64, "width": 64, "num_inference_steps": 10,
                        "guidance_scale": 4.0, "model_max_pixels": 256 * 256}

    import torch
    from diffusers import PixArtSigmaPipeline
    from safetensors.torch import load_file

    stored = load_file(out / "transformer/diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.float16}  # half the wheel size
    pipe = PixArtSigmaPipeline.from_pretrained(str(out))
    assert pipe.transformer.dtype == pipe.text_encoder.dtype == torch.float32
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.scheduler.config.use_flow_sigmas
    assert pipe.tokenizer.model_max_length == 300
    images = pipe(["a red circle on a white background"], num_inference_steps=2,
                  height=64, width=64, output_type="pt", use_resolution_binning=False,
                  clean_caption=False, generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 64, 64)
    assert torch.isfinite(images).all()

    again = train(tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resuming from" in again.stdout and "at step 6" in again.stdout
    assert "done: 6 transformer steps" in again.stdout

    # --init-from starts a new run (fresh schedule, its own state) from the saved weights
    init = train(tmp_path, "--init-from", str(out), "--out", str(tmp_path / "continued"))
    assert init.returncode == 0, init.stdout[-2000:] + init.stderr[-2000:]
    assert f"starting from the weights of {out}" in init.stdout
    assert "resuming from" not in init.stdout
    assert "done: 6 transformer steps" in init.stdout
    assert len([p for p in (tmp_path / "work").iterdir() if "-init" in p.name]) == 1
