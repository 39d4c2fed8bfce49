"""A served pipeline's execution device is found once, not by a module walk per call."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import diffusers.hooks.group_offloading as group_offloading
import pytest
import torch
from diffusers import DiffusionPipeline

from diffbatch.pipelines.interception.execution_device import (
    pin_execution_device,
    pinned_device,
)
from tests.pipelines.conftest import make_batch, make_request


@pytest.fixture
def counted_walks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How often diffusers walks a component's modules to find the execution device."""
    walks: list[int] = []
    original = group_offloading._get_group_onload_device

    def counting(module: torch.nn.Module) -> torch.device:
        walks.append(1)
        return original(module)

    monkeypatch.setattr(group_offloading, "_get_group_onload_device", counting)
    yield walks


# (Flux's prompt encoding also asks each text encoder for its device, a walk of that
# encoder alone: diffusers' `get_module_execution_device`, not the pipeline's)
@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd3", "tiny-pixart"])
def test_a_wave_runs_without_walking_the_modules(load_tiny, counted_walks, name) -> None:
    pipeline = load_tiny(name)
    counted_walks.clear()  # loading it computed the device once
    with pinned_device():  # as within a pipeline call
        assert pipeline.pipe._execution_device == torch.device("cpu")
        # also each edit pipeline built from it, and step mode's per-request copies
        for pipe in [*pipeline.task_pipes.values(), copy.copy(pipeline.pipe)]:
            assert pipe._execution_device == torch.device("cpu")
    assert counted_walks == []
    request = make_request(pipeline, "r", "a red cat", seed=1)
    [output] = pipeline.forward(make_batch([request]))
    assert output.error is None and output.images is not None
    assert counted_walks == []


def test_an_unpinned_pipeline_computes_as_diffusers_does(load_tiny, counted_walks) -> None:
    """Pinning one pipeline leaves every other pipeline of the process as it was, and
    outside pipeline calls the class is diffusers' own."""
    original = DiffusionPipeline.__dict__["_execution_device"]
    pinned = load_tiny("tiny-sd").pipe
    other = copy.copy(pinned)
    other.__dict__.pop("_diffbatch_execution_device")
    with pinned_device():
        counted_walks.clear()
        assert other._execution_device == torch.device("cpu")
        assert counted_walks, "an unpinned pipeline looks for offloading hooks, as in diffusers"
        counted_walks.clear()
        with pinned_device():  # calls nest and interleave (step mode)
            assert pinned._execution_device == torch.device("cpu")
        assert pinned._execution_device == torch.device("cpu")
        assert counted_walks == []
    assert DiffusionPipeline.__dict__["_execution_device"] is original
    counted_walks.clear()
    assert pinned._execution_device == torch.device("cpu")
    assert counted_walks, "outside a call, every pipeline computes as in diffusers"


def test_objects_that_are_not_diffusers_pipelines_are_left_alone() -> None:
    class Custom:
        pass

    custom = Custom()
    pin_execution_device(custom)
    assert vars(custom) == {}
