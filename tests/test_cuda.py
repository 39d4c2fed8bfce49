"""The engine on a CUDA device: skipped where there is none (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from diffbatch import Engine, SamplingParams

# The GPU picks its kernels by batch size (cuBLAS/cuDNN, TF32 convolutions by default),
# so a request's image in a wave is not bitwise its image alone, as on the CPU: an H200
# measured differences up to 0.0013 on [0, 1] images. They stay under one 8-bit level,
# so a served PNG differs at most by one level in a few pixels.
CUDA_ATOL = 1 / 255

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny-sd", device="cuda") as engine:  # auto batching, worker process
        yield engine


def test_generates_on_cuda_with_auto_batching(engine):
    assert engine.info.device.startswith("cuda")
    outs = engine.generate([f"a cat {i}" for i in range(8)], SamplingParams(seed=1))
    assert all(o.ok for o in outs)
    assert max(o.batch_size for o in outs) > 1
    assert engine.policy.cost.capacity(engine.policy.default_shape) >= 1


def test_batch_invariance_on_cuda(engine):
    """A request's image in a wave equals its image alone, up to the GPU's rounding."""
    params = SamplingParams(height=64, width=64, num_inference_steps=4, output_type="pt")
    together = engine.generate(["a red circle", "a blue square", "a cat"],
                               [params.clone(seed=s) for s in (1, 2, 3)])
    alone = engine.generate(["a blue square"], params.clone(seed=2))[0]
    assert together[1].batch_size > 1
    torch.testing.assert_close(together[1].images, alone.images, atol=CUDA_ATOL, rtol=0)


def test_half_precision_runs_on_cuda():
    with Engine("tiny-sd", device="cuda", dtype="float16", max_num_seqs=4,
                request_batch_max_wait_ms=0) as engine:
        outs = engine.generate(["a", "b", "c", "d"], SamplingParams(seed=5, output_type="pt"))
    assert all(o.ok for o in outs)
    assert all(torch.isfinite(o.images).all() for o in outs)


def test_step_mode_on_cuda_equals_request_mode(engine):
    """Mixed step counts share the running batch on the GPU; each image equals its
    request-mode run."""
    with Engine("tiny-sd", device="cuda", step_execution=True, max_num_seqs=4) as steps:
        params = [SamplingParams(num_inference_steps=n, seed=10 + n, output_type="pt")
                  for n in (2, 4, 8)]
        prompts = ["a red circle", "a blue square", "a cat"]
        stepped = steps.generate(prompts, params)
        alone = [engine.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    for out, ref in zip(stepped, alone, strict=True):
        assert out.ok, out.error
        torch.testing.assert_close(out.images, ref.images, atol=CUDA_ATOL, rtol=0)
    assert max(o.batch_size for o in stepped) > 1
