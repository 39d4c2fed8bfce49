"""Shared test set-up: offline hub, a private model cache, light torch threading, and
the order files run in."""

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

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest-xdist is a [dev] dependency; without it the suite runs serially
    LoadFileScheduling = None

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir() -> str:
    """The model cache folder of this test session (shared with worker processes)."""
    return os.environ["DIFFBATCH_CACHE_DIR"]


# The tests that start a Ray cluster: a parallel run gives them all to one process.
RAY_TEST_FILES = ("tests/entrypoints/ray/", "tests/bench/test_ray_benchmarks_smoke.py")
# The longest test files (or groups), longest first, from `--durations` of a serial run:
# `make test` hands them to its processes first. A hint only: a stale list costs time,
# never a failure.
LONGEST_FIRST = (
    *RAY_TEST_FILES, "tests/test_e2e_step_execution.py", "tests/bench/test_benchmarks_smoke.py",
    "tests/bench/test_auto_benchmarks_smoke.py", "tests/executor/test_multiproc.py",
    "tests/test_e2e_step_faults.py", "tests/test_e2e_engine.py",
    "tests/bench/test_reliability_smoke.py", "tests/entrypoints/openai/test_lora_loading.py",
    "tests/test_e2e_auto_batching.py", "tests/entrypoints/openai/test_worker_faults.py",
    "tests/scripts/test_train_dit_model.py", "tests/test_e2e_lora.py",
    "tests/pipelines/test_diffusers_t2i.py", "tests/entrypoints/test_cli_serve.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order files run in: `LONGEST_FIRST`, then the other files with end-to-end
    (`slow`) tests, then the rest, each file's tests kept together and in order.
    `make test` hands whole files to its processes in this order: the long ones start
    first, and the quick ones fill the gaps at the end."""
    has_slow = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, bool]:
        nodeid = item.nodeid
        for i, prefix in enumerate(LONGEST_FIRST):
            if nodeid.startswith(prefix):
                return i, False
        return len(LONGEST_FIRST), item.path not in has_slow

    items.sort(key=rank)


if LoadFileScheduling is not None:

    class FilesWithRayTogether(LoadFileScheduling):
        """`--dist loadfile`, except that every test that starts a Ray cluster
        (`RAY_TEST_FILES`) goes to one process: two local Ray clusters starting at once
        on a small machine can miss Ray's fixed wait for its raylet."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(RAY_TEST_FILES):
                return "ray"
            return super()._split_scope(nodeid)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
        if config.getoption("dist") != "loadfile":
            return None  # another --dist mode: xdist's own scheduler
        return FilesWithRayTogether(config, log)

