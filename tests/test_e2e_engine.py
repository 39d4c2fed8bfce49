"""End to end through the worker process (`executor="mp"`) with real tiny pipelines."""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
import torch

from diffbatch import Engine, SamplingParams
from tests.fake_pipelines import fake_images
from tests.process_utils import segments_of, wait_gone

pytestmark = pytest.mark.slow

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white boat", "a black car",
           "a small house", "a yellow sun", "a pink flower"]


def pt(seed: int, size: int = 64, steps: int = 2) -> SamplingParams:
    return SamplingParams(height=size, width=size, num_inference_steps=steps, seed=seed,
                          output_type="pt")


@pytest.fixture(scope="module")
def sd_engine():
    with Engine("tiny-sd", max_num_seqs=4, request_batch_max_wait_ms=50, executor="mp",
                torch_num_threads=1) as engine:
        yield engine


def test_eight_concurrent_prompts_run_in_waves_larger_than_one(sd_engine):
    outs = sd_engine.generate(PROMPTS, [pt(i) for i in range(8)])
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert max(o.batch_size for o in outs) > 1
    total, count = sd_engine.metrics.wave_sizes_sum_count()
    assert total / count > 1
    assert all(o.images.shape == (1, 3, 64, 64) for o in outs)


def test_an_engine_dropped_without_close_stops_its_worker_process():
    def serve_once() -> int:
        engine = Engine(pipeline_class="tests.fake_pipelines.FakeBatchPipeline",
                        executor="mp", max_num_seqs=2, torch_num_threads=1)
        assert engine.generate(["a"])[0].ok
        return engine.executor.worker_pid
    worker = serve_once()  # the engine is unreachable once it returns
    gc.collect()
    assert wait_gone(worker, 60.0), "the dropped engine's worker process lives on"


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-sd3"])
def test_batch_invariance_each_image_equals_its_solo_run(model, sd_engine):
    engine = sd_engine if model == "tiny-sd" else Engine(
        model, max_num_seqs=4, request_batch_max_wait_ms=50, executor="mp", torch_num_threads=1)
    try:
        batched = engine.generate(PROMPTS[:4], [pt(100 + i) for i in range(4)])
        assert {o.batch_size for o in batched} == {4}
        for i, out in enumerate(batched):
            alone = engine.generate([PROMPTS[i]], [pt(100 + i)])[0]
            assert alone.batch_size == 1
            diff = (out.images - alone.images).abs().max().item()
            assert diff <= 1e-4, f"{model} request {i} differs from its solo run by {diff}"
        # and a different seed really gives a different image (the check can fail)
        other = engine.generate([PROMPTS[0]], [pt(999)])[0]
        assert (other.images - batched[0].images).abs().max().item() > 1e-3
    finally:
        if engine is not sd_engine:
            engine.close()


def test_pil_output_and_n_images_per_prompt(sd_engine):
    out = sd_engine.generate(["a cat"], SamplingParams(num_outputs_per_prompt=3, seed=1,
                                                       num_inference_steps=2))[0]
    assert out.ok and len(out.images) == 3
    assert all(img.size == (64, 64) for img in out.images)
    assert out.images[0].tobytes() != out.images[1].tobytes()


def test_np_output_is_the_float_image_channels_last(sd_engine):
    """output_type="np" through the worker: a float32 array [n, H, W, C] in [0, 1], the
    "pt" tensor's values channels-last, and the "pil" image's within rounding."""
    params = SamplingParams(num_outputs_per_prompt=2, seed=11, num_inference_steps=2)
    as_np, as_pt, as_pil = (sd_engine.generate(["a cat"], params.clone(output_type=kind))[0]
                            for kind in ("np", "pt", "pil"))
    assert isinstance(as_np.images, np.ndarray), type(as_np.images)
    assert as_np.images.shape == (2, 64, 64, 3) and as_np.images.dtype == np.float32
    assert as_np.images.min() >= 0.0 and as_np.images.max() <= 1.0
    channels_last = as_pt.images.clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(as_np.images, channels_last, atol=1e-5)
    pil = np.stack([np.asarray(image) for image in as_pil.images]) / 255.0
    assert np.abs(as_np.images - pil).max() <= 0.5 / 255 + 1e-6
    assert not np.allclose(as_np.images[0], as_np.images[1])  # each image its own noise


def test_two_hundred_concurrent_requests_each_get_their_own_image():
    """Large (> 1 MiB) results cross through shared memory; none is mixed up."""
    size = 384  # 3*384*384 float32 = 1.7 MiB per image: above the shm threshold
    # no work limit: the fake model's default request is 16x16, and 100x that is small
    with Engine(pipeline_class="tests.fake_pipelines.FakeBatchPipeline", executor="mp",
                max_num_seqs=8, request_batch_max_wait_ms=5, max_request_work=0) as engine:
        worker = engine.executor.worker_pid
        prompts = [f"prompt number {i}" for i in range(200)]
        outs = engine.generate(prompts, [pt(10_000 + i, size=size) for i in range(200)])
        for i, out in enumerate(outs):
            assert out.ok, out.error
            expected = fake_images(prompts[i], [torch.Generator().manual_seed(10_000 + i)],
                                   size, size)
            assert torch.equal(out.images, expected), f"request {i} got someone else's image"
        assert max(o.batch_size for o in outs) > 1
    assert not segments_of(os.getpid()) + segments_of(worker)  # every one was unlinked


def test_per_request_pipeline_through_the_worker():
    """A pipeline that cannot batch runs waves of one through the worker, each its own."""
    with Engine(pipeline_class="tests.fake_pipelines.FakeSinglePipeline", executor="mp") as engine:
        prompts = ["one", "two", "three"]
        outs = engine.generate(prompts, [pt(20 + i) for i in range(3)])
    for i, out in enumerate(outs):
        assert out.ok, out.error
        assert out.batch_size == 1
        expected = fake_images(prompts[i], [torch.Generator().manual_seed(20 + i)], 64, 64)
        assert torch.equal(out.images, expected)


def test_failing_wave_fails_only_its_requests_through_the_worker():
    with Engine(pipeline_class="tests.fake_pipelines.FakeBatchPipeline", executor="mp",
                max_num_seqs=4) as engine:
        bad = engine.generate(["poison"], SamplingParams(seed=1))[0]
        assert "poisoned prompt" in bad.error.message and bad.error.status_code == 500
        assert engine.generate(["fine"], SamplingParams(seed=1))[0].ok
        assert engine.is_healthy


def test_a_request_that_kills_the_worker_twice_fails_alone(tmp_path, monkeypatch):
    marker = tmp_path / "wave-started"
    monkeypatch.setenv("DIFFBATCH_FAKE_MARKER", str(marker))
    with Engine(pipeline_class="tests.fake_pipelines.SlowPipeline", executor="mp",
                max_num_seqs=4) as engine:
        _, future = engine._submit("slow wave", SamplingParams(seed=1), "victim", 0)
        deadline = time.monotonic() + 60
        # readiness poll: the worker is inside the forward (and has written its pid)
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the slow wave never started"
            time.sleep(0.02)
        first_pid = int(marker.read_text())
        marker.unlink()
        os.kill(first_pid, signal.SIGKILL)
        # The crashed wave runs again on the replacement; killing that run too fails the
        # request (it is the one that crashes the worker), and only it.
        deadline = time.monotonic() + 120
        while not marker.exists() or not marker.read_text():  # readiness poll: re-run began
            assert time.monotonic() < deadline, "the crashed wave was not re-run"
            time.sleep(0.02)
        second_pid = int(marker.read_text())
        assert second_pid != first_pid
        os.kill(second_pid, signal.SIGKILL)
        out = future.result(timeout=120)
        assert out.error is not None and "died while running this request, and again" \
            in out.error.message
        deadline = time.monotonic() + 120
        while not engine.is_healthy:  # a replacement worker is starting
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.05)
        assert engine.generate(["after the crash"], SamplingParams(seed=2))[0].ok
