"""The bookkeeping every policy shares, read through `SchedulerInterface` only."""

from __future__ import annotations

import pytest

from diffbatch import (
    BatchRunnerOutput,
    DiffusionOutput,
    DiffusionRequest,
    RequestStatus,
    SamplingParams,
    SamplingParamsKey,
)
from diffbatch.config import EngineConfig
from diffbatch.sched.base import SchedulerBase
from diffbatch.sched.grouped import GroupedScheduler
from diffbatch.sched.interface import SchedulerInterface
from diffbatch.sched.policy import make_scheduler
from diffbatch.sched.scheduler import FifoScheduler

POLICIES = ["fifo", "grouped"]


def make_request(request_id: str, size: int = 64) -> DiffusionRequest:
    params = SamplingParams(height=size, width=size, num_inference_steps=2,
                            guidance_scale=5.0, seed=0)
    request = DiffusionRequest(request_id, "a cat", params)
    request.key = SamplingParamsKey.from_params(params, cfg_enabled=True)
    return request


def make(policy: str, max_num_seqs: int = 2) -> SchedulerInterface:
    return make_scheduler(EngineConfig(max_num_seqs=max_num_seqs, scheduling_policy=policy))


def test_each_policy_owns_its_queue_on_the_shared_base():
    assert issubclass(FifoScheduler, SchedulerBase) and issubclass(GroupedScheduler, SchedulerBase)
    assert not issubclass(GroupedScheduler, FifoScheduler)
    assert not issubclass(FifoScheduler, GroupedScheduler)


@pytest.mark.parametrize("policy", POLICIES)
def test_ids_and_counts_follow_each_request_through_its_lifecycle(policy):
    sched = make(policy)
    for rid, size in [("a", 64), ("b", 64), ("c", 128)]:
        sched.add_request(make_request(rid, size))
    assert sorted(sched.request_ids()) == ["a", "b", "c"]
    assert sched.running_request_ids() == []
    assert sorted(sched.num_waiting_by_key().values()) == [1, 2]

    wave = sched.schedule()
    assert sorted(wave.req_ids) == ["a", "b"]
    assert sorted(sched.running_request_ids()) == ["a", "b"]
    assert sorted(sched.request_ids()) == ["a", "b", "c"]
    assert list(sched.num_waiting_by_key().values()) == [1]
    assert (sched.num_waiting, sched.num_running) == (1, 2)

    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.running_request_ids() == ["b"]
    sched.update_from_output(wave, BatchRunnerOutput(
        {rid: DiffusionOutput(rid, images=[1]) for rid in wave.req_ids}))
    assert sched.request_ids() == ["c"] and sched.running_request_ids() == []

    next_wave = sched.schedule()
    assert next_wave.req_ids == ["c"] and next_wave.wave_id > wave.wave_id
    finished = sched.finish_requests(sched.request_ids(), RequestStatus.FINISHED_ERROR)
    assert [r.request_id for r in finished] == ["c"]
    assert sched.request_ids() == [] and not sched.has_unfinished_requests()
    assert sched.num_waiting_by_key() == {}


@pytest.mark.parametrize("policy", POLICIES)
def test_finishing_every_waiting_request_empties_the_queue(policy):
    sched = make(policy)
    for rid in "abc":
        sched.add_request(make_request(rid))
    sched.finish_requests(sched.request_ids(), RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and sched.request_ids() == []
    assert sched.schedule().is_empty and not sched.has_full_wave()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
