"""Row plans: each row of a module call gets its request's LoRA stack, as stated.

The pipeline adapter states a diffusers call's layout (requests, n, CFG copies); a
root module's call takes its rows from it and never guesses a layout from shapes.
"""

from __future__ import annotations

import pytest

from diffbatch.pipelines.diffusers_quirks import cfg_copies
from diffbatch.pipelines.interception.rows import CallRows, RowPlan

A, B = (("a", 1.0),), (("b", 0.5),)


def test_image_rows_follow_the_batched_cfg_layout() -> None:
    plan = RowPlan(("r0", "r1"), (A, B), num_outputs_per_prompt=2, cfg_copies=2)
    rows = plan.rows("images", 8, "unet")
    # negative half, then positive half; each request's n images together
    assert rows.stacks == (A, A, B, B, A, A, B, B)
    assert rows.requests == ("r0", "r0", "r1", "r1") * 2
    assert plan.rows("images", 8, "unet") is rows  # made once per call shape


def test_prompt_rows_are_one_per_request() -> None:
    plan = RowPlan(("r0", "r1", "r2"), (A, (), B), num_outputs_per_prompt=3, cfg_copies=2)
    rows = plan.rows("prompts", 3, "text_encoder")
    assert rows.stacks == (A, (), B) and rows.requests == ("r0", "r1", "r2")


def test_a_batch_the_plan_does_not_state_raises_when_stacks_differ() -> None:
    plan = RowPlan(("r0", "r1"), (A, B), num_outputs_per_prompt=1, cfg_copies=1)
    with pytest.raises(RuntimeError, match="row plan states 2"):
        plan.rows("images", 4, "unet")


def test_one_stack_for_every_request_fits_any_batch() -> None:
    plan = RowPlan(("r0", "r1"), (A, A), num_outputs_per_prompt=1, cfg_copies=1)
    rows = plan.rows("images", 6, "unet")
    assert rows.stacks == (A,) * 6
    assert rows.requests is None  # which of the two requests a row holds is not stated
    alone = RowPlan(("r0",), (A,), 1, 1).rows("images", 3, "unet")
    assert alone.requests == ("r0",) * 3


def test_fused_rows_concatenate_in_call_order() -> None:
    one, two = CallRows((A, A), ("r0", "r0")), CallRows((B,), ("r1",))
    fused = CallRows.concat([(one, 2), (two, 1)])
    assert fused is not None and fused.stacks == (A, A, B)
    assert fused.requests == ("r0", "r0", "r1")
    unknown = CallRows.concat([(one, 2), (None, 3), (two, 1)])
    assert unknown is not None and unknown.stacks == (A, A, (), (), (), B)
    assert unknown.requests is None
    assert CallRows.concat([(None, 2), (None, 1)]) is None
    with pytest.raises(RuntimeError):
        CallRows.concat([(one, 3), (two, 1)])


class _Param:
    def __init__(self, default: object) -> None:
        self.default = default


def test_cfg_copies_follow_the_calls_guidance() -> None:
    sd_like = {"guidance_scale": _Param(7.5)}
    assert cfg_copies(sd_like, 5.0) == 2
    assert cfg_copies(sd_like, 1.0) == 1
    assert cfg_copies(sd_like, None) == 2  # the call's own default
    flux_like = {"guidance_scale": _Param(3.5), "true_cfg_scale": _Param(1.0)}
    assert cfg_copies(flux_like, 3.5) == 1  # embedded guidance; true CFG runs apart
