"""Smoke test of benchmarks/compile.py: it runs end to end on a minimal setting (see
`tests.bench.smoke`: one shared server stands in for the eager, twin and compiled
ones, so the ratios mean nothing here; the report's fields are what is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import run_script

pytestmark = pytest.mark.slow


def test_compile_smoke(tmp_path: Path) -> None:
    report = run_script("compile.py", tmp_path / "compile.json", "--models", "tiny-sd",
                        "--steps", "1", "--rounds", "1", "--requests", "2",
                        "--lone-requests", "1", "--backend", "eager", "--buckets", "2",
                        "--parts", "restart", "served", "pipeline", "--device-waves", "1",
                        "--device-iters", "1")
    restart = report["tiny-sd"]["restart"]
    assert set(restart["seconds"]) == {"eager", "compiled_cold", "compiled_warm",
                                       "eager_again"}
    served = report["tiny-sd"]["served"]
    for key in ("closed_compiled_over_eager", "lone_p50_compiled_over_eager",
                "mixed_eager_over_compiled_latency"):
        assert served[key] > 0
    assert served["mixed_recompiles_after_warmup"] == 0
    pipeline = report["pipeline"]
    assert pipeline["compiled_over_eager_speedup"]["1"] > 0
    assert {"ms", "rounds", "first_calls_s"} <= set(pipeline["eager"])
