"""Smoke tests of the benchmarks that start a Ray cluster, `ray_scaling.py` and
`peers.py` against Ray Serve: each runs end to end on a minimal setting (see
`tests.bench.smoke`). A parallel run gives them to the process that runs the other
Ray tests (see `tests/conftest.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.smoke import BENCHMARKS, REPO_ROOT, TIMEOUT_S, run_peers_with_batching_peer

pytestmark = pytest.mark.slow


def test_ray_scaling_smoke(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "ray.json"
    cmd = [sys.executable, str(BENCHMARKS / "ray_scaling.py"), "--steps", "1", "--size", "64",
           "--num-sequential", "2", "--warmup", "1", "--num-requests", "4",
           "--concurrency", "2", "--rounds", "1", "--executor", "inproc", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    report = json.loads(out.read_text())
    assert report["markdown"] and "date" in report


def test_peers_smoke_ray(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve")
    run_peers_with_batching_peer(tmp_path, "ray")
