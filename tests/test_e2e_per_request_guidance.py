"""Per-request guidance end to end: requests with different guidance scales share a
wave through `Engine` (worker process, real tiny-sd pipeline) and each still equals
its solo run.

Waves are made deterministic by queueing a whole `generate()` call at once: the first
wave sees every request.
"""

from __future__ import annotations

import pytest
import torch

from diffbatch import Engine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white boat", "a black car",
           "a small house", "a yellow sun", "a pink flower"]
TOLERANCE = 1e-4


def pt(seed: int, *, guidance_scale: float) -> SamplingParams:
    return SamplingParams(height=64, width=64, num_inference_steps=2, seed=seed,
                          guidance_scale=guidance_scale, output_type="pt")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def sd_engine():
    """tiny-sd in a worker process, waves of up to 8."""
    with Engine("tiny-sd", max_num_seqs=8, executor="mp", torch_num_threads=1) as engine:
        yield engine


def test_guidance_scales_share_waves_and_equal_solo_runs(sd_engine):
    assert sd_engine.info.supports_per_request_guidance
    scales = [5.0 if i % 2 == 0 else 7.5 for i in range(8)]
    params = [pt(200 + i, guidance_scale=g) for i, g in enumerate(scales)]
    outs = sd_engine.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert [o.batch_size for o in outs] == [8] * 8  # one wave, two guidance scales
    for i, out in enumerate(outs):
        alone = sd_engine.generate([PROMPTS[i]], [params[i]], use_tqdm=False)[0]
        assert alone.batch_size == 1
        diff = max_diff(out.images, alone.images)
        assert diff <= TOLERANCE, f"request {i} (g={scales[i]}) differs from its solo run by {diff}"
    # the same prompt and seed at the other scale is a different image
    other = sd_engine.generate([PROMPTS[0]], [pt(200, guidance_scale=7.5)], use_tqdm=False)[0]
    assert max_diff(other.images, outs[0].images) > 1e-3
