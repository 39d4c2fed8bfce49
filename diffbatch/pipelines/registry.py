"""Model names and pipeline classes: what `model` and `pipeline_class` may be, resolved.

A model is one of:

- a built-in name: a tiny model built on first use (`tiny-sd`, `tiny-sd3`, `tiny-flux`,
  `tiny-pixart`), or a model shipped inside the package as a diffusers folder
  `diffbatch/models/<name>/` (found automatically: `shapes`, `shapes-dit`);
- a local diffusers folder (with model_index.json);
- a hub id `org/name`, handed to diffusers unchanged.

A pipeline class is None (the batch-capable `DiffusersT2IPipeline`), a class, or a
dotted name (`pkg.mod.Cls` or `pkg.mod:Cls`). A raw diffusers `DiffusionPipeline`
subclass has no `supports_request_batch`, so it runs one request per wave.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from diffbatch.errors import ConfigError, DiffbatchError, ModelLoadError, ModelNotFoundError
from diffbatch.imports import import_by_name
from diffbatch.models import DEFAULT_MODEL, packaged_models
from diffbatch.pipelines.model_folder import check_component_folders

if TYPE_CHECKING:
    from diffbatch.pipelines.diffusers_t2i import DiffusersPerRequestPipeline
    from diffbatch.pipelines.interface import BasePipeline

logger = logging.getLogger(__name__)

# diffusers (and transformers) are imported only by what uses them: the default and
# the per-request adapters, the tiny models' builder. A worker that loads a pipeline
# class of its own starts without them (seconds of CPU).


def _build_tiny(name: str) -> str:
    import diffbatch.pipelines.tiny_families  # noqa: F401 - registers the other families
    from diffbatch.pipelines.tiny import ensure_tiny_model

    return ensure_tiny_model(name)


# The tiny models of the other diffusers families (`tiny_families.py`); named here so
# that listing them imports no diffusers.
FAMILY_MODEL_NAMES = (
    "tiny-sdxl", "tiny-qwen-image", "tiny-z-image", "tiny-flux2-klein", "tiny-sana",
    "tiny-chroma", "tiny-lumina2", "tiny-cogview4", "tiny-auraflow", "tiny-hunyuandit",
    "tiny-sd35", "tiny-lcm",
)
# Built-in tiny model name -> builder that ensures it is built and returns its folder.
BUILTIN_MODELS: dict[str, Callable[[], str]] = {
    name: functools.partial(_build_tiny, name)
    for name in ("tiny-sd", "tiny-sd3", "tiny-flux", "tiny-pixart", *FAMILY_MODEL_NAMES,
                 "tiny-wan", "tiny-ltx")
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")
_PER_REQUEST_CLASSES: dict[type, type] = {}


def builtin_model_names() -> list[str]:
    """Every built-in model name: the tiny ones, then the packaged ones."""
    return [*BUILTIN_MODELS, *(n for n in packaged_models() if n not in BUILTIN_MODELS)]


def resolve_model_path(model: str | None) -> str:
    """Turn a model spec into what `from_pretrained` takes: a folder or a hub id.

    None -> the default model; a built-in name -> its folder (built if needed); an
    existing local folder -> its absolute path; `org/name` -> unchanged (a hub id).

    Raises:
        ModelNotFoundError: anything else, listing the built-in names.
    """
    if model is None:
        model = DEFAULT_MODEL
    check_model_spec(model, warn=False)  # (the engine warned already)
    if model in BUILTIN_MODELS:
        return BUILTIN_MODELS[model]()
    packaged = packaged_models()
    if model in packaged:
        return packaged[model]
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    return model  # a hub id


def check_diffusers_folder(model: str | None) -> None:
    """For a local folder the diffusers adapters will load: its model_index.json is
    readable and names no missing component, checked before a worker starts (which
    would say the same after seconds of imports). Names and hub ids are left alone."""
    if model is None or model in BUILTIN_MODELS or model in packaged_models():
        return
    folder = os.path.expanduser(model)
    if not os.path.isdir(folder):
        return
    try:
        with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
            index = json.load(f)
        if not isinstance(index, dict):
            raise ValueError(f"a JSON object was expected, got {type(index).__name__}")
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"model {model!r} (local folder) could not be loaded as a diffusers pipeline: "
            f"no readable model_index.json ({type(exc).__name__}: {exc})", param="model",
        ) from None
    check_component_folders(folder, index)


def check_model_spec(model: Any, *, warn: bool = True) -> None:
    """Raise `ModelNotFoundError` for a spec `resolve_model_path` would refuse, without
    building or loading anything (the engine checks before it starts a worker); `warn`:
    log when a built-in name is also a folder here (the built-in is served)."""
    if not isinstance(model, str) or not model:
        raise ModelNotFoundError(f"model must be a non-empty string, got {model!r}",
                                 param="model")
    builtin = model in BUILTIN_MODELS or model in packaged_models()
    if warn and builtin and os.path.isdir(model):
        logger.warning(
            "%r is a built-in model's name and also a folder here; the built-in is served "
            "(name the folder as a path, ./%s, to serve it)", model, model)
    if builtin or os.path.isdir(os.path.expanduser(model)):
        return
    if _HUB_ID.match(model) and ".." not in model and not os.path.isabs(model):
        return
    names = builtin_model_names()
    close = difflib.get_close_matches(model, names, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    raise ModelNotFoundError(
        f"model {model!r} is not a built-in name, an existing local folder or a hub id "
        f"(org/name){hint}; built-in models: {', '.join(names)}",
        param="model",
    )


def resolve_pipeline_class(spec: Any) -> type:
    """Turn a pipeline class spec (None, a class or a dotted name) into a class.

    Raises:
        ConfigError: the name does not import, or the object lacks `from_pretrained`
            and `forward`.
    """
    if spec is None:
        from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline

        return DiffusersT2IPipeline
    obj = import_by_name(spec, what="pipeline_class") if isinstance(spec, str) else spec
    if _is_diffusers_pipeline(obj):
        return per_request_class(obj)
    if not isinstance(obj, type) or not callable(getattr(obj, "from_pretrained", None)) \
            or not callable(getattr(obj, "forward", None)):
        raise ConfigError(
            f"pipeline_class {spec!r} must be a pipeline class with `from_pretrained` and "
            "`forward` (e.g. a diffbatch.pipelines.interface.BasePipeline subclass) or a "
            f"diffusers DiffusionPipeline subclass, got {obj!r}"
        )
    return obj


def per_request_class(diffusers_class: type) -> type[DiffusersPerRequestPipeline]:
    """A `DiffusersPerRequestPipeline` subclass bound to `diffusers_class` (cached)."""
    from diffbatch.pipelines.diffusers_t2i import DiffusersPerRequestPipeline

    if diffusers_class not in _PER_REQUEST_CLASSES:
        _PER_REQUEST_CLASSES[diffusers_class] = type(
            f"PerRequest{diffusers_class.__name__}",
            (DiffusersPerRequestPipeline,),
            {"diffusers_class": diffusers_class, "__module__": __name__},
        )
    return _PER_REQUEST_CLASSES[diffusers_class]


def video_pipeline_class(path: str) -> type | None:
    """The video adapter for a model whose model_index.json (a local folder's, or a
    hub id's in the local cache) names a video pipeline (a refused family is a
    `ModelLoadError` saying why); None otherwise."""
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isdir(path) and _HUB_ID.match(path):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "model_index.json")
        index_file = cached if isinstance(cached, str) else index_file
    try:
        with open(index_file, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict):
        return None
    from diffbatch.pipelines.diffusers_video import (
        DiffusersVideoPipeline,
        check_video_family,
        video_family,
    )

    family = video_family(index)
    if family is None:
        return None
    check_video_family(family)
    return DiffusersVideoPipeline


def load_pipeline(
    model: str | None, pipeline_class: Any = None, *, device: str | None = None,
    dtype: str | None = None, **kwargs: Any,
) -> BasePipeline:
    """Resolve `model` and `pipeline_class`, then load the pipeline.

    `device` and `dtype` are passed to `from_pretrained` only when given, so a custom
    class that does not take them still loads.
    """
    path = resolve_model_path(model)
    cls = video_pipeline_class(path) if pipeline_class is None else None
    cls = cls or resolve_pipeline_class(pipeline_class)
    if device is not None:
        kwargs["device"] = device
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        return cls.from_pretrained(path, **kwargs)  # type: ignore[attr-defined]
    except DiffbatchError:
        raise
    except Exception as exc:
        # One clear start-up error (the CLI prints it as one line) instead of the
        # loader's traceback; the cause stays chained for a debugger.
        raise ModelLoadError(
            f"could not load the model {model or DEFAULT_MODEL!r} with {cls.__name__}: "
            f"{type(exc).__name__}: {exc}") from exc


def _is_diffusers_pipeline(obj: Any) -> bool:
    if not isinstance(obj, type) or hasattr(obj, "supports_request_batch"):
        return False
    from diffusers import DiffusionPipeline

    return issubclass(obj, DiffusionPipeline)
