"""LoRA adapters are read and checked when they are loaded, not at first use.

A real server, engine and worker process on `tiny-sd`, in request mode and in step
mode, with the run-time load/unload routes on and `--max-loras 2`: a bad adapter is a
400 at `POST /v1/load_lora_adapter` naming the client's adapter name and the reason,
never a server path; loading a name again after its file was overwritten serves the
new weights; a NUL in `lora_path` is a 400 on a connection that stays usable. A bad
`--lora-modules` entry fails start-up, naming it. (Each bad field of a stack entry
having its own `param` is the HTTP layer's check: test_input_validation.py.)
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import os
import shutil
import types
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from diffbatch import Engine, SamplingParams
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.errors import ConfigError, InvalidRequestError
from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.pipelines.tiny_lora import make_tiny_lora
from tests.entrypoints.openai.conftest import serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "tiny-sd"
WEIGHTS = "pytorch_lora_weights.safetensors"
GENERATE = {"prompt": "a cat", "size": "64x64", "seed": 3, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two good adapters in a server folder whose name must never reach a client."""
    root = tmp_path_factory.mktemp("srvfolder")
    model = resolve_model_path(MODEL)
    return {name: make_tiny_lora(model, root / name, seed=i, rank=4)
            for i, name in enumerate(["one", "two", "three"])}


@pytest.fixture(scope="module", params=["request", "step"])
def server(request: pytest.FixtureRequest, adapters: dict[str, str]):
    step = request.param == "step"
    with Engine(MODEL, executor="mp", max_num_seqs=4, request_batch_max_wait_ms=0,
                max_request_work=0, max_loras=2, torch_num_threads=1, step_execution=step,
                lora_modules={"one": adapters["one"]}) as engine:
        app = build_app(engine, served_model_name=MODEL, close_engine_on_shutdown=False,
                        allow_runtime_lora_updating=True)
        with serve_in_thread(app) as url:
            yield types.SimpleNamespace(url=url, engine=engine, mode=request.param)


def _load(server: Any, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=120,
                      json={"lora_name": name, "lora_path": path})


def _unload(server: Any, name: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", timeout=60,
                      json={"lora_name": name})


def _image(server: Any, **body: Any) -> np.ndarray:
    response = httpx.post(f"{server.url}/v1/images/generations", timeout=120,
                          json={**GENERATE, **body})
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)


def _assert_refused(response: httpx.Response, param: str, *words: str) -> str:
    """A 400 in OpenAI's shape blaming `param`, saying `words`, naming no server path."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    assert "srvfolder" not in response.text and "srv_" not in response.text
    assert "/tmp" not in response.text
    return error["message"]


# -- 1. NUL ------------------------------------------------------------------------------
def test_a_nul_in_lora_path_is_a_400_and_the_connection_serves_the_next(server) -> None:
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        body = json.dumps({"lora_name": "nul", "lora_path": "/tmp/a\u0000b"})
        conn.request("POST", "/v1/load_lora_adapter", body,
                     {"content-type": "application/json"})
        first = conn.getresponse()
        error = json.loads(first.read())["error"]
        sock = conn.sock
        assert first.status == 400 and error["param"] == "lora_path", error
        assert "NUL" in error["message"]
        conn.request("GET", "/v1/models")
        second = conn.getresponse()
        second.read()
        assert second.status == 200 and conn.sock is sock  # the same connection
    finally:
        conn.close()


# -- 2. overwrite + reload ----------------------------------------------------------------
def test_loading_again_after_an_overwrite_serves_the_new_weights(server, adapters,
                                                                 tmp_path) -> None:
    folder = tmp_path / "srv_mutable"
    shutil.copytree(adapters["two"], folder)
    assert _load(server, "m", str(folder)).status_code == 200
    old = _image(server, model="m")
    assert _unload(server, "m").status_code == 200
    shutil.copy(os.path.join(adapters["three"], WEIGHTS), folder / WEIGHTS)
    assert _load(server, "m", str(folder)).status_code == 200
    new = _image(server, model="m")
    assert _load(server, "three", adapters["three"]).status_code == 200
    wanted = _image(server, model="three")
    assert np.array_equal(new, wanted)
    assert np.abs(new - old).max() > 5
    for name in ("m", "three"):
        assert _unload(server, name).status_code == 200


# -- 3. bad files, refused at load -------------------------------------------------------
def _variant(source: str, folder: Any, change: str) -> str:
    """A copy of adapter `source` in `folder`, broken as `change` says; its path."""
    folder.mkdir()
    tensors = load_file(os.path.join(source, WEIGHTS))
    target = str(folder / WEIGHTS)
    if change == "truncated":
        with open(os.path.join(source, WEIGHTS), "rb") as f:
            data = f.read()
        (folder / WEIGHTS).write_bytes(data[: len(data) // 2])
    elif change == "junk":
        (folder / WEIGHTS).write_bytes(os.urandom(300_000))
    elif change == "nan":
        key = next(iter(tensors))
        save_file({**tensors, key: torch.full_like(tensors[key], math.nan)}, target)
    elif change == "wrong shape":
        key = next(k for k in tensors if "down" in k or "lora_A" in k)
        rank, width = tensors[key].shape
        save_file({**tensors, key: torch.ones(rank, width + 3)}, target)
    elif change == "matches nothing":
        save_file({k.replace("attn", "nothing"): v for k, v in tensors.items()}, target)
    elif change == "no model part":
        save_file({f"elsewhere.{k}": v for k, v in tensors.items()}, target)
    elif change == "pickle":
        torch.save(tensors, folder / "pytorch_lora_weights.bin")
    elif change == "symlink out":
        (folder / "adapter.safetensors").symlink_to("/etc/passwd")
    elif change == "device":
        (folder / "adapter.safetensors").symlink_to("/dev/zero")
    return str(folder)


BAD = {  # the change -> what the refusal says
    "truncated": "is truncated",
    "junk": "is not a safetensors file",
    "nan": "is not finite",
    "wrong shape": "does not fit this model",
    "matches nothing": "matches nothing",
    "no model part": "matches nothing",
    "pickle": "safetensors files only",
    "symlink out": "leads out of its folder",
    "device": "leads out of its folder",
}


@pytest.mark.parametrize("change", list(BAD))
def test_a_bad_adapter_is_refused_at_load_with_its_reason(server, adapters, tmp_path,
                                                          change) -> None:
    name = "client_" + change.replace(" ", "_")
    path = _variant(adapters["two"], tmp_path / "srv_bad", change)
    message = _assert_refused(_load(server, name, path), "lora_path", BAD[change])
    assert message.startswith(f"LoRA adapter {name!r} ")
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert name not in [m["id"] for m in models]
    unknown = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                         json={**GENERATE, "model": name})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


# -- 4. no server path in errors, even when a file changes after its load ---------------
def test_a_file_broken_after_its_load_is_refused_naming_only_the_client_name(
        server, adapters, tmp_path) -> None:
    folder = tmp_path / "srv_trunc"
    shutil.copytree(adapters["two"], folder)
    assert _load(server, "client_name", str(folder)).status_code == 200
    # two more adapters under --max-loras 2 evict it; its file then breaks
    for name in ("two", "three"):
        assert _load(server, name, adapters[name]).status_code == 200
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])
    response = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                          json={**GENERATE, "model": "client_name"})
    message = _assert_refused(response, "lora", "'client_name'", "truncated")
    assert "trunc'" not in message and WEIGHTS not in message
    assert _image(server).size  # the server serves on
    for name in ("client_name", "two", "three"):
        assert _unload(server, name).status_code == 200


# -- start-up ---------------------------------------------------------------------------
@pytest.mark.parametrize("step_execution", [False, True], ids=["request", "step"])
def test_a_bad_lora_module_fails_start_up_naming_it(adapters, tmp_path,
                                                    step_execution) -> None:
    bad = _variant(adapters["two"], tmp_path / "srv_nan", "nan")
    with pytest.raises(ConfigError, match=r"--lora-modules broken: LoRA adapter 'broken' is "
                                          r"not finite"):
        Engine(MODEL, executor="inproc", max_num_seqs=2, warmup=False,
               step_execution=step_execution, lora_modules={"ok": adapters["one"],
                                                            "broken": bad})


def test_pickle_adapters_load_only_with_the_opt_in(adapters, tmp_path) -> None:
    folder = _variant(adapters["two"], tmp_path / "srv_pickle", "pickle")
    with Engine(MODEL, executor="inproc", max_num_seqs=2, warmup=False) as engine, \
            pytest.raises(InvalidRequestError, match="safetensors files only"):
        engine.add_lora("pickled", folder)
    with Engine(MODEL, executor="inproc", max_num_seqs=2, warmup=False,
                lora_allow_pickle=True) as engine:
        engine.add_lora("pickled", folder)
        engine.add_lora("same", adapters["two"])
        pickled, same = engine.generate(["a cat"] * 2, [
            SamplingParams(lora=name, seed=1, num_inference_steps=2, height=64, width=64)
            for name in ("pickled", "same")])
    assert pickled.ok and same.ok
    assert np.array_equal(np.asarray(pickled.images[0]), np.asarray(same.images[0]))


def test_an_adapter_file_over_the_size_cap_is_refused_at_load(adapters, tmp_path) -> None:
    big = tmp_path / "srv_big"
    shutil.copytree(adapters["two"], big)
    tensors = load_file(str(big / WEIGHTS))
    save_file({**tensors, "unet.padding.lora_A.weight": torch.zeros(512, 600)},
              str(big / WEIGHTS))  # 1.2 MB
    with Engine(MODEL, executor="inproc", max_num_seqs=2, warmup=False,
                max_lora_file_mb=1) as engine:
        with pytest.raises(InvalidRequestError, match="larger than this server's limit of 1 MB"):
            engine.add_lora("big", str(big))
        engine.add_lora("small", adapters["two"])


def test_a_load_logs_one_plain_line(adapters, caplog) -> None:
    """diffusers' "No LoRA keys associated to CLIPTextModel..." and PEFT's warnings
    become one line per load."""
    with Engine(MODEL, executor="inproc", max_num_seqs=2, warmup=False) as engine:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            engine.loras.add("two", adapters["two"])
    library = [r for r in caplog.records if r.name.split(".")[0] in ("diffusers", "peft")]
    loads = [r.getMessage() for r in caplog.records if "loaded LoRA adapter" in r.getMessage()]
    assert not library, [r.getMessage() for r in library]
    assert loads == ["loaded LoRA adapter 'two': 32 layers (nothing for CLIPTextModel)"], loads
