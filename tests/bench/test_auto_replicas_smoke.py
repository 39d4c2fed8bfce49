"""Smoke test of `auto_replicas.py` (several servers per setting on one load): it runs
end to end on a minimal setting (see `tests.bench.smoke`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import MINIMAL, run_script

pytestmark = pytest.mark.slow


def test_auto_replicas_smoke(tmp_path: Path) -> None:
    report = run_script("auto_replicas.py", tmp_path / "replicas.json", *MINIMAL,
                        "--settings", "auto", "2:0", "--replicas", "1", "--rounds", "2",
                        "--load", "20", "--num-requests", "3", "--warmup-requests", "2")
    assert set(report["runs"]) == {"auto#0", "seqs2_wait0#0"}
    assert all(len(runs) == 2 and all(r["failed"] == 0 and r["throughput_rps"] > 0
                                      for r in runs) for runs in report["runs"].values())
    summary = report["summary"]
    assert list(summary) == ["auto", "seqs2_wait0"]
    assert summary["auto"]["throughput_rps_paired_to_auto"] == 1.0
    assert summary["seqs2_wait0"]["p50_ms_paired_to_auto"] > 0
