"""Step caching per request: each request's image equals its solo run with the same
settings, in any wave, in request mode and in step mode; a lone request equals
diffusers' own `FirstBlockCache`; the counts are exact."""

from __future__ import annotations

from typing import Any

import pytest

from diffbatch.config import EngineConfig
from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.step_cache import StepCacheConfig
from diffbatch.worker.model_runner import ModelRunner
from diffbatch.worker.step_runner import StepRunner
from tests.pipelines.conftest import TOLERANCE, make_batch, make_request
from tests.pipelines.test_step_execution import (
    join,
    poison_latents,
    run_until_idle,
    solo_image,
    step_request,
)

TRANSFORMERS = ["tiny-sd3", "tiny-flux", "tiny-pixart"]
STEPS = 6
# thresholds that cache some steps of the random tiny transformers, and settings that
# differ per request; None: the request does not cache
SETTINGS: list[str | None] = ["first_block:0.3", None, "first_block:0.1",
                              "first_block:0.3,max_cached=1", "taylorseer:0.3"]


def cache_request(pipeline: Any, index: int, step_cache: str | None, **params: Any) -> Any:
    return make_request(pipeline, f"r{index}", f"a prompt number {index}", seed=100 + index,
                        num_inference_steps=params.pop("num_inference_steps", STEPS),
                        step_cache=step_cache, **params)


def run_alone(pipeline: Any, request: Any) -> Any:
    (output,) = pipeline.forward(make_batch([request]))
    return output


@pytest.mark.parametrize("model", TRANSFORMERS)
def test_each_request_of_a_mixed_wave_equals_its_solo_run_with_its_own_settings(
        model: str, load_tiny: Any) -> None:
    pipeline = load_tiny(model)
    requests = [cache_request(pipeline, i, s) for i, s in enumerate(SETTINGS)]
    outputs = pipeline.forward(make_batch(requests))
    for request, output in zip(requests, outputs, strict=True):
        alone = run_alone(pipeline, request)
        diff = (output.images - alone.images).abs().max().item()
        assert diff <= TOLERANCE, f"{model} {request.request_id}: max abs difference {diff}"
        assert (output.computed_steps, output.cached_steps) == \
            (alone.computed_steps, alone.cached_steps)
    assert outputs[1].cached_steps is None  # not caching: no counts
    assert outputs[0].cached_steps > 0, "the cache never skipped a step"
    assert outputs[0].cached_steps != outputs[2].cached_steps  # thresholds act per request


def test_taylorseer_forecasts_the_cached_residual_from_the_last_two_computed_steps(
        load_tiny: Any) -> None:
    """The same decisions as first_block (same prompt, seed, threshold), another image:
    a cached step adds a first-order forecast instead of the last residual."""
    pipeline = load_tiny("tiny-pixart")
    steps = {"num_inference_steps": 10}
    plain = run_alone(pipeline, cache_request(pipeline, 0, "first_block:0.3", **steps))
    taylor = run_alone(pipeline, cache_request(pipeline, 0, "taylorseer:0.3", **steps))
    assert plain.cached_steps > 0
    assert (taylor.images - plain.images).abs().max().item() > 1e-4


@pytest.mark.parametrize("model", TRANSFORMERS)
def test_step_mode_requests_that_join_midway_equal_their_solo_runs(
        model: str, load_tiny: Any) -> None:
    pipeline = load_tiny(model)
    runner = ModelRunner(EngineConfig(model=model), pipeline=pipeline)
    steps = StepRunner(runner)
    made = [step_request(pipeline, i, n, step_cache=s) for i, (n, s) in
            enumerate([(6, SETTINGS[0]), (4, None), (6, SETTINGS[4]), (5, SETTINGS[3])])]
    requests = [r for r, _ in made]
    expected = {r.request_id: solo_image(runner, r, key) for r, key in made}
    join(steps, requests[:2], 0, capacity=4)

    def late_joiners(tick: int) -> None:
        if tick == 2:  # r2, r3 join at step 2 of r0, beside its warm cache
            join(steps, requests[2:], 2, capacity=4)

    left = run_until_idle(steps, late_joiners)
    for request_id, (_tick, output) in left.items():
        assert output.error is None, output.error
        diff = (output.images - expected[request_id]).abs().max().item()
        assert diff <= TOLERANCE, f"{model} {request_id}: max abs difference {diff}"
    assert left["r0"][1].cached_steps > 0
    assert max(output.batch_size for _t, output in left.values()) == 4


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-pixart"])
def test_a_lone_request_equals_diffusers_first_block_cache(model: str, load_tiny: Any) -> None:
    """diffusers' `FirstBlockCacheConfig(threshold=t)` on the same call. (SD3 is left
    out: diffusers' hook fails on its last block, which returns no encoder states.)"""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    pipeline = load_tiny(model)
    request = cache_request(pipeline, 0, "first_block:0.3", num_inference_steps=8)
    ours = run_alone(pipeline, request)
    reference = DiffusersT2IPipeline.from_pretrained(resolve_model_path(model)).pipe
    apply_first_block_cache(reference.transformer, FirstBlockCacheConfig(threshold=0.3))
    _set_cache_context(reference.transformer, CacheContext("cond"))  # what Flux sets itself
    theirs = reference(**pipeline.call_kwargs(make_batch([request]))).images
    assert ours.cached_steps > 0
    assert (ours.images - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("model", TRANSFORMERS)
def test_a_cached_image_differs_from_its_uncached_one_and_counts_are_exact(
        model: str, load_tiny: Any) -> None:
    pipeline = load_tiny(model)
    last_block = pipeline.pipe.transformer
    *_, tail = (m for m in last_block.modules() if type(m).__name__.endswith("Block"))
    inner = next(m for m in tail.children() if any(True for _ in m.parameters()))
    calls: list[int] = []
    handle = inner.register_forward_hook(lambda *_: calls.append(1))
    try:
        cached = run_alone(pipeline, cache_request(pipeline, 0, "first_block:0.3"))
        tail_runs = len(calls)
        plain = run_alone(pipeline, cache_request(pipeline, 0, None))
    finally:
        handle.remove()
    assert (cached.images - plain.images).abs().max().item() > 1e-3
    assert cached.cached_steps > 0
    assert cached.computed_steps + cached.cached_steps == STEPS
    assert cached.computed_steps == tail_runs  # the tail ran exactly on computed steps


def test_warm_up_steps_always_compute_and_the_cap_limits_cached_steps_in_a_row(
        load_tiny: Any) -> None:
    pipeline = load_tiny("tiny-pixart")
    free = run_alone(pipeline, cache_request(pipeline, 0, "first_block:0.3",
                                             num_inference_steps=8))
    warm = run_alone(pipeline, cache_request(pipeline, 0, "first_block:0.3,warmup=5",
                                             num_inference_steps=8))
    capped = run_alone(pipeline, cache_request(pipeline, 0, "first_block:0.3,max_cached=1",
                                               num_inference_steps=8))
    assert free.cached_steps >= 3
    assert warm.cached_steps <= 3 and warm.cached_steps < free.cached_steps
    assert capped.cached_steps <= 4 and capped.cached_steps < free.cached_steps


def test_a_unet_model_refuses_step_caching_naming_the_flag(load_tiny: Any) -> None:
    reason = load_tiny("tiny-sd").info().step_cache_unsupported
    assert reason is not None and "--step-cache" in reason and "step_cache" in reason
    assert load_tiny("tiny-sd3").info().step_cache_unsupported is None


def test_specs_parse_and_bad_ones_say_what_is_expected() -> None:
    assert StepCacheConfig.parse("fbc:0.1,warmup=2,max_cached=3") == StepCacheConfig(
        "first_block", 0.1, 2, 3)
    assert not StepCacheConfig.parse("off").enabled
    assert StepCacheConfig.parse({"threshold": 0.2}).threshold == 0.2
    for bad in ("teacache", "first_block:x", "first_block:-1", {"threshold": 1, "k": 2},
                "off:0.1", 3):
        with pytest.raises(ValueError, match="step_cache"):
            StepCacheConfig.parse(bad)


def test_rows_that_compute_keep_their_own_lora_adapters(tmp_path: Any, model_cache_dir: str
                                                       ) -> None:
    """The sub-batch of computing rows runs with those rows' adapters only."""
    from dataclasses import replace

    from diffbatch.pipelines.tiny_lora import make_tiny_lora

    path = resolve_model_path("tiny-sd3")
    pipeline = DiffusersT2IPipeline.from_pretrained(path)
    pipeline.load_lora("a", make_tiny_lora(path, tmp_path / "a", seed=1))
    stack = (("a", 1.0),)
    specs = [(stack, "first_block:0.3"), ((), "first_block:0.3"), (stack, None),
             ((), "first_block:0.1")]
    requests = [cache_request(pipeline, i, s) for i, (_, s) in enumerate(specs)]
    stacks = [st for st, _ in specs]
    outputs = pipeline.forward(replace(make_batch(requests), lora_stacks=stacks))
    for request, st, output in zip(requests, stacks, outputs, strict=True):
        (alone,) = pipeline.forward(replace(make_batch([request]), lora_stacks=[st]))
        diff = (output.images - alone.images).abs().max().item()
        assert diff <= TOLERANCE, f"{request.request_id}: max abs difference {diff}"
        assert output.cached_steps == alone.cached_steps
    assert outputs[0].cached_steps and (outputs[0].images - outputs[1].images).abs().max() > 0


def test_in_a_packed_wave_of_several_sizes_every_request_computes(load_tiny: Any) -> None:
    """A packed forward (mixed resolution) runs every request's blocks: the padded
    carrier would put padding into a request's residual (docs/step_cache.md)."""
    from tests.pipelines.test_mixed_resolution import any_size

    pipeline = load_tiny("tiny-sd3")
    requests = [any_size(pipeline, cache_request(pipeline, i, "first_block:0.3",
                                                  height=size, width=size))
                for i, size in enumerate((64, 128))]
    outputs = pipeline.forward(make_batch(requests))
    for output in outputs:
        assert output.error is None
        assert (output.computed_steps, output.cached_steps) == (STEPS, 0)


class NaNCheckingPixArt(DiffusersT2IPipeline):
    """tiny-pixart whose last transformer block raises on a batch holding NaN, after the
    step cache's head block decided; a request whose prompt says "poison" gets NaN
    latents."""

    def step_fusion_points(self) -> list[Any]:
        def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.isnan().any():
                raise RuntimeError("NaN in the last block's batch")

        self.pipe.transformer.transformer_blocks[-1].register_forward_pre_hook(
            check, with_kwargs=True)
        return super().step_fusion_points()

    def call_kwargs(self, batch: Any) -> dict[str, Any]:
        return poison_latents(super().call_kwargs(batch), batch, self.pipe,
                              self.pipe.transformer)


def test_a_fused_forward_that_fails_and_is_rerun_leaves_each_cache_as_it_was(
        load_tiny: Any) -> None:
    """Step mode re-runs a failing fused call in parts: the caching requests beside the
    failing one decide again from the state they had, so their images stay their own."""
    from diffbatch.pipelines.registry import load_pipeline

    clean = load_tiny("tiny-pixart")
    reference = ModelRunner(EngineConfig(model="tiny-pixart"), pipeline=clean)
    pipeline = load_pipeline("tiny-pixart", NaNCheckingPixArt)
    steps = StepRunner(ModelRunner(EngineConfig(model="tiny-pixart"), pipeline=pipeline))
    # r0 computes its third step (warm-up) in the fused call that fails
    made = [step_request(clean, i, 6, step_cache="first_block:0.3,warmup=3")
            for i in range(2)]
    poisoned, _ = step_request(clean, 9, 4, step_cache="first_block:0.3")
    poisoned.prompt = "poison in this prompt"
    join(steps, [made[0][0]], 0, capacity=4)
    steps.tick()
    steps.tick()
    join(steps, [poisoned, made[1][0]], 1, capacity=4)
    left = run_until_idle(steps)
    assert left["r9"][1].error is not None
    for request, key in made:
        output = left[request.request_id][1]
        assert output.error is None, output.error
        solo = solo_image(reference, request, key)
        assert (output.images - solo).abs().max().item() <= TOLERANCE
    assert left["r0"][1].cached_steps > 0


def test_the_first_caching_request_may_join_requests_that_started_without_a_cache(
        model_cache_dir: str) -> None:
    """On a pipeline that has not cached yet, a caching request joins a running
    non-caching one in step mode and still decides alone, as in its solo run."""
    from diffbatch.pipelines.registry import load_pipeline

    pipeline = load_pipeline("tiny-pixart")
    runner = ModelRunner(EngineConfig(model="tiny-pixart"), pipeline=pipeline)
    steps = StepRunner(runner)
    plain, _ = step_request(pipeline, 0, 6)
    caching, key = step_request(pipeline, 1, 6, step_cache="first_block:0.3")
    join(steps, [plain], 0, capacity=2)
    steps.tick()
    join(steps, [caching], 1, capacity=2)
    left = run_until_idle(steps)
    expected = solo_image(runner, caching, key)
    assert left["r1"][1].cached_steps > 0
    assert (left["r1"][1].images - expected).abs().max().item() <= TOLERANCE
