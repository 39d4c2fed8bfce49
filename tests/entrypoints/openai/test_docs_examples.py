"""The `openai` client examples of docs/serving.md work against the servers they name.

The server is what `make serve` starts: no MODEL (the default model), no API key,
the served model name left to its default; the inpainting example's is `make serve
MODEL=tiny-sd`. Each example's code is read from the document and run unchanged but
for the port, in one folder, in the document's order (the edits edit the image the
generation example wrote).
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


def python_block_after(phrase: str) -> str:
    """The first Python block after `phrase` in the document."""
    text = DOC.read_text()
    start = text.index(phrase)
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no Python block after {phrase!r}"
    return match.group(1)


def openai_example() -> str:
    """The Python block that follows "With the official `openai` Python client"."""
    return python_block_after("With the official `openai` Python client")


def run_example(code: str, url: str) -> None:
    assert DOC_URL in code
    exec(compile(code.replace(DOC_URL, url), str(DOC), "exec"), {})


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    with Engine(None, executor="inproc") as engine:
        app = build_app(engine, served_model_name=served_name_of(engine, None))
        with serve_in_thread(app) as url:
            yield url


@pytest.fixture(scope="module")
def tiny_sd_server() -> Iterator[str]:
    with Engine("tiny-sd", executor="inproc") as engine:
        app = build_app(engine, served_model_name="tiny-sd")
        with serve_in_thread(app) as url:
            yield url


def test_the_openai_client_example_runs_against_make_serve(
    default_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    run_example(openai_example(), default_server)
    images = sorted(tmp_path.glob("image-*.png"))
    assert len(images) == 2
    for path in images:
        assert Image.open(path).size == (64, 64)
    assert "shapes" in capsys.readouterr().out
    # The edits: image-to-image on the default model, inpainting on tiny-sd's server.
    run_example(python_block_after("With the official `openai` client, image-to-image"),
                default_server)
    assert Image.open(tmp_path / "edited.png").size == (64, 64)
    assert capsys.readouterr().out.strip() == "64x64"


def test_the_inpainting_and_link_examples_run(
    default_server: str, tiny_sd_server: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "image-0.png")
    run_example(python_block_after("and inpainting, with an OpenAI-style mask"),
                tiny_sd_server)
    assert [Image.open(tmp_path / f"inpainted-{i}.png").size for i in (0, 1)] == [(64, 64)] * 2
    run_example(python_block_after('answers with links instead of base64 images'),
                default_server)
    assert Image.open(tmp_path / "linked.png").size == (64, 64)


def test_the_streaming_examples_run(default_server: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    run_example(python_block_after("With the official `openai` client, a generation and "
                                   "then an edit"), default_server)
    assert capsys.readouterr().out.split() == [
        "image_generation.partial_image", "image_generation.partial_image",
        "image_generation.completed", "image_edit.partial_image", "image_edit.completed"]
    for name in ("partial-0.png", "partial-1.png", "streamed.png"):
        assert Image.open(tmp_path / name).size == (64, 64)
    # The Python API's example (its own engine, no server).
    code = python_block_after("**From Python**, `Engine.generate_stream`")
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    assert sorted(p.name for p in tmp_path.glob("step-*.png")) == [
        "step-1.png", "step-2.png", "step-3.png"]
    assert Image.open(tmp_path / "final.png").size == (64, 64)

