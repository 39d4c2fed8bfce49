"""Per-request guidance: requests with different guidance scales share one fused call.

For StableDiffusion, SD3 and PixArt-Sigma the adapter passes a `PerSampleGuidance`
as `guidance_scale`, so each sample of the wave is guided by its own request's
scale; each image must equal the same request run alone. Flux embeds its guidance
in the model and does not declare the ability.
"""

from __future__ import annotations

import pytest
import torch

from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interception import PerSampleGuidance
from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParamsKey
from tests.pipelines.conftest import TINY_NAMES, TOLERANCE, make_batch, make_request

CFG_NAMES = ("tiny-sd", "tiny-sd3", "tiny-pixart")


def _request(pipeline: DiffusersT2IPipeline, request_id: str, prompt: str, *, seed: int,
             guidance_scale: float, **params: object) -> DiffusionRequest:
    """A request keyed as the engine keys it for this pipeline (scale dropped if supported)."""
    request = make_request(pipeline, request_id, prompt, seed=seed,
                           guidance_scale=guidance_scale, **params)
    request.key = SamplingParamsKey.from_params(
        request.sampling_params, cfg_enabled=pipeline.cfg_enabled(request.sampling_params),
        per_request_guidance=pipeline.info().supports_per_request_guidance,
    )
    return request


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_wave_equals_solo_runs(pipeline: DiffusersT2IPipeline,
                                 requests: list[DiffusionRequest]) -> list[torch.Tensor]:
    batch = make_batch(requests)
    guidance = pipeline.call_kwargs(batch)["guidance_scale"]
    assert isinstance(guidance, PerSampleGuidance)  # really one fused call, mixed scales
    n = requests[0].sampling_params.num_outputs_per_prompt
    expected = [r.sampling_params.guidance_scale for r in requests for _ in range(n)]
    assert guidance.scales.tolist() == expected
    batched = pipeline.forward(batch)
    for request, out in zip(requests, batched, strict=True):
        alone = pipeline.forward(make_batch([request]))[0]
        assert not isinstance(pipeline.call_kwargs(make_batch([request]))["guidance_scale"],
                              PerSampleGuidance)
        diff = _max_diff(out.images, alone.images)
        assert diff <= TOLERANCE, f"{request.request_id} differs from its solo run by {diff}"
    return [out.images for out in batched]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_info_declares_per_request_guidance(name: str, load_tiny) -> None:
    assert load_tiny(name).info().supports_per_request_guidance == (name != "tiny-flux")


@pytest.mark.parametrize("name", CFG_NAMES)
def test_mixed_guidance_wave_equals_solo_runs(name: str, load_tiny) -> None:
    pipeline = load_tiny(name)
    requests = [
        _request(pipeline, "a-5.0", "a red cat", seed=11, guidance_scale=5.0),
        _request(pipeline, "b-7.5", "a blue dog", seed=12, guidance_scale=7.5,
                 negative_prompt="blurry"),
        _request(pipeline, "c-7.5", "a red cat", seed=11, guidance_scale=7.5),
    ]
    assert len({r.key for r in requests}) == 1  # the key no longer splits them
    images = _check_wave_equals_solo_runs(pipeline, requests)
    # same prompt and seed, different scale: the scale really is applied per sample
    assert _max_diff(images[0], images[2]) > 1e-3


def test_guidance_rescale_and_n_keep_working(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    extra = {"guidance_rescale": 0.7}
    requests = [
        _request(pipeline, f"r{i}", "a green tree", seed=20 + i, guidance_scale=scale, n=2,
                 extra=dict(extra))
        for i, scale in enumerate((5.0, 7.5, 3.0))
    ]
    images = _check_wave_equals_solo_runs(pipeline, requests)
    assert all(img.shape[0] == 2 for img in images)
    plain = _request(pipeline, "plain", "a green tree", seed=20, guidance_scale=5.0, n=2)
    assert _max_diff(pipeline.forward(make_batch([plain]))[0].images, images[0]) > 1e-4


def test_a_wave_with_one_scale_passes_a_plain_float(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    requests = [_request(pipeline, f"r{i}", "a cat", seed=i, guidance_scale=6.0)
                for i in range(2)]
    guidance = pipeline.call_kwargs(make_batch(requests))["guidance_scale"]
    assert type(guidance) is float and guidance == 6.0


def test_mixed_scales_on_a_pipeline_without_support_are_refused(load_tiny) -> None:
    pipeline = load_tiny("tiny-flux")
    requests = [make_request(pipeline, f"r{i}", "a cat", seed=i, guidance_scale=scale)
                for i, scale in enumerate((3.5, 5.0))]
    for request in requests:  # a key built as if Flux could take per-request guidance
        request.key = SamplingParamsKey.from_params(
            request.sampling_params, cfg_enabled=True, per_request_guidance=True)
    with pytest.raises(ValueError, match="cannot apply per-request guidance"):
        pipeline.forward(make_batch(requests))


def test_per_sample_guidance_value() -> None:
    guidance = PerSampleGuidance([5.0, 5.0, 7.5])
    assert float(guidance) == 5.0 and guidance > 1 and guidance - 1 == 4.0
    x = torch.ones(3, 2, 4, 4)
    expected = torch.tensor([5.0, 5.0, 7.5]).view(3, 1, 1, 1).expand(3, 2, 4, 4)
    assert torch.equal(guidance * x, expected)
    assert torch.equal(x * guidance, expected)
    assert (guidance * x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert guidance * 2.0 == 10.0
    with pytest.raises(ValueError, match="3 scales"):
        guidance * torch.ones(2, 4)
    with pytest.raises(TypeError):
        x + guidance
    assert "7.5" in repr(guidance)
