"""End to end for issue 5 through `Engine` with the real tiny-sd pipeline.

Guidance co-batching (requests with different guidance scales share a wave and
still equal their solo runs), the `grouped` policy (a mixed-size queue is served
in full waves where `fifo` runs one request per wave), and error isolation (a
poisoned request in a wave of 8 fails alone with `bisect`, takes the wave down
with `none`). Waves are made deterministic by queueing a whole `generate()` call
at once: the first wave sees every request.
"""

from __future__ import annotations

import pytest
import torch

from diffbatch import Engine, SamplingParams
from tests.issue5_pipelines import POISON

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white boat", "a black car",
           "a small house", "a yellow sun", "a pink flower"]
TOLERANCE = 1e-4
POISON_PIPELINE = "tests.issue5_pipelines.PoisonTinySD"


def pt(seed: int, *, size: int = 64, guidance_scale: float = 5.0) -> SamplingParams:
    return SamplingParams(height=size, width=size, num_inference_steps=2, seed=seed,
                          guidance_scale=guidance_scale, output_type="pt")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def sd_engine():
    """tiny-sd in a worker process, `fifo`, `bisect`, waves of up to 8.

    The pipeline is the real adapter that fails only waves holding a poisoned
    prompt, so one worker serves every mp test here.
    """
    with Engine("tiny-sd", pipeline_class=POISON_PIPELINE, max_num_seqs=8, executor="mp",
                torch_num_threads=1, batch_error_isolation="bisect") as engine:
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


def _mixed_sizes() -> tuple[list[str], list[SamplingParams]]:
    prompts = [f"{PROMPTS[i % 8]} #{i}" for i in range(16)]
    return prompts, [pt(300 + i, size=64 if i % 2 == 0 else 128) for i in range(16)]


def test_fifo_runs_an_alternating_size_queue_one_request_per_wave(sd_engine):
    prompts, params = _mixed_sizes()
    outs = sd_engine.generate(prompts, params, use_tqdm=False)
    assert all(o.ok for o in outs)
    assert [o.batch_size for o in outs] == [1] * 16  # head-of-line blocking, as designed


def test_grouped_serves_a_mixed_size_queue_in_full_waves():
    prompts, params = _mixed_sizes()
    with Engine("tiny-sd", max_num_seqs=8, executor="inproc", torch_num_threads=1,
                scheduling_policy="grouped") as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert [o.batch_size for o in outs] == [8] * 16
        assert [tuple(o.images.shape[-2:]) for o in outs] == \
            [(64, 64) if i % 2 == 0 else (128, 128) for i in range(16)]
        total, count = engine.metrics.wave_sizes_sum_count()
        assert (total, count) == (16, 2)  # two full waves (the warm-up is not counted)


def _poisoned_wave() -> tuple[list[str], list[SamplingParams]]:
    prompts = list(PROMPTS)
    prompts[3] = f"a {POISON} apple"
    return prompts, [pt(400 + i) for i in range(8)]


def test_bisect_isolates_a_poisoned_request_in_a_wave_of_eight(sd_engine):
    prompts, params = _poisoned_wave()
    outs = sd_engine.generate(prompts, params, use_tqdm=False)
    failed = [i for i, o in enumerate(outs) if not o.ok]
    assert failed == [3]
    assert "poisoned prompt" in outs[3].error.message
    assert all(o.batch_size == 8 for o in outs)
    for i, out in enumerate(outs):
        if i == 3:
            continue
        alone = sd_engine.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
        assert alone.batch_size == 1
        diff = max_diff(out.images, alone.images)
        assert diff <= TOLERANCE, f"request {i} differs from its solo run by {diff}"
    assert sd_engine.is_healthy


def test_without_isolation_a_poisoned_request_fails_its_whole_wave():
    prompts, params = _poisoned_wave()
    with Engine("tiny-sd", pipeline_class=POISON_PIPELINE, max_num_seqs=8, executor="inproc",
                torch_num_threads=1, batch_error_isolation="none") as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [o.batch_size for o in outs] == [8] * 8
        assert all(o.error is not None and "poisoned prompt" in o.error.message for o in outs)
        assert engine.generate([prompts[0]], [params[0]], use_tqdm=False)[0].ok
