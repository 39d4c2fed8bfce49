"""The model matrix for the families with LLM text encoders (Qwen-Image, Z-Image, Flux.2 Klein,
CogView4).

Each family runs through `check_model` (diffbatch/entrypoints/check_model.py): one
wave of 4, batched == solo, mixed guidance/negative prompts/prompt lengths, solo ==
plain diffusers, step mode, every image within 1 level (0-255). The matrix is split
into files by family group so the suite's workers share it.
"""

from __future__ import annotations

import pytest

from diffbatch.entrypoints.check_model import check_model

pytestmark = pytest.mark.slow

CHECKS = ["wave of 4", "batched == solo", "mixed guidance, negatives, lengths",
          "solo == diffusers", "step mode"]


@pytest.mark.parametrize("name", [
    "tiny-qwen-image", "tiny-z-image", "tiny-flux2-klein", "tiny-cogview4",
])
def test_family_batches_and_equals_plain_diffusers(model_cache_dir, name):
    checks = check_model(name)
    report = "\n".join(f"{'ok' if c.ok else 'FAILED'} {c.name}: {c.detail}" for c in checks)
    assert [c.name for c in checks] == CHECKS, report
    assert all(c.ok for c in checks), report


def test_z_image_starts_with_the_default_warmup(model_cache_dir, tmp_path):
    """A Z-Image folder without serving defaults (as downloaded): the default size,
    and so the warm-up, stays within what its rotary table covers."""
    import shutil

    from diffbatch import Engine
    from diffbatch.pipelines.model_folder import DEFAULTS_FILE
    from diffbatch.pipelines.registry import resolve_model_path

    folder = tmp_path / "z-image"
    shutil.copytree(resolve_model_path("tiny-z-image"), folder)
    (folder / DEFAULTS_FILE).unlink()
    with Engine(str(folder), executor="inproc", max_num_seqs=1) as engine:  # warm-up on
        assert engine.config.warmup
        assert engine.info.default_height == engine.info.default_width == 128
