"""The FIFO wave scheduler."""

from __future__ import annotations

import pytest

from diffbatch import (
    BatchRunnerOutput,
    DiffusionOutput,
    DiffusionRequest,
    RequestError,
    RequestStatus,
    SamplingParams,
    SamplingParamsKey,
)
from diffbatch.sched.scheduler import FifoScheduler


def make_request(request_id: str, size: int = 64, prompt: str = "a cat") -> DiffusionRequest:
    params = SamplingParams(height=size, width=size, num_inference_steps=2,
                            guidance_scale=5.0, seed=0)
    request = DiffusionRequest(request_id, prompt, params)
    request.key = SamplingParamsKey.from_params(params, cfg_enabled=True)
    return request


def ok_output(wave) -> BatchRunnerOutput:
    return BatchRunnerOutput({r.request_id: DiffusionOutput(r.request_id, images=[1])
                              for r in wave.requests})


def test_single_request_lifecycle():
    sched = FifoScheduler(max_num_seqs=4)
    req = make_request("a")
    sched.add_request(req)
    assert (sched.num_waiting, sched.num_running) == (1, 0)
    wave = sched.schedule()
    assert wave.req_ids == ["a"] and req.status == RequestStatus.RUNNING
    assert (sched.num_waiting, sched.num_running) == (0, 1)
    finished = sched.update_from_output(wave, ok_output(wave))
    assert [(r.request_id, o.ok) for r, o in finished] == [("a", True)]
    assert req.status == RequestStatus.FINISHED_COMPLETED
    assert not sched.has_unfinished_requests() and sched.requests == {}
    assert sched.schedule().is_empty


def test_waves_fill_up_to_capacity_in_fifo_order():
    sched = FifoScheduler(max_num_seqs=3)
    for i in range(7):
        sched.add_request(make_request(f"r{i}"))
    waves = []
    while True:
        wave = sched.schedule()
        if wave.is_empty:
            break
        waves.append((wave.req_ids, wave.close_reason))
        sched.update_from_output(wave, ok_output(wave))
    assert waves == [
        (["r0", "r1", "r2"], "capacity"),
        (["r3", "r4", "r5"], "capacity"),
        (["r6"], "queue_empty"),
    ]


def test_the_pixel_cap_bounds_fifo_waves_too():
    sched = FifoScheduler(max_num_seqs=8, max_wave_pixels=3 * 64 * 64)
    for i in range(7):
        sched.add_request(make_request(f"r{i}"))
    assert sched.has_full_wave()  # three 64x64 images reach the cap
    waves = []
    while not (wave := sched.schedule()).is_empty:
        waves.append((len(wave.requests), wave.close_reason))
        sched.update_from_output(wave, ok_output(wave))
    assert waves == [(3, "pixel_cap"), (3, "pixel_cap"), (1, "queue_empty")]
    # a request larger than the cap still runs, alone; the capacity binds when tighter
    sched.add_request(make_request("huge", 128))
    assert sched.schedule().req_ids == ["huge"]
    sched = FifoScheduler(max_num_seqs=2, max_wave_pixels=3 * 64 * 64)
    for i in range(3):
        sched.add_request(make_request(f"s{i}"))
    assert sched.schedule().close_reason == "capacity"


def test_incompatible_head_blocks_later_compatible_requests():
    sched = FifoScheduler(max_num_seqs=4)
    for rid, size in [("a", 64), ("b", 128), ("c", 64), ("d", 64)]:
        sched.add_request(make_request(rid, size))
    first = sched.schedule()
    assert first.req_ids == ["a"] and first.close_reason == "key"
    sched.update_from_output(first, ok_output(first))
    second = sched.schedule()
    assert second.req_ids == ["b"]
    sched.update_from_output(second, ok_output(second))
    assert sched.schedule().req_ids == ["c", "d"]


def test_abort_waiting_request_leaves_the_queue_at_once():
    sched = FifoScheduler(max_num_seqs=4)
    for rid in "abc":
        sched.add_request(make_request(rid))
    done = sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["b"]
    assert done[0].status == RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 2 and "b" not in sched.requests
    assert sched.schedule().req_ids == ["a", "c"]


def test_aborting_every_waiting_request_leaves_no_queue_entry():
    sched = FifoScheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid))
    sched.finish_requests(["c", "a", "b"], RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and len(sched.waiting) == 0 and sched.requests == {}


def test_abort_running_request_discards_its_result():
    sched = FifoScheduler(max_num_seqs=4)
    for rid in "ab":
        sched.add_request(make_request(rid))
    wave = sched.schedule()
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)[0].request_id == "a"
    assert sched.num_running == 1
    finished = sched.update_from_output(wave, ok_output(wave))
    assert [r.request_id for r, _ in finished] == ["b"]
    assert not sched.has_unfinished_requests()
    # aborting again (or an unknown id) is a no-op
    assert sched.finish_requests(["a", "zzz"], RequestStatus.FINISHED_ABORTED) == []


def test_duplicate_active_id_is_rejected_but_reusable_after_finish():
    sched = FifoScheduler(max_num_seqs=2)
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already active"):
        sched.add_request(make_request("a"))
    wave = sched.schedule()
    sched.update_from_output(wave, ok_output(wave))
    sched.add_request(make_request("a"))
    assert sched.num_waiting == 1


def test_error_stays_with_its_request_and_missing_output_becomes_an_error():
    sched = FifoScheduler(max_num_seqs=3)
    for rid in "abc":
        sched.add_request(make_request(rid))
    wave = sched.schedule()
    outputs = {
        "a": DiffusionOutput("a", images=[1]),
        "b": DiffusionOutput.from_error("b", RequestError("b broke", 500)),
        # "c" is missing
    }
    finished = {r.request_id: (r, o) for r, o in
                sched.update_from_output(wave, BatchRunnerOutput(outputs))}
    assert finished["a"][0].status == RequestStatus.FINISHED_COMPLETED
    assert finished["b"][0].status == RequestStatus.FINISHED_ERROR
    assert finished["b"][1].error.message == "b broke"
    assert finished["c"][0].status == RequestStatus.FINISHED_ERROR
    assert "no output" in finished["c"][1].error.message


def test_request_without_key_and_bad_capacity_are_rejected():
    with pytest.raises(ValueError, match="max_num_seqs"):
        FifoScheduler(max_num_seqs=0)
    req = DiffusionRequest("x", "a cat", SamplingParams())
    with pytest.raises(ValueError, match="no key"):
        FifoScheduler(1).add_request(req)


def test_has_full_wave_only_when_waiting_could_not_grow_the_next_wave():
    sched = FifoScheduler(max_num_seqs=3)
    assert not sched.has_full_wave()  # nothing waiting
    for i in range(2):
        sched.add_request(make_request(f"a{i}"))
    assert not sched.has_full_wave()  # 2 of 3: an arrival could still join
    sched.add_request(make_request("a2"))
    assert sched.has_full_wave()  # capacity
    sched.finish_requests(["a1"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_full_wave()  # an aborted entry does not count
    sched.add_request(make_request("b0", size=128))
    assert sched.has_full_wave()  # another key behind the head run ends the wave anyway
    wave = sched.schedule()
    assert wave.req_ids == ["a0", "a2"] and wave.close_reason == "key"
    assert not sched.has_full_wave()  # b0 alone could still grow
