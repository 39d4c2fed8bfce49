"""LoRA adapters over HTTP, in vLLM's conventions, through the official `openai` client.

A real server, engine and worker process on `tiny-sd` with eight adapters served by
name (`--lora-modules`): `model: "<adapter>"` and `lora: [...]` select them, /v1/models
lists them under the base model, eight requests on eight adapters run as one wave,
and the run-time load/unload routes exist only when enabled and need the key.
"""

from __future__ import annotations

import base64
import io
import os
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.pipelines.tiny_lora import make_tiny_lora
from tests.entrypoints.openai.conftest import (
    API_KEY,
    app_client,
    disconnect,
    open_raw_request,
    serve_in_thread,
)
from tests.process_utils import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-sd"
NAMES = [f"style{i}" for i in range(8)]
BODY = {"size": "64x64", "extra_body": {"seed": 7, "num_inference_steps": 2}}


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served-loras")
    model = resolve_model_path(MODEL)
    return {name: make_tiny_lora(model, root / name, seed=i, rank=8)
            for i, name in enumerate([*NAMES, "extra"])}


@pytest.fixture(scope="module")
def server(adapter_paths: dict[str, str]):
    modules = {name: adapter_paths[name] for name in NAMES}
    # one wave at a time: while a wave runs, the next one's requests wait in the queue
    with Engine(MODEL, executor="mp", max_num_seqs=8, request_batch_max_wait_ms=0,
                max_waves_in_flight=1, max_request_work=0, lora_modules=modules,
                torch_num_threads=1) as engine:
        app = build_app(engine, served_model_name=MODEL, api_key=API_KEY,
                        close_engine_on_shutdown=False, allow_runtime_lora_updating=True)
        with serve_in_thread(app) as url:
            yield types.SimpleNamespace(url=url, engine=engine)


def _client(server: Any) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _pixels(result: Any) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))),
                      dtype=np.int16)


def test_model_and_lora_select_adapters_through_the_openai_client(server) -> None:
    client = _client(server)
    base = _pixels(client.images.generate(model=MODEL, prompt="a cat", **BODY))
    by_model = _pixels(client.images.generate(model="style1", prompt="a cat", **BODY))
    extra = {**BODY["extra_body"], "lora": [{"name": "style1", "scale": 1.0}]}
    by_list = _pixels(client.images.generate(model=MODEL, prompt="a cat", size="64x64",
                                             extra_body=extra))
    stacked = {**BODY["extra_body"], "lora": [{"name": "style1", "scale": 0.5},
                                              {"name": "style2", "scale": 0.5}]}
    by_stack = _pixels(client.images.generate(model=MODEL, prompt="a cat", size="64x64",
                                              extra_body=stacked))
    assert np.abs(by_model - base).max() > 5  # the adapter changes the image
    assert np.array_equal(by_model, by_list)  # the same adapter, two ways to name it
    assert np.abs(by_stack - by_model).max() > 5 and np.abs(by_stack - base).max() > 5


def test_models_lists_the_adapters_under_the_base_model(server) -> None:
    models = _client(server).models.list().data
    assert [m.id for m in models] == [MODEL, *NAMES]
    assert all(m.model_extra["parent"] == MODEL for m in models[1:])
    assert models[0].model_extra["parent"] is None
    assert all(m.model_extra["root"] == m.id for m in models[1:])  # never a server path
    assert _client(server).models.retrieve("style3").model_extra["parent"] == MODEL


def test_unknown_adapters_are_404s(server) -> None:
    import openai

    client = _client(server)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.images.generate(model="nope", prompt="a cat", **BODY)
    with pytest.raises(openai.NotFoundError, match="'nope' is not served"):
        client.images.generate(model=MODEL, prompt="a cat", size="64x64",
                               extra_body={"lora": [{"name": "nope"}]})


def test_eight_requests_on_eight_adapters_run_as_one_wave(server) -> None:
    """While a long request holds the worker, eight requests on eight adapters queue;
    once its client leaves (its wave stops at the next step), they run as ONE wave."""
    key = {"Authorization": f"Bearer {API_KEY}"}

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/images/generations", timeout=300, headers=key,
                          json={"prompt": "a cat", "size": "64x64", **body})

    engine = server.engine
    with ThreadPoolExecutor(8) as pool:
        blocker = open_raw_request(int(server.url.rsplit(":", 1)[1]), headers=key, body={
            "prompt": "a cat", "seed": 2, "num_inference_steps": 400, "size": "128x128"})
        try:
            wait_until(lambda: engine.num_running == 1, what="the long request to run")
            waves = [pool.submit(post, {"model": name, "seed": 1, "num_inference_steps": 2})
                     for name in NAMES]
            wait_until(lambda: engine.num_waiting == 8, what="the eight requests to queue")
            assert engine.num_running == 1, "the long request ended first"
        finally:
            disconnect(blocker)
        responses = [f.result() for f in waves]
    assert [r.status_code for r in responses] == [200] * 8, responses[0].text
    assert [r.headers["x-diffbatch-batch-size"] for r in responses] == ["8"] * 8
    images = {r.json()["data"][0]["b64_json"] for r in responses}
    assert len(images) == 8  # same seed and prompt: only the adapters differ


def test_load_and_unload_need_the_key_and_change_what_is_served(server, adapter_paths) -> None:
    url = server.url
    body = {"lora_name": "extra", "lora_path": adapter_paths["extra"]}
    refused = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert refused.status_code == 401
    key = {"Authorization": f"Bearer {API_KEY}"}
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=key)
    assert loaded.status_code == 200, loaded.text
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=key)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad_path = httpx.post(f"{url}/v1/load_lora_adapter", headers=key,
                          json={"lora_name": "x", "lora_path": os.devnull + "-missing"})
    assert bad_path.status_code == 400 and bad_path.json()["error"]["param"] == "lora_path"
    client = _client(server)
    assert "extra" in [m.id for m in client.models.list().data]
    assert client.images.generate(model="extra", prompt="a cat", **BODY).data[0].b64_json
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}
                      ).status_code == 401
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"},
                          headers=key)
    assert unloaded.status_code == 200, unloaded.text
    assert "extra" not in [m.id for m in client.models.list().data]
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"},
                      headers=key)
    assert gone.status_code == 404


async def test_load_and_unload_are_refused_unless_enabled(server, adapter_paths) -> None:
    body = {"lora_name": "other", "lora_path": adapter_paths["extra"]}
    async with app_client(server.engine, served_model_name=MODEL) as client:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = await client.post(route, json=body)
            assert response.status_code == 404, response.text
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert "other" not in server.engine.loras.names()
