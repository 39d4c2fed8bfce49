"""Smoke test of `rising_load.py` (loads that rise with no pause between rates): it runs
end to end on a minimal setting and reports every phase of every server (see
`tests.bench.smoke`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import MINIMAL, run_script

pytestmark = pytest.mark.slow


def test_rising_load_smoke(tmp_path: Path) -> None:
    report = run_script("rising_load.py", tmp_path / "rising.json", *MINIMAL,
                        "--size", "64", "--capacity", "10", "--phase-seconds", "0.3",
                        "--rounds", "2", "--fixed", "2:0", "--warmup-requests", "2")
    assert list(report["runs"]) == list(report["summary"]) == ["auto", "seqs2_wait0"]
    for name, rounds in report["runs"].items():
        assert len(rounds) == 2
        assert [p["factor"] for p in rounds[0]] == [0.5, 0.9, 1.2]
        assert all(p["failed"] == 0 and p["throughput_rps"] > 0 for r in rounds for p in r)
        phases = report["summary"][name]
        assert list(phases) == ["0.5x", "0.9x", "1.2x"]
        # each round's p50 against the first server's in the same round
        assert phases["0.9x"]["p50_vs_first_rounds"] == [
            a / b for a, b in zip(phases["0.9x"]["p50_ms_rounds"],
                                  report["summary"]["auto"]["0.9x"]["p50_ms_rounds"],
                                  strict=True)]
    assert report["summary"]["auto"]["1.2x"]["p50_vs_first_rounds"] == [1.0, 1.0]
