"""Refused image requests are counted once each, whichever layer refuses them.

`diffbatch_requests_total{outcome="rejected"}` counts every image request the server
refuses: before FastAPI parses it (the guard), in validation, in the server's own
checks, or in the engine (invalid for the model, a full queue). The HTTP layer
counts what it refuses in one place (the metrics middleware's hook), the engine
what it refuses; a request is never counted by both. In-process (ASGI transport).
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from PIL import Image

from diffbatch import Engine, SamplingParams
from tests.entrypoints.openai.conftest import app_client, make_gate
from tests.fake_pipelines import POISON

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}
ROUTE = "/v1/images/generations"
EDITS = "/v1/images/edits"
GATE_TIMEOUT_S = 30.0  # bounds a broken test only


def png(size: tuple[int, int] = (16, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine, api_key=KEY, max_image_pixels=32 * 32, max_body_bytes=4096,
                          max_upload_bytes=64 * 1024) as client:
        yield client


def counts(engine: Engine) -> dict[str, float]:
    return {o: engine.metrics.count(o) for o in ("rejected", "completed", "error", "aborted")}


# (what is refused, where, the request as client.post's keywords, its status)
REFUSALS: list[tuple[str, str, dict[str, Any], int]] = [
    ("no API key", ROUTE, {"json": {"prompt": "p"}}, 401),
    ("wrong API key", ROUTE,
     {"json": {"prompt": "p"}, "headers": {"Authorization": "Bearer nope"}}, 401),
    ("not JSON", ROUTE, {"content": b"prompt=p", "headers": {**AUTH, "content-type": "text/plain"}},
     415),
    ("body too large", ROUTE, {"json": {"prompt": "p" * 5000}, "headers": AUTH}, 413),
    ("body not UTF-8", ROUTE, {"content": b'{"prompt": "\xff"}', "headers": JSON}, 400),
    ("malformed JSON", ROUTE, {"content": b'{"prompt": "p"', "headers": JSON}, 400),
    ("missing field", ROUTE, {"json": {"n": 1}, "headers": AUTH}, 400),
    ("bad field", ROUTE, {"json": {"prompt": "p", "n": 0}, "headers": AUTH}, 400),
    ("unknown field", ROUTE, {"json": {"prompt": "p", "colour": "red"}, "headers": AUTH}, 400),
    ("unknown model", ROUTE, {"json": {"prompt": "p", "model": "other"}, "headers": AUTH}, 404),
    ("size over the server's limit", ROUTE,
     {"json": {"prompt": "p", "size": "64x64"}, "headers": AUTH}, 400),
    ("size the model cannot make", ROUTE,
     {"json": {"prompt": "p", "size": "12x16"}, "headers": AUTH}, 400),
    ("no LoRA adapter (the engine)", ROUTE,
     {"json": {"prompt": "p", "lora": "notes"}, "headers": AUTH}, 400),
    ("missing LoRA adapter (the engine)", ROUTE,
     {"json": {"prompt": "p", "lora": "missing"}, "headers": AUTH}, 404),
    ("edit without an image", EDITS, {"files": {"prompt": (None, "p")}, "headers": AUTH},
     400),
    ("edit of no image", EDITS, {"data": {"prompt": "p"}, "headers": AUTH,
                                 "files": {"image": ("a.png", b"not an image", "image/png")}},
     400),
    ("edit with a bad field", EDITS, {"data": {"prompt": "p", "n": "eleven"}, "headers": AUTH,
                                      "files": {"image": ("a.png", png(), "image/png")}}, 400),
]


@pytest.mark.parametrize(("route", "kwargs", "status"), [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
async def test_each_refusal_is_counted_exactly_once(client, engine: Engine, route: str,
                                                   kwargs: dict[str, Any], status: int) -> None:
    before = counts(engine)
    response = await client.post(route, **kwargs)
    assert response.status_code == status, response.text
    assert "error" in response.json()
    assert counts(engine) == {**before, "rejected": before["rejected"] + 1}
    assert engine.num_waiting == engine.num_running == engine.num_unfinished == 0


async def test_answers_that_are_no_refusal_are_not_counted_as_one(client, engine: Engine) -> None:
    before = counts(engine)
    ok = await client.post(ROUTE, json={"prompt": "p"}, headers=AUTH)
    failed = await client.post(ROUTE, json={"prompt": f"a {POISON} prompt"}, headers=AUTH)
    assert (ok.status_code, failed.status_code) == (200, 500)
    for method in ("GET", "PUT", "OPTIONS"):  # 405: no image request was made
        assert (await client.request(method, ROUTE, headers=AUTH)).status_code == 405
    assert counts(engine) == {**before, "completed": before["completed"] + 1,
                              "error": before["error"] + 1}


async def test_a_full_queue_is_counted_once() -> None:
    gate = make_gate()
    with Engine(pipeline_class=gate, executor="inproc", max_num_seqs=1, max_queue_size=1,
                request_batch_max_wait_ms=0) as engine:
        running = engine._submit("runs", SamplingParams(), "running", 0)[1]
        assert gate.entered.wait(GATE_TIMEOUT_S)
        waiting = engine._submit("waits", SamplingParams(), "waiting", 0)[1]
        try:
            before = counts(engine)
            async with app_client(engine, served_model_name="gated") as client:
                response = await client.post(ROUTE, json={"prompt": "one too many"})
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "queue_full"
            assert counts(engine) == {**before, "rejected": before["rejected"] + 1}
        finally:
            gate.release.set()
        assert running.result(GATE_TIMEOUT_S).ok and waiting.result(GATE_TIMEOUT_S).ok
