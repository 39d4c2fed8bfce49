"""Batch error isolation end to end, with the real tiny-sd adapter failing every wave
that holds a poisoned prompt: with `bisect` the poisoned request in a wave of 8 fails
alone (the others equal their solo runs, the worker stays healthy); with `none` it
takes its whole wave down, and the engine serves on.

Waves are made deterministic by queueing a whole `generate()` call at once: the first
wave sees every request.
"""

from __future__ import annotations

import pytest
import torch

from diffbatch import Engine, SamplingParams
from tests.fake_pipelines import POISON

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white boat", "a black car",
           "a small house", "a yellow sun", "a pink flower"]
TOLERANCE = 1e-4
POISON_PIPELINE = "tests.fake_tiny_sd.PoisonTinySD"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _poisoned_wave() -> tuple[list[str], list[SamplingParams]]:
    prompts = list(PROMPTS)
    prompts[3] = f"a {POISON} apple"
    return prompts, [SamplingParams(height=64, width=64, num_inference_steps=2, seed=400 + i,
                                    guidance_scale=5.0, output_type="pt") for i in range(8)]


def test_bisect_isolates_a_poisoned_request_in_a_wave_of_eight():
    prompts, params = _poisoned_wave()
    with Engine("tiny-sd", pipeline_class=POISON_PIPELINE, max_num_seqs=8, executor="mp",
                torch_num_threads=1, batch_error_isolation="bisect") as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        failed = [i for i, o in enumerate(outs) if not o.ok]
        assert failed == [3]
        assert "poisoned prompt" in outs[3].error.message
        assert all(o.batch_size == 8 for o in outs)
        for i, out in enumerate(outs):
            if i == 3:
                continue
            alone = engine.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
            assert alone.batch_size == 1
            diff = max_diff(out.images, alone.images)
            assert diff <= TOLERANCE, f"request {i} differs from its solo run by {diff}"
        assert engine.is_healthy


def test_without_isolation_a_poisoned_request_fails_its_whole_wave():
    prompts, params = _poisoned_wave()
    with Engine("tiny-sd", pipeline_class=POISON_PIPELINE, max_num_seqs=8, executor="inproc",
                torch_num_threads=1, batch_error_isolation="none") as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [o.batch_size for o in outs] == [8] * 8
        assert all(o.error is not None and "poisoned prompt" in o.error.message for o in outs)
        assert engine.generate([prompts[0]], [params[0]], use_tqdm=False)[0].ok
