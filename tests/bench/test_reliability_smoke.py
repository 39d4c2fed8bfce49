"""Smoke test of the reliability campaign, `reliability.py`: every scenario runs on a
minimal setting and reports its checks and figures (see `tests.bench.smoke`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import run_script

pytestmark = pytest.mark.slow


def test_reliability_smoke(tmp_path: Path) -> None:
    """One mode, step mode (the campaign's request mode differs only in the server's
    flag and the re-run counter it reads): every scenario, each with its figures."""
    report = run_script("reliability.py", tmp_path / "reliability.json", "--quick",
                        "--modes", "step", "--burst", "8", "--disconnects", "2", "--kills",
                        "1", "--soak-s", "1", "--clients", "2", "--sigterm-requests", "2",
                        "--stall-timeout", "2")
    scenarios = ["burst", "disconnects", "worker kills", "worker freeze", "soak", "adapters",
                 "SIGTERM"]
    assert [(row["mode"], row["scenario"]) for row in report["results"]] == \
        [("step", scenario) for scenario in scenarios]
    rows = {row["scenario"]: row for row in report["results"]}
    for row in rows.values():
        assert row["checks"] and row["figure"] and row["answers"]
    assert sum(rows["burst"]["answers"].values()) == 8
    assert len(rows["worker kills"]["recovery_s"]) == 1
    assert "detect_s" in rows["worker freeze"] and "exit_s" in rows["SIGTERM"]
    assert rows["soak"]["rss_mib"]
    assert all(rows["adapters"]["checks"].values()), rows["adapters"]
