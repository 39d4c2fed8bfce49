"""The model matrix for the MMDiT families with CLIP/T5 encoders (SD3, SD3.5, Flux, Chroma).

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


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-sd35", "tiny-flux", "tiny-chroma"])
def test_family_batches_and_equals_plain_diffusers(model_cache_dir, name):
    checks = check_model(name)
    report = "\n".join(f"{'ok' if c.ok else 'FAILED'} {c.name}: {c.detail}" for c in checks)
    assert [c.name for c in checks] == CHECKS, report
    assert all(c.ok for c in checks), report
