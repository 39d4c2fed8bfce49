"""The model runner: generators per request, the output contract, routing by id."""

from __future__ import annotations

import pytest
import torch

from diffbatch import (
    DiffusionRequest,
    EngineConfig,
    PipelineError,
    SamplingParams,
    SamplingParamsKey,
    SchedulerOutput,
)
from diffbatch.pipelines.interface import DiffusionRequestBatch
from diffbatch.worker.model_runner import ModelRunner, check_outputs, make_generators
from tests.fake_pipelines import (
    FakeBatchPipeline,
    WrongCountPipeline,
    WrongTypePipeline,
    fake_images,
    make_fake_adapter,
)


def make_request(rid: str, prompt: str = "a cat", seed: int = 0, n: int = 1,
                 output_type: str = "pt", lora: str | None = None) -> DiffusionRequest:
    params = SamplingParams(height=16, width=16, num_inference_steps=2, guidance_scale=5.0,
                            seed=seed, num_outputs_per_prompt=n, output_type=output_type,
                            lora=lora)
    request = DiffusionRequest(rid, prompt, params)
    request.key = SamplingParamsKey.from_params(params, cfg_enabled=True)
    return request


def wave(*requests: DiffusionRequest) -> SchedulerOutput:
    return SchedulerOutput(wave_id=1, requests=list(requests), key=requests[0].key)


def run_alone(runner: ModelRunner, request: DiffusionRequest):
    """The output of `request` run in a wave of its own."""
    return runner.execute_batch(wave(request)).outputs[request.request_id]


def runner_with(pipeline) -> ModelRunner:
    return ModelRunner(EngineConfig(executor="inproc"), pipeline=pipeline)


def test_each_request_generator_is_seeded_from_its_own_seed():
    requests = [make_request("a", seed=5, n=2), make_request("b", seed=9, n=1)]
    gens = make_generators(requests)
    assert len(gens) == 3
    expected = [5, 6, 9]
    for gen, seed in zip(gens, expected, strict=True):
        assert torch.equal(torch.rand(4, generator=gen),
                           torch.rand(4, generator=torch.Generator().manual_seed(seed)))


def test_outputs_are_routed_by_request_id_and_depend_only_on_own_seed():
    runner = runner_with(FakeBatchPipeline())
    out = runner.execute_batch(
        wave(make_request("a", "cat", 1, n=2), make_request("b", "dog", 2, n=2)))
    assert out.req_ids == ["a", "b"]
    assert out.outputs["a"].images.shape == (2, 3, 16, 16)
    assert out.outputs["b"].images.shape == (2, 3, 16, 16)
    assert out.outputs["a"].batch_size == 2 and out.outputs["a"].seed == 1
    alone = run_alone(runner, make_request("b2", "dog", 2, n=2))
    assert torch.equal(alone.images, out.outputs["b"].images)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    expected = fake_images("cat", gens, 16, 16)
    assert torch.equal(out.outputs["a"].images, expected)


def test_pil_output_type_ships_uint8_hwc():
    runner = runner_with(FakeBatchPipeline())
    out = run_alone(runner, make_request("a", output_type="pil"))
    assert out.images.dtype == torch.uint8 and out.images.shape == (1, 16, 16, 3)


def test_wrong_output_count_is_rejected_with_the_exact_message():
    runner = runner_with(WrongCountPipeline())
    out = runner.execute_batch(wave(make_request("a"), make_request("b"), make_request("c")))
    message = ("pipeline WrongCountPipeline.forward doesn't preserve batch size: the batch "
               "has 3 requests but it returned 2 outputs")
    assert [o.error.message for o in out.outputs.values()] == [message] * 3


def test_wrong_output_type_is_rejected_naming_the_type():
    runner = runner_with(WrongTypePipeline())
    out = runner.execute_batch(wave(make_request("a"), make_request("b")))
    assert all(o.error.message == "pipeline WrongTypePipeline.forward must return "
               "DiffusionOutput objects, got dict at position 0" for o in out.outputs.values())


def test_check_outputs_names_order_and_container_problems():
    batch = DiffusionRequestBatch([make_request("a"), make_request("b")])
    from diffbatch import DiffusionOutput

    with pytest.raises(PipelineError, match="must return a list of 2 DiffusionOutput, got dict"):
        check_outputs("P", batch, {})
    with pytest.raises(PipelineError, match="out of order"):
        check_outputs("P", batch, [DiffusionOutput("b"), DiffusionOutput("a")])


def test_pipeline_exception_fails_the_wave_without_isolation():
    runner = ModelRunner(EngineConfig(executor="inproc", batch_error_isolation="none"),
                         pipeline=FakeBatchPipeline())
    out = runner.execute_batch(wave(make_request("a"), make_request("b", "poison pill")))
    assert all("poisoned prompt" in o.error.message for o in out.outputs.values())
    assert out.num_forwards == 1
    assert run_alone(runner, make_request("c")).ok


def test_bisect_isolates_the_failing_request_and_keeps_the_others_images():
    runner = runner_with(FakeBatchPipeline())  # bisect is the default
    requests = [make_request(f"r{i}", f"prompt {i}", seed=i) for i in range(8)]
    requests[5] = make_request("r5", "poison pill", seed=5)
    out = runner.execute_batch(wave(*requests))
    errors = [rid for rid, o in out.outputs.items() if o.error is not None]
    assert errors == ["r5"] and "poisoned prompt" in out.outputs["r5"].error.message
    assert out.req_ids == [f"r{i}" for i in range(8)]
    assert out.num_forwards - 1 <= 2 * 3  # at most 2*log2(8) extra forwards
    for i in range(8):
        if i != 5:
            alone = run_alone(runner, make_request(f"solo{i}", f"prompt {i}", seed=i))
            assert torch.equal(out.outputs[f"r{i}"].images, alone.images)
            assert out.outputs[f"r{i}"].batch_size == 8


def test_cache_refresh_and_adapter_loads_happen_once_per_wave(tmp_path):
    pipeline = FakeBatchPipeline()
    runner = runner_with(pipeline)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for folder in (a, b):
        make_fake_adapter(folder)
    out = runner.execute_batch(wave(make_request("a", lora=a), make_request("b", lora=b),
                                    make_request("c", lora=a), make_request("d")))
    assert pipeline.cache_refreshes == 1 and out.num_forwards == 1
    assert len(pipeline.lora_loads) == 2 and out.num_lora_loads == 2
    assert out.num_lora_adapters == 2
    # one forward, each request with its own stack (adapter names, scales), in order
    (stacks,) = pipeline.lora_waves
    assert [len(s) for s in stacks] == [1, 1, 1, 0]
    assert stacks[0] == stacks[2] != stacks[1] and stacks[0][0][1] == 1.0
    again = runner.execute_batch(wave(make_request("e", lora=a)))
    assert len(pipeline.lora_loads) == 2 and again.num_lora_loads == 0  # still resident


def test_a_missing_adapter_fails_only_its_requests(tmp_path):
    pipeline = FakeBatchPipeline()
    runner = runner_with(pipeline)
    make_fake_adapter(tmp_path / "a")
    out = runner.execute_batch(wave(make_request("a", lora=str(tmp_path / "a")),
                                    make_request("m", lora=str(tmp_path / "nope")),
                                    make_request("p")))
    assert "not found" in out.outputs["m"].error.message
    assert out.outputs["a"].ok and out.outputs["p"].ok and out.num_forwards == 1
    assert [len(s) for s in pipeline.lora_waves[0]] == [1, 0]  # the forward ran without m


def test_eviction_is_least_recently_used_and_a_wave_never_loses_its_adapters(tmp_path):
    """--max-loras 2, four adapters: a wave needing three runs in two parts, each
    part's adapters resident while it runs; evictions take the least recently used."""
    pipeline = FakeBatchPipeline()
    runner = ModelRunner(EngineConfig(executor="inproc", max_loras=2), pipeline=pipeline)
    paths = []
    for name in "abcd":
        make_fake_adapter(tmp_path / name)
        paths.append(str(tmp_path / name))
    a, b, c, d = paths
    runner.execute_batch(wave(make_request("1", lora=a), make_request("2", lora=b)))
    runner.execute_batch(wave(make_request("3", lora=a)))  # a is now the most recent
    out = runner.execute_batch(wave(make_request("4", lora=c), make_request("5", lora=a),
                                    make_request("6", lora=d)))
    assert all(o.ok for o in out.outputs.values())
    assert out.num_forwards == 2  # parts [c, a] and [d]
    assert out.num_lora_evictions == 2
    names = pipeline.lora_loads
    # b was the least recently used; then c, as part [d] runs once part [c, a] is done
    assert pipeline.lora_unloads == [names[1], names[2]]
    assert runner.loras.resident == [a, d]


class StepCheckingPipeline(FakeBatchPipeline):
    """Checks for an interrupt where a real pipeline would, between steps."""

    forwards = 0

    def forward(self, batch: DiffusionRequestBatch):
        type(self).forwards += 1
        batch.check_interrupt()
        return super().forward(batch)


def test_a_wave_stopped_mid_forward_comes_back_aborted_without_bisecting():
    runner = ModelRunner(EngineConfig(executor="inproc", batch_error_isolation="bisect"),
                         pipeline=StepCheckingPipeline())
    answers = iter([False, True])  # not before the forward; yes at its first step
    StepCheckingPipeline.forwards = 0
    out = runner.execute_batch(wave(make_request("a"), make_request("b")),
                               should_stop=lambda: next(answers))
    assert all(o.aborted for o in out.outputs.values()) and list(out.outputs) == ["a", "b"]
    assert StepCheckingPipeline.forwards == 1  # an interrupt is no error: no halves re-run
    assert out.num_forwards == 0  # nothing for the cost model


def test_a_wave_whose_requests_are_all_finished_is_not_started():
    """In process, the runner sees the engine's own request objects: once every one of
    them is finished (aborted), the wave is dropped without a forward."""
    from diffbatch.request import RequestStatus

    runner = ModelRunner(EngineConfig(executor="inproc"), pipeline=StepCheckingPipeline())
    a, b = make_request("a"), make_request("b")
    a.status = b.status = RequestStatus.FINISHED_ABORTED
    StepCheckingPipeline.forwards = 0
    out = runner.execute_batch(wave(a, b))
    assert all(o.aborted for o in out.outputs.values())
    assert StepCheckingPipeline.forwards == 0
    b.status = RequestStatus.RUNNING  # one is still wanted: the wave runs
    assert runner.execute_batch(wave(a, b)).outputs["b"].ok
