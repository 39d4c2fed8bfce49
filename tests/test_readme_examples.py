"""The README's Python examples, run verbatim as plain scripts, as a new user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def python_examples() -> list[str]:
    """The ```python blocks of the README's "Python API" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run_script(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = cwd / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_the_readme_has_the_two_examples():
    examples = python_examples()
    assert len(examples) == 2
    assert "Engine()" in examples[0] and 'Engine("tiny-sd"' in examples[1]
    assert all("__main__" not in code for code in examples)  # no main guard needed


# Appended to an example: which model libraries the script's own process imported.
REPORT_MODULES = """
import sys
print("model libraries here:", [m for m in ("diffusers", "transformers") if m in sys.modules],
      file=sys.stderr)
"""


def test_default_model_example_runs_as_a_plain_script(tmp_path):
    done = run_script(python_examples()[0] + REPORT_MODULES, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # the worker loads the pipeline; the script's process never imports diffusers or
    # transformers (seconds of start-up)
    assert "model libraries here: []" in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip().startswith("[")
    for name in ("shape0.png", "shape1.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size == (64, 64)  # the default model's own size
    assert "requires torchvision" not in done.stderr


def test_async_tiny_sd_example_runs_as_a_plain_script(tmp_path):
    done = run_script(python_examples()[1], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = eval(done.stdout.strip().splitlines()[-1])  # the printed list of wave sizes
    assert len(sizes) == 4 and max(sizes) > 1  # the four concurrent requests shared a wave
    with Image.open(tmp_path / "cat.png") as image:
        assert image.size == (64, 64)
