"""The playground's Video tab in a real headless Chromium, against a tiny-wan server.

The transformer is gated (`TransformerGate`) so the test sees the job's card at a
known step (its progress bar) before letting it finish and play.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import serve_in_thread
from tests.entrypoints.openai.test_playground import (  # noqa: F401 - fixtures
    browser,
    expect,
    open_playground,
    page,
    snap,
)
from tests.entrypoints.openai.test_videos import WAIT_S, TransformerGate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wan_server() -> Iterator[tuple[str, Engine]]:
    with Engine("tiny-wan", executor="inproc", max_num_seqs=4, warmup=False,
                calibration_budget_s=0) as engine:
        app = build_app(engine, served_model_name="tiny-wan", close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            yield url, engine


def test_video_tab_shows_progress_then_plays_the_clip(page: Any, wan_server,  # noqa: F811
                                                      tmp_path: Path) -> None:
    url, engine = wan_server
    gate = TransformerGate(engine)
    try:
        open_playground(page, url)
        # a video model: the Video tab is the page's tab, the image tabs are off
        expect(page.locator("#tab-video")).to_be_visible()
        expect(page.locator("#tab-video")).to_have_class("active")
        assert page.is_disabled("#tab-generate") and page.is_visible("#video-panel")
        page.fill("#prompt", "a red cat")
        page.fill("#size", "48x32")
        page.fill("#seconds", "0.5")  # 8 frames at 16 fps: Wan's nearest count is 9
        page.fill("#seed", "4")
        gate.hold(at_call=3)  # 4 steps with CFG: the second step's first call
        page.click("#submit")
        assert gate.held.wait(WAIT_S)
        card = page.locator(".video-card").first
        expect(card).to_have_attribute("data-state", "in_progress")
        expect(card).to_have_attribute("data-progress", "25")  # 1 of 4 steps done
        assert card.locator("progress").get_attribute("value") == "25"
        snap(page, "playground-video-progress", tmp_path)
        gate.open()
        expect(card).to_have_attribute("data-state", "final")
        width, height, duration = card.locator("video").evaluate(
            "v => new Promise(done => { const read = () => done([v.videoWidth, "
            "v.videoHeight, v.duration]); if (v.readyState >= 1) read(); "
            "else v.addEventListener('loadedmetadata', read); })")
        assert (width, height) == (48, 32)
        assert duration == pytest.approx(9 / 16, abs=0.07)
        assert page.text_content("#status").startswith("1 of 1 videos done")
        snap(page, "playground-video", tmp_path)
    finally:
        gate.close()
