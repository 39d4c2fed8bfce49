"""The pure parts of `defaults.py` and `auto_batching.py`: the grid, the bars, the
server commands. Fast (no server is started); the end-to-end runs are in
test_benchmarks_smoke.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import auto_batching  # noqa: E402
from peers_servers import harness  # noqa: E402

TUNING_FLAGS = ("--max-num-seqs", "--request-batch-max-wait-ms", "--torch-threads")


def test_grid_runs_max_num_seqs_1_once() -> None:
    names = [s.name for s in auto_batching.grid([1, 4], [0.0, 10.0])]
    assert names == ["seqs1_wait0", "seqs4_wait0", "seqs4_wait10"]


def test_rotated_covers_every_server_in_a_new_order() -> None:
    names = ["a", "b", "c"]
    assert auto_batching.rotated(names, 1, reverse=False) == ["b", "c", "a"]
    assert auto_batching.rotated(names, 4, reverse=True) == ["a", "c", "b"]


def test_parse_configs_groups_sizes_by_model() -> None:
    assert auto_batching.parse_configs(["tiny-sd:64", "shapes:64", "tiny-sd:128"]) == {
        "tiny-sd": [64, 128], "shapes": [64]}
    with pytest.raises(SystemExit, match="MODEL:SIZE"):
        auto_batching.parse_configs(["tiny-sd"])



def test_a_poisson_run_spans_its_seconds_unless_its_request_count_is_longer() -> None:
    from argparse import Namespace
    args = Namespace(num_requests=32, poisson_seconds=5.0)
    assert auto_batching.poisson_count(2.0, args) == 32  # 32 arrivals take 16 s
    assert auto_batching.poisson_count(50.0, args) == 250
    assert auto_batching.poisson_count(50.1, args) == 251  # the span is reached
    assert auto_batching.poisson_count(50.0, Namespace(num_requests=32,
                                                       poisson_seconds=0.0)) == 32

SETTINGS = [auto_batching.AUTO, *auto_batching.grid([1, 4], [0.0])]


def rows(auto: tuple[float, float], s1: tuple[float, float], s4: tuple[float, float]) -> dict:
    """One round: (throughput, p50) per setting."""
    return {name: {"throughput_rps": thr, "p50_ms": p50, "mean_wave_size": 1.0,
                   "throughput_rps_rounds": [thr], "p50_ms_rounds": [p50]}
            for name, (thr, p50) in (("auto", auto), ("seqs1_wait0", s1), ("seqs4_wait0", s4))}


def rounds(**per_setting: tuple[list[float], list[float]]) -> dict:
    """Several rounds: (throughputs, p50s) per setting; medians as `summarize_runs`."""
    return {name: auto_batching.summarize_runs(
        [{"throughput_rps": t, "p50_ms": p, "p99_ms": p, "mean_wave_size": 1.0,
          "server_cpu_s_per_request": 0.0, "failed": 0, "errors": []}
         for t, p in zip(thr, p50, strict=True)])
        for name, (thr, p50) in per_setting.items()}


def test_verdict_passes_when_auto_is_as_good_as_the_best() -> None:
    v = auto_batching.verdict("poisson_0.9x", 0.9, rows((10.0, 100.0), (6.0, 300.0),
                                                        (10.2, 95.0)), SETTINGS)
    assert v["best_fixed_throughput_setting"] == "seqs4_wait0"
    assert v["throughput_ratio"] == pytest.approx(10.0 / 10.2)
    assert v["p50_bar_ms"] == pytest.approx(1.1 * 95.0 + 2.0)
    assert v["dominated_by"] == [] and v["pass"]


def test_verdict_fails_each_bar() -> None:
    # 0.9 of the best throughput, a p50 past 1.1x + 2 ms, and beaten on both by > 5%.
    v = auto_batching.verdict("burst_64", None, rows((9.0, 120.0), (6.0, 300.0),
                                                     (10.0, 100.0)), SETTINGS)
    assert not v["throughput_pass"] and not v["p50_pass"]
    assert v["dominated_by"] == ["seqs4_wait0"] and not v["pass"]


def test_verdict_at_low_load_compares_p50_with_max_num_seqs_1() -> None:
    # At 0.1x the reference is S = 1 (+ 2 ms, no 10 %), even if another setting is lower.
    v = auto_batching.verdict("poisson_0.1x", 0.1, rows((1.0, 52.5), (1.0, 50.0),
                                                        (1.0, 49.0)), SETTINGS)
    assert v["p50_reference_setting"] == "seqs1_wait0"
    assert v["p50_bar_ms"] == pytest.approx(52.0) and not v["p50_pass"]


def test_verdict_compares_auto_with_the_references_round_by_round() -> None:
    # Round 3 was slow for auto alone: its median (23.5) against the best fixed
    # setting's (25.7) is 0.91, but round by round auto ran 1.01, 1.00 and 0.91 of it.
    v = auto_batching.verdict("poisson_1.2x", 1.2, rounds(
        auto=([26.0, 23.5, 23.4], [480.0, 490.0, 500.0]),
        seqs1_wait0=([12.0, 11.0, 12.0], [900.0, 950.0, 990.0]),
        seqs4_wait0=([25.8, 23.6, 25.7], [470.0, 480.0, 460.0])), SETTINGS)
    assert v["throughput_ratio_of_medians"] == pytest.approx(23.5 / 25.7)
    assert v["throughput_ratio"] == pytest.approx(23.5 / 23.6)  # the median of the rounds'
    assert v["throughput_pass"] and v["p50_pass"] and v["pass"]
    assert v["p50_to_bar"] == pytest.approx(480.0 / (1.1 * 470.0 + 2.0))
    # Slower in every round: the pairing changes nothing.
    v = auto_batching.verdict("poisson_1.2x", 1.2, rounds(
        auto=([24.0, 22.0, 23.0], [480.0, 490.0, 500.0]),
        seqs1_wait0=([12.0, 11.0, 12.0], [900.0, 950.0, 990.0]),
        seqs4_wait0=([26.0, 23.6, 25.7], [400.0, 410.0, 420.0])), SETTINGS)
    assert not v["throughput_pass"] and not v["p50_pass"]
    assert v["dominated_by"] == ["seqs4_wait0"]


def test_a_control_twin_is_judged_with_autos_bars_and_is_no_reference() -> None:
    # A twin of seqs1_wait0 with the lowest p50 of all: were it a reference, auto's
    # low-load bar would be its p50 (40 + 2 ms) and auto would fail it.
    control = auto_batching.control_setting("1:0")
    assert (control.name, control.max_num_seqs, control.wait_ms) == (
        "control_seqs1_wait0", 1, 0.0)
    assert control.control and not control.is_auto and not control.is_reference
    settings = [*SETTINGS, control]
    rows_ = rows((1.0, 51.0), (1.0, 50.0), (1.0, 60.0))
    rows_[control.name] = {"throughput_rps": 1.0, "p50_ms": 40.0, "mean_wave_size": 1.0,
                           "throughput_rps_rounds": [1.0], "p50_ms_rounds": [40.0]}
    v = auto_batching.verdict("poisson_0.1x", 0.1, rows_, settings)
    assert v["p50_reference_setting"] == "seqs1_wait0" and v["pass"]
    twin = auto_batching.verdict("poisson_0.1x", 0.1, rows_, settings,
                                 subject=control.name)
    assert twin["auto_p50_ms"] == 40.0 and twin["p50_reference_setting"] == "seqs1_wait0"
    assert twin["pass"]
    # a twin slower than the reference by more than the slack fails as auto would
    rows_[control.name]["p50_ms"] = rows_[control.name]["p50_ms_rounds"][0] = 53.0
    twin = auto_batching.verdict("poisson_0.1x", 0.1, rows_, settings,
                                 subject=control.name)
    assert not twin["p50_pass"] and not twin["pass"]
    with pytest.raises(argparse.ArgumentTypeError, match="S:W"):
        auto_batching.control_setting("16")


def test_held_out_picks_each_rounds_reference_on_the_other_rounds() -> None:
    # seqs4 is best on medians only through its lucky round 1 (30 against 20 and 20);
    # seqs1 is steady at 21. In-sample, auto (20 in every round) is compared with
    # seqs4 throughout; held out, round 1 is compared with seqs1 (the best of rounds
    # 2-3), rounds 2 and 3 with seqs4 (the best of rounds 1 and 3, or 1 and 2).
    rows_ = rounds(auto=([20.0, 20.0, 20.0], [100.0, 100.0, 100.0]),
                   seqs1_wait0=([21.0, 21.0, 21.0], [100.0, 100.0, 100.0]),
                   seqs4_wait0=([30.0, 20.0, 22.0], [100.0, 100.0, 100.0]))
    v = auto_batching.verdict("poisson_0.9x", 0.9, rows_, SETTINGS)
    assert v["best_fixed_throughput_setting"] == "seqs4_wait0"
    assert v["throughput_ratio"] == pytest.approx(20.0 / 22.0)
    # ratios 20/21 (round 1, against seqs1), 20/20 and 20/22: the median is 20/21
    assert v["throughput_ratio_held_out"] == pytest.approx(20.0 / 21.0)
    # One round: nothing to hold out.
    one = auto_batching.verdict("poisson_0.9x", 0.9, rows((10.0, 100.0), (6.0, 300.0),
                                                          (10.2, 95.0)), SETTINGS)
    assert one["throughput_ratio_held_out"] is None


def test_defaults_server_has_no_tuning_flags_and_no_thread_env(monkeypatch) -> None:
    spec = harness.diffbatch_defaults_spec("tiny-sd")
    assert spec.cmd[-4:] == ["serve", "tiny-sd", "--port", str(spec.port)]
    assert not set(TUNING_FLAGS) & set(spec.cmd) and spec.threads is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = harness.user_env()
    assert not set(harness.THREAD_ENV_VARS) & set(env)
    assert "OMP_NUM_THREADS" not in harness.server_env_overrides(None)
    assert harness.server_env_overrides(2)["OMP_NUM_THREADS"] == "2"
    fixed = harness.diffbatch_spec("tiny-sd", threads=None, max_num_seqs=4, wait_ms=10)
    assert fixed.cmd[fixed.cmd.index("--max-num-seqs") + 1] == "4"


def test_step_vs_request_judges_each_cancel_load_and_only_what_ran() -> None:
    import step_vs_request

    def row(throughput: float, latency: float = 1.0) -> dict:
        return {"ratio": {"throughput": throughput, "mean_latency": latency}}

    rounds = [{"rows": {"cancel@0.5": row(1.05), "cancel@0.95": row(1.5)}},
              {"rows": {"cancel@0.5": row(1.10), "cancel@0.95": row(1.3)}}]
    result = step_vs_request.verdict(rounds, {"overhead_share": 0.02})
    assert list(result["figures"]) == ["cancel@0.5 completed/s", "cancel@0.95 completed/s",
                                       "tick overhead"]
    assert result["figures"]["cancel@0.95 completed/s"] == pytest.approx(1.4)
    assert result["passed"] == {"cancel@0.5 completed/s": False,
                                "cancel@0.95 completed/s": True, "tick overhead": True}
    assert not result["pass"] and result["workloads"] == ["cancel"]
    mixed = [{"rows": {"mixed@0.8": row(1.1, 0.5), "uniform@0.95": row(0.9)}}]
    result = step_vs_request.verdict(mixed, {"overhead_share": 0.04})
    assert result["passed"] == {"mixed@0.8 mean latency": True, "mixed@0.8 throughput": True,
                                "uniform@0.95 throughput": False, "tick overhead": False}


def test_auto_replicas_pairs_round_means_and_names_its_servers() -> None:
    import auto_replicas

    specs = auto_replicas.specs_for("tiny-sd", ["auto", "16:0", "auto:10"], replicas=2)
    assert [s.name for s in specs] == ["auto#0", "seqs16_wait0#0", "seqsauto_wait10#0",
                                       "auto#1", "seqs16_wait0#1", "seqsauto_wait10#1"]
    assert not set(TUNING_FLAGS) & set(specs[0].cmd)
    half = specs[2].cmd
    assert half[half.index("--max-num-seqs") + 1] == "auto"
    assert half[half.index("--request-batch-max-wait-ms") + 1] == "10"
    with pytest.raises(SystemExit, match="S:W"):
        auto_replicas.setting_label("16")
    for bad in ("abc:0", "0:10", "16:-1", "16:x"):  # refused before any server starts
        with pytest.raises(SystemExit, match="S:W"):
            auto_replicas.specs_for("tiny-sd", ["auto", bad], replicas=1)

    def runs(throughputs: list[float]) -> list[dict]:
        return [{"throughput_rps": t, "p50_ms": 100.0, "mean_wave_size": 4.0}
                for t in throughputs]

    # round means: auto 50, 60, 70; fixed 55, 60, 56 -> ratios 1.1, 1.0, 0.8 -> 1.0
    summary = auto_replicas.summarize(
        {"auto#0": runs([40, 60, 70]), "auto#1": runs([60, 60, 70]),
         "seqs16_wait0#0": runs([50, 50, 56]), "seqs16_wait0#1": runs([60, 70, 56])},
        ["auto", "16:0"], replicas=2)
    fixed = summary["seqs16_wait0"]
    assert fixed["throughput_rps_round_means"] == [55, 60, 56]
    assert fixed["throughput_rps_paired_to_auto"] == pytest.approx(1.0)
    assert fixed["throughput_rps_range"] == [50, 70]
    assert summary["auto"]["p50_ms_paired_to_auto"] == 1.0


def test_threads_arg_takes_a_count_or_none() -> None:
    assert harness.threads_arg("2") == 2
    assert harness.threads_arg("None") is None
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive thread count"):
            harness.threads_arg(bad)


def test_peers_with_their_defaults_get_no_batching_or_thread_flags() -> None:
    """`peers.py --defaults --threads none`: each peer as its library configures it;
    without --defaults, the batching flags every server shares."""
    import peers

    def command(name: str, *flags: str) -> list[str]:
        parser_args = peers.parse_args([*flags, "--servers", name])
        return peers.server_specs(parser_args)[0].cmd

    for peer in ("ray", "litserve"):
        cmd = command(peer, "--defaults", "--threads", "none")
        assert not {"--threads", "--max-batch-size", "--batch-wait-ms",
                    "--batch-timeout-ms"} & set(cmd), cmd
        cmd = command(peer, "--max-batch-size", "4", "--wait-ms", "5")
        assert cmd[cmd.index("--max-batch-size") + 1] == "4"
        assert cmd[cmd.index("--threads") + 1] == "1"
    cmd = command("diffbatch", "--defaults", "--threads", "none")
    assert not set(TUNING_FLAGS) & set(cmd), cmd
    assert peers.server_specs(peers.parse_args(["--defaults", "--threads", "none",
                                                "--servers", "diffbatch"]))[0].threads is None


def test_peers_summary_keeps_a_load_whose_every_request_failed() -> None:
    """A server that failed every request of a load (no latency to take a median of)
    is reported with nan latencies and its failures, not a crash of the whole run."""
    import math

    import peers

    def report(p50: float | None, failed: int) -> dict:
        return {"request_throughput": 0.0 if p50 is None else 5.0, "p50_e2e_ms": p50,
                "p99_e2e_ms": p50, "server_cpu_s_per_request": 0.1, "failed": failed}

    rows = peers.summarize({("burst", "broken"): [report(None, 3), report(None, 3)],
                            ("burst", "fine"): [report(10.0, 0), report(30.0, 0)]})
    broken, fine = rows
    assert math.isnan(broken["p50_ms"]) and broken["failed"] == 6
    assert fine["p50_ms"] == 20.0
