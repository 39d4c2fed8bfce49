"""Smoke tests of the benchmarks of batch gain, latency, overhead, peers without Ray,
partial images and scheduling: each script runs end to end on a minimal setting (see
`tests.bench.smoke`); the profile is skipped without pyinstrument."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import (
    HAS_PYINSTRUMENT,
    MINIMAL,
    run_peers_with_batching_peer,
    run_script,
)

pytestmark = pytest.mark.slow


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


def test_peers_smoke_litserve(tmp_path: Path) -> None:
    pytest.importorskip("litserve")
    run_peers_with_batching_peer(tmp_path, "litserve")


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


def test_step_cache_smoke(tmp_path: Path) -> None:
    report = run_script("step_cache.py", tmp_path / "step_cache.json", "--model", "tiny-pixart",
                        "--parts", "quality", "device", "--num-prompts", "2", "--batch", "2",
                        "--thresholds", "0.3", "--threads", "1", "--device-size", "64",
                        "--device-layers", "2", "--device-wave", "2", "--device-steps", "3",
                        "--rounds", "1")
    assert {row["step_cache"] for row in report["quality"].values()} == {"off", "first_block:0.3"}
    assert all(0 < row["tail_share"] <= 1 for row in report["quality"].values())
    assert report["device"]["off_over_all"] > 0
