"""Loading a diffusers pipeline for diffbatch: device, dtype, folder or hub id.

`load_diffusers_pipe` reads model_index.json first (components a folder leaves out
must be passed as None; a missing or unreachable model is a clear error), loads with
the class it names or the one given, moves the pipeline to its device once and
silences the per-step progress bar; a folder's `diffbatch_defaults.json` gives the
pipeline's defaults.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from typing import Any

import torch

from diffbatch.errors import ConfigError, ModelNotFoundError
from diffbatch.pipelines import library_logs
from diffbatch.pipelines.model_folder import DEFAULTS_FILE, check_component_folders

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# Installed on import: the builders in tiny.py and `load_diffusers_pipe` both import
# diffusers pipeline modules, and both import this module first.
library_logs.install()


def resolve_device(device: str | torch.device | None) -> str:
    """None picks "cuda" when available, else "cpu"; a device this machine's torch
    cannot use is a `ConfigError` naming it (not torch's own assertion)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    name = str(device).strip().lower()
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ConfigError(
            f"device {name!r} is not available here (torch {torch.__version__}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); use "
            "--device cpu, or leave it out to use cuda when available", param="device",
        ) from None
    return name


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """None means float32 (diffusers' own default); strings like "bf16" are accepted."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ConfigError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")


# Installed on import: the builders in tiny.py and `from_pretrained` below both import
# diffusers pipeline modules, and both import this module first.
library_logs.install()


def _disable_progress_bars() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _load_model_index(model: str) -> dict[str, Any]:
    """Read model_index.json (local folder or hub), as a clear error if there is none."""
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(model))
    except Exception as exc:  # OSError, HF hub errors, offline mode, bad JSON
        if not os.path.isdir(model) and _hub_unreachable(exc):
            raise ModelNotFoundError(
                f"model {model!r} (hub id) could not be loaded: it is not in the local "
                "Hugging Face cache and the hub could not be reached from here; download "
                f"it where the hub is reachable (`hf download {model} --local-dir DIR`) and "
                "serve the folder, or point HF_HOME at a cache that holds it",
                param="model",
            ) from exc
        where = "local folder" if os.path.isdir(model) else "hub id"
        raise ModelNotFoundError(
            f"model {model!r} ({where}) could not be loaded as a diffusers pipeline: no "
            f"readable model_index.json ({type(exc).__name__}: {exc})", param="model",
        ) from exc


def _hub_unreachable(exc: BaseException) -> bool:
    """Whether loading failed because the hub could not be reached (offline, no DNS)
    and the files were not cached, rather than because the repository lacks them."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled",
                                      "ConnectError", "ConnectionError", "ConnectTimeout",
                                      "gaierror"):
            return True
        current = current.__cause__ or current.__context__
    return False



def load_diffusers_pipe(model: str, device: str | torch.device | None,
                        dtype: str | torch.dtype | None, diffusers_class: type | None,
                        **kwargs: Any) -> tuple[Any, str, dict[str, Any]]:
    """The loaded diffusers pipeline, its device and the folder's defaults (see the
    module docstring); `kwargs` go to diffusers' `from_pretrained`."""
    from diffusers import DiffusionPipeline

    device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    _disable_progress_bars()
    # 1. Read model_index.json: which components the folder leaves out (SD3 without
    #    T5, SD without safety checker) must be passed as None explicitly.
    index = _load_model_index(model)
    check_component_folders(model, index)
    for name, value in index.items():
        if not name.startswith("_") and isinstance(value, list | tuple) \
                and list(value) == [None, None]:
            kwargs.setdefault(name, None)
    loader = diffusers_class or DiffusionPipeline
    target = loader if loader is not DiffusionPipeline else _index_class(index)
    init_params = inspect.signature(
        target.__init__).parameters if target else {}  # type: ignore[misc]
    if "safety_checker" in init_params:
        kwargs.setdefault("safety_checker", None)
    if "requires_safety_checker" in init_params:
        kwargs.setdefault("requires_safety_checker", False)
    # 2. Load, move, silence the per-step progress bar.
    pipe = loader.from_pretrained(  # type: ignore[union-attr]
        model, **{_dtype_kwarg(): torch_dtype}, **kwargs)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    defaults: dict[str, Any] = {}
    if os.path.isfile(os.path.join(model, DEFAULTS_FILE)):
        with open(os.path.join(model, DEFAULTS_FILE), encoding="utf-8") as f:
            defaults = json.load(f)
    logger.info("loaded %s from %s on %s (%s)", type(pipe).__name__, model, device,
                torch_dtype)
    return pipe, device, defaults


def _dtype_kwarg() -> str:
    """diffusers >= 0.36 takes `dtype` and deprecates `torch_dtype`."""
    from diffusers.pipelines import pipeline_utils

    return "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"


def _index_class(index: dict[str, Any]) -> type | None:
    """The diffusers class model_index.json names, or None if diffusers lacks it."""
    import diffusers

    name = index.get("_class_name")
    return getattr(diffusers, name, None) if isinstance(name, str) else None
