"""The public API: `diffbatch.__all__` is exactly what the package exports."""

from __future__ import annotations

import re
from pathlib import Path

import diffbatch


def test_all_matches_the_public_names():
    public = {name for name in dir(diffbatch) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(diffbatch, name)).__name__ == "module"}
    assert set(diffbatch.__all__) - {"__version__"} == public - modules
    assert len(diffbatch.__all__) == len(set(diffbatch.__all__))


def test_the_documented_entry_points_exist():
    from diffbatch import Engine, SamplingParams

    for name in ("generate", "generate_async", "abort", "close", "check_health"):
        assert callable(getattr(Engine, name))
    assert SamplingParams().num_outputs_per_prompt == 1


def test_every_error_the_readme_names_is_importable_from_the_package():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    named = set(re.findall(r"\b([A-Z][A-Za-z]*Error)\b", readme))
    assert named and named <= set(diffbatch.__all__), named - set(diffbatch.__all__)
