"""Step mode's running batch, in process: each request's image equals its solo run.

The `StepRunner` is driven tick by tick here, so where a request joins, when it
leaves and what a cancel frees are exact, not timed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffbatch.config import EngineConfig
from diffbatch.errors import ConfigError
from diffbatch.ipc.messages import StepJoin
from diffbatch.outputs import PartialImage
from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.registry import load_pipeline
from diffbatch.sched.output import SchedulerOutput
from diffbatch.worker.model_runner import ModelRunner
from diffbatch.worker.step_runner import StepRunner
from tests.fake_pipelines import make_fake_adapter
from tests.pipelines.conftest import TOLERANCE, make_request

FAMILIES = ["tiny-sd", "tiny-sd3", "tiny-flux", "tiny-pixart", "shapes"]


def step_request(pipeline: Any, index: int, steps: int, **params: Any) -> Any:
    request = make_request(pipeline, f"r{index}", f"a prompt number {index}", seed=100 + index,
                           num_inference_steps=steps, **params)
    solo_key = request.key
    request.key = request.key.for_step_execution()
    return request, solo_key


def solo_image(runner: ModelRunner, request: Any, key: Any) -> torch.Tensor:
    """The request run alone in request mode (its own wave of one)."""
    solo = type(request)(request.request_id, request.prompt, request.sampling_params)
    solo.key = key
    out = runner.execute_batch(SchedulerOutput(1, [solo], key)).outputs[solo.request_id]
    assert out.error is None, out.error
    return out.images


def join(steps: StepRunner, requests: list[Any], first_call_id: int, capacity: int) -> None:
    ids = list(range(first_call_id, first_call_id + len(requests)))
    steps.join(StepJoin(SchedulerOutput(1, requests, requests[0].key), ids, capacity))


def run_until_idle(steps: StepRunner, on_tick: Any = None) -> dict[str, tuple[int, Any]]:
    """Tick until the batch is empty; request id -> (tick it left at, its output)."""
    left: dict[str, tuple[int, Any]] = {}
    tick = 0
    while not steps.idle:
        if on_tick is not None:
            on_tick(tick)
        for _call_id, output in steps.tick():
            left[output.request_id] = (tick, output)
        tick += 1
        assert tick < 1000, "the running batch never drained"
    return left


@pytest.mark.parametrize("model", FAMILIES)
def test_each_image_equals_its_solo_run_whether_it_joined_at_step_zero_or_midway(
        model: str, load_tiny: Any) -> None:
    pipeline = load_tiny(model)
    runner = ModelRunner(EngineConfig(model=model), pipeline=pipeline)
    steps = StepRunner(runner)
    specs = [(0, 6, {}), (1, 2, {}), (2, 4, {"guidance_scale": 3.0}), (3, 3, {})]
    made = [step_request(pipeline, i, n, **kw) for i, n, kw in specs]
    requests = [r for r, _ in made]
    expected = {r.request_id: solo_image(runner, r, key) for r, key in made}
    join(steps, requests[:2], 0, capacity=4)  # r0, r1 start together

    def late_joiners(tick: int) -> None:
        if tick == 1:  # r2, r3 join after the first step
            join(steps, requests[2:], 2, capacity=4)

    left = run_until_idle(steps, late_joiners)
    assert set(left) == {r.request_id for r in requests}
    for request_id, (_tick, output) in left.items():
        assert output.error is None, output.error
        diff = (output.images - expected[request_id]).abs().max().item()
        assert diff <= TOLERANCE, f"{model} {request_id}: max abs difference {diff}"
    # the 2-step request left first, while its mates kept running; all four shared a step
    assert left["r1"][0] < min(left[r][0] for r in ("r0", "r2", "r3"))
    assert max(output.batch_size for _t, output in left.values()) == 4


def test_a_cancelled_request_leaves_at_the_next_boundary_and_its_slot_is_reused(
        load_tiny: Any) -> None:
    pipeline = load_tiny("tiny-sd")
    runner = ModelRunner(EngineConfig(model="tiny-sd"), pipeline=pipeline)
    steps = StepRunner(runner)
    long_request, _ = step_request(pipeline, 0, 50)
    next_request, next_key = step_request(pipeline, 1, 3)
    join(steps, [long_request], 0, capacity=1)
    join(steps, [next_request], 1, capacity=1)
    for _ in range(3):
        assert steps.tick() == []
    assert [t.request.request_id for t in steps.running] == ["r0"]  # capacity 1: r1 waits
    steps.take_ticks()
    aborted = steps.cancel(0)
    assert aborted is not None and aborted.aborted
    steps.tick()
    leave, tick = steps.take_ticks()
    assert (leave.batch_size, leave.leaves) == (0, 1)  # the cancel: a leave, no step
    assert (tick.joins, tick.batch_size) == (1, 1)  # r1 ran its first step on the next tick
    left = run_until_idle(steps)
    assert left["r1"][1].error is None
    diff = (left["r1"][1].images - solo_image(runner, next_request, next_key)).abs().max()
    assert diff.item() <= TOLERANCE


def test_an_isolated_join_runs_as_a_batch_of_its_own(load_tiny: Any) -> None:
    """A re-run after a worker death (an isolated join) enters only an empty batch, and
    nothing joins it until it has left, whatever the capacity: a request that may have
    killed the worker shares no step with requests that did not run with it."""
    pipeline = load_tiny("tiny-sd")
    runner = ModelRunner(EngineConfig(model="tiny-sd"), pipeline=pipeline)
    steps = StepRunner(runner)
    made = [step_request(pipeline, i, n) for i, n in enumerate((4, 2, 2, 3))]
    requests = [r for r, _ in made]
    join(steps, requests[:1], 0, capacity=4)  # ordinary traffic, running
    steps.tick()
    steps.join(StepJoin(SchedulerOutput(1, requests[1:3], requests[1].key), [1, 2], 4,
                        isolated=True))
    join(steps, requests[3:], 3, capacity=4)  # ordinary traffic behind the isolated group
    batches: list[set[str]] = []
    left = run_until_idle(steps, lambda _tick: batches.append(
        {t.request.request_id for t in steps.running}))
    runs = [b for b in batches if b]
    assert {"r1", "r2"} in runs  # the group ran together...
    for running in runs:  # ...and alone: no step shared with another request
        assert running <= {"r1", "r2"} or not running & {"r1", "r2"}
    assert left["r3"][0] > max(left["r1"][0], left["r2"][0])  # it waited behind them
    for (request, key), request_id in zip(made, ("r0", "r1", "r2", "r3"), strict=True):
        diff = (left[request_id][1].images - solo_image(runner, request, key)).abs().max()
        assert diff.item() <= TOLERANCE


def test_an_adapter_that_fails_to_load_fails_only_the_request_that_uses_it(
        load_tiny: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    pipeline = load_tiny("tiny-sd")
    runner = ModelRunner(EngineConfig(model="tiny-sd"), pipeline=pipeline)
    steps = StepRunner(runner)
    reported: list[list[int]] = []
    steps.report_joins_to(reported.append)

    def broken(name: str, path: str) -> None:
        raise RuntimeError("adapter weights do not fit this model")

    monkeypatch.setattr(pipeline, "load_lora", broken)
    make_fake_adapter(tmp_path / "bad")
    requests = [step_request(pipeline, 0, 3, lora=str(tmp_path / "bad"))[0],
                step_request(pipeline, 1, 3)[0]]
    join(steps, requests, 0, capacity=2)
    left = run_until_idle(steps)
    assert reported == [[0, 1]]  # both entered the batch together, reported before running
    error = left["r0"][1].error
    assert error is not None and "adapter weights do not fit" in error.message
    assert left["r1"][1].error is None  # its mate ran without it
    assert runner.loras.resident == []


def test_a_running_requests_adapter_is_never_evicted(load_tiny: Any, tmp_path: Any) -> None:
    """--max-loras 1: a joiner on another adapter waits until the running request on
    the resident one has left (loading its adapter would evict a running one's), then
    runs; both images equal their solo runs."""
    from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
    from diffbatch.pipelines.registry import resolve_model_path
    from diffbatch.pipelines.tiny_lora import make_tiny_lora

    model = resolve_model_path("tiny-sd")
    pipeline = DiffusersT2IPipeline.from_pretrained(model, device="cpu")  # adapters stay
    paths = [make_tiny_lora(model, tmp_path / name, seed=i) for i, name in enumerate("ab")]
    runner = ModelRunner(EngineConfig(model="tiny-sd", max_loras=1), pipeline=pipeline)
    first, first_key = step_request(pipeline, 0, 4, lora=paths[0])
    second, second_key = step_request(pipeline, 1, 2, lora=paths[1])
    alone = [solo_image(runner, first, first_key), solo_image(runner, second, second_key)]
    steps = StepRunner(runner)
    joins: list[list[int]] = []
    steps.report_joins_to(joins.append)
    join(steps, [first, second], 0, capacity=2)
    resident: list[list[str]] = []
    left = run_until_idle(steps, on_tick=lambda tick: resident.append(runner.loras.resident))
    assert joins == [[0], [1]]  # the second joined only after the first had left
    assert left["r1"][0] > left["r0"][0]
    assert all(len(r) <= 1 for r in resident)
    for request, image in zip((first, second), alone, strict=True):
        output = left[request.request_id][1]
        assert output.error is None, output.error
        assert (output.images - image).abs().max().item() <= TOLERANCE


def poison_latents(kwargs: dict[str, Any], batch: Any, pipe: Any,
                   denoiser: Any) -> dict[str, Any]:
    """`kwargs` with NaN latents when the (one-request) batch's prompt says "poison"."""
    if any("poison" in p for p in batch.prompts):
        channels = denoiser.config.in_channels
        side = batch.sampling_params.height // pipe.vae_scale_factor
        kwargs["latents"] = torch.full((1, channels, side, side), float("nan"))
    return kwargs

class NaNCheckingSD(DiffusersT2IPipeline):
    """tiny-sd whose denoiser raises on a batch holding NaN latents, and which gives a
    request whose prompt says "poison" NaN latents: the failure happens inside the
    fused denoiser call, for the whole batch, as a numerical fault would."""

    def step_fusion_points(self) -> list[Any]:
        unet = self.pipe.unet
        original = unet.forward

        def checking_forward(sample: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if torch.isnan(sample).any():
                raise RuntimeError("NaN latents in the denoiser batch")
            return original(sample, *args, **kwargs)

        unet.forward = checking_forward
        return super().step_fusion_points()

    def call_kwargs(self, batch: Any) -> dict[str, Any]:
        return poison_latents(super().call_kwargs(batch), batch, self.pipe, self.pipe.unet)


def test_a_request_failing_inside_the_fused_denoiser_errors_alone(load_tiny: Any) -> None:
    clean = load_tiny("tiny-sd")
    reference = ModelRunner(EngineConfig(model="tiny-sd"), pipeline=clean)
    pipeline = load_pipeline("tiny-sd", NaNCheckingSD)
    steps = StepRunner(ModelRunner(EngineConfig(model="tiny-sd"), pipeline=pipeline))
    made = [step_request(clean, i, 4) for i in range(3)]
    poisoned, _ = step_request(clean, 9, 4)
    poisoned.prompt = "poison in this prompt"
    join(steps, [r for r, _ in made[:2]], 0, capacity=4)
    steps.tick()  # r0 and r1 are one step in when the poisoned request joins
    join(steps, [poisoned, made[2][0]], 2, capacity=4)
    left = run_until_idle(steps)
    assert left["r9"][1].error is not None
    assert "NaN latents" in left["r9"][1].error.message
    for request, key in made:
        output = left[request.request_id][1]
        assert output.error is None, output.error
        diff = (output.images - solo_image(reference, request, key)).abs().max().item()
        assert diff <= TOLERANCE


def test_a_pipeline_without_the_step_contract_is_refused_by_name() -> None:
    from tests.fake_pipelines import FakeBatchPipeline

    runner = ModelRunner(EngineConfig(model="tiny-sd"),
                         pipeline=FakeBatchPipeline.from_pretrained("fake"))
    with pytest.raises(ConfigError, match=r"FakeBatchPipeline.*cannot run in step mode"):
        StepRunner(runner)


@pytest.mark.parametrize("task", ["image-to-image", "inpaint"])
def test_edits_with_different_strengths_and_n_share_the_batch_and_equal_their_solo_runs(
        task: str, load_tiny: Any) -> None:
    from tests.pipelines.test_diffusers_edit import _image, _mask

    pipeline = load_tiny("tiny-sd")
    runner = ModelRunner(EngineConfig(model="tiny-sd"), pipeline=pipeline)
    steps = StepRunner(runner)
    made = [step_request(pipeline, i, 8, image=_image(i), strength=strength, n=2,
                         **({"mask": _mask(4 * i)} if task == "inpaint" else {}))
            for i, strength in enumerate([0.5, 0.75, 1.0])]
    requests = [r for r, _ in made]
    assert len({r.key for r in requests}) == 1  # strength is not in the step key
    join(steps, requests, 0, capacity=4)
    left = run_until_idle(steps)
    for request, key in made:
        output = left[request.request_id][1]
        assert output.error is None, output.error
        assert output.images.shape[0] == 2
        diff = (output.images - solo_image(runner, request, key)).abs().max().item()
        assert diff <= TOLERANCE, f"{task} {request.request_id}: {diff}"
    assert left["r0"][0] < left["r2"][0]  # strength 0.5 runs 4 steps, 1.0 all 8


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux", "shapes"])
def test_partial_images_in_step_mode_equal_request_modes(model: str, load_tiny: Any) -> None:
    """A request streams the previews it asked for from its own call in the running batch
    (its mate asks for none), the same as it gets alone in request mode."""
    pipeline = load_tiny(model)
    runner = ModelRunner(EngineConfig(model=model), pipeline=pipeline)
    steps = StepRunner(runner)
    sent: list[tuple[int, PartialImage]] = []
    steps.send_partial_images_to(lambda call_id, partial: sent.append((call_id, partial)))
    streamed, key = step_request(pipeline, 0, 4, partial_images=3)
    plain, _ = step_request(pipeline, 1, 6)
    solo = type(streamed)(streamed.request_id, streamed.prompt, streamed.sampling_params)
    solo.key = key
    want: list[PartialImage] = []
    runner.execute_batch(SchedulerOutput(1, [solo], key), on_partial_image=want.append)
    join(steps, [streamed, plain], 10, capacity=4)
    left = run_until_idle(steps)
    assert set(left) == {"r0", "r1"}
    assert [(call_id, p.request_id, p.step) for call_id, p in sent] == [
        (10, "r0", 1), (10, "r0", 2), (10, "r0", 3)]
    assert [p.step for p in want] == [1, 2, 3]
    for (_, got), expected in zip(sent, want, strict=True):
        assert (got.image - expected.image).abs().max().item() <= TOLERANCE


def test_a_wave_pixel_cap_is_refused_in_step_mode_not_ignored():
    """The cap belongs to request mode's grouped waves; step mode's batch would not
    hold it, so asking for both fails at once, naming the option."""
    from diffbatch import EngineConfig

    with pytest.raises(ConfigError, match="max_wave_pixels") as info:
        EngineConfig(step_execution=True, max_wave_pixels=8192)
    assert info.value.param == "max_wave_pixels"
    assert EngineConfig(max_wave_pixels=8192, scheduling_policy="grouped").max_wave_pixels
