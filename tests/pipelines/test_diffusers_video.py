"""The video adapter on `tiny-wan`: one call per wave, batch invariance, step mode, and
which video families load."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
import torch

from diffbatch import Engine, SamplingParams
from diffbatch.engine.request_checks import resolve_num_frames
from diffbatch.errors import InvalidRequestError, ModelLoadError
from diffbatch.outputs import PartialImage
from diffbatch.pipelines.diffusers_video import DiffusersVideoPipeline
from diffbatch.pipelines.registry import video_pipeline_class
from diffbatch.worker.model_runner import to_output_type
from tests.pipelines.conftest import make_batch, make_request

FRAMES = {"num_frames": 5}
PROMPTS = [("a red cat", None), ("a blue dog", "blurry"), ("a green tree", "ugly bad"),
           ("a house", None)]


@pytest.fixture(scope="module")
def wan(load_tiny) -> DiffusersVideoPipeline:
    pipeline = load_tiny("tiny-wan")
    assert isinstance(pipeline, DiffusersVideoPipeline)
    return pipeline


@pytest.fixture(scope="module")
def ltx(load_tiny) -> DiffusersVideoPipeline:
    pipeline = load_tiny("tiny-ltx")
    assert isinstance(pipeline, DiffusersVideoPipeline)
    return pipeline


def _requests(pipeline, **params):
    return [make_request(pipeline, f"req-{i}", prompt, seed=100 + i, negative_prompt=negative,
                         height=32, width=32, extra=dict(FRAMES), **params)
            for i, (prompt, negative) in enumerate(PROMPTS)]


def test_info_declares_a_video_model(wan) -> None:
    info = wan.info()
    assert info.name == "WanPipeline" and info.is_video
    assert (info.default_num_frames, info.frame_multiple, info.default_fps) == (9, 4, 16)
    assert info.size_multiple == 16  # VAE x8, patch 2
    assert "num_frames" in info.call_arguments
    assert info.max_prompt_tokens == 64  # the tiny model's max_sequence_length


def test_a_wave_is_one_call_and_each_clip_equals_its_solo_run(wan) -> None:
    calls = []
    original = type(wan.pipe).__call__

    @functools.wraps(original)  # (the adapter reads the call's signature)
    def counting(pipe, *args, **kwargs):
        calls.append(len(kwargs["prompt"]))
        return original(pipe, *args, **kwargs)

    requests = _requests(wan)
    type(wan.pipe).__call__ = counting
    try:
        batched = wan.forward(make_batch(requests))
    finally:
        type(wan.pipe).__call__ = original
    assert calls == [4]
    for request, output in zip(requests, batched, strict=True):
        assert output.images.shape == (1, 5, 3, 32, 32)  # [n, F, C, H, W]
        solo = wan.forward(make_batch([request]))[0]
        # within 1 level of 255 per frame, as the clip is encoded
        levels = (to_output_type(output.images, "pil").int()
                  - to_output_type(solo.images, "pil").int()).abs().max().item()
        assert levels <= 1, (request.request_id, levels)
        assert (output.images - solo.images).abs().max().item() < 1e-4


def test_ltx_video_batches_through_the_same_adapter(ltx) -> None:
    """LTX-Video: its own names for the VAE's compression and its frame rate, one call
    per wave, each clip equal to its solo run."""
    info = ltx.info()
    assert info.name == "LTXPipeline" and info.is_video
    assert (info.default_num_frames, info.frame_multiple, info.default_fps) == (9, 4, 25)
    assert info.size_multiple == 4 and "frame_rate" in info.call_arguments
    requests = [make_request(ltx, f"ltx-{i}", prompt, seed=7 + i, negative_prompt=negative,
                             height=32, width=32, extra={"num_frames": 9, "frame_rate": 25})
                for i, (prompt, negative) in enumerate(PROMPTS[:3])]
    batched = ltx.forward(make_batch(requests))
    for request, output in zip(requests, batched, strict=True):
        assert output.images.shape == (1, 9, 3, 32, 32)
        solo = ltx.forward(make_batch([request]))[0]
        assert (output.images - solo.images).abs().max().item() < 1e-4


def test_output_conversion_keeps_the_frame_dimension(wan) -> None:
    output = wan.forward(make_batch(_requests(wan)[:1]))[0]
    frames = to_output_type(output.images, "pil")
    assert frames.dtype == torch.uint8 and frames.shape == (1, 5, 32, 32, 3)


def test_frame_counts_are_checked_against_the_model(wan) -> None:
    info = wan.info()
    assert resolve_num_frames(info, SamplingParams())["num_frames"] == 9
    assert resolve_num_frames(info, SamplingParams(extra={"num_frames": 13}))["num_frames"] == 13
    with pytest.raises(InvalidRequestError, match="one more than a multiple of 4") as exc:
        resolve_num_frames(info, SamplingParams(extra={"num_frames": 12}))
    assert exc.value.param == "num_frames" and "9 or 13" in exc.value.message
    with pytest.raises(InvalidRequestError, match="from 1 to 257"):
        resolve_num_frames(info, SamplingParams(extra={"num_frames": 261}))


@pytest.mark.parametrize("family", ["CogVideoXPipeline", "HunyuanVideoPipeline",
                                    "WanImageToVideoPipeline", "LTXImageToVideoPipeline"])
def test_other_video_families_are_refused_saying_why(tmp_path, family) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": family}))
    with pytest.raises(ModelLoadError, match=family) as exc:
        video_pipeline_class(str(tmp_path))
    assert "LTXPipeline, WanPipeline" in exc.value.message  # what is served instead


def test_image_models_keep_the_image_adapter(tmp_path) -> None:
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline"}))
    assert video_pipeline_class(str(tmp_path)) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-wan", "tiny-ltx"])
def test_step_mode_a_short_clip_joins_and_finishes_before_a_long_one(
        name: str, request: pytest.FixtureRequest) -> None:
    """Step mode: a 2-step clip submitted while a 40-step clip runs joins the running
    batch and finishes first; both equal their request-mode solo runs."""
    pipeline = request.getfixturevalue({"tiny-wan": "wan", "tiny-ltx": "ltx"}[name])
    def params(seed: int, steps: int) -> SamplingParams:
        return SamplingParams(height=32, width=32, num_inference_steps=steps, seed=seed,
                              output_type="pt", extra=dict(FRAMES))

    finished: list[str] = []
    with Engine(name, step_execution=True, max_num_seqs=4, executor="inproc",
                warmup=False, calibration_budget_s=0) as engine:
        async def run():
            long = asyncio.ensure_future(engine.generate_async("a long clip", params(1, 40)))
            long.add_done_callback(lambda _t: finished.append("long"))
            while engine.num_running < 1:  # the long clip runs
                await asyncio.sleep(0.005)
            short = asyncio.ensure_future(stream("a short clip", params(2, 2)))
            short.add_done_callback(lambda _t: finished.append("short"))
            return await asyncio.gather(long, short)

        async def stream(prompt: str, sampling: SamplingParams):
            """The output, after the progress the video adapter reports per step."""
            sampling.partial_images = 1
            async for item in engine.generate_stream(prompt, sampling):
                if isinstance(item, PartialImage):
                    progress.append(item.step)
                else:
                    return item

        progress: list[int] = []
        long_out, short_out = asyncio.run(run())
    assert finished == ["short", "long"]
    assert progress == [0, 1]  # started, 1 of 2 steps done (then the clip)
    assert long_out.ok and short_out.ok
    for prompt, seed, steps, output in (("a long clip", 1, 40, long_out),
                                        ("a short clip", 2, 2, short_out)):
        solo = pipeline.forward(make_batch([make_request(
            pipeline, prompt, prompt, seed=seed, height=32, width=32,
            num_inference_steps=steps, extra=dict(FRAMES))]))[0]
        assert (output.images - solo.images).abs().max().item() < 1e-4, prompt


def test_a_cached_hub_video_model_gets_the_video_adapter(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    index = tmp_path / "model_index.json"
    index.write_text(json.dumps({"_class_name": "WanPipeline"}))
    seen = []

    def cached(repo_id: str, filename: str) -> str:
        seen.append((repo_id, filename))
        return str(index)

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", cached)
    assert video_pipeline_class("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") is DiffusersVideoPipeline
    assert seen == [("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "model_index.json")]
