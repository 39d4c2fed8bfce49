"""`diffbatch check-model`: the command line over `check_model` (the checks themselves
run on every family in tests/pipelines/test_model_matrix_*.py)."""

from __future__ import annotations

import json

import pytest
import torch

from diffbatch.entrypoints import check_model as cm
from diffbatch.entrypoints import cli


def test_levels_count_what_a_user_sees():
    a = torch.zeros(1, 3, 4, 4)
    assert cm.levels(a, a + 0.4 / 255) == 0  # rounds to the same level
    assert cm.levels(a, a + 1 / 255) == 1
    assert cm.levels(a, a + 2 / 255) == 2
    assert cm.levels(a, torch.zeros(1, 3, 8, 8)) == 255  # another size: no match at all
    assert cm._compare("x", [("r", a, a + 2 / 255)]).ok is False
    assert cm._compare("x", [("r", a, a + 1 / 255)]).ok is True


@pytest.mark.slow
def test_the_command_checks_a_built_in_model(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = cli.main(["check-model", "tiny-lcm", "--no-step-mode", "--json",
                     "--size", "32x32"])
    results = json.loads(capsys.readouterr().out)
    assert code == 0, results
    assert [r["name"] for r in results] == [
        "wave of 4", "batched == solo", "mixed guidance, negatives, lengths",
        "solo == diffusers"]
    assert all(r["ok"] and (r["levels"] is None or r["levels"] <= 1) for r in results)
