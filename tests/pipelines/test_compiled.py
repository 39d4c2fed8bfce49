"""Compiled forwards per wave-size bucket: padding, counting, eager calls, fallback.

A small per-row module stands in for the denoiser here (the mechanism does not
depend on what the module computes); the real pipelines compile in
tests/test_e2e_compile.py. Most tests trace with dynamo's "eager" backend, which
checks the mechanism (graphs, guards, recompiles) without generating code; one
compiles with inductor and compares numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffbatch.compile import CompileSettings, auto_buckets, parse_buckets
from diffbatch.pipelines.interception.compiled import CompiledForward, CompileStats
from diffbatch.pipelines.interception.rows import CallRows, call_rows

REPO_ROOT = Path(__file__).resolve().parents[2]


class PerRow(torch.nn.Module):
    """Each row on its own: a small MLP over features, a timestep added per row."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 16)
        self.outer = torch.nn.Linear(16, 8)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                context: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        hidden = torch.nn.functional.gelu(self.inner(sample)) + timestep.reshape(-1, 1) / 10
        if context is not None:
            hidden = hidden + context.mean(dim=1)
        return (self.outer(hidden),)


def settings(buckets: tuple[int, ...] = (2, 4), backend: str = "eager",
             dynamic: bool = False) -> CompileSettings:
    return CompileSettings(target="denoiser", buckets=buckets, dynamic=dynamic,
                           backend=backend, mode="default", cache_dir="")


def compiled(module: torch.nn.Module, s: CompileSettings, **kwargs) -> tuple[CompiledForward,
                                                                          CompileStats]:
    stats = CompileStats()
    forward = CompiledForward(module, "toy", s, stats, **kwargs)
    with forward.capture(), torch.inference_mode():
        module(torch.randn(2, 8), torch.tensor(3.0), context=torch.randn(2, 5, 16))
    forward.warm()
    return forward, stats


def inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.tensor(5.0), torch.randn(rows, 5, 16,
                                                                            generator=g)


@pytest.fixture(scope="module")
def toy() -> tuple[PerRow, CompiledForward, CompileStats]:
    torch.manual_seed(0)
    module = PerRow()
    forward, stats = compiled(module, settings())
    return module, forward, stats


def test_buckets_parse_and_cover_the_largest_wave() -> None:
    assert auto_buckets(8) == (1, 2, 4, 8)
    assert auto_buckets(6) == (1, 2, 4, 8)
    assert parse_buckets("1,3,6", 8) == ((1, 3, 6), False)
    assert parse_buckets("dynamic", 8) == ((), True)
    assert settings((2, 4)).bucket_for(3) == 4 and settings((2, 4)).bucket_for(5) is None
    with pytest.raises(ValueError, match="increasing row counts"):
        parse_buckets("4,2", 8)


def test_every_wave_size_within_the_buckets_runs_compiled_without_a_recompile(toy) -> None:
    module, _forward, stats = toy
    assert stats.buckets == {"toy": [2, 4]} and stats.compiles == 2
    before = stats.compiled_forwards
    for rows in (1, 3, 4, 2, 3):  # 1 and 3 rows run padded to buckets 2 and 4
        with torch.inference_mode():
            module(*inputs(rows))
    assert stats.compiled_forwards == before + 5
    assert stats.recompiles == 0


def test_padding_rows_never_change_a_real_row(toy) -> None:
    module, _forward, _stats = toy
    sample, t, context = inputs(3, seed=1)
    with torch.inference_mode():
        padded = module(sample, t, context)[0]  # 3 rows in bucket 4
        solo = module(sample[:1], t, context[:1])[0]  # 1 row in bucket 2
        eager = PerRow.forward(module, sample, t, context)[0]  # the original, uncompiled
    assert padded.shape == (3, 8)
    torch.testing.assert_close(padded, eager)
    torch.testing.assert_close(padded[:1], solo)


def test_rows_that_carry_adapters_run_the_original_module(toy) -> None:
    module, forward, stats = toy
    rows = CallRows(((("style", 1.0),), ()), ("r0", "r1"))
    forward._eager_reason = lambda rows: "lora" if rows is not None and any(rows.stacks) \
        else None
    try:
        with call_rows(rows), torch.inference_mode():
            module(*inputs(2))
    finally:
        forward._eager_reason = lambda rows: None
    assert stats.eager_forwards.get("lora") == 1


def test_changes_to_the_module_at_run_time_never_reach_the_compiled_graph(toy) -> None:
    module, _forward, stats = toy
    # what a LoRA load does to the denoiser: a layer replaced, a forward hook added
    original_inner = module.inner
    wrapped = torch.nn.Sequential(original_inner)
    module.inner = wrapped  # type: ignore[assignment]
    handle = wrapped.register_forward_hook(lambda m, a, out: out + 1.0)
    try:
        with torch.inference_mode():
            module(*inputs(3))
        assert stats.recompiles == 0
    finally:
        handle.remove()
        module.inner = original_inner


def test_more_rows_than_the_largest_bucket_run_eagerly(toy) -> None:
    module, _forward, stats = toy
    with torch.inference_mode():
        out = module(*inputs(5))[0]
    assert out.shape == (5, 8) and stats.eager_forwards.get("above_buckets") == 1


def test_a_fused_step_mode_call_runs_compiled_in_its_bucket() -> None:
    """Step mode's fusion hook wraps the compiled one: two requests' calls (one row and
    a timestep each) run as one compiled call of 2 rows, each getting its own row."""
    from diffbatch.pipelines.interception import Coordinator, FusionPoint, install

    module = PerRow()
    _forward, stats = compiled(module, settings(buckets=(2,)))
    install([FusionPoint(module, "forward", "step", "toy")])
    rows = [inputs(1, seed=s) for s in (3, 4)]

    def call(i: int):
        sample, _, context = rows[i]
        with torch.inference_mode():
            return module(sample, torch.tensor(float(i)), context)[0]

    fused = Coordinator().run_together([lambda: call(0), lambda: call(1)])
    assert stats.compiled_forwards == 1 and stats.recompiles == 0
    for i, out in enumerate(fused):
        sample, _, context = rows[i]
        with torch.inference_mode():
            alone = PerRow.forward(module, sample, torch.tensor(float(i)), context)[0]
        torch.testing.assert_close(out, alone)


def failing_backend(graph: torch.fx.GraphModule, example_inputs: list) -> None:
    raise RuntimeError("this backend cannot compile")


def test_a_compile_that_fails_serves_eagerly(caplog) -> None:
    module = PerRow()
    with caplog.at_level("WARNING"):
        forward, stats = compiled(module, settings(backend=f"{__name__}:failing_backend"))
    assert not forward.active and stats.failures == 1
    assert [r.message for r in caplog.records if "runs eagerly" in r.message] \
        and "cannot compile" in caplog.text
    with torch.inference_mode():
        assert module(*inputs(3))[0].shape == (3, 8)
    assert stats.eager_forwards == {"off": 1}


def test_dynamic_batch_dimension_compiles_once_for_every_size() -> None:
    module = PerRow()
    _forward, stats = compiled(module, settings(buckets=(), dynamic=True))
    graphs = stats.graphs
    for rows in (3, 5, 2, 7):
        with torch.inference_mode():
            module(*inputs(rows))
    assert stats.recompiles == 0 and stats.graphs == graphs
    assert stats.compiled_forwards == 4


# One start of a process that compiles the toy module with inductor for one bucket,
# checks the compiled result against the original and prints the compile counts.
_START = """
import json, sys, torch
from tests.pipelines.test_compiled import PerRow, compiled, inputs, settings
torch.manual_seed(0)
module = PerRow()
forward, stats = compiled(module, settings(buckets=(4,), backend="inductor"))
sample, t, context = inputs(3, seed=2)
with torch.inference_mode():
    got = module(sample, t, context)[0]
    want = PerRow.forward(module, sample, t, context)[0]
torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
print(json.dumps(stats.as_dict()))
"""


def test_inductor_matches_eager_and_a_second_start_reads_the_on_disk_cache(tmp_path) -> None:
    # (one compile thread: a pool of compile workers costs more than it saves here)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    starts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _START], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = starts
    assert first["compiled_forwards"] == 1 and first["failures"] == 0
    assert first["cache_misses"] >= 1 and first["cache_hits"] == 0
    assert second["cache_hits"] >= 1 and second["cache_misses"] == 0
