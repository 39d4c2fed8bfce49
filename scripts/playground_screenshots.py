"""Screenshots of the playground for the docs, with the built-in `shapes` model.

Serves `shapes` (waves of up to 4, a 300 ms admission wait so the page's burst shares a
wave), opens `GET /` in the system's headless Chromium (the one `make browser`
installs) and saves each state under docs/images/:

- playground-generate.png: 4 requests sent at once, one wave of 4, each image with
  its seed, wave size, queue and forward time, and the live wave strip;
- playground-stream.png: 4 more, streamed at 120 steps, caught while their cards
  show their second partial image;
- playground-edit.png: "Edit" on a result, image-to-image towards another prompt
  (`shapes` cannot inpaint: diffusers' SD inpainting takes a UNet of 4 or 9 input
  channels, and its UNet has 8);
- playground-api-key.png: a server started with an API key, refusing the page until
  the key is entered.

Usage:
    python scripts/playground_screenshots.py [--out docs/images] [--chromium PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffbatch import Engine  # noqa: E402
from diffbatch.entrypoints.openai.api_server import build_app, uvicorn_config  # noqa: E402

TIMEOUT_MS = 120_000
PROMPT = "a large red circle on a white background"
EDIT_PROMPT = "a large blue circle on a white background"
STREAM_PROMPT = "a large green triangle on a black background"
FINAL = ".card[data-state='final']"  # a card showing its image (not a partial one)


@contextlib.contextmanager
def serve(app: object) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port; yields the base URL."""
    import httpx
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        httpx.get(f"{url}/health", timeout=120).raise_for_status()
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def open_page(browser: object, url: str) -> object:
    page = browser.new_page(viewport={"width": 1280, "height": 860})  # type: ignore[attr-defined]
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{url}/")
    page.wait_for_selector("body[data-ready=true]")
    return page


def generate_and_edit(browser: object, url: str, out: Path) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    page = open_page(browser, url)
    page.fill("#prompt", PROMPT)
    page.fill("#seed", "1")
    page.fill("#steps", "15")
    page.fill("#requests", "4")
    page.click("#submit")
    expect(page.locator(FINAL)).to_have_count(4)
    expect(page.locator("#waves li")).not_to_have_count(0)
    page.screenshot(path=str(out / "playground-generate.png"))
    # The same, streamed slowly enough to catch the partial images.
    page.fill("#prompt", STREAM_PROMPT)
    page.fill("#seed", "11")
    page.fill("#steps", "120")
    page.fill("#previews", "3")
    page.click("#submit")
    expect(page.locator(".card[data-state='partial'][data-partial-index='1']")
           ).to_have_count(4)
    page.screenshot(path=str(out / "playground-stream.png"))
    expect(page.locator(FINAL)).to_have_count(8)
    page.fill("#steps", "15")
    # Edit the first result towards another prompt.
    page.locator(".card .edit-this").last.click()
    page.wait_for_selector("#edit-stage:not([hidden])")
    page.fill("#prompt", EDIT_PROMPT)
    page.fill("#strength", "0.7")
    page.fill("#requests", "1")
    page.click("#submit")
    page.wait_for_selector("#status:has-text('1 of 1'), #error:not([hidden])")
    if page.is_visible("#error"):
        raise SystemExit(f"the edit failed: {page.text_content('#error')}")
    expect(page.locator(FINAL)).to_have_count(9)
    page.locator("header").scroll_into_view_if_needed()
    page.screenshot(path=str(out / "playground-edit.png"), full_page=True)
    page.close()


def api_key_refused(browser: object, url: str, out: Path) -> None:
    page = open_page(browser, url)
    page.fill("#prompt", PROMPT)
    page.click("#submit")
    page.wait_for_selector("#error:not([hidden])")
    page.screenshot(path=str(out / "playground-api-key.png"))
    page.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--chromium", default=os.environ.get("DIFFBATCH_CHROMIUM")
                        or shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args()
    if not args.chromium:
        parser.error("no Chromium found: run `make browser` or pass --chromium")
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with Engine("shapes", max_num_seqs=4, request_batch_max_wait_ms=300) as engine, \
            sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, headless=True)
        with serve(build_app(engine, served_model_name="shapes",
                             close_engine_on_shutdown=False)) as url:
            generate_and_edit(browser, url, args.out)
        with serve(build_app(engine, served_model_name="shapes", api_key="secret",
                             close_engine_on_shutdown=False)) as url:
            api_key_refused(browser, url, args.out)
        browser.close()
    print(f"screenshots in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
