"""Shared test set-up: offline hub, a private model cache, light torch threading."""

from __future__ import annotations

import os
import tempfile

# Set before anything imports huggingface_hub / diffusers, and inherited by workers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
