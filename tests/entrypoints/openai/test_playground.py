"""The playground page in a real headless Chromium, against a real server.

The browser is the system's Chromium (installed by `make install-dev`), driven by
playwright through its path: nothing is downloaded. Without one the tests skip, and
under `make test` (`DIFFBATCH_REQUIRE_BROWSER=1`) they fail instead.

The engine runs `GatedPipeline` in-process with waves of up to 4: a first request
holds the gate, the page's 4 requests queue behind it, and the test releases the
gate once all 4 wait, so they run as one wave of 4, a state the test creates rather
than a timing it hopes for. Edits use the fake pipeline's rule (noise mixed in only
where the mask paints), so an unpainted pixel must come back as it went in. The page
streams (n = 1): its cards show partial images, then the image; the streaming test's
`PreviewGatedPipeline` holds a wave at its partial images until the test lets it end.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import make_gate, serve_in_thread
from tests.fake_pipelines import OverheadGatedPipeline
from tests.process_utils import wait_until

pytestmark = pytest.mark.slow

TIMEOUT_MS = 20_000  # bounds a broken test only: a red test fails in seconds
SCREENSHOTS = os.environ.get("DIFFBATCH_SCREENSHOT_DIR")  # also save each state's screenshot


def chromium_path() -> str | None:
    """The system Chromium: `$DIFFBATCH_CHROMIUM`, else the first on PATH."""
    given = os.environ.get("DIFFBATCH_CHROMIUM")
    if given:
        return given
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        message = ("no Chromium found: run `make browser` (apt's chromium) or set "
                   "DIFFBATCH_CHROMIUM")
        if os.environ.get("DIFFBATCH_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"the page raised: {errors}"


def snap(page: Any, name: str, tmp_path: Path) -> None:
    """Screenshot the page: into the test's folder, and `$DIFFBATCH_SCREENSHOT_DIR`."""
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    if SCREENSHOTS:
        page.screenshot(path=os.path.join(SCREENSHOTS, f"{name}.png"), full_page=True)


def expect(locator: Any) -> Any:
    """playwright's `expect` (its waits use selectors: the page's CSP forbids eval)."""
    from playwright.sync_api import expect as playwright_expect

    playwright_expect.set_options(timeout=TIMEOUT_MS)
    return playwright_expect(locator)


def open_playground(page: Any, url: str) -> None:
    response = page.goto(f"{url}/")
    assert response.status == 200 and "default-src 'none'" in response.headers[
        "content-security-policy"]
    page.wait_for_selector("body[data-ready=true]")


FINAL = ".card[data-state='final']"  # a card showing its image (not a partial one)


def card_pixels(page: Any, index: int, cards: str = ".card") -> np.ndarray:
    """The RGB pixels of the `index`-th result card (newest first), from its data URL."""
    src = page.locator(f"{cards} img").nth(index).get_attribute("src")
    data = base64.b64decode(src.split(",", 1)[1])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def gated() -> Iterator[tuple[str, Engine, Any]]:
    gate = make_gate()
    with Engine(pipeline_class=gate, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=0) as engine:
        app = build_app(engine, served_model_name="fake", close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            try:
                yield url, engine, gate
            finally:
                gate.release.set()


def submit_behind_a_blocker(page: Any, url: str, engine: Engine, gate: Any,
                            fields: dict[str, str]) -> None:
    """A request from elsewhere holds the (only) forward while the page submits `fields`
    (its 4 requests), then lets go once all 4 wait: they run as one wave if capacity
    allows, a state the test creates rather than a timing it hopes for."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        blocker = pool.submit(httpx.post, f"{url}/v1/images/generations",
                              json={"prompt": "hold the gate"}, timeout=120)
        assert gate.entered.wait(60)
        for selector, value in {**fields, "#requests": "4"}.items():
            page.fill(selector, value)
        page.click("#submit")
        wait_until(lambda: engine.num_waiting == 4, what="the page's 4 requests to queue")
        gate.release.set()
        assert blocker.result().status_code == 200


def test_generate_shows_each_image_with_its_wave(page: Any, gated, tmp_path: Path) -> None:
    url, engine, gate = gated
    open_playground(page, url)
    assert page.text_content("#model") == "model: fake"
    snap(page, "playground-empty", tmp_path)
    # 1. A request from elsewhere holds the (only) forward, so the page's 4 queue.
    submit_behind_a_blocker(page, url, engine, gate, {"#prompt": "a red circle", "#seed": "10"})
    # 2. Four cards in request order, each with its seed and the wave of 4 it ran in.
    expect(page.locator(FINAL)).to_have_count(4)
    cards = page.locator(".card")
    assert [int(cards.nth(i).get_attribute("data-seed")) for i in range(4)] \
        == [10, 11, 12, 13]
    for i in range(4):
        assert cards.nth(i).get_attribute("data-wave-size") == "4"
        assert cards.nth(i).locator("dd.wave").text_content() == "4 requests"
        assert cards.nth(i).locator("dd.forward").text_content().endswith(" ms")
    assert page.text_content("#status").startswith("4 of 4 done")
    # 3. The live strip shows the blocker's wave of 1, then the wave of 4.
    page.wait_for_selector("#waves li[data-size='4']")
    sizes = [int(s) for s in page.eval_on_selector_all(
        "#waves li", "items => items.map(i => i.dataset.size)")]
    assert sizes[-2:] == [1, 4]
    assert "16x16/s2/g5/n1" in page.text_content("#waves li[data-size='4']")
    snap(page, "playground-generate", tmp_path)


@pytest.fixture(scope="module")
def defaults() -> Iterator[tuple[str, Engine, Any]]:
    """A gated server with no batching settings at all: capacity and wait are "auto",
    learned on a model whose waves pay a fixed cost (so batching pays)."""
    gate = make_gate(OverheadGatedPipeline)
    with Engine(pipeline_class=gate, executor="inproc") as engine:
        app = build_app(engine, served_model_name="fake", close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            try:
                yield url, engine, gate
            finally:
                gate.release.set()


def test_queued_requests_share_a_wave_with_no_flags(page: Any, defaults) -> None:
    """With the default settings, the page's 4 requests that wait together run as one
    wave of 4: "auto" capacity, learned at start-up, admits them all. A blocker holds
    the forward while they queue: the wave is a state the test creates, not a timing."""
    url, engine, gate = defaults
    assert engine.config.max_num_seqs == "auto" == engine.config.request_batch_max_wait_ms
    open_playground(page, url)
    submit_behind_a_blocker(page, url, engine, gate, {"#prompt": "four at once"})
    expect(page.locator(FINAL)).to_have_count(4)
    cards = page.locator(".card")
    assert [cards.nth(i).get_attribute("data-wave-size") for i in range(4)] == ["4"] * 4


def test_an_edit_round_trip_paints_only_where_the_mask_is(page: Any, gated,
                                                          tmp_path: Path) -> None:
    url, _, gate = gated
    gate.release.set()
    open_playground(page, url)
    page.fill("#n", "1")
    page.fill("#seed", "5")
    page.fill("#size", "64x64")
    page.click("#submit")
    page.wait_for_selector(FINAL)
    source = card_pixels(page, 0)
    # 1. "Edit" on the result: the edit tab opens on it.
    page.click(".card .edit-this")
    page.wait_for_selector("#edit-stage:not([hidden])")
    assert page.is_visible("#edit-panel") and page.text_content("#submit") == "Edit"
    # 2. Paint a fast stroke down the left quarter of the 64x64 image: two pointer
    # events, top and bottom, which the page joins with a line.
    box = page.locator("#edit-mask").bounding_box()
    page.fill("#brush", "20")
    page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + 4)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + box["height"] - 4, steps=1)
    page.mouse.up()
    page.fill("#prompt", "a blue square")
    snap(page, "playground-edit-mask", tmp_path)
    with page.expect_response("**/v1/images/edits") as answer:
        page.click("#submit")
    response = answer.value
    assert response.status == 200, response.text()
    expect(page.locator(FINAL)).to_have_count(2)
    # the wave ran as inpainting (its key, in the live strip), at the fake's default strength
    expect(page.locator("#waves li").last).to_contain_text("64x64/s2/g5/n1/inpaint@1")
    edited = card_pixels(page, 0)
    assert edited.shape == source.shape == (64, 64, 3)
    assert (edited[:, 40:] == source[:, 40:]).all()  # unpainted: as it went in
    # painted: changed in every row of the stroke, between its two points too
    assert (edited[2:62, :8] != source[2:62, :8]).any(axis=(1, 2)).all()
    snap(page, "playground-edit", tmp_path)
    # 3. An uploaded image without a mask is image-to-image.
    upload = tmp_path / "upload.png"
    Image.new("RGB", (24, 16), (10, 200, 10)).save(upload)
    page.set_input_files("#edit-file", str(upload))
    expect(page.locator("#edit-mask")).to_have_attribute("width", "24")
    page.fill("#size", "")
    with page.expect_response("**/v1/images/edits") as answer:
        page.click("#submit")
    assert answer.value.status == 200
    expect(page.locator(FINAL)).to_have_count(3)
    expect(page.locator("#waves li").last).to_contain_text("24x16/s2/g5/n1/i2i@0.8")
    assert card_pixels(page, 0).shape == (16, 24, 3)
    assert page.text_content(".card dd.size") == "24x16"


def test_a_generate_click_shows_streamed_partial_images_then_the_image(
        page: Any, tmp_path: Path) -> None:
    from tests.fake_pipelines import PreviewGatedPipeline

    gate = make_gate(PreviewGatedPipeline)
    with Engine(pipeline_class=gate, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=0) as engine:
        app = build_app(engine, served_model_name="fake", close_engine_on_shutdown=False)
        with serve_in_thread(app) as url, ThreadPoolExecutor(max_workers=1) as pool:
            try:
                open_playground(page, url)
                # 1. A plain request holds the forward; the page's 2 requests queue.
                blocker = pool.submit(httpx.post, f"{url}/v1/images/generations",
                                      json={"prompt": "hold the gate"}, timeout=120)
                assert gate.entered.wait(60)
                page.fill("#prompt", "a red circle")
                page.fill("#seed", "20")
                page.fill("#steps", "4")
                page.fill("#previews", "3")
                page.fill("#requests", "2")
                page.click("#submit")
                wait_until(lambda: engine.num_waiting == 2, what="the page's 2 requests")
                gate.release.set()
                assert blocker.result().status_code == 200
                # 2. Their wave sent its partial images and holds: the cards show them.
                assert gate.previewed.wait(60)
                partial = ".card[data-state='partial'][data-partial-index='2']"
                expect(page.locator(partial)).to_have_count(2)
                expect(page.locator(".card .badge").first).to_have_text("preview 3")
                previews = [card_pixels(page, i) for i in range(2)]
                snap(page, "playground-stream", tmp_path)
                # 3. The wave ends: each card shows its image and the wave of 2 it ran in.
                gate.finish.set()
                expect(page.locator(FINAL)).to_have_count(2)
                cards = page.locator(".card")
                for i in range(2):
                    assert cards.nth(i).get_attribute("data-wave-size") == "2"
                    assert cards.nth(i).locator("dd.wave").text_content() == "2 requests"
                    final = card_pixels(page, i)
                    # the fake's last preview (after step 3 of 4) is 3/4 of its image
                    assert np.abs(previews[i] - final * 0.75).max() <= 1
                assert sorted(int(cards.nth(i).get_attribute("data-seed"))
                              for i in range(2)) == [20, 21]
                # (set once both streams have ended: after the cards, not with them)
                expect(page.locator("#status")).to_have_text(re.compile(r"^2 of 2 done"))
            finally:
                gate.release.set()
                gate.finish.set()


def partial_image_event() -> str:
    """One server-sent partial image event (a gray 8x8 PNG)."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buffer, "PNG")
    data = {"type": "image_generation.partial_image", "partial_image_index": 0,
            "b64_json": base64.b64encode(buffer.getvalue()).decode(),
            "output_format": "png", "size": "8x8"}
    return f"event: image_generation.partial_image\ndata: {json.dumps(data)}\n\n"


_PARTIAL = partial_image_event()


@pytest.mark.parametrize("body", [
    pytest.param(_PARTIAL, id="ends-without-its-image"),
    pytest.param(_PARTIAL + "event: image_generation.partial_image\ndata: {cut off\n\n",
                 id="breaks-off-mid-event"),
])
def test_a_stream_that_stops_short_fails_its_card_and_frees_the_button(
        page: Any, gated, body: str) -> None:
    """A streamed answer that ends before its image (a server gone mid-stream) shows an
    error, marks its card failed and enables Generate again; the page raises nothing."""
    url, _, _ = gated
    open_playground(page, url)
    page.route("**/v1/images/generations", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.fill("#previews", "2")
    page.click("#submit")
    page.wait_for_selector("#error:not([hidden])")
    expect(page.locator(".card[data-state='failed']")).to_have_count(1)
    assert page.is_enabled("#submit")
    assert page.text_content("#status").startswith("0 of 1 done")


def test_an_api_key_server_refuses_without_the_key_and_works_with_it(page: Any,
                                                                      tmp_path: Path) -> None:
    from tests.fake_pipelines import FakeBatchPipeline

    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=1) as engine:
        app = build_app(engine, served_model_name="fake", api_key="s3cret",
                        close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            open_playground(page, url)
            assert "enter the API key" in page.text_content("#model")
            page.click("#submit")
            page.wait_for_selector("#error:not([hidden])")
            assert "missing API key" in page.text_content("#error")
            assert page.locator(".card").count() == 0
            snap(page, "playground-api-key-refused", tmp_path)
            page.fill("#api-key", "s3cret")
            page.dispatch_event("#api-key", "change")
            expect(page.locator("#model")).to_have_text("model: fake")
            page.click("#submit")
            page.wait_for_selector(FINAL)
            assert page.is_hidden("#error")
            page.wait_for_selector("#waves li")  # the strip polls with the key too


def test_the_api_docs_render_without_any_other_host(page: Any, gated) -> None:
    """/docs (Swagger UI) shows the image operations with every request to another
    host refused, as on a machine without internet access."""
    url, _, _ = gated
    elsewhere: list[str] = []

    def only_this_server(route: Any) -> None:
        if route.request.url.startswith(url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_server)
    assert page.goto(f"{url}/docs").status == 200
    expect(page.locator(".opblock-summary-path[data-path='/v1/images/generations']")
           ).to_be_visible()
    assert not elsewhere, elsewhere


def test_the_playground_offers_what_the_model_takes(page: Any, gated) -> None:
    """The size list is the one /v1/models gives; each tab keeps its own request count
    (a click on Edit sends one edit, not the Generate tab's 4)."""
    url, _, gate = gated
    gate.release.set()
    open_playground(page, url)
    accepts = httpx.get(f"{url}/v1/models").json()["data"][0]["diffbatch"]
    expect(page.locator("#sizes option")).to_have_count(len(accepts["sizes"]) + 1)
    offered = page.eval_on_selector_all("#sizes option", "items => items.map(i => i.value)")
    assert offered == ["auto", *accepts["sizes"]]
    assert page.get_attribute("#size", "placeholder") == "auto (16x16)"
    page.fill("#requests", "4")
    page.click("#tab-edit")
    assert page.input_value("#requests") == "1"
    page.click("#tab-generate")
    assert page.input_value("#requests") == "4"
    assert page.is_hidden("#edit-note")


@pytest.mark.parametrize("edits", ["image-to-image", "none"])
def test_mask_painting_is_offered_only_for_a_model_that_inpaints(page: Any, tmp_path: Path,
                                                                 edits: str) -> None:
    from tests.fake_pipelines import ImageToImagePipeline, NoEditPipeline

    pipeline = ImageToImagePipeline if edits == "image-to-image" else NoEditPipeline
    with Engine(pipeline_class=pipeline, executor="inproc", max_num_seqs=1) as engine:
        app = build_app(engine, served_model_name="fake", max_image_pixels=32 * 32,
                        close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            open_playground(page, url)
            expect(page.locator("#sizes option")).to_have_count(4)
            assert page.eval_on_selector_all(
                "#sizes option", "items => items.map(i => i.value)") == [
                    "auto", "8x8", "16x16", "32x32"]  # 32x32: the server's pixel cap
            if edits == "none":
                assert page.is_disabled("#tab-edit")
                assert "cannot edit images" in page.text_content("#edit-note")
                return
            page.click("#tab-edit")
            expect(page.locator("#edit-note")).to_be_visible()
            assert "cannot inpaint" in page.text_content("#edit-note")
            upload = tmp_path / "upload.png"
            Image.new("RGB", (16, 16), (10, 200, 10)).save(upload)
            page.set_input_files("#edit-file", str(upload))
            page.wait_for_selector("#edit-stage:not([hidden])")
            assert page.is_hidden("#edit-mask") and page.is_hidden("#mask-tools")
            snap(page, "playground-image-to-image-only", tmp_path)
            with page.expect_response("**/v1/images/edits") as answer:
                page.click("#submit")
            assert answer.value.status == 200, answer.value.text()  # no mask was sent
            page.wait_for_selector(FINAL)
