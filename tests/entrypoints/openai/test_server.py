"""End to end: a real uvicorn server, the real engine, worker process and `tiny-sd`.

One server for the module (`--max-num-seqs 4 --request-batch-max-wait-ms 50`, an
API key, `--max-image-pixels 128*128`, a LoRA folder), driven by the official
`openai` client and by plain httpx.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import API_KEY, RunningServer, serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "tiny-sd"
ROUTE = "/v1/images/generations"
EDITS_ROUTE = "/v1/images/edits"
# Batch invariance: a request's image in a wave of 4 equals the image it gets alone
# up to float reordering in batched kernels, far below one 8-bit level on average.
MAX_PIXEL_DIFF = 3  # out of 255, per channel; measured <= 1
STEPS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    lora_dir = tmp_path_factory.mktemp("loras")
    engine = Engine(MODEL, max_num_seqs=4, request_batch_max_wait_ms=50, executor="mp",
                    lora_dir=str(lora_dir))
    try:
        assert engine.info.size_multiple > 1 and 64 % engine.info.size_multiple == 0
        assert (engine.info.default_width, engine.info.default_height) == (64, 64)
        app = build_app(engine, served_model_name=MODEL, api_key=API_KEY,
                        max_image_pixels=128 * 128)
        with serve_in_thread(app) as url:
            yield RunningServer(url, engine, app, API_KEY)
    finally:
        engine.close()


def decode(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_official_openai_client(server: RunningServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    result = client.images.generate(
        model=MODEL, prompt="a red circle on a blue background", n=2, size="64x64",
        response_format="b64_json", extra_body={"seed": 1, "num_inference_steps": STEPS},
    )
    assert len(result.data) == 2
    images = [decode(item.b64_json) for item in result.data]
    for image in images:
        assert (image.format, image.size) == ("PNG", (64, 64))
    assert np.asarray(images[0]).tolist() != np.asarray(images[1]).tolist()  # own noise each
    assert [m.id for m in client.models.list()] == [MODEL]


def test_official_openai_client_streams_partial_images_through_the_worker(
        server: RunningServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    events = list(client.images.generate(
        model=MODEL, prompt="a red circle", size="64x64", stream=True, partial_images=2,
        extra_body={"seed": 4, "num_inference_steps": 4}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 \
        + ["image_generation.completed"]
    images = [decode(e.b64_json) for e in events]
    assert all(image.size == (64, 64) for image in images)
    # the previews (after steps 1 and 3 of 4) are x0 predictions, not the image itself
    assert np.asarray(images[0]).tolist() != np.asarray(images[-1]).tolist()
    plain = client.images.generate(model=MODEL, prompt="a red circle", size="64x64",
                                   extra_body={"seed": 4, "num_inference_steps": 4})
    assert plain.data[0].b64_json == events[-1].b64_json  # streaming changed nothing


def test_official_openai_client_with_url_links(server: RunningServer) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    result = client.images.generate(model=MODEL, prompt="a red circle", n=2,
                                    response_format="url",
                                    extra_body={"seed": 1, "num_inference_steps": STEPS})
    assert [item.b64_json for item in result.data] == [None, None]
    linked = []
    for item in result.data:
        assert item.url.startswith(f"{server.url}/v1/images/files/")
        download = httpx.get(item.url)  # a link needs no API key
        assert download.status_code == 200 and download.headers["content-type"] == "image/png"
        linked.append(np.asarray(Image.open(io.BytesIO(download.content))))
    same = client.images.generate(model=MODEL, prompt="a red circle", n=2,
                                  extra_body={"seed": 1, "num_inference_steps": STEPS})
    for image, item in zip(linked, same.data, strict=True):
        assert (image == np.asarray(decode(item.b64_json))).all()


async def _generate(client: httpx.AsyncClient, prompt: str, seed: int) -> np.ndarray:
    response = await client.post(ROUTE, json={
        "prompt": prompt, "seed": seed, "num_inference_steps": STEPS, "size": "64x64",
    })
    assert response.status_code == 200, response.text
    return np.asarray(decode(response.json()["data"][0]["b64_json"]), dtype=np.int16)


def _waves_over_one(server: RunningServer) -> float:
    """Waves with more than one request, from the wave-size histogram."""
    name = "diffbatch_wave_size_requests"
    total = server.metric(f"{name}_count")
    return total - server.metric(f"{name}_bucket", {"le": "1.0"})


async def test_concurrent_requests_batch_and_match_solo_runs(server: RunningServer) -> None:
    prompts = [(f"shape number {i}", 100 + i) for i in range(8)]
    waves_before = _waves_over_one(server)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                 timeout=120) as client:
        batched = await asyncio.gather(*(_generate(client, p, s) for p, s in prompts))
        metrics_text = (await client.get("/metrics")).text
        assert "diffbatch_wave_size_requests_bucket" in metrics_text
        assert _waves_over_one(server) > waves_before, "no wave had more than one request"
        for (prompt, seed), image in zip(prompts, batched, strict=True):
            alone = await _generate(client, prompt, seed)  # one at a time: waves of one
            assert np.abs(image - alone).max() <= MAX_PIXEL_DIFF, prompt


BAD_INPUTS = [
    ({"n": 1}, 400, "prompt"),
    ({"prompt": ["a cat", "a dog"]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x" * 10_001}, 400, "prompt"),
    ({"prompt": "p", "n": 0}, 400, "n"),
    ({"prompt": "p", "n": 11}, 400, "n"),
    ({"prompt": "p", "size": "abc"}, 400, "size"),
    ({"prompt": "p", "size": "256x256"}, 400, "size"),  # over --max-image-pixels
    ({"prompt": "p", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": "p", "num_inference_steps": 10_000}, 400, "num_inference_steps"),
    ({"prompt": "p", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "p", "lora": "../outside"}, 400, "lora"),
    ({"prompt": "p", "lora": "missing-adapter"}, 404, "lora"),
    ({"prompt": "p", "response_format": "svg"}, 400, "response_format"),
]


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_bad_input_gets_4xx_in_openai_shape_then_a_valid_request_works(
    server: RunningServer,
) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        for body, status, param in BAD_INPUTS:
            _assert_openai_error(client.post(ROUTE, json=body), status, param)
        odd = 64 - server.engine.info.size_multiple // 2  # not a multiple the model takes
        _assert_openai_error(client.post(ROUTE, json={"prompt": "p", "size": f"{odd}x64"}),
                             400, "size")
        json_header = {"content-type": "application/json"}
        nan = b'{"prompt": "p", "guidance_scale": NaN}'
        _assert_openai_error(client.post(ROUTE, content=nan, headers=json_header), 400,
                             "guidance_scale")
        _assert_openai_error(client.post(ROUTE, content=b'{"prompt": "p"',
                                         headers=json_header), 400, None)
        _assert_openai_error(client.post(ROUTE, content=b'{"prompt": "p"}',
                                         headers={"content-type": "text/plain"}), 415, None)
        _assert_openai_error(client.post(ROUTE, json={"prompt": "p"},
                                         headers={"Authorization": "Bearer wrong"}), 401, None)
    _assert_openai_error(httpx.post(f"{server.url}{ROUTE}", json={"prompt": "p"}), 401, None)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        response = client.post(ROUTE, json={"prompt": "still works", "seed": 5,
                                            "num_inference_steps": STEPS})
        assert response.status_code == 200, response.text
        assert decode(response.json()["data"][0]["b64_json"]).size == (64, 64)


def test_steps_past_what_the_models_scheduler_schedules_are_a_400_naming_its_limit(
    server: RunningServer,
) -> None:
    # tiny-sd's DDIM ("leading", steps_offset 1) has no 1000-step schedule: its first
    # timestep would be 1000 (an IndexError mid-wave, a 500, before this limit)
    assert server.engine.info.max_inference_steps == 999
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        response = client.post(ROUTE, json={"prompt": "p", "size": "16x16",
                                            "num_inference_steps": 1000})
        _assert_openai_error(response, 400, "num_inference_steps")
        assert "at most 999 for StableDiffusionPipeline" in response.json()["error"]["message"]


def test_text_and_loras_the_model_cannot_take_are_400s_naming_no_path(
    server: RunningServer,
) -> None:
    # A lone surrogate reached the real tokenizer (a 500 for the whole wave); a folder
    # without weights reached diffusers' loader (a 500 naming the server's path).
    lora_dir = server.engine.config.lora_dir
    (Path(lora_dir) / "notes").mkdir(exist_ok=True)
    json_header = {**server.headers, "content-type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for field in ("prompt", "negative_prompt"):
            content = b'{"prompt": "a cat", "' + field.encode() + b'": "a \\ud800"}'
            _assert_openai_error(client.post(ROUTE, content=content, headers=json_header), 400,
                                 field)
        for lora in ("notes", "style\x00"):
            response = client.post(ROUTE, json={"prompt": "p", "lora": lora},
                                   headers=server.headers)
            _assert_openai_error(response, 400, "lora")
            assert lora_dir not in response.text
        response = client.post(ROUTE, json={"prompt": "still works", "seed": 5,
                                            "num_inference_steps": STEPS},
                               headers=server.headers)
        assert response.status_code == 200, response.text


def test_official_client_sees_size_and_route_errors_as_openai_does(server: RunningServer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as too_large:
        client.images.generate(model=MODEL, prompt="p", size="1024x1024")
    assert too_large.value.param == "size"
    assert "the largest square size is 128x128" in too_large.value.message
    with pytest.raises(openai.NotFoundError):  # no variations route: 404, not 415
        client.images.create_variation(image=("a.png", b"\x89PNG", "image/png"))
    with pytest.raises(openai.BadRequestError) as not_an_image:
        client.images.edit(image=("a.png", b"\x89PNG", "image/png"), prompt="p")
    assert not_an_image.value.param == "image"


def _png(seed: int, size: int = 64) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _mask_png(size: int = 64) -> bytes:
    """Transparent (edit here) in the left half, opaque in the right."""
    alpha = np.full((size, size), 255, dtype=np.uint8)
    alpha[:, : size // 2] = 0
    rgba = np.dstack([np.zeros((size, size, 3), dtype=np.uint8), alpha])
    buffer = io.BytesIO()
    Image.fromarray(rgba, mode="RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


async def _edit(client: httpx.AsyncClient, seed: int, mask: bool) -> tuple[np.ndarray, int]:
    files = {"image": ("in.png", _png(seed), "image/png")}
    if mask:
        files["mask"] = ("mask.png", _mask_png(), "image/png")
    response = await client.post(EDITS_ROUTE, files=files, data={
        "prompt": f"edit number {seed}", "seed": str(seed), "strength": "0.75",
        "num_inference_steps": str(STEPS * 2),
    })
    assert response.status_code == 200, response.text
    image = np.asarray(decode(response.json()["data"][0]["b64_json"]), dtype=np.int16)
    return image, int(response.headers["x-diffbatch-batch-size"])


@pytest.mark.parametrize("mask", [False, True], ids=["image-to-image", "inpaint"])
async def test_concurrent_edits_batch_and_match_solo_runs(server: RunningServer,
                                                          mask: bool) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                 timeout=120) as client:
        batched = await asyncio.gather(*(_edit(client, 200 + i, mask) for i in range(4)))
        assert max(size for _, size in batched) > 1, "no edit wave had more than one request"
        for i, (image, _) in enumerate(batched):
            alone, size = await _edit(client, 200 + i, mask)
            assert size == 1
            assert np.abs(image - alone).max() <= MAX_PIXEL_DIFF, i


def test_official_openai_client_edits_on_tiny_sd(server: RunningServer, tmp_path: Path) -> None:
    from openai import OpenAI

    (tmp_path / "in.png").write_bytes(_png(7))
    (tmp_path / "mask.png").write_bytes(_mask_png())
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with open(tmp_path / "in.png", "rb") as image, open(tmp_path / "mask.png", "rb") as mask:
        result = client.images.edit(image=image, mask=mask, prompt="a red circle", n=2,
                                    extra_body={"seed": 1, "num_inference_steps": STEPS})
    assert result.size == "64x64" and len(result.data) == 2
    assert decode(result.data[0].b64_json).size == (64, 64)


def test_open_routes_and_engine_state(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/docs").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    for outcome in ("completed", "error", "aborted", "rejected"):
        assert f'diffbatch_requests_total{{outcome="{outcome}"}}' in metrics
    assert server.engine.num_waiting == server.engine.num_running == 0
