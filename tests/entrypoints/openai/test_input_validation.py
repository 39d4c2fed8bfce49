"""Input the HTTP layer must refuse with a clear 400 (in the OpenAI shape), never a 500.

Each case here once reached the engine or the pipeline and failed there: a lone
surrogate in a prompt broke the tokenizer, a NUL in `lora` broke the file system
calls, a LoRA folder without weights failed inside the wave with a message naming
the server's path. Plus the protocol edges: strict numbers, sizes told what is
wrong with them, content types checked only where a JSON body is expected.

The app runs in-process (httpx's ASGI transport) on a fake-pipeline engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from diffbatch import Engine, InvalidRequestError, SamplingParams
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.entrypoints.openai.serving_images import OpenAIServingImages
from tests.entrypoints.openai.conftest import app_client, make_gate, make_lora_dir
from tests.fake_pipelines import FakeBatchPipeline, SmallModelPipeline, make_fake_adapter
from tests.process_utils import wait_until

ROUTE = "/v1/images/generations"
JSON = {"content-type": "application/json"}
MAX_PIXELS = 32 * 32  # the app's --max-image-pixels; the fake model's multiple is 8


class RefusingLoraPipeline(FakeBatchPipeline):
    """Refuses every adapter's weights, as diffusers refuses another model's."""

    def load_lora(self, name: str, weights: Any) -> None:
        raise RuntimeError("Error(s) in loading state_dict: the weights do not fit")


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine, max_image_pixels=MAX_PIXELS) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None, *, private: tuple[str, ...] = ()) -> dict:
    """The response is `status` in the OpenAI error shape, blaming `param`, and its
    body names none of the `private` paths."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert (error["param"], error["code"]) == (param, code)
    for path in private:
        assert path not in response.text
    return error


def _private(lora_dir: str) -> tuple[str, ...]:
    return (lora_dir, os.path.realpath(lora_dir))


# -- text that cannot reach a tokenizer or a file system ---------------------------------
@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
async def test_a_lone_surrogate_is_a_400_not_a_500(client, engine: Engine, field: str) -> None:
    # Sent as the JSON escape a client would send; it decodes to an unpaired surrogate.
    body = {"prompt": "a cat", field: "a \\ud800"}
    content = json.dumps(body).replace("\\\\ud800", "\\ud800").encode()
    assert b'"a \\ud800"' in content
    rejected = engine.metrics.count("rejected")
    error = assert_openai_error(await client.post(ROUTE, content=content, headers=JSON), 400,
                                field)
    assert "surrogate" in error["message"]
    assert engine.metrics.count("rejected") == rejected + 1  # refused before the engine
    assert engine.num_waiting == engine.num_running == 0


async def test_a_nul_byte_in_lora_is_a_400(client, lora_dir: str) -> None:
    response = await client.post(ROUTE, json={"prompt": "p", "lora": "style\x00/../x"})
    error = assert_openai_error(response, 400, "lora", private=_private(lora_dir))
    assert "NUL" in error["message"]


@pytest.mark.parametrize("name", ["notes", "training", "training/checkpoint-500"])
async def test_a_lora_that_is_no_adapter_is_a_400_naming_no_path(client, lora_dir: str,
                                                                 name: str) -> None:
    response = await client.post(ROUTE, json={"prompt": "p", "lora": name})
    error = assert_openai_error(response, 400, "lora", private=_private(lora_dir))
    assert f"'{name}' is not a LoRA adapter" in error["message"]


async def test_an_unknown_lora_is_a_404_and_a_weights_file_is_an_adapter(client,
                                                                         lora_dir: str) -> None:
    response = await client.post(ROUTE, json={"prompt": "p", "lora": "nothing-here"})
    assert_openai_error(response, 404, "lora", "model_not_found", private=_private(lora_dir))
    (await client.post(ROUTE, json={"prompt": "p", "lora": "style"})).raise_for_status()


async def test_an_adapter_the_pipeline_refuses_is_a_400_naming_only_its_name(tmp_path) -> None:
    lora_dir = make_lora_dir(tmp_path)
    with Engine(pipeline_class=RefusingLoraPipeline, executor="inproc",
                lora_dir=lora_dir) as engine:
        async with app_client(engine) as client:
            response = await client.post(ROUTE, json={"prompt": "p", "lora": "style"})
    # an adapter that does not load is the caller's error, and says why without the path
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora"
    message = error["message"]
    assert message.startswith("LoRA adapter 'style' does not fit this model"), message
    for path in _private(lora_dir):
        assert path not in response.text


class ServerFaultLoraPipeline(FakeBatchPipeline):
    """Fails to load an adapter for a reason of the server's, chosen by the adapter's
    folder name (out of memory, a file it may not read)."""

    def load_lora(self, name: str, weights: Any) -> None:
        raise MemoryError() if "memory" in name else PermissionError(13, "denied")


@pytest.mark.parametrize("adapter", ["memory", "permission"])
async def test_a_lora_load_that_fails_for_the_servers_reasons_is_no_400(tmp_path,
                                                                        adapter) -> None:
    """Only an adapter's own fault (a corrupt file, another model's weights) is the
    caller's 400; a server fault stays a 500 a client may retry, and harms nothing."""
    lora_dir = tmp_path / "loras"
    make_fake_adapter(lora_dir / adapter)
    with Engine(pipeline_class=ServerFaultLoraPipeline, executor="inproc",
                lora_dir=str(lora_dir)) as engine:
        async with app_client(engine) as client:
            failed = await client.post(ROUTE, json={"prompt": "p", "lora": adapter})
            plain = await client.post(ROUTE, json={"prompt": "p"})
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["type"] == "server_error"
    assert plain.status_code == 200, plain.text


# -- LoRA stacks -------------------------------------------------------------------
@pytest.mark.parametrize(("stack", "param", "words"), [
    ([{"name": "style", "scale": math.nan}], "lora[0].scale", "finite"),
    ([{"name": "style", "scale": math.inf}], "lora[0].scale", "finite"),
    ([{"name": "style", "scale": 1e30}], "lora[0].scale", "between -10 and 10"),
    ([{"name": "style"}, {"name": "style", "scale": "0.5"}], "lora[1].scale", "a string"),
    ([{"name": None}], "lora[0].name", "null"),
    ([{"name": 7}], "lora[0].name", "a number"),
    ([{"name": ""}], "lora[0].name", "name an adapter"),
    ([{"name": "style"}, {"scale": 1}], "lora[1].name", "required"),
    ([{"name": "style", "weight": 1}], "lora[0].weight", "unknown field"),
    (["style"], "lora[0]", "object"),
])
async def test_every_bad_stack_field_gets_its_own_param(client, lora_dir: str, stack,
                                                        param, words) -> None:
    response = await client.post(ROUTE, content=json.dumps({"prompt": "p", "lora": stack}),
                                 headers=JSON)
    error = assert_openai_error(response, 400, param, private=_private(lora_dir))
    assert words in error["message"], error["message"]


# -- numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value)
     for field in ("guidance_scale", "lora_scale", "n", "num_inference_steps", "seed",
                   "priority", "output_compression")
     for value in (True, False, "1.5", "7", "1")],
)
async def test_every_numeric_field_refuses_booleans_and_strings(client, field: str,
                                                                value: Any) -> None:
    body = {"prompt": "p", field: value, "output_format": "jpeg"}
    assert_openai_error(await client.post(ROUTE, json=body), 400, field)


async def test_an_integral_float_is_an_integer_as_in_json_schema(client) -> None:
    response = await client.post(ROUTE, json={"prompt": "p", "n": 2.0, "seed": 3.0})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2
    assert_openai_error(await client.post(ROUTE, json={"prompt": "p", "n": 1.5}), 400, "n")


@pytest.mark.parametrize(("field", "value"), [("guidance_scale", 1e308),
                                              ("guidance_scale", 50.5),
                                              ("lora_scale", 1e308), ("lora_scale", -11)])
async def test_scales_are_bounded_so_the_image_stays_finite(client, field: str,
                                                            value: float) -> None:
    error = assert_openai_error(await client.post(ROUTE, json={"prompt": "p", field: value}),
                                400, field)
    assert "<=" in error["message"] or ">=" in error["message"]


# -- sizes -----------------------------------------------------------------------------
@pytest.mark.parametrize("size", ["100000x100000", "99999x99999", "64x64", "8x256",
                                  "9" * 30 + "x8"])
async def test_a_size_too_large_is_told_so_with_the_largest_size(client, size: str) -> None:
    error = assert_openai_error(await client.post(ROUTE, json={"prompt": "p", "size": size}),
                                400, "size")
    assert "larger than this server generates" in error["message"]
    assert f"at most {MAX_PIXELS} pixels" in error["message"]
    assert "the largest square size is 32x32" in error["message"]


async def test_a_size_over_the_models_own_cap_is_a_400_naming_it() -> None:
    # SmallModelPipeline caps images at 32x32 pixels; the server's own cap is larger.
    with Engine(pipeline_class=SmallModelPipeline, executor="inproc") as engine:
        async with app_client(engine, served_model_name="small") as client:
            response = await client.post(ROUTE, json={"prompt": "p", "size": "64x64"})
            ok = await client.post(ROUTE, json={"prompt": "p", "size": "32x32"})
    error = assert_openai_error(response, 400, "size")
    assert "larger than SmallModelPipeline generates" in error["message"]  # the engine's
    assert "the largest square size is 32x32" in error["message"]
    assert ok.status_code == 200, ok.text


def test_the_server_checks_only_its_own_size_limit(engine: Engine) -> None:
    """The model's limits (multiple, own cap) are the engine's, checked when the request is
    added; the server checks only what holds for any model it could serve."""
    serving = OpenAIServingImages(engine, served_model_name="fake", max_image_pixels=MAX_PIXELS)
    serving.check_size(12, 16, "12x16")  # not multiples of 8: the engine refuses it
    with pytest.raises(InvalidRequestError, match="larger than this server generates"):
        serving.check_size(64, 64, "64x64")
    with pytest.raises(InvalidRequestError, match="multiples of 8") as info:
        engine.generate(["p"], SamplingParams(width=12, height=16))
    assert info.value.param == "width"  # over HTTP: `size` (the request's one field)


@pytest.mark.parametrize(("size", "fragment"), [("12x16", "multiples of 8"),
                                                ("64", "<width>x<height>"),
                                                ("0x8", "positive sides")])
async def test_other_size_errors_keep_their_own_message(client, size: str,
                                                        fragment: str) -> None:
    error = assert_openai_error(await client.post(ROUTE, json={"prompt": "p", "size": size}),
                                400, "size")
    assert fragment in error["message"]


# -- protocol edges --------------------------------------------------------------------
async def test_a_multipart_post_to_a_route_that_does_not_exist_is_a_404(client) -> None:
    files = {"image": ("a.png", b"\x89PNG", "image/png")}
    response = await client.post("/v1/images/variations", data={"prompt": "p"}, files=files)
    assert_openai_error(response, 404)


@pytest.mark.parametrize(("method", "path"), [("POST", f"{ROUTE}/"), ("GET", "/v1/waves/"),
                                              ("GET", "/health/")])
async def test_a_path_with_a_trailing_slash_is_a_404_not_a_redirect(client, method: str,
                                                                   path: str) -> None:
    response = await client.request(method, path, json={"prompt": "p"},
                                    headers={"host": "evil.example"})
    assert_openai_error(response, 404)
    assert "location" not in response.headers


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/fake"])
@pytest.mark.parametrize("headers", [None, JSON, {"content-type": "text/plain"}])
async def test_a_post_to_a_get_route_is_a_405(client, path: str, headers) -> None:
    response = await client.post(path, content=b"{}", headers=headers)
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "GET"


async def test_a_non_json_body_to_the_image_route_is_still_a_415(client) -> None:
    response = await client.post(ROUTE, content=b"prompt=p",
                                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert_openai_error(response, 415, code="unsupported_media_type")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b'{"prompt": "caf\xe9"}', "not UTF-8 (byte 0xe9 at position 15)"),
     (b'{"prompt": "p", "seed": ' + b"1" * 5000 + b"}", "not valid JSON"),
     (b'{"prompt": "p", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON")],
)
async def test_a_body_that_is_not_json_is_invalid_json(client, content: bytes,
                                                       fragment: str) -> None:
    error = assert_openai_error(await client.post(ROUTE, content=content, headers=JSON), 400,
                                code="invalid_json")
    assert fragment in error["message"]


async def test_401_names_the_bearer_scheme(engine: Engine) -> None:
    async with app_client(engine, api_key="k") as client:
        missing = await client.post(ROUTE, json={"prompt": "p"})
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert missing.status_code == wrong.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert wrong.headers["www-authenticate"] == 'Bearer error="invalid_token"'


async def test_a_client_gone_mid_upload_is_a_disconnect_not_a_rejection(engine: Engine) -> None:
    app = build_app(engine, served_model_name="fake", close_engine_on_shutdown=False)
    metrics = app.state.http_metrics.registry
    before = (engine.metrics.count("rejected"),
              metrics.get_sample_value("diffbatch_http_client_disconnects_total"))
    messages = [{"type": "http.request", "body": b'{"prompt": "a c', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": ROUTE, "raw_path": ROUTE.encode(), "root_path": "",
        "query_string": b"", "server": ("app", 80), "client": ("127.0.0.1", 5000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "state": {},
    }
    await app(scope, receive, send)
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [499]  # for logs and metrics; the client is gone
    after = (engine.metrics.count("rejected"),
             metrics.get_sample_value("diffbatch_http_client_disconnects_total"))
    assert after == (before[0], before[1] + 1)


# -- request ids and metric labels -----------------------------------------------------
async def test_a_clients_request_id_is_echoed_and_never_the_engines_id(lora_dir: str) -> None:
    gate = make_gate()
    with Engine(pipeline_class=gate, executor="inproc", max_num_seqs=1,
                lora_dir=lora_dir) as engine:
        same = {"x-request-id": "client-chosen-id"}
        async with app_client(engine, served_model_name="gated") as client:
            try:
                first = asyncio.create_task(client.post(ROUTE, json={"prompt": "a"},
                                                        headers=same))
                await asyncio.to_thread(gate.entered.wait, 30)
                # A second client with the same id, and a LoRA request, wait behind it.
                second = asyncio.create_task(client.post(
                    ROUTE, json={"prompt": "b", "lora": "style", "lora_scale": 0.5},
                    headers=same))
                await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 1,
                                        what="the second request to queue")
                text = (await client.get("/metrics")).text
                bad = await client.post(ROUTE, json={"prompt": "p", "n": 0}, headers=same)
            finally:
                gate.release.set()
            responses = [await first, await second]
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == "client-chosen-id"
    assert bad.headers["x-request-id"] == "client-chosen-id"  # errors echo it too
    # The waiting request's key label: adapters are no part of the key (a LoRA request
    # shares waves), so neither an adapter nor the server's folder shows.
    assert 'key="16x16/s2/g5/n1"}' in text
    for path in _private(lora_dir):
        assert path not in text


async def test_without_a_client_id_the_answer_carries_the_servers(client) -> None:
    response = await client.post(ROUTE, json={"prompt": "p"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"].startswith("img-")
