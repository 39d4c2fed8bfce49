"""DiffusionRequest: one prompt, one id."""

from __future__ import annotations

import pytest

from diffbatch import DiffusionRequest, InvalidRequestError, RequestStatus, SamplingParams


def test_list_prompt_is_rejected_with_a_clear_error():
    with pytest.raises(InvalidRequestError, match=r"single string.*one request per prompt"):
        DiffusionRequest("r1", ["a", "b"], SamplingParams())


@pytest.mark.parametrize("request_id", ["", None, 3])
def test_request_id_must_be_a_non_empty_string(request_id):
    with pytest.raises(InvalidRequestError, match="request_id"):
        DiffusionRequest(request_id, "a cat", SamplingParams())


@pytest.mark.parametrize("prompt", ["", "   ", "x" * 10_001, 42])
def test_bad_prompts_are_rejected(prompt):
    with pytest.raises(InvalidRequestError, match="prompt"):
        DiffusionRequest("r1", prompt, SamplingParams())


@pytest.mark.parametrize("prompt", ["a \ud800", "\udfff", "ok \udc80 ok"])
def test_a_prompt_with_a_lone_surrogate_is_rejected(prompt):
    # What a JSON "\\ud800" escape decodes to; no tokenizer can encode it.
    with pytest.raises(InvalidRequestError, match="surrogate") as info:
        DiffusionRequest("r1", prompt, SamplingParams())
    assert info.value.param == "prompt"


def test_a_surrogate_prompt_is_refused_at_the_call_and_never_joins_a_wave():
    # With error isolation off, one bad prompt inside a wave would fail all of it.
    from diffbatch import Engine
    from tests.fake_pipelines import FakeBatchPipeline

    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                batch_error_isolation="none") as engine:
        with pytest.raises(InvalidRequestError, match="surrogate"):
            engine.generate(["fine", "a \ud800"], use_tqdm=False)
        assert engine.num_unfinished == 0
        assert [o.ok for o in engine.generate(["fine", "also fine"], use_tqdm=False)] \
            == [True, True]


def test_status_order_and_anon_repr_hides_the_prompt():
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert all(RequestStatus.is_finished(s) for s in (
        RequestStatus.FINISHED_COMPLETED, RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR))
    req = DiffusionRequest("r1", "a secret prompt", SamplingParams())
    assert "secret" not in req.anon_repr() and "r1" in req.anon_repr()
