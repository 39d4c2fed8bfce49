"""The scheduling policies end to end with the real tiny-sd pipeline: a queue of
alternating sizes runs in full waves under `grouped` (the default) and one request per
wave under `fifo` (head-of-line blocking, as designed).

Waves are made deterministic by queueing a whole `generate()` call at once: the first
wave sees every request.
"""

from __future__ import annotations

import pytest

from diffbatch import Engine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white boat", "a black car",
           "a small house", "a yellow sun", "a pink flower"]


def _mixed_sizes() -> tuple[list[str], list[SamplingParams]]:
    prompts = [f"{PROMPTS[i % 8]} #{i}" for i in range(16)]
    sizes = [64 if i % 2 == 0 else 128 for i in range(16)]
    return prompts, [SamplingParams(height=size, width=size, num_inference_steps=2,
                                    seed=300 + i, guidance_scale=5.0, output_type="pt")
                     for i, size in enumerate(sizes)]


def test_fifo_runs_an_alternating_size_queue_one_request_per_wave():
    prompts, params = _mixed_sizes()
    with Engine("tiny-sd", max_num_seqs=8, executor="mp", torch_num_threads=1,
                scheduling_policy="fifo") as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
    assert all(o.ok for o in outs)
    assert [o.batch_size for o in outs] == [1] * 16  # head-of-line blocking, as designed


def test_the_default_policy_serves_a_mixed_size_queue_in_full_waves():
    prompts, params = _mixed_sizes()
    with Engine("tiny-sd", max_num_seqs=8, executor="inproc", torch_num_threads=1) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert [o.batch_size for o in outs] == [8] * 16
        assert [tuple(o.images.shape[-2:]) for o in outs] == \
            [(64, 64) if i % 2 == 0 else (128, 128) for i in range(16)]
        total, count = engine.metrics.wave_sizes_sum_count()
        assert (total, count) == (16, 2)  # two full waves (the warm-up is not counted)
