"""Wave capacity under a size-free key (mixed resolution) counts pixels, not requests.

The key holds the model's default size as its reference; a request takes its pixels
over that size of the wave's capacity, under both policies, and never more than
`max_num_seqs` requests share a wave.
"""

from __future__ import annotations

import pytest

from diffbatch import DiffusionRequest, SamplingParams, SamplingParamsKey
from diffbatch.sched.grouped import GroupedScheduler
from diffbatch.sched.scheduler import FifoScheduler

POLICIES = {"fifo": FifoScheduler, "grouped": GroupedScheduler}


def request(request_id: str, size: int, reference: int | None = 64) -> DiffusionRequest:
    params = SamplingParams(height=size, width=size, num_inference_steps=2,
                            guidance_scale=5.0, seed=0)
    made = DiffusionRequest(request_id, "a cat", params)
    made.key = SamplingParamsKey.from_params(
        params, cfg_enabled=True,
        reference_size=None if reference is None else (reference, reference))
    return made


def test_a_size_free_key_is_the_same_for_every_size_and_says_so():
    small, large = request("a", 64), request("b", 128)
    assert small.key == large.key and small.key.any_size
    assert (small.key.height, small.key.width) == (64, 64)  # the reference size
    assert small.key.short().startswith("*x*/")
    assert request("c", 64, reference=None).key != request("d", 128, reference=None).key


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_mixed_size_wave_fills_up_to_its_capacity_in_pixels(policy: str):
    sched = POLICIES[policy](max_num_seqs=8)
    for i, size in enumerate([128, 128, 64]):  # 4 + 4 + 1 units of 64x64
        sched.add_request(request(f"r{i}", size))
    assert sched.has_full_wave()
    first = sched.schedule()
    assert first.req_ids == ["r0", "r1"] and first.close_reason == "capacity"
    assert sched.schedule().req_ids == ["r2"]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_small_requests_still_take_at_most_max_num_seqs(policy: str):
    sched = POLICIES[policy](max_num_seqs=4)
    for i in range(6):  # 0.25 units each against a 128x128 reference
        sched.add_request(request(f"r{i}", 64, reference=128))
    assert len(sched.schedule().req_ids) == 4


@pytest.mark.parametrize("policy", list(POLICIES))
def test_sized_keys_count_requests_as_before(policy: str):
    sched = POLICIES[policy](max_num_seqs=2)
    for i in range(3):
        sched.add_request(request(f"r{i}", 128, reference=None))
    assert sched.has_full_wave()
    assert sched.schedule().req_ids == ["r0", "r1"]


def test_the_learned_curve_sees_a_mixed_wave_in_capacity_units():
    from diffbatch.sched.base import wave_units

    sched = FifoScheduler(max_num_seqs=8)
    for i, size in enumerate([128, 64, 96]):  # 4 + 1 + 2.25 units
        sched.add_request(request(f"r{i}", size))
    assert wave_units(sched.schedule()) == 7
    keyed = FifoScheduler(max_num_seqs=8)
    for i in range(3):
        keyed.add_request(request(f"k{i}", 128, reference=None))
    assert wave_units(keyed.schedule()) == 3


@pytest.mark.parametrize("policy", list(POLICIES))
def test_step_mode_joiners_count_units_under_a_size_free_key(policy: str):
    """Joiners of a mixed-size running batch stop at `limit` units: a 128x128 request
    on a 64x64 model takes 4 of them, so it leaves room for fewer 64x64 joiners than
    the limit counted in requests would."""
    sched = POLICIES[policy](max_num_seqs=8)
    for i, size in enumerate([128, 64, 64, 64]):  # 4 + 1 + 1 + 1 units
        sched.add_request(request(f"r{i}", size))
    key = sched.next_key()
    assert sched.schedule_joiners(key, 6).req_ids == ["r0", "r1", "r2"]  # 6 units
    assert sched.schedule_joiners(key, 0.5).req_ids == ["r3"]  # an empty batch takes one
    sized = POLICIES[policy](max_num_seqs=8)
    for i in range(4):
        sized.add_request(request(f"k{i}", 128, reference=None))
    assert len(sized.schedule_joiners(sized.next_key(), 3).req_ids) == 3  # requests
