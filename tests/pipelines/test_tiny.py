"""Tests of the built-in tiny models: build, reload, real tokenizers, safe caching."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffbatch.pipelines import tiny
from tests.pipelines.conftest import TINY_NAMES

EXPECTED_CLASS = {
    "tiny-sd": "StableDiffusionPipeline",
    "tiny-sd3": "StableDiffusion3Pipeline",
    "tiny-flux": "FluxPipeline",
    "tiny-pixart": "PixArtSigmaPipeline",
}


def _folder_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _weights(folder: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(p.relative_to(folder)): load_file(p) for p in Path(folder).rglob("*.safetensors")}


def _reload(folder: str) -> object:
    from diffusers import DiffusionPipeline

    with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    missing = {k: None for k, v in index.items() if v == [None, None]}
    return DiffusionPipeline.from_pretrained(folder, **missing)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_builds_into_cache_and_reloads(name: str, model_cache_dir: str) -> None:
    folder = tiny.ensure_tiny_model(name)
    assert Path(folder) == Path(model_cache_dir) / "models" / name
    assert (Path(folder) / "model_index.json").is_file()
    assert 100_000 < _folder_bytes(folder) < 4_500_000
    with open(Path(folder) / "diffbatch_defaults.json", encoding="utf-8") as f:
        defaults = json.load(f)
    assert defaults["height"] == defaults["width"] == 64
    assert defaults["num_inference_steps"] == 4
    assert defaults["diffbatch_tiny_version"] == tiny.TINY_BUILD_VERSION
    pipe = _reload(folder)
    assert type(pipe).__name__ == EXPECTED_CLASS[name]
    assert not [p for p in Path(folder).parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tokenizers_have_a_real_vocabulary(name: str, model_cache_dir: str) -> None:
    pipe = _reload(tiny.ensure_tiny_model(name))
    tokenizers = [getattr(pipe, a) for a in ("tokenizer", "tokenizer_2", "tokenizer_3")
                  if getattr(pipe, a, None) is not None]
    assert tokenizers
    for tokenizer in tokenizers:
        is_clip = "CLIP" in type(tokenizer).__name__
        assert len(tokenizer) > (300 if is_clip else 100), type(tokenizer).__name__
        red = tokenizer("a red cat").input_ids
        blue = tokenizer("a blue dog").input_ids
        assert red != blue
        assert len(set(red)) >= 4  # not a 3-token vocabulary mapping words to one id
        if is_clip:
            assert tokenizer.model_max_length == 77
            assert red[0] == tokenizer.bos_token_id and red[-1] == tokenizer.eos_token_id


def test_clip_tokenizer_merges_common_words(tmp_path: Path) -> None:
    tokenizer = tiny.build_clip_tokenizer(tmp_path)
    ids = tokenizer("a red cat").input_ids
    assert len(ids) == 5  # bos, one token per word, eos
    assert tokenizer.convert_ids_to_tokens(ids[1:4]) == ["a</w>", "red</w>", "cat</w>"]
    assert len(tokenizer("zebra").input_ids) > 3  # unknown words fall back to smaller pieces


def test_same_name_gives_the_same_weights(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    torch.manual_seed(123)  # the caller's RNG state must not matter
    tiny.build_tiny_model("tiny-sd3", first)
    torch.manual_seed(456)
    tiny.build_tiny_model("tiny-sd3", second)
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys() and a
    for file in a:
        for key in a[file]:
            assert torch.equal(a[file][key], b[file][key]), (file, key)


def test_build_does_not_disturb_the_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    tiny.build_tiny_model("tiny-pixart", tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_lost_build_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process renames its build into place while ours is building."""
    monkeypatch.setenv("DIFFBATCH_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / "tiny-pixart"
    real_build = tiny.build_tiny_model

    def build_while_another_process_wins(name: str, folder: str | os.PathLike[str]) -> None:
        other = tmp_path / "models" / ".other-process"
        other.mkdir()
        real_build(name, other)
        (other / "winner.txt").write_text("other process")
        os.rename(other, target)
        real_build(name, folder)

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_another_process_wins)
    assert tiny.ensure_tiny_model("tiny-pixart") == str(target)
    assert (target / "winner.txt").read_text() == "other process"
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-pixart"]


def test_existing_build_is_reused_and_stale_build_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIFFBATCH_CACHE_DIR", str(tmp_path))
    folder = Path(tiny.ensure_tiny_model("tiny-pixart"))
    marker = folder / "marker.txt"
    marker.write_text("kept")
    assert tiny.ensure_tiny_model("tiny-pixart") == str(folder)
    assert marker.exists()  # current build: reused, not rebuilt
    defaults = json.loads((folder / "diffbatch_defaults.json").read_text())
    defaults["diffbatch_tiny_version"] = -1
    (folder / "diffbatch_defaults.json").write_text(json.dumps(defaults))
    assert tiny.ensure_tiny_model("tiny-pixart") == str(folder)
    assert not marker.exists()  # stale build: replaced
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny-pixart"]


def test_cache_dir_default_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DIFFBATCH_CACHE_DIR", raising=False)
    assert tiny.cache_dir() == Path("~/.cache/diffbatch").expanduser()
    monkeypatch.setenv("DIFFBATCH_CACHE_DIR", str(tmp_path))
    assert tiny.cache_dir() == tmp_path


def test_unknown_tiny_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="tiny-sd"):
        tiny.build_tiny_model("tiny-nope", tmp_path)
