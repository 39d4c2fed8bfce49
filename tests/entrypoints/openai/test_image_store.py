"""`response_format: "url"`: the bounded, expiring image store and the links it serves."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.entrypoints.openai.image_store import ImageStore, ImageStoreFullError
from tests.clock import ManualClock
from tests.entrypoints.openai.conftest import app_client
from tests.entrypoints.openai.test_input_validation import assert_openai_error
from tests.fake_pipelines import FakeBatchPipeline

ROUTE = "/v1/images/generations"
KEY = {"Authorization": "Bearer k"}



# -- the store -------------------------------------------------------------------------------
def test_images_expire_after_their_ttl() -> None:
    clock = ManualClock(100.0)
    store = ImageStore(max_bytes=1000, ttl_s=60, clock=clock)
    first = store.put(b"a" * 10, "png")
    clock.now += 30
    second = store.put(b"b" * 10, "webp")
    assert first.endswith(".png") and second.endswith(".webp") and first != second
    image = store.get(first)
    assert image is not None and (image.data, image.media_type) == (b"a" * 10, "image/png")
    assert store.seconds_left(image) == 30
    clock.now += 30  # the first is 60 s old: gone; the second has 30 s left
    assert store.get(first) is None and store.get(second) is not None
    assert (len(store), store.num_bytes) == (1, 10)
    clock.now += 30
    assert store.get(second) is None and (len(store), store.num_bytes) == (0, 0)


def test_the_oldest_images_make_room_and_one_too_large_is_refused() -> None:
    store = ImageStore(max_bytes=25, ttl_s=60, clock=ManualClock(100.0))
    ids = [store.put(bytes([i]) * 10, "png") for i in range(3)]
    assert [store.get(i) is not None for i in ids] == [False, True, True]
    assert store.num_bytes == 20
    with pytest.raises(ImageStoreFullError, match="b64_json"):
        store.put(b"x" * 26, "png")
    assert store.get("no-such-id.png") is None


def test_the_images_of_one_answer_are_kept_together() -> None:
    store = ImageStore(max_bytes=25, ttl_s=60, clock=ManualClock(100.0))
    old = store.put(b"o" * 10, "png")
    ids = store.put_all([b"a" * 10, b"b" * 10], "png")
    assert store.get(old) is None  # older images make room, never one of the answer's
    assert [store.get(i).data for i in ids] == [b"a" * 10, b"b" * 10]
    with pytest.raises(ImageStoreFullError, match="3 image file"):
        store.put_all([b"x" * 10] * 3, "png")
    assert [store.get(i) is not None for i in ids] == [True, True]  # nothing was dropped


def test_ids_are_unguessable() -> None:
    store = ImageStore()
    ids = {store.put(b"x", "png") for _ in range(100)}
    assert len(ids) == 100 and all(len(i.removesuffix(".png")) == 32 for i in ids)


# -- over HTTP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=1) as engine:
        yield engine


def client_of(engine: Engine, **app_kwargs: Any) -> AbstractAsyncContextManager[Any]:
    """An in-process client of an app with the API key "k"."""
    return app_client(engine, api_key="k", **app_kwargs)


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with client_of(engine) as client:
        yield client


async def test_url_answers_links_that_need_no_key(client) -> None:
    response = await client.post(ROUTE, headers=KEY, json={
        "prompt": "a cat", "n": 2, "seed": 1, "response_format": "url", "output_format": "webp"})
    assert response.status_code == 200, response.text
    items = response.json()["data"]
    assert [set(item) for item in items] == [{"url", "revised_prompt"}] * 2
    same = await client.post(ROUTE, headers=KEY, json={
        "prompt": "a cat", "n": 2, "seed": 1, "output_format": "webp"})
    assert [set(item) for item in same.json()["data"]] == [{"b64_json", "revised_prompt"}] * 2
    for item in items:
        assert item["url"].startswith("http://app/v1/images/files/")
        download = await client.get(item["url"])  # no Authorization header
        assert download.status_code == 200
        assert download.headers["content-type"] == "image/webp"
        cache, max_age = download.headers["cache-control"].split(", max-age=")
        assert cache == "private" and 0 < int(max_age) <= 3600  # the link's time left
        assert Image.open(io.BytesIO(download.content)).size == (16, 16)
    # the downloads and a 404 have the route's own label in the metrics, not "other"
    assert (await client.get("/v1/images/files/gone.png")).status_code == 404
    registry = client._transport.app.state.http_metrics.registry
    label = {"route": "/v1/images/files/{file_id}", "method": "GET"}
    assert registry.get_sample_value("diffbatch_http_requests_total",
                                     {**label, "status": "200"}) == 2
    assert registry.get_sample_value("diffbatch_http_requests_total",
                                     {**label, "status": "404"}) == 1


async def test_an_unknown_link_is_a_404_and_other_v1_routes_keep_their_key(client) -> None:
    missing = await client.get("/v1/images/files/nothing-here.png")
    assert "an hour" in assert_openai_error(missing, 404, "file_id")["message"]
    assert (await client.get("/v1/images/filesystem")).status_code == 401
    assert (await client.get("/v1/models")).status_code == 401


async def test_edits_answer_links_too(client) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(buffer, format="PNG")
    response = await client.post("/v1/images/edits", headers=KEY,
                                 data={"prompt": "p", "response_format": "url"},
                                 files={"image": ("a.png", buffer.getvalue(), "image/png")})
    assert response.status_code == 200, response.text
    assert (await client.get(response.json()["data"][0]["url"])).status_code == 200


async def test_a_public_url_starts_the_links(engine: Engine) -> None:
    async with client_of(engine, public_url="https://img.example.com/api/") as client:
        response = await client.post(ROUTE, headers=KEY,
                                     json={"prompt": "p", "response_format": "url"})
    assert response.json()["data"][0]["url"].startswith(
        "https://img.example.com/api/v1/images/files/")
    with pytest.raises(ValueError, match="public_url"):
        build_app(engine, served_model_name="fake", public_url="img.example.com",
                  close_engine_on_shutdown=False)


async def test_links_the_store_could_not_keep_together_are_refused_before_any_compute(
        engine: Engine) -> None:
    # The fake's images are 16x16: at most 3 * 256 * 1.1 + 4096 = 4940 bytes each.
    async with client_of(engine, image_store_bytes=10_000, image_url_ttl_s=90) as client:
        body = {"prompt": "p", "response_format": "url", "n": 3}
        refused = await client.post(ROUTE, headers=KEY, json=body)
        message = assert_openai_error(refused, 400, "response_format")["message"]
        # the bound, checked before the engine ran it (not the store's refusal after)
        assert "3 image(s) of 16x16 may take up to" in message and "b64_json" in message
        answer = await client.post(ROUTE, headers=KEY, json={**body, "n": 2})
        assert answer.status_code == 200, answer.text
        for image in answer.json()["data"]:
            assert (await client.get(image["url"])).status_code == 200
        missing = await client.get("/v1/images/files/nothing-here.png")
        assert "links last 90 s after" in assert_openai_error(missing, 404, "file_id")["message"]


async def test_without_a_store_url_is_a_400(engine: Engine) -> None:
    async with client_of(engine, image_store_bytes=0) as client:
        response = await client.post(ROUTE, headers=KEY,
                                     json={"prompt": "p", "response_format": "url"})
        assert "b64_json" in assert_openai_error(response, 400, "response_format")["message"]
        missing = await client.get("/v1/images/files/x.png")
        assert "keeps no images" in assert_openai_error(missing, 404, "file_id")["message"]
