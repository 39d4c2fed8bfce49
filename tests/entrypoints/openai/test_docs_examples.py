"""The `openai` client example of docs/serving.md works against a default server.

The server is what `make serve` starts: no MODEL (the default model), no API key,
the served model name left to its default. The example's code is read from the
document and run unchanged but for the port.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app, served_name_of
from tests.entrypoints.openai.conftest import serve_in_thread

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[3] / "docs" / "serving.md"
DOC_URL = "http://127.0.0.1:8000"


def openai_example() -> str:
    """The Python block that follows "With the official `openai` Python client"."""
    text = DOC.read_text()
    start = text.index("With the official `openai` Python client")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, "no Python block after the openai client paragraph"
    return match.group(1)


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    with Engine(None, executor="inproc") as engine:
        app = build_app(engine, served_model_name=served_name_of(engine, None))
        with serve_in_thread(app) as url:
            yield url


def test_the_openai_client_example_runs_against_make_serve(
    default_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = openai_example()
    assert DOC_URL in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace(DOC_URL, default_server), str(DOC), "exec"), {})
    images = sorted(tmp_path.glob("image-*.png"))
    assert len(images) == 2
    for path in images:
        assert Image.open(path).size == (64, 64)
    assert "shapes" in capsys.readouterr().out
