"""Smoke test of the reliability campaign, `reliability.py`: every scenario runs on a
minimal setting and reports its checks and figures (see `tests.bench.smoke`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import run_script

pytestmark = pytest.mark.slow


def test_reliability_smoke(tmp_path: Path) -> None:
    report = run_script("reliability.py", tmp_path / "reliability.json", "--quick",
                        "--burst", "30", "--disconnects", "6", "--kills", "1", "--soak-s", "3",
                        "--clients", "4", "--sigterm-requests", "4")
    scenarios = ["burst", "disconnects", "worker kills", "worker freeze", "soak", "adapters",
                 "SIGTERM"]
    assert [(row["mode"], row["scenario"]) for row in report["results"]] == \
        [(mode, scenario) for mode in ("request", "step") for scenario in scenarios]
    for mode in ("request", "step"):
        rows = {row["scenario"]: row for row in report["results"] if row["mode"] == mode}
        for row in rows.values():
            assert row["checks"] and row["figure"] and row["answers"]
        assert sum(rows["burst"]["answers"].values()) == 30
        assert len(rows["worker kills"]["recovery_s"]) == 1
        assert "detect_s" in rows["worker freeze"] and "exit_s" in rows["SIGTERM"]
        assert rows["soak"]["rss_mib"]
        assert all(rows["adapters"]["checks"].values()), rows["adapters"]
