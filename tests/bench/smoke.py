"""What the benchmark smoke tests share: running a script of `benchmarks/` on a minimal
setting and reading back its JSON report.

The smoke tests start real servers (diffbatch, and the peers when the `[bench]` extra
is installed), so they are `slow`; they check that each script finishes and writes
its report with the figures it promises, never how fast anything was. Each runs one
short round against one diffbatch server: the harness's smoke mode (`SMOKE_ENV`)
stands that one server in for every diffbatch server the script asks for, so a
script that compares five settings starts one server, not five, and keeps the
test run's one torch thread per process. The plots are drawn when matplotlib is
installed and skipped (`--no-plot`) otherwise. They are spread over a few files so
that a parallel run (`pytest -n`) can share them out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
TIMEOUT_S = 240  # bounds a broken script only
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_PYINSTRUMENT = importlib.util.find_spec("pyinstrument") is not None
MINIMAL = ["--steps", "1"]


def smoke_env() -> dict[str, str]:
    """The environment of a benchmark script in a smoke test."""
    return dict(os.environ, HF_HUB_OFFLINE="1", DIFFBATCH_BENCH_SMOKE="1")


def run_script(name: str, out: Path, *args: str) -> dict:
    """Run benchmarks/<name> with `args`; return its JSON report."""
    cmd = [sys.executable, str(BENCHMARKS / name), *args, "--out", str(out)]
    if not HAS_MATPLOTLIB:
        cmd.append("--no-plot")
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=smoke_env(), capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    assert out.is_file()
    if HAS_MATPLOTLIB:
        assert out.with_suffix(".png").is_file()
    report = json.loads(out.read_text())
    for key in ("benchmark", "date", "machine", "command", "args"):
        assert key in report
    return report


def run_peers_with_batching_peer(tmp_path: Path, peer: str) -> None:
    """peers.py against one batching peer ("ray" or "litserve") alone."""
    report = run_script("peers.py", tmp_path / "peers.json", *MINIMAL,
                        "--servers", peer, "--num-requests", "2", "--burst", "3",
                        "--capacity", "5", "--warmup-requests", "1", "--repeats", "1")
    assert {r["server"] for r in report["results"]} == {peer}
    assert all(r["failed"] == 0 for r in report["results"])
