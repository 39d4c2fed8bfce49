"""Shared test set-up: offline hub, a private model cache, light torch threading."""

from __future__ import annotations

import os
import tempfile

# Set before anything imports huggingface_hub / diffusers, and inherited by workers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread in every worker and server the tests start (a user's setting, so
# the worker keeps it): `make test` runs two test processes side by side, and a worker
# that took both cores with spinning OpenMP threads would slow the other one's work
# several times over. The thread choice itself is tested on synthetic machines
# (tests/worker/test_threads.py); the benchmark scripts drop this setting for the
# servers they start, as a user's shell would not have it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(
    "DIFFBATCH_CACHE_DIR", tempfile.mkdtemp(prefix="diffbatch-test-cache-")
)

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir() -> str:
    """The model cache folder of this test session (shared with worker processes)."""
    return os.environ["DIFFBATCH_CACHE_DIR"]
