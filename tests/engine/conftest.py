"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.fake_pipelines import GatedPipeline


@pytest.fixture
def gate():
    """`GatedPipeline`, closed: its forwards block until the test sets `release`."""
    GatedPipeline.entered.clear()
    GatedPipeline.release.clear()
    yield GatedPipeline
    GatedPipeline.release.set()
