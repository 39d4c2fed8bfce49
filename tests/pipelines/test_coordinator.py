"""The interception layer's coordinator: diffusers-style calls meet at one module call.

Each task runs ordinary code calling a module whose `forward` is routed through a
diffusers hook; inside a task the call is handed to the coordinator, which runs the
waiting calls as one, hands each task its own rows, and keeps a failing call's
exception to its own task.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry

from diffbatch.errors import WaveInterrupted
from diffbatch.pipelines.interception import Coordinator, FusionPoint, install


class Doubler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(int(x.shape[0]))
        if torch.isnan(x).any():
            raise ValueError("NaN input")
        return x * 2


@pytest.fixture
def module() -> Doubler:
    module = Doubler()
    install([FusionPoint(module, "forward", "step", "doubler")])
    install([FusionPoint(module, "forward", "step", "doubler")])  # twice is harmless
    return module


def test_the_forward_is_routed_by_a_diffusers_hook(module: Doubler) -> None:
    registry = HookRegistry.check_if_exists_or_initialize(module)
    assert registry.get_hook("diffbatch.fusion") is not None
    assert module(torch.ones(3, 1)).tolist() == [[2.0]] * 3  # outside a task: runs as is
    assert module.batches == [3]


def test_tasks_waiting_at_one_module_share_one_call(module: Doubler) -> None:
    inputs = [torch.full((n, 1), float(n)) for n in (1, 2, 3)]
    results = Coordinator().run_together(
        [lambda x=x: module(module(x)) + 1 for x in inputs])
    assert module.batches == [6, 6]  # each of the two module calls once, fused
    for x, result in zip(inputs, results, strict=True):
        assert torch.equal(result, x * 4 + 1)


def test_a_failing_call_fails_its_own_task_only(module: Doubler) -> None:
    def guarded(x: torch.Tensor) -> object:
        try:
            return module(x)
        except ValueError as exc:
            return exc

    coordinator = Coordinator()
    good = coordinator.start(lambda: guarded(torch.ones(2, 1)))
    bad = coordinator.start(lambda: guarded(torch.full((1, 1), float("nan"))))
    assert good.pending is not None and bad.pending is not None
    coordinator.resolve([good, bad])
    assert good.done and torch.equal(good.result, torch.full((2, 1), 2.0))
    assert bad.done and isinstance(bad.result, ValueError)
    assert module.batches == [3, 2, 1]  # fused, then bisected: each alone


def test_run_together_raises_the_first_error_after_unwinding_the_rest(module: Doubler) -> None:
    unwound: list[str] = []

    def waits_twice() -> torch.Tensor:
        try:
            return module(module(torch.ones(1, 1)))
        except WaveInterrupted:
            unwound.append("unwound")
            raise

    def fails() -> torch.Tensor:
        return module(torch.full((1, 1), float("nan")))

    with pytest.raises(ValueError, match="NaN"):
        Coordinator().run_together([waits_twice, fails])
    assert unwound == ["unwound"]
