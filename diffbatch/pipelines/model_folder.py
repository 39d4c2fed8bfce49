"""What a diffusers model folder holds: the checks and names every loader shares.

Kept apart from the registry (which resolves names and classes) and the pipelines
(which load folders), so that both, and the tiny models' builder, use it without
importing each other.
"""

from __future__ import annotations

import os
from typing import Any

from diffbatch.errors import ModelLoadError

DEFAULTS_FILE = "diffbatch_defaults.json"  # optional serving defaults in a model folder


def check_component_folders(model: str, index: dict[str, Any]) -> None:
    """A local folder must hold a subfolder per component its model_index.json names
    (diffusers' own error names the folder's root, not the part that is missing)."""
    if not os.path.isdir(model):
        return
    missing = [name for name, value in index.items()
               if not name.startswith("_") and isinstance(value, list | tuple)
               and len(value) == 2 and value[1] is not None
               and not os.path.isdir(os.path.join(model, name))]
    if missing:
        raise ModelLoadError(
            f"model {model!r}: its model_index.json names the component(s) "
            f"{', '.join(missing)}, but the folder has no {', '.join(missing)} "
            "subfolder; copy the whole pipeline folder (`save_pretrained` writes one per "
            "component)")


__all__ = ["DEFAULTS_FILE", "check_component_folders"]
