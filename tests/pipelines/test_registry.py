"""Tests of model and pipeline-class resolution, and their errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import diffbatch.models
from diffbatch.errors import ConfigError, ModelNotFoundError
from diffbatch.pipelines.diffusers_t2i import DiffusersPerRequestPipeline, DiffusersT2IPipeline
from diffbatch.pipelines.registry import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    FAMILY_MODEL_NAMES,
    builtin_model_names,
    check_model_spec,
    load_pipeline,
    packaged_models,
    resolve_model_path,
    resolve_pipeline_class,
)
from tests.pipelines.conftest import TINY_NAMES


def test_builtin_names_and_default() -> None:
    assert DEFAULT_MODEL == "shapes"  # the trained model shipped in the package
    assert tuple(BUILTIN_MODELS) == (*TINY_NAMES, *FAMILY_MODEL_NAMES, "tiny-wan", "tiny-ltx")
    assert builtin_model_names()[:4] == list(TINY_NAMES)


def test_the_family_names_are_those_with_builders() -> None:
    from diffbatch.pipelines.tiny_families import FAMILY_BUILDERS

    assert set(FAMILY_MODEL_NAMES) == set(FAMILY_BUILDERS)


def test_none_resolves_to_the_shipped_default() -> None:
    path = resolve_model_path(None)
    assert path == packaged_models()["shapes"]
    assert os.path.isfile(os.path.join(path, "model_index.json"))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_builtin_name_resolves_to_its_cache_folder(name: str, model_cache_dir: str) -> None:
    path = resolve_model_path(name)
    assert path == os.path.join(model_cache_dir, "models", name)
    assert os.path.isfile(os.path.join(path, "model_index.json"))


def test_local_folder_resolves_to_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("my-model") == str(tmp_path / "my-model")
    assert resolve_model_path(str(tmp_path / "my-model")) == str(tmp_path / "my-model")


@pytest.mark.parametrize("hub_id", ["stabilityai/sd-turbo", "org/name", "a-b/c.d_e"])
def test_hub_id_is_returned_unchanged(hub_id: str) -> None:
    assert resolve_model_path(hub_id) == hub_id


@pytest.mark.parametrize("bad", ["no-such-model", "./missing/folder", "/no/such/folder", "a b/c"])
def test_unknown_model_lists_the_builtin_names(bad: str) -> None:
    with pytest.raises(ModelNotFoundError, match="tiny-sd, tiny-sd3, tiny-flux, tiny-pixart") as e:
        resolve_model_path(bad)
    assert repr(bad) in e.value.message
    assert e.value.status_code == 404
    with pytest.raises(ModelNotFoundError, match=r"\(did you mean `shapes`\?\)"):
        check_model_spec("shape")


def test_packaged_model_folders_are_builtin_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "model_index.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()  # no model_index.json: ignored
    monkeypatch.setattr(diffbatch.models, "PACKAGED_MODELS_DIR", tmp_path)
    assert "shapes" in builtin_model_names()
    assert "not-a-model" not in builtin_model_names()
    assert resolve_model_path("shapes") == str(tmp_path / "shapes")
    with pytest.raises(ModelNotFoundError, match="shapes"):
        resolve_model_path("not-a-model")


def test_pipeline_class_none_class_and_dotted_names() -> None:
    assert resolve_pipeline_class(None) is DiffusersT2IPipeline
    assert resolve_pipeline_class(DiffusersPerRequestPipeline) is DiffusersPerRequestPipeline
    dotted = "diffbatch.pipelines.diffusers_t2i.DiffusersT2IPipeline"
    assert resolve_pipeline_class(dotted) is DiffusersT2IPipeline
    assert resolve_pipeline_class(dotted.replace(".Diffusers", ":Diffusers")) \
        is DiffusersT2IPipeline


def test_raw_diffusers_class_gets_the_per_request_path() -> None:
    import diffusers

    cls = resolve_pipeline_class("diffusers.StableDiffusionPipeline")
    assert issubclass(cls, DiffusersPerRequestPipeline)
    assert cls.supports_request_batch is False
    assert cls.diffusers_class is diffusers.StableDiffusionPipeline
    assert resolve_pipeline_class(diffusers.StableDiffusionPipeline) is cls  # cached


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_pkg.module.Pipeline", "could not be imported"),
        ("diffbatch.pipelines.registry.NoSuchClass", "could not be imported"),
        ("NoDots", "dotted name"),
        ("os.path", "from_pretrained"),
        ("collections.OrderedDict", "from_pretrained"),
        (42, "from_pretrained"),
    ],
)
def test_bad_pipeline_class_is_a_config_error(spec: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        resolve_pipeline_class(spec)
    assert repr(spec) in e.value.message


def test_load_pipeline_default_and_per_request(model_cache_dir: str) -> None:
    batched = load_pipeline("tiny-sd", device="cpu", dtype="float32")
    assert type(batched) is DiffusersT2IPipeline
    per_request = load_pipeline("tiny-sd", "diffusers.StableDiffusionPipeline")
    assert isinstance(per_request, DiffusersPerRequestPipeline)
    assert type(per_request).supports_request_batch is False
    assert per_request.info().name == "StableDiffusionPipeline"


def test_load_pipeline_passes_kwargs_to_a_custom_class(model_cache_dir: str) -> None:
    class Custom(DiffusersT2IPipeline):
        seen: dict = {}

        @classmethod
        def from_pretrained(cls, model: str, **kwargs: object) -> DiffusersT2IPipeline:
            cls.seen = {"model": model, **kwargs}
            return super().from_pretrained(model, **kwargs)

    pipeline = load_pipeline("tiny-sd3", Custom)
    assert isinstance(pipeline, Custom)
    assert Custom.seen == {"model": resolve_model_path("tiny-sd3")}  # no device/dtype given


def test_unknown_hub_id_offline_is_model_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="diffbatch-test/no-such-model") as e:
        load_pipeline("diffbatch-test/no-such-model")
    assert "hub id" in e.value.message


def test_a_folder_named_like_a_builtin_model_is_pointed_out(tmp_path, monkeypatch, caplog):
    from diffbatch.pipelines.registry import check_model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-sd").mkdir()
    with caplog.at_level(logging.WARNING, logger="diffbatch"):
        check_model_spec("tiny-sd")
        check_model_spec("./tiny-sd")  # the folder, named as a path: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "'tiny-sd' is a built-in model's name and also a folder here; the built-in is "
        "served (name the folder as a path, ./tiny-sd, to serve it)"]
