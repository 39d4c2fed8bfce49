"""Smoke tests: every benchmark script runs end to end on a minimal setting.

They start real servers (diffbatch, and the peers when the `[bench]` extra is
installed), so they are `slow`; they check that each script finishes and writes
its report with the figures it promises, never how fast anything was. The plots
are drawn when matplotlib is installed and skipped (`--no-plot`) otherwise, and
the profile is skipped without pyinstrument.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
TIMEOUT_S = 240
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_PYINSTRUMENT = importlib.util.find_spec("pyinstrument") is not None
MINIMAL = ["--steps", "1"]


def run_script(name: str, out: Path, *args: str) -> dict:
    """Run benchmarks/<name> with `args`; return its JSON report."""
    cmd = [sys.executable, str(BENCHMARKS / name), *args, "--out", str(out)]
    if not HAS_MATPLOTLIB:
        cmd.append("--no-plot")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
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


def test_bench_serve_cli_parses() -> None:
    """`diffbatch bench serve` flags parse (the subcommand is wired in the CLI)."""
    import argparse

    from diffbatch.bench.serve import add_bench_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "3",
        "--request-rate", "inf", "--burstiness", "0.5", "--max-concurrency", "2",
        "--size", "64x32", "--steps", "1", "--seed", "3", "--warmup-requests", "0",
        "--output-json", "x.json", "--api-key", "k",
    ])
    config = config_from_args(args)
    assert (config.width, config.height, config.num_prompts) == (64, 32, 3)
    assert config.request_rate == float("inf") and config.api_key == "k"


def test_batch_gain_smoke(tmp_path: Path) -> None:
    report = run_script("batch_gain.py", tmp_path / "batch_gain.json", *MINIMAL,
                        "--models", "tiny-sd", "--sizes", "64", "--batch-sizes", "1", "2",
                        "--num-images", "2", "--min-waves", "1", "--repeats", "1",
                        "--max-waves-in-flight", "1")
    rows = report["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["P1"] > 0 and row["P2"] > 0


def test_low_load_latency_smoke(tmp_path: Path) -> None:
    report = run_script("low_load_latency.py", tmp_path / "low_load.json", *MINIMAL,
                        "--num-requests", "2", "--repeats", "1")
    assert "P4_ms" in report and "P4_server_queue_ms" in report


@pytest.mark.skipif(not HAS_PYINSTRUMENT, reason="pyinstrument ([bench] extra) not installed")
def test_overhead_smoke(tmp_path: Path) -> None:
    report = run_script("overhead.py", tmp_path / "overhead.json", *MINIMAL,
                        "--num-requests", "2", "--repeats", "1", "--profile-requests", "2")
    assert report["P5_inproc_ms"] is not None and report["P5_http_ms"] is not None
    assert all(Path(p).is_file() for p in report["profile"])


def test_peers_smoke_fastapi(tmp_path: Path) -> None:
    report = run_script("peers.py", tmp_path / "peers.json", *MINIMAL,
                        "--servers", "diffbatch", "fastapi", "--num-requests", "2",
                        "--burst", "3", "--calibration-requests", "2",
                        "--warmup-requests", "1", "--repeats", "1")
    assert {r["server"] for r in report["results"]} == {"diffbatch", "fastapi"}
    assert all(r["failed"] == 0 for r in report["results"])
    assert len(report["verdicts"]) == 3  # one per load


@pytest.mark.parametrize("peer", ["ray", "litserve"])
def test_peers_smoke_batching_peer(tmp_path: Path, peer: str) -> None:
    pytest.importorskip({"ray": "ray.serve", "litserve": "litserve"}[peer])
    report = run_script("peers.py", tmp_path / "peers.json", *MINIMAL,
                        "--servers", peer, "--num-requests", "2", "--burst", "3",
                        "--capacity", "5", "--warmup-requests", "1", "--repeats", "1")
    assert {r["server"] for r in report["results"]} == {peer}
    assert all(r["failed"] == 0 for r in report["results"])


def test_offline_batch_gain_smoke(tmp_path: Path) -> None:
    report = run_script(
        "offline_batch_gain.py", tmp_path / "offline.json", *MINIMAL, "--models", "tiny-sd",
        "--sizes", "64", "--batch-sizes", "1", "2", "--num-images", "2", "--repeats", "1",
        "--executor", "inproc", "--threads", "1",
    )
    rows = report["results"]
    assert [(r["model"], r["size"], r["batch"]) for r in rows] == [
        ("tiny-sd", 64, 1), ("tiny-sd", 64, 2)]
    for row in rows:
        assert row["raw_images_per_s"] > 0 and row["engine_images_per_s"] > 0
        assert row["engine_over_raw"] > 0 and "raw_gain" in row


def test_partial_images_smoke(tmp_path: Path) -> None:
    report = run_script(
        "partial_images.py", tmp_path / "partial.json", "--models", "tiny-sd",
        "--batch-size", "2", "--rounds", "1", "--decode-repeats", "1", "--sd15-sides",
    )
    [wave] = report["waves"]
    assert wave["previews"] == {"none": 0, "one": 3, "all": 6}  # 3 per request, 4 steps
    assert set(wave["ms_per_preview"]) == {"one", "all"}
    assert [d["vae"] for d in report["decodes"]] == ["tiny-sd"]


def test_scheduling_policies_smoke(tmp_path: Path) -> None:
    report = run_script(
        "scheduling_policies.py", tmp_path / "sched.json", *MINIMAL, "--num-requests", "4",
        "--burst", "4", "--rounds", "1", "--guidance-requests", "4",
        "--calibration-repeats", "1", "--executor", "inproc",
    )
    for policy in ("fifo", "grouped"):
        assert report["mixed"][policy]["num_requests"] == 8
    assert report["mixed"]["throughput_ratio"] > 0
    assert report["guidance"]["fifo_on"]["mean_wave_size"] >= 1


def test_ray_scaling_smoke(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "ray.json"
    cmd = [sys.executable, str(BENCHMARKS / "ray_scaling.py"), "--steps", "1", "--size", "64",
           "--num-sequential", "2", "--warmup", "1", "--num-requests", "4",
           "--concurrency", "2", "--rounds", "1", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    report = json.loads(out.read_text())
    assert report["markdown"] and "date" in report


def test_defaults_smoke(tmp_path: Path) -> None:
    report = run_script("defaults.py", tmp_path / "defaults.json", *MINIMAL,
                        "--models", "tiny-sd", "--num-images", "4", "--concurrency", "4",
                        "--extra-batches", "2", "--repeats", "1")
    [row] = report["results"]
    assert row["model"] == "tiny-sd" and row["batch_B"] >= 1
    assert row["served"]["images_per_s"] > 0 and row["served"]["mean_wave_size"] >= 1
    assert {"1", "2", str(row["batch_B"])} == set(row["plain"]) == set(row["served_over_plain"])
    assert all(p["images_per_s"] > 0 for p in row["plain"].values())
    assert set(row["bars"]) == {"served_over_plain_at_B", "served_over_plain_at_1"}
    assert row["pass"] == all(bar["pass"] for bar in row["bars"].values())
    assert report["verdicts"] == {"tiny-sd": "PASS" if row["pass"] else "FAIL"}


def test_auto_batching_smoke(tmp_path: Path) -> None:
    report = run_script("auto_batching.py", tmp_path / "auto.json", *MINIMAL, "--quick",
                        "--grid-seqs", "2", "--grid-waits", "0", "10", "--loads", "0.5",
                        "--burst", "3", "--num-requests", "3", "--capacity-requests", "3",
                        "--warmup-requests", "2")
    assert set(report["settings"]) == {"auto", "seqs2_wait0", "seqs2_wait10"}
    assert report["settings"]["auto"]["max_num_seqs"] is None
    [result] = report["results"]
    assert (result["model"], result["size"]) == ("tiny-sd", 64)
    assert result["capacity_rps"] > 0 and result["capacity_setting"] != "auto"
    loads = ["saturated", "poisson_0.5x", "burst_3"]
    assert list(result["loads"]) == list(result["verdicts"]) == loads
    assert {(r["load"], r["setting"]) for r in result["results"]} == {
        (load, name) for load in loads for name in report["settings"]}
    assert all(r["failed"] == 0 and r["throughput_rps"] > 0 for r in result["results"])
    for verdict in result["verdicts"].values():
        assert verdict["best_fixed_throughput_setting"] in report["settings"]
        assert verdict["throughput_ratio"] > 0 and verdict["p50_bar_ms"] > 0
        assert verdict["pass"] == (verdict["throughput_pass"] and verdict["p50_pass"]
                                   and verdict["dominance_pass"])
    assert report["pass"] == result["pass"]
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


def test_reliability_smoke(tmp_path: Path) -> None:
    report = run_script("reliability.py", tmp_path / "reliability.json", "--quick",
                        "--burst", "30", "--disconnects", "6", "--kills", "1", "--soak-s", "3",
                        "--clients", "4", "--sigterm-requests", "4")
    rows = {row["scenario"]: row for row in report["results"]}
    assert list(rows) == ["burst", "disconnects", "worker kills", "worker freeze", "soak",
                          "SIGTERM"]
    for row in rows.values():
        assert row["checks"] and row["figure"] and row["answers"]
    assert sum(rows["burst"]["answers"].values()) == 30
    assert len(rows["worker kills"]["recovery_s"]) == 1
    assert "detect_s" in rows["worker freeze"] and "exit_s" in rows["SIGTERM"]
    assert rows["soak"]["rss_mib"]
