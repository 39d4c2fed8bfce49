"""Smoke tests of the zero-config benchmarks, `defaults.py` (served with no tuning flags
against the plain diffusers loop) and `policy_bars.py` (`auto` against fixed settings):
each runs end to end on a minimal setting (see `tests.bench.smoke`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.smoke import BENCHMARKS, MINIMAL, TIMEOUT_S, run_script, smoke_env

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
    plain_b = row["plain"][str(row["batch_B"])]["images_per_s"]
    assert base["baseline_over_plain_at_B"] == pytest.approx(base["images_per_s"] / plain_b)


def test_policy_bars_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bars.json"
    cmd = [sys.executable, str(BENCHMARKS / "policy_bars.py"), *MINIMAL, "--rounds", "1",
           "--lone-requests", "2", "--burst", "3", "--capacity-requests", "4",
           "--poisson-s", "0.5", "--min-poisson-requests", "2", "--warmup-requests", "1",
           "--bars", "lone", "poisson", "--out", str(out)]
    result = subprocess.run(cmd, cwd=BENCHMARKS.parent, capture_output=True, text=True,
                            env=smoke_env(), timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    report = json.loads(out.read_text())
    assert set(report["lone"]["p50_ms_rounds"]) == {"auto", "1:0", "1:0-twin"}
    assert set(report["burst"]["makespan_ms_rounds"]) == {"auto", "16:0", "16:0-twin"}
    for bar in ("lone", "burst"):
        assert isinstance(report[bar]["met"], bool)
    poisson = report["poisson"]
    assert poisson["rate_per_s"] > 0 and poisson["best_fixed_first_round"] in ("1:0", "8:0",
                                                                               "16:10")
    assert f"{poisson['best_fixed_first_round']}-twin" in poisson["p50_ms_rounds"]
    assert isinstance(poisson["met"], bool)


def test_policy_bars_co_tenant_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bars.json"
    cmd = [sys.executable, str(BENCHMARKS / "policy_bars.py"), *MINIMAL, "--rounds", "1",
           "--bars", "busy_start", "step_co_tenant", "--clients", "2", "--load-s", "1.5",
           "--tail-s", "1", "--tenant-after-s", "0.5", "--step-requests", "2",
           "--step-rate", "20", "--out", str(out)]
    result = subprocess.run(cmd, cwd=BENCHMARKS.parent, capture_output=True, text=True,
                            env=smoke_env(), timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    busy = json.loads(out.read_text())["busy_start"]
    assert set(busy["runs"]) == {"busy", "quiet", "quiet-twin"}
    [run] = busy["runs"]["busy"]
    assert run["images_per_s"] > 0 and run["tenant_stopped_s_after_ready"] >= 0.5
    assert run["capacity_log"] and isinstance(busy["met"], bool)
    step = json.loads(out.read_text())["step_co_tenant"]
    assert set(step["requests_per_s_rounds"]) == {"co-tenant", "quiet", "quiet-twin"}
    assert all(r[0]["completed"] == 2 for r in step["runs"].values())
    assert step["co_tenant_over_quiet"] > 0 and isinstance(step["met"], bool)


def test_openmp_wait_smoke(tmp_path: Path) -> None:
    report = run_script("openmp_wait.py", tmp_path / "wait.json", *MINIMAL, "--rounds", "1",
                        "--candidates", "default", "1thread", "--batches", "1",
                        "--num-images", "1")
    assert set(report["median_images_per_s"]) == {"default", "1thread"}
    assert all(v["1"] > 0 for v in report["median_images_per_s"].values())
