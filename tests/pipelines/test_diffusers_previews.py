"""Partial images inside a diffusers call: when they are taken, what they show, and that
taking them changes nothing else.

Every tiny model runs a wave of two requests, one asking for previews and one not: the
previewing one gets them after the planned steps, the other none, and both final images
equal a run without any previews (the scheduler step is wrapped only while previews are
owed, and a VAE decode draws no random numbers).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffbatch.outputs import PartialImage
from diffbatch.pipelines.diffusers_previews import predicted_x0
from diffbatch.pipelines.partial_images import preview_steps
from tests.pipelines.conftest import SIZE, TINY_NAMES, make_batch, make_request

STEPS = 4  # enough steps for three previews (after steps 1, 2 and 3)


@pytest.mark.parametrize(("count", "num_steps", "expected"), [
    (0, 4, []), (1, 4, [2]), (2, 4, [1, 3]), (3, 4, [1, 2, 3]), (3, 15, [4, 8, 11]),
    (3, 2, [1]), (2, 1, []), (3, 3, [1, 2]),
])
def test_preview_steps_are_evenly_spaced_and_never_the_last(count: int, num_steps: int,
                                                            expected: list[int]) -> None:
    assert preview_steps(count, num_steps) == expected


@pytest.mark.parametrize("name", TINY_NAMES)
def test_a_wave_previews_only_for_the_request_that_asked(name: str, load_tiny) -> None:
    pipeline = load_tiny(name)
    extra = {"true_cfg_scale": 2.0} if name == "tiny-flux" else {}

    def wave(previews: int) -> list:
        return [make_request(pipeline, "streamed", "a red cat", seed=1, n=2,
                             num_inference_steps=STEPS, partial_images=previews,
                             extra=dict(extra)),
                make_request(pipeline, "plain", "a blue dog", seed=2, n=2,
                             num_inference_steps=STEPS, extra=dict(extra))]

    requests = wave(3)
    assert requests[0].key == requests[1].key  # `partial_images` is not in the key
    got: list[PartialImage] = []
    batch = dataclasses.replace(make_batch(requests), on_partial_image=got.append)
    outputs = pipeline.forward(batch)
    # 1. Three previews of each of the streamed request's two images, in step order.
    assert [(p.request_id, p.step, p.index, p.image_index) for p in got] == [
        ("streamed", step, step - 1, image) for step in (1, 2, 3) for image in (0, 1)]
    for partial in got:
        assert partial.num_steps == STEPS
        assert partial.image.shape == (3, SIZE, SIZE)
        assert partial.image.min() >= 0 and partial.image.max() <= 1
    # two images of one request: two previews of their own noise
    assert not torch.equal(got[0].image, got[1].image)
    # 2. Taking them changed no image of the wave.
    unpreviewed = pipeline.forward(make_batch(wave(0)))
    for with_previews, without in zip(outputs, unpreviewed, strict=True):
        assert torch.equal(with_previews.images, without.images)


def test_nobody_listening_means_no_previews_and_no_wrapped_step(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    request = make_request(pipeline, "r", "a cat", num_inference_steps=STEPS,
                           partial_images=3)
    batch = make_batch([request])  # on_partial_image None: the runner passes none
    assert batch.partial_image_plan(STEPS) is None
    pipeline.forward(batch)
    assert "step" not in vars(pipeline.pipe.scheduler)


def _flow_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(4)
    return scheduler


def _dpm_scheduler():
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(prediction_type="v_prediction",
                                            rescale_betas_zero_snr=True,
                                            timestep_spacing="trailing")
    scheduler.set_timesteps(4)
    return scheduler


def test_x0_of_flow_matching_and_v_prediction_recovers_the_clean_sample() -> None:
    """Where the scheduler reports no x0, the one computed from the step's inputs is the
    clean sample the inputs were made from (noise and model output known exactly)."""
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(2, 4, 8, 8, generator=generator)
    # Flow matching: x_t = (1 - s) x0 + s noise, the model predicts v = noise - x0.
    flow = _flow_scheduler()
    timestep = flow.timesteps[1]
    flow._init_step_index(timestep)
    flow._step_index += 1  # as right after the step
    sigma = flow.sigmas[1]
    sample = (1 - sigma) * x0 + sigma * noise
    assert torch.allclose(predicted_x0(flow, noise - x0, timestep, sample), x0, atol=1e-5)
    # v-prediction on alphas_cumprod: v = sqrt(a) noise - sqrt(1 - a) x0.
    dpm = _dpm_scheduler()
    timestep = dpm.timesteps[1]
    alpha = dpm.alphas_cumprod[int(timestep)]
    sample = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise
    v = alpha.sqrt() * noise - (1 - alpha).sqrt() * x0
    assert torch.allclose(predicted_x0(dpm, v, timestep, sample), x0, atol=1e-4)


def test_an_unknown_parameterisation_gives_no_x0() -> None:
    class Opaque:
        config = {"prediction_type": "something_new"}
        alphas_cumprod = torch.ones(10)
        init_noise_sigma = 1.0

    assert predicted_x0(Opaque(), torch.zeros(1), 3, torch.zeros(1)) is None
