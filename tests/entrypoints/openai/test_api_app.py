"""The app in-process (httpx's ASGI transport) on an in-process fake-pipeline engine.

Fast checks of every answer's shape: successes in each output format, every error
in the OpenAI shape with the right status and `param`, auth, and metrics. The
same behaviour over a real socket and the real model is in test_server.py.
"""

from __future__ import annotations

import base64
import io
import random
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from PIL import Image, ImageFilter

from diffbatch import Engine
from diffbatch.entrypoints.openai import serving_images
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.entrypoints.openai.serving_images import OpenAIServingImages, encode_images
from tests.entrypoints.openai.conftest import app_client, asgi_client
from tests.fake_pipelines import POISON, FakeBatchPipeline

API_KEY = "unit-key"
ROUTE = "/v1/images/generations"


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine, max_image_pixels=32 * 32,
                          max_body_bytes=64 * 1024) as client:
        yield client


@pytest.fixture
async def keyed_client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine, api_key=API_KEY) as client:
        yield client


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize(("fmt", "pil_format"), [("png", "PNG"), ("jpeg", "JPEG"),
                                                 ("webp", "WEBP")])
async def test_generates_each_output_format(client, fmt: str, pil_format: str) -> None:
    response = await client.post(ROUTE, json={
        "prompt": "a red circle", "n": 2, "size": "16x8", "seed": 3, "output_format": fmt,
    }, headers={"x-request-id": "my-id"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["output_format"], body["size"]) == (fmt, "16x8")
    assert isinstance(body["created"], int)
    assert len(body["data"]) == 2
    for item in body["data"]:
        assert item["revised_prompt"] is None
        image = decode(item["b64_json"])
        assert (image.format, image.size) == (pil_format, (16, 8))
    assert response.headers["x-request-id"] == "my-id"
    assert response.headers["x-diffbatch-batch-size"] == "1"  # alone in its wave
    ms = {t: float(response.headers[f"x-diffbatch-{t}-ms"])
          for t in ("queue", "execute", "engine", "encode")}
    assert ms["execute"] > 0 and ms["encode"] > 0 and ms["queue"] >= 0
    # the engine's time, arrival to delivery, holds the wait and the run (2-place rounding)
    assert ms["queue"] + ms["execute"] <= ms["engine"] + 0.01, ms


async def test_default_size_and_equal_seeds_give_equal_images(client) -> None:
    bodies = []
    for _ in range(2):
        response = await client.post(ROUTE, json={"prompt": "a cat", "seed": 11})
        assert response.status_code == 200, response.text
        bodies.append(response.json())
    assert bodies[0]["size"] == "16x16"
    assert bodies[0]["data"] == bodies[1]["data"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"n": 1}, 400, "prompt"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x" * 10_001}, 400, "prompt"),
        ({"prompt": "p", "n": 0}, 400, "n"),
        ({"prompt": "p", "n": 11}, 400, "n"),
        ({"prompt": "p", "size": "abc"}, 400, "size"),
        ({"prompt": "p", "size": "12x16"}, 400, "size"),
        ({"prompt": "p", "size": "64x64"}, 400, "size"),
        ({"prompt": "p", "num_inference_steps": 0}, 400, "num_inference_steps"),
        ({"prompt": "p", "num_inference_steps": 10_000}, 400, "num_inference_steps"),
        ({"prompt": "p", "model": "other"}, 404, "model"),
        ({"prompt": "p", "lora": "../style"}, 400, "lora"),
        ({"prompt": "p", "lora": "/etc"}, 400, "lora"),
        ({"prompt": "p", "lora": "missing"}, 404, "lora"),
        ({"prompt": "p", "unknown_field": 1}, 400, "unknown_field"),
        ([{"prompt": "p"}], 400, None),
    ],
)
async def test_bad_input_is_an_openai_error(client, body, status: int, param: str | None) -> None:
    error = assert_openai_error(await client.post(ROUTE, json=body), status, param)
    assert error["type"] in ("invalid_request_error", "not_found_error")


async def test_nan_guidance_is_rejected(client) -> None:
    # The JSON token NaN (accepted by Python's json module) must not reach the engine.
    response = await client.post(ROUTE, content=b'{"prompt": "p", "guidance_scale": NaN}',
                                 headers={"content-type": "application/json"})
    assert "finite" in assert_openai_error(response, 400, "guidance_scale")["message"]


async def test_valid_lora_inside_the_folder_is_served(client) -> None:
    response = await client.post(ROUTE, json={"prompt": "p", "lora": "style", "seed": 1})
    assert response.status_code == 200, response.text


async def test_malformed_json_wrong_type_and_oversized_bodies(client) -> None:
    json_header = {"content-type": "application/json"}
    error = assert_openai_error(
        await client.post(ROUTE, content=b'{"prompt": ', headers=json_header), 400
    )
    assert "not valid JSON" in error["message"]
    error = assert_openai_error(
        await client.post(ROUTE, content=b"prompt=a", headers={"content-type": "text/plain"}), 415
    )
    assert "application/json" in error["message"]
    assert_openai_error(await client.post(ROUTE, content=b'{"prompt": "a"}'), 415)
    big = b'{"prompt": "' + b"a" * (64 * 1024) + b'"}'
    assert_openai_error(await client.post(ROUTE, content=big, headers=json_header), 413)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        for _ in range(80):
            yield b" " * 1024

    assert_openai_error(await client.post(ROUTE, content=chunks(), headers=json_header), 413)


async def test_unknown_route_and_method(client) -> None:
    assert_openai_error(await client.get("/v1/nothing"), 404)
    assert_openai_error(await client.get(ROUTE), 405)


async def test_pipeline_failure_is_a_500(client) -> None:
    response = await client.post(ROUTE, json={"prompt": f"{POISON} apple"})
    assert assert_openai_error(response, 500)["type"] == "server_error"
    assert (await client.post(ROUTE, json={"prompt": "fine"})).status_code == 200


async def test_api_key(keyed_client) -> None:
    body = {"prompt": "a cat"}
    error = assert_openai_error(await keyed_client.post(ROUTE, json=body), 401)
    assert error["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(await keyed_client.post(ROUTE, json=body, headers=wrong), 401)
    assert_openai_error(await keyed_client.get("/v1/models", headers=wrong), 401)
    # The key is checked before the body: no key + malformed JSON is still a 401.
    assert_openai_error(await keyed_client.post(ROUTE, content=b"{"), 401)
    right = {"Authorization": f"Bearer {API_KEY}"}
    assert (await keyed_client.post(ROUTE, json=body, headers=right)).status_code == 200
    for open_path in ("/health", "/metrics", "/docs", "/openapi.json"):
        assert (await keyed_client.get(open_path)).status_code == 200, open_path


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_api_docs_load_nothing_from_another_host(keyed_client, page: str) -> None:
    """The docs pages work offline: every script and stylesheet they name is served
    here (also with an API key set), none comes from a CDN."""
    html = (await keyed_client.get(page)).text
    assets = re.findall(r"""(?:src|href)=["']([^"']+\.(?:js|css))["']""", html)
    assert assets, html
    for asset in assets:
        assert asset.startswith("/"), asset  # this server, not https://cdn...
        response = await keyed_client.get(asset)
        assert response.status_code == 200 and len(response.content) > 1000, asset


async def test_models(client) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    # the model, then the adapters of its --lora-dir, each with the model as parent
    assert [(m["id"], m["parent"]) for m in body["data"]] == [("fake", None), ("style", "fake")]
    assert body["data"][0]["object"] == "model"
    assert (await client.get("/v1/models/fake")).json()["id"] == "fake"
    assert (await client.get("/v1/models/style")).json()["parent"] == "fake"
    assert_openai_error(await client.get("/v1/models/other"), 404, "model")


async def metric_values(client: httpx.AsyncClient) -> dict[tuple[str, frozenset], float]:
    """Every sample of GET /metrics: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_cover_both_layers(client) -> None:
    """One image request moves each layer's counters by exactly one (refusals and how
    they are counted: test_rejections.py)."""
    before = await metric_values(client)
    response = await client.post(ROUTE, json={"prompt": "p", "n": 2})
    assert response.status_code == 200
    after = await metric_values(client)

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("diffbatch_requests_total", outcome="completed") == 1
    assert grew("diffbatch_wave_size_requests_count") == 1
    assert grew("diffbatch_wave_size_requests_sum") == 1  # requests, not images
    assert grew("diffbatch_http_requests_total", route=ROUTE, method="POST", status="200") == 1
    assert grew("diffbatch_image_encode_seconds_count", format="png") == 1  # one batch of 2
    assert after[("diffbatch_num_requests_waiting", frozenset())] == 0


async def test_closed_engine_answers_503() -> None:
    engine = Engine(pipeline_class=FakeBatchPipeline, executor="inproc")
    app = build_app(engine, served_model_name="fake")
    engine.close()
    async with asgi_client(app) as client:
        error = assert_openai_error(await client.get("/health"), 503)
        assert error["type"] == "engine_unavailable"
        assert_openai_error(await client.post(ROUTE, json={"prompt": "p"}), 503)


def _smooth_image(side: int = 128) -> Image.Image:
    """A blurred noise image: compressible, but not trivially (unlike a flat one)."""
    noise = Image.frombytes("RGB", (side, side), random.Random(0).randbytes(side * side * 3))
    return noise.filter(ImageFilter.GaussianBlur(4))


def test_png_compress_level_changes_bytes_not_pixels() -> None:
    image = _smooth_image()
    fast, small = (base64.b64decode(encode_images([image], "png", None, level)[0])
                   for level in (1, 9))
    for data in (fast, small):
        decoded = Image.open(io.BytesIO(data))
        assert decoded.format == "PNG"
        assert decoded.tobytes() == image.tobytes()  # lossless at every level
    assert len(small) <= len(fast)


@pytest.mark.parametrize("level", [10, -1])
def test_png_compress_level_out_of_range_is_refused(engine: Engine, level: int) -> None:
    expected = f"png_compress_level must be between 0 and 9, got {level}"
    with pytest.raises(ValueError, match=expected):
        OpenAIServingImages(engine, served_model_name="fake", png_compress_level=level)
    with pytest.raises(ValueError, match=expected):
        build_app(engine, served_model_name="fake", png_compress_level=level,
                  close_engine_on_shutdown=False)


async def test_png_responses_use_the_servers_compress_level(engine: Engine, monkeypatch) -> None:
    levels: list[int] = []
    real_encode = serving_images.encode_images

    def spy(images, output_format, quality, png_compress_level):
        levels.append(png_compress_level)
        return real_encode(images, output_format, quality, png_compress_level)

    monkeypatch.setattr(serving_images, "encode_images", spy)
    async with app_client(engine, png_compress_level=9) as client:
        response = await client.post(ROUTE, json={"prompt": "p", "seed": 1})
    assert response.status_code == 200, response.text
    assert decode(response.json()["data"][0]["b64_json"]).format == "PNG"
    assert levels == [9]


def test_the_default_served_name_is_the_model_argument_without_a_trailing_slash():
    from types import SimpleNamespace

    from diffbatch.entrypoints.openai.api_server import served_name_of

    engine = SimpleNamespace(config=SimpleNamespace(model="from-config"))
    assert served_name_of(engine, "mymodel/") == "mymodel"  # as tab completion gives it
    assert served_name_of(engine, "/models/sd//") == "/models/sd"
    assert served_name_of(engine, "org/model") == "org/model"  # a hub id keeps its slash
    assert served_name_of(engine, None) == "from-config"


async def test_models_offer_only_sizes_accepted_at_default_steps(engine: Engine) -> None:
    """With no pixel cap of its own, the server's sizes are bounded by the work limit
    at the model's default steps: each one offered is generated, and the next square
    size above the largest offered is refused."""
    async with app_client(engine, max_image_pixels=4096 * 4096) as client:
        accepts = (await client.get("/v1/models")).json()["data"][0]["diffbatch"]
        sides = [int(size.split("x")[0]) for size in accepts["sizes"]]
        assert accepts["max_pixels"] < 4096 * 4096  # the work limit binds, not the cap
        for size in accepts["sizes"]:
            response = await client.post(ROUTE, json={"prompt": "a cat", "size": size})
            assert response.status_code == 200, (size, response.text)
        above = max(sides) + accepts["size_multiple"]
        assert above * above > accepts["max_pixels"]
        refused = await client.post(ROUTE, json={"prompt": "a cat",
                                                 "size": f"{above}x{above}"})
        assert_openai_error(refused, 400, "num_inference_steps")  # (1 step would fit)
