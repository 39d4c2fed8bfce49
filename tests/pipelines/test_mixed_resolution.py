"""Mixed resolutions: requests of different sizes share one packed transformer forward.

Each image of a mixed-size wave (request mode) or running batch (step mode, joiners
included) must equal the same request run alone, and the transformer must really
have run packed (one call per step for every size, counted on `TokenPacker`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from diffbatch.config import EngineConfig
from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interception import packed_tokens
from diffbatch.pipelines.registry import load_pipeline
from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParamsKey
from diffbatch.sched.output import SchedulerOutput
from diffbatch.worker.model_runner import ModelRunner
from diffbatch.worker.step_runner import StepRunner
from tests.pipelines.conftest import TOLERANCE, make_batch, make_request
from tests.pipelines.test_step_execution import (
    join,
    poison_latents,
    run_until_idle,
    solo_image,
)

TRANSFORMERS = ["tiny-sd3", "tiny-flux", "tiny-pixart"]
SIZES = {"two sizes": [64, 128, 64], "three sizes": [64, 96, 128]}


@pytest.fixture
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the packed transformer calls (each entry: the calls packed into one)."""
    calls: list[int] = []
    original = packed_tokens.TokenPacker.pack_calls

    def counting(self: Any, module_calls: Any) -> Any:
        calls.append(len(module_calls))
        return original(self, module_calls)

    monkeypatch.setattr(packed_tokens.TokenPacker, "pack_calls", counting)
    return calls


def any_size(pipeline: Any, request: DiffusionRequest) -> DiffusionRequest:
    """`request` keyed as the engine keys it with mixed resolution on."""
    info = pipeline.info()
    request.key = SamplingParamsKey.from_params(
        request.sampling_params, cfg_enabled=pipeline.cfg_enabled(request.sampling_params),
        per_request_guidance=info.supports_per_request_guidance,
        reference_size=(info.default_height, info.default_width))
    return request


def sized(pipeline: Any, index: int, size: int | tuple[int, int],
          **params: Any) -> DiffusionRequest:
    """A request of `size` (a side, or height and width)."""
    height, width = (size, size) if isinstance(size, int) else size
    return make_request(pipeline, f"r{index}", f"a prompt number {index}", seed=40 + index,
                        height=height, width=width, **params)


def check_equals_solo(pipeline: DiffusersT2IPipeline, requests: list[DiffusionRequest],
                      outputs: list[Any]) -> None:
    for request, output in zip(requests, outputs, strict=True):
        assert output.error is None, output.error
        solo = make_request(pipeline, request.request_id, request.prompt,
                            seed=request.sampling_params.seed,
                            **{k: getattr(request.sampling_params, k) for k in (
                                "height", "width", "guidance_scale")},
                            n=request.sampling_params.num_outputs_per_prompt)
        [expected] = pipeline.forward(make_batch([solo]))
        size = (request.sampling_params.height, request.sampling_params.width)
        assert output.images.shape[-2:] == size
        diff = (output.images - expected.images).abs().max().item()
        assert diff <= TOLERANCE, f"{request.request_id} {size}: max abs difference {diff}"


@pytest.mark.parametrize("sizes", [*SIZES.values(), [(64, 128), (128, 64)]],
                         ids=[*SIZES, "aspect ratios"])
@pytest.mark.parametrize("model", TRANSFORMERS)
def test_a_wave_of_several_sizes_equals_each_requests_solo_run(
        model: str, sizes: list[int], load_tiny: Any, packed_calls: list[int]) -> None:
    pipeline = load_tiny(model)
    assert pipeline.info().supports_mixed_resolution
    requests = [any_size(pipeline, sized(pipeline, i, s)) for i, s in enumerate(sizes)]
    outputs = pipeline.forward(make_batch(requests))
    # every step's transformer call packed every size's call (one per size)
    assert packed_calls and set(packed_calls) == {len(set(sizes))}
    check_equals_solo(pipeline, requests, outputs)


def test_n_above_one_and_per_request_guidance_mix_with_sizes(
        load_tiny: Any, packed_calls: list[int]) -> None:
    pipeline = load_tiny("tiny-sd3")  # CFG on, per-request guidance
    requests = [any_size(pipeline, sized(pipeline, i, s, n=2, guidance_scale=g))
                for i, (s, g) in enumerate([(64, 5.0), (96, 3.0), (64, 7.0)])]
    assert len({r.key for r in requests}) == 1
    outputs = pipeline.forward(make_batch(requests))
    assert packed_calls
    assert [tuple(o.images.shape[:1]) for o in outputs] == [(2,)] * 3
    check_equals_solo(pipeline, requests, outputs)


def test_a_unet_pipeline_cannot_take_several_sizes(load_tiny: Any) -> None:
    pipeline = load_tiny("tiny-sd")
    assert not pipeline.info().supports_mixed_resolution
    requests = [sized(pipeline, i, s) for i, s in enumerate([64, 96])]
    for request in requests:
        request.key = replace(request.key, height=64, width=64, any_size=True)
    with pytest.raises(ValueError, match="cannot run requests of different sizes"):
        pipeline.forward(make_batch(requests))


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize("model", TRANSFORMERS)
def test_step_mode_packs_sizes_and_joiners_equal_their_solo_runs(
        model: str, sizes: list[int], load_tiny: Any, packed_calls: list[int]) -> None:
    pipeline = load_tiny(model)
    runner = ModelRunner(EngineConfig(model=model), pipeline=pipeline)
    steps = StepRunner(runner)
    step_counts = [3, 2, 3]
    requests, expected = [], {}
    for i, (size, count) in enumerate(zip(sizes, step_counts, strict=True)):
        request = sized(pipeline, i, size, num_inference_steps=count)
        expected[request.request_id] = solo_image(runner, request, request.key)
        any_size(pipeline, request)
        request.key = request.key.for_step_execution()
        requests.append(request)
    assert len({r.key for r in requests}) == 1
    # capacity in units of the 64x64 default: every mix here fits (at most 7.25)
    join(steps, requests[:2], 0, capacity=8)

    def late_joiner(tick: int) -> None:
        if tick == 1:  # the last request joins after the first step
            join(steps, requests[2:], 2, capacity=8)

    left = run_until_idle(steps, late_joiner)
    # the late joiner's step ran packed with the others (one module call each)
    assert max(packed_calls) == len(requests)
    for request in requests:
        output = left[request.request_id][1]
        assert output.error is None, output.error
        diff = (output.images - expected[request.request_id]).abs().max().item()
        assert diff <= TOLERANCE, f"{model} {request.request_id}: max abs difference {diff}"


class NaNCheckingSD3(DiffusersT2IPipeline):
    """tiny-sd3 whose transformer raises on a batch holding NaN latents, and which
    gives a request whose prompt says "poison" NaN latents: the failure happens inside
    the packed transformer call, for every size in it, as a numerical fault would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        transformer = self.pipe.transformer
        original = transformer.forward

        def checking_forward(hidden_states: torch.Tensor, **kw: Any) -> Any:
            if torch.isnan(hidden_states).any():
                raise RuntimeError("NaN latents in the transformer batch")
            return original(hidden_states=hidden_states, **kw)

        transformer.forward = checking_forward

    def call_kwargs(self, batch: Any) -> dict[str, Any]:
        return poison_latents(super().call_kwargs(batch), batch, self.pipe,
                              self.pipe.transformer)


def test_an_error_in_one_request_of_a_mixed_size_wave_fails_only_that_request(
        load_tiny: Any, packed_calls: list[int]) -> None:
    clean = load_tiny("tiny-sd3")
    pipeline = load_pipeline("tiny-sd3", NaNCheckingSD3)
    runner = ModelRunner(EngineConfig(model="tiny-sd3"), pipeline=pipeline)
    requests = [any_size(clean, sized(clean, i, s)) for i, s in enumerate([64, 96, 128])]
    poisoned = any_size(clean, sized(clean, 9, 96))
    poisoned.prompt = "poison in this prompt"
    wave = [requests[0], poisoned, requests[1], requests[2]]
    outputs = runner.execute_batch(SchedulerOutput(1, wave, wave[0].key)).outputs
    error = outputs[poisoned.request_id].error
    assert error is not None and "NaN latents" in error.message
    assert packed_calls  # the first try ran all four sizes packed
    check_equals_solo(clean, requests, [outputs[r.request_id] for r in requests])


def step_mode_requests(pipeline: Any, runner: ModelRunner, specs: list[tuple[int, dict]],
                       ) -> tuple[list[DiffusionRequest], dict[str, torch.Tensor]]:
    """Requests of (size, params) keyed for step mode with mixed resolution on, and
    each one's image run alone in request mode."""
    requests, expected = [], {}
    for i, (size, params) in enumerate(specs):
        request = sized(pipeline, i, size, num_inference_steps=2, **params)
        expected[request.request_id] = solo_image(runner, request, request.key)
        any_size(pipeline, request)
        request.key = request.key.for_step_execution()
        requests.append(request)
    assert len({r.key for r in requests}) == 1
    return requests, expected


def test_step_mode_mixes_sizes_with_n_above_one_and_per_request_guidance(
        load_tiny: Any, packed_calls: list[int]) -> None:
    pipeline = load_tiny("tiny-sd3")  # CFG on, per-request guidance
    runner = ModelRunner(EngineConfig(model="tiny-sd3"), pipeline=pipeline)
    steps = StepRunner(runner)
    requests, expected = step_mode_requests(pipeline, runner, [
        (64, {"n": 2, "guidance_scale": 5.0}), (96, {"n": 2, "guidance_scale": 3.0}),
        (64, {"n": 2, "guidance_scale": 7.0})])
    join(steps, requests, 0, capacity=8)
    left = run_until_idle(steps)
    assert max(packed_calls) == len(requests)
    for request in requests:
        output = left[request.request_id][1]
        assert output.error is None, output.error
        assert output.images.shape[0] == 2
        diff = (output.images - expected[request.request_id]).abs().max().item()
        assert diff <= TOLERANCE, f"{request.request_id}: max abs difference {diff}"


def test_an_error_in_one_request_of_a_mixed_size_running_batch_fails_only_it(
        load_tiny: Any, packed_calls: list[int]) -> None:
    clean = load_tiny("tiny-sd3")
    runner = ModelRunner(EngineConfig(model="tiny-sd3"),
                         pipeline=load_pipeline("tiny-sd3", NaNCheckingSD3))
    steps = StepRunner(runner)
    requests, _ = step_mode_requests(clean, runner, [(64, {}), (96, {}), (128, {})])
    poisoned = any_size(clean, sized(clean, 9, 96, num_inference_steps=2))
    poisoned.key = poisoned.key.for_step_execution()
    poisoned.prompt = "poison in this prompt"
    join(steps, [requests[0], poisoned, requests[1], requests[2]], 0, capacity=16)
    left = run_until_idle(steps)
    error = left[poisoned.request_id][1].error
    assert error is not None and "NaN latents" in error.message
    assert max(packed_calls) == 4  # the first try ran all four requests packed
    check_equals_solo(clean, requests, [left[r.request_id][1] for r in requests])
