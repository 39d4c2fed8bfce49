"""Built-in models shipped inside the package (each a diffusers pipeline folder), and
the default model. Importing this costs nothing heavy (no torch, no diffusers): the
engine's process names the default model without loading any pipeline code."""

from __future__ import annotations

from pathlib import Path

# Models shipped inside the package: diffbatch/models/<name>/model_index.json.
PACKAGED_MODELS_DIR = Path(__file__).resolve().parent


def packaged_models() -> dict[str, str]:
    """Name -> folder of every diffusers model shipped under diffbatch/models/."""
    if not PACKAGED_MODELS_DIR.is_dir():
        return {}
    return {
        p.name: str(p) for p in sorted(PACKAGED_MODELS_DIR.iterdir())
        if (p / "model_index.json").is_file()
    }


# The default model: the trained `shapes` model shipped in diffbatch/models/ (it draws
# simple coloured shapes a person can judge by eye), else the random-weight `tiny-sd`
# where the package was installed without its model data.
DEFAULT_MODEL = "shapes" if (PACKAGED_MODELS_DIR / "shapes" / "model_index.json").is_file() \
    else "tiny-sd"
