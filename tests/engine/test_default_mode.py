"""The engine's default mode is the one the docs state: request mode, whether or not
the pipeline has the step contract (step mode is `--step-execution`; the figures
behind that choice are in docs/step_mode.md, "Which mode by default")."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffbatch import Engine
from diffbatch.config import EngineConfig
from diffbatch.engine.wave_dispatch import WaveDispatch
from tests.fake_pipelines import FakeBatchPipeline

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_and_the_config_name_the_same_default():
    assert EngineConfig(model="tiny-sd").step_execution is False
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--step-execution`"))
    assert row.split("|")[2].strip() == "off"
    assert "In request mode (the default)" in (ROOT / "docs" / "step_mode.md").read_text()


@pytest.mark.parametrize(("model", "pipeline_class", "has_contract"), [
    ("tiny-sd", None, True),  # the diffusers adapter: supports_step_execution
    (None, FakeBatchPipeline, False),
])
def test_an_engine_without_options_runs_request_mode(model, pipeline_class, has_contract):
    with Engine(model, pipeline_class=pipeline_class, executor="inproc", warmup=False,
                max_num_seqs=2) as engine:
        assert engine.info.supports_step_execution is has_contract
        assert type(engine.core.dispatch) is WaveDispatch
        assert engine.generate(["a cat"], use_tqdm=False)[0].ok
