"""Smoke tests of the zero-config benchmarks, `defaults.py` (served with no tuning flags
against the plain diffusers loop) and `auto_batching.py` (`auto` against a grid of fixed
settings): each runs end to end on a minimal setting (see `tests.bench.smoke`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.bench.smoke import BENCHMARKS, MINIMAL, run_script

pytestmark = pytest.mark.slow


def test_defaults_smoke(tmp_path: Path) -> None:
    # (the baseline: this checkout again, as another one would run)
    report = run_script("defaults.py", tmp_path / "defaults.json", *MINIMAL,
                        "--models", "tiny-sd", "--num-images", "4", "--concurrency", "4",
                        "--extra-batches", "2", "--repeats", "1",
                        "--baseline-tree", str(BENCHMARKS.parent))
    [row] = report["results"]
    assert row["model"] == "tiny-sd" and row["batch_B"] >= 1
    assert row["served"]["images_per_s"] > 0 and row["served"]["mean_wave_size"] >= 1
    assert {"1", "2", str(row["batch_B"])} == set(row["plain"]) == set(row["served_over_plain"])
    assert all(p["images_per_s"] > 0 for p in row["plain"].values())
    assert set(row["bars"]) == {"served_over_plain_at_B", "served_over_plain_at_1"}
    assert row["pass"] == all(bar["pass"] for bar in row["bars"].values())
    assert report["verdicts"] == {"tiny-sd": "PASS" if row["pass"] else "FAIL"}
    base = row["baseline"]
    assert base["images_per_s"] > 0 and len(base["served_over_baseline_rounds"]) == 1
    assert base["served_over_baseline"] == pytest.approx(
        row["served"]["images_per_s"] / base["images_per_s"])


def test_auto_batching_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    report = run_script("auto_batching.py", tmp_path / "auto.json", *MINIMAL, "--quick",
                        "--grid-seqs", "2", "--grid-waits", "0", "--loads", "0.5",
                        "--burst", "3", "--num-requests", "3", "--capacity-requests", "3",
                        "--warmup-requests", "2", "--control", "2:0")
    assert set(report["settings"]) == {"auto", "seqs2_wait0", "control_seqs2_wait0"}
    assert report["settings"]["control_seqs2_wait0"]["control"]
    assert report["settings"]["auto"]["max_num_seqs"] is None
    [result] = report["results"]
    assert (result["model"], result["size"]) == ("tiny-sd", 64)
    assert result["capacity_rps"] > 0 and result["capacity_setting"] != "auto"
    loads = ["saturated", "poisson_0.5x", "burst_3"]
    assert list(result["loads"]) == list(result["verdicts"]) == loads
    assert {(r["load"], r["setting"]) for r in result["results"]} == {
        (load, name) for load in loads for name in report["settings"]}
    assert all(r["failed"] == 0 and r["throughput_rps"] > 0 for r in result["results"])
    # the waves each run ran, from the server's wave log: every request in one of them
    burst = {r["setting"]: r for r in result["results"] if r["load"] == "burst_3"}
    for row in burst.values():
        [waves] = row["waves_rounds"]
        assert sum(size for size, _forward_ms, _admission in waves) == 3
    # each server's torch threads, as its /metrics said after each run (None before
    # the worker's first heartbeat); auto's calibration ran after that
    assert all(r["worker_torch_threads"] is None or r["worker_torch_threads"] >= 1
               for r in result["results"])
    assert all(r["worker_torch_threads"] >= 1 for r in result["results"]
               if r["setting"] == "auto")
    # auto's learned capacity per curve after each run (/metrics); none for fixed ones
    for r in result["results"]:
        for capacity in r["capacity_rounds"]:
            if r["setting"] == "auto":
                assert capacity["64x64/s1/n1/cfg"] >= 1, capacity
            else:
                assert capacity is None
    for verdict in result["verdicts"].values():
        assert verdict["best_fixed_throughput_setting"] in report["settings"]
        assert verdict["throughput_ratio"] > 0 and verdict["p50_bar_ms"] > 0
        assert verdict["pass"] == (verdict["throughput_pass"] and verdict["p50_pass"]
                                   and verdict["dominance_pass"])
    assert report["pass"] == result["pass"]
    # the twin is judged with auto's bars against the grid, and is none of its references
    control = result["control_verdicts"]["control_seqs2_wait0"]
    assert list(control) == loads
    assert all(v["best_fixed_throughput_setting"] == "seqs2_wait0" for v in control.values())
    assert {v["auto_throughput_rps"] for v in control.values()} == {
        r["throughput_rps"] for r in result["results"] if r["setting"] == "control_seqs2_wait0"}
    # Judged again from the file alone (in this process: no server is run): the same
    # verdicts, marked as rejudged.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import auto_batching
    finally:
        sys.path.remove(str(BENCHMARKS))
    auto_batching.main(["--rejudge", str(tmp_path / "auto.json"),
                        "--out", str(tmp_path / "again.json"), "--no-plot"])
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["rejudged"]["from"] == str(tmp_path / "auto.json")
    assert again["results"][0]["verdicts"] == result["verdicts"]
    assert again["results"][0]["control_verdicts"] == result["control_verdicts"]
    # Without --out the table is printed and no file is written (the default results
    # file, relative to the working directory, is left as it was).
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    auto_batching.main(["--rejudge", "auto.json", "--no-plot"])
    assert "poisson_0.5x" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*.json")) == ["again.json", "auto.json"]
