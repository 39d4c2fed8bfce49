"""Fusing module calls across requests: arguments in, results out.

`fuse_arguments` turns the calls the running requests wait on into one call, and
`split_result` hands each its own part back; a call's part must be exactly what its
own call would have received and returned.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

from diffbatch.pipelines.interception import (
    FusionPoint,
    ModuleCall,
    Unfusable,
    fuse_arguments,
    split_result,
)

POINT = FusionPoint(None, "forward", "step", "denoiser", shared=frozenset({"ids"}))


def call(batch: int, timestep: float, **kwargs: object) -> ModuleCall:
    sample = torch.full((batch, 2, 3), float(timestep))
    return ModuleCall(POINT, lambda *a, **k: None, (sample, torch.tensor(timestep)),
                      dict(kwargs))


def test_each_calls_scalar_is_repeated_once_per_sample_of_that_call() -> None:
    calls = [call(2, 10.0), call(1, 20.0), call(3, 30.0)]
    (sample, timesteps), _ = fuse_arguments(calls)
    assert sample.shape == (6, 2, 3)
    assert timesteps.tolist() == [10.0, 10.0, 20.0, 30.0, 30.0, 30.0]
    # row r of the fused sample belongs to the call whose timestep sits at r
    assert sample[:, 0, 0].tolist() == timesteps.tolist()


def test_equal_options_pass_through_and_shared_tensors_are_taken_once() -> None:
    ids = torch.arange(4)
    calls = [call(1, 1.0, return_dict=False, ids=ids, mask=None),
             call(1, 2.0, return_dict=False, ids=ids.clone(), mask=None)]
    _, kwargs = fuse_arguments(calls)
    assert kwargs["return_dict"] is False and kwargs["mask"] is None
    assert kwargs["ids"] is ids


@pytest.mark.parametrize("other", [{"return_dict": True}, {"ids": torch.arange(5)},
                                   {"mask": torch.ones(1, 2)}])
def test_calls_that_differ_in_what_has_no_batch_dimension_do_not_fuse(
        other: dict[str, object]) -> None:
    base = {"return_dict": False, "ids": torch.arange(4), "mask": None}
    with pytest.raises(Unfusable):
        fuse_arguments([call(1, 1.0, **base), call(1, 2.0, **{**base, **other})])


def test_results_split_back_per_call_in_every_container() -> None:
    fused = torch.arange(6.0).reshape(6, 1)
    sizes = [2, 1, 3]
    parts = split_result((fused,), sizes)
    assert [p[0].flatten().tolist() for p in parts] == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0]]
    outputs = split_result(UNet2DConditionOutput(sample=fused), sizes)
    assert all(isinstance(o, UNet2DConditionOutput) for o in outputs)
    assert outputs[2].sample.flatten().tolist() == [3.0, 4.0, 5.0]
    scalar = torch.tensor(7.0)  # no batch dimension: every call gets it whole
    assert all(p is scalar for p in split_result(scalar, sizes))


def test_calls_of_different_shapes_run_as_one_through_the_points_pack() -> None:
    from diffbatch.pipelines.interception import run_fused

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    packed: list[int] = []

    def pack(calls: list[ModuleCall]) -> list[torch.Tensor]:
        packed.append(len(calls))
        return [c.args[0] * 2 for c in calls]

    point = FusionPoint(None, "forward", "step", "denoiser", pack=pack)
    calls = [ModuleCall(point, double, (torch.ones(1, n),), {}) for n in (2, 3, 2)]
    outcomes = run_fused(calls)
    assert packed == [3]  # the three shapes in one packed call
    assert [value.tolist() for _ok, value in outcomes] == [[[2.0] * n] for n in (2, 3, 2)]


def test_a_pack_that_fails_falls_back_to_smaller_groups_with_the_same_results() -> None:
    from diffbatch.pipelines.interception import run_fused

    ran: list[int] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        ran.append(x.shape[0])
        if x.shape[1] == 3:
            raise RuntimeError("this call fails on its own")
        return x * 2

    def pack(calls: list[ModuleCall]) -> list[torch.Tensor]:
        raise RuntimeError("one of the packed calls failed")

    point = FusionPoint(None, "forward", "step", "denoiser", pack=pack)
    calls = [ModuleCall(point, double, (torch.ones(1, n),), {}) for n in (2, 3, 2)]
    outcomes = run_fused(calls)
    assert [ok for ok, _value in outcomes] == [True, False, True]
    assert outcomes[0][1].tolist() == outcomes[2][1].tolist() == [[2.0, 2.0]]
