"""The pure parts of the benchmarks: the bars' arithmetic and the server commands.
Fast (no server is started); the end-to-end runs are in test_benchmarks_smoke.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import policy_bars  # noqa: E402
from peers_servers import harness  # noqa: E402

TUNING_FLAGS = ("--max-num-seqs", "--request-batch-max-wait-ms", "--torch-threads")


def test_policy_bars_pair_rounds_and_name_their_servers() -> None:
    assert policy_bars.median_ratio([2.0, 3.0, 10.0], [1.0, 3.0, 4.0]) == 2.0
    assert policy_bars.median_diff([5.0, 7.0, 9.0], [4.0, 4.0, 4.0]) == 3.0
    args = argparse.Namespace(model="tiny-sd", step_execution=False)
    auto = policy_bars.spec("auto", args)
    assert not set(TUNING_FLAGS) & set(auto.cmd)
    assert "--step-execution" not in auto.cmd
    step = policy_bars.spec("auto", argparse.Namespace(model="tiny-sd", step_execution=True))
    assert "--step-execution" in step.cmd and not set(TUNING_FLAGS) & set(step.cmd)
    assert "--step-execution" not in policy_bars.spec(
        "1:0", argparse.Namespace(model="tiny-sd", step_execution=True)).cmd
    twin = policy_bars.spec("16:10-twin", args)
    assert twin.name == "16:10-twin"
    assert twin.cmd[twin.cmd.index("--max-num-seqs") + 1] == "16"
    assert twin.cmd[twin.cmd.index("--request-batch-max-wait-ms") + 1] == "10.0"


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


def test_threads_arg_takes_a_count_or_none() -> None:
    assert harness.threads_arg("2") == 2
    assert harness.threads_arg("None") is None
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive thread count"):
            harness.threads_arg(bad)


def test_step_parity_judges_only_the_parts_that_ran() -> None:
    import step_vs_request

    rounds = [{"throughput": {"twin": 1.0, "step": value}, "mean_latency":
               {"twin": None, "step": None}} for value in (0.9, 0.97, 1.0)]
    args = argparse.Namespace(steps=0, parity_parts=["saturated"])
    result = step_vs_request.parity_verdict(rounds, args)
    assert set(result) == {"throughput"}  # the mix did not run: not judged
    assert result["throughput"]["bar"] == 0.95  # the model's default steps
    assert result["throughput"]["step_median"] == 0.97 and result["throughput"]["pass"]
    args = argparse.Namespace(steps=4, parity_parts=["saturated", "mixed"])
    rounds = [{"throughput": {"twin": 1.0, "step": 0.95},
               "mean_latency": {"twin": 1.1, "step": 0.52}}]
    result = step_vs_request.parity_verdict(rounds, args)
    assert result["throughput"]["pass"] and not result["mean_latency"]["pass"]


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
