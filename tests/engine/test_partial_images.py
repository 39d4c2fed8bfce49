"""`Engine.generate_stream`: partial images while the wave runs, then the output.

The fake pipelines' preview after step s of S is the request's final image times
s / S, so a test can tell each preview belongs to its request, image and step.
"""

from __future__ import annotations

import asyncio

import torch

from diffbatch import Engine, SamplingParams
from diffbatch.engine.partial_images import PartialImageRouter
from diffbatch.outputs import DiffusionOutput, PartialImage
from tests.fake_pipelines import make_gate

FAKE = "tests.fake_pipelines.FakeBatchPipeline"


async def collect(engine: Engine, prompt: str, **params) -> list:
    return [item async for item in engine.generate_stream(prompt, SamplingParams(**params))]


async def test_previews_of_each_image_come_before_the_output() -> None:
    with Engine(pipeline_class=FAKE, executor="inproc") as engine:
        items = await collect(engine, "a cat", num_inference_steps=4, partial_images=3,
                              num_outputs_per_prompt=2, seed=7, output_type="pt")
    *partials, output = items
    assert isinstance(output, DiffusionOutput) and output.ok
    assert all(isinstance(p, PartialImage) for p in partials)
    assert [(p.step, p.index, p.image_index) for p in partials] == [
        (step, step - 1, image) for step in (1, 2, 3) for image in (0, 1)]
    for partial in partials:
        expected = output.images[partial.image_index] * partial.step / 4
        assert torch.allclose(partial.image, expected, atol=1e-6)


async def test_previews_follow_the_output_type() -> None:
    with Engine(pipeline_class=FAKE, executor="inproc") as engine:
        pil = await collect(engine, "a cat", num_inference_steps=2, partial_images=1)
        array = await collect(engine, "a cat", num_inference_steps=2, partial_images=1,
                              output_type="np")
    assert pil[0].image.size == (16, 16) and pil[0].image.mode == "RGB"
    assert array[0].image.shape == (16, 16, 3)


def gated_engine(max_num_seqs: int) -> tuple[Engine, type]:
    gate = make_gate()
    return Engine(pipeline_class=gate, executor="inproc", max_num_seqs=max_num_seqs,
                  request_batch_max_wait_ms=0), gate


async def hold(engine: Engine, gate: type) -> asyncio.Future:
    """A request that holds the gate's forward (so others queue); its future."""
    blocker = asyncio.ensure_future(engine.generate_async("hold the gate"))
    assert await asyncio.to_thread(gate.entered.wait, 30)
    return blocker


async def test_a_streamed_request_shares_its_wave_with_plain_ones() -> None:
    engine, gate = gated_engine(4)
    with engine:
        blocker = await hold(engine, gate)
        streamed = asyncio.ensure_future(collect(engine, "streamed", partial_images=1))
        plain = asyncio.ensure_future(engine.generate_async("plain"))
        while engine.num_waiting < 2:
            await asyncio.sleep(0.01)
        gate.release.set()
        (*partials, streamed_output), plain_output = await asyncio.gather(streamed, plain)
        await blocker
    assert len(partials) == 1  # default 2 steps: one preview, after step 1
    assert streamed_output.batch_size == plain_output.batch_size == 2


async def test_leaving_the_stream_aborts_the_request() -> None:
    engine, gate = gated_engine(1)
    with engine:
        blocker = await hold(engine, gate)
        stream = engine.generate_stream("left", SamplingParams(partial_images=1))
        first = asyncio.ensure_future(anext(stream))
        while engine.num_waiting < 1:
            await asyncio.sleep(0.01)
        first.cancel()  # the caller goes away before anything came
        await asyncio.gather(first, return_exceptions=True)
        assert engine.num_waiting == 0 and engine.metrics.count("aborted") == 1
        assert len(engine.partial_images) == 0  # its route is closed
        gate.release.set()
        assert (await blocker).ok


async def test_only_a_stream_asks_for_previews() -> None:
    with Engine(pipeline_class=FAKE, executor="inproc") as engine:
        plain = engine._prepare("a cat", SamplingParams(partial_images=2), None, 0)
        streamed = engine._prepare("a cat", SamplingParams(partial_images=2), None, 0,
                                   streamed=True)
    assert plain.sampling_params.partial_images == 0  # nobody would receive them
    assert streamed.sampling_params.partial_images == 2
    assert plain.key == streamed.key


def test_the_router_hands_each_preview_out_once_and_drops_closed_streams() -> None:
    router = PartialImageRouter()
    got: list[PartialImage] = []
    router.open("r", "pt", got.append)

    def preview(index: int, image_index: int = 0) -> PartialImage:
        return PartialImage("r", index, image_index, index + 1, 4, torch.zeros(3, 2, 2))

    assert router.deliver(preview(0)) and router.deliver(preview(0, image_index=1))
    assert not router.deliver(preview(0))  # made again (a re-run wave): dropped
    assert router.deliver(preview(1))
    router.close("r")
    assert not router.deliver(preview(2))
    assert [(p.index, p.image_index) for p in got] == [(0, 0), (0, 1), (1, 0)]
    assert got[0].image.shape == (3, 2, 2)
