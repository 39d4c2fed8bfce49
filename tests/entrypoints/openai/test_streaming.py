"""Streamed image requests (`stream: true`): server-sent events from a real uvicorn server.

The engine runs fake pipelines in process (tests/fake_pipelines.py): the preview after
step s of S is the request's final image times s / S, so a test can tell each event's
image is its request's at that step. The official `openai` client iterates the streams
unmodified. Gated servers hold a wave at its previews (`PreviewGatedPipeline`), so "the
stream has started" is a state a test creates, not a timing it hopes for.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import gated_server, serve_in_thread
from tests.entrypoints.openai.test_edits import png
from tests.entrypoints.openai.test_input_validation import assert_openai_error
from tests.fake_pipelines import LATE_POISON, POISON, FakeBatchPipeline, PreviewGatedPipeline
from tests.process_utils import wait_until

ROUTE = "/v1/images/generations"
EDITS_ROUTE = "/v1/images/edits"
TIMEOUT_S = 60.0  # bounds a broken test only


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=0) as engine:
        app = build_app(engine, served_model_name="fake", close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            yield url


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"),
                      dtype=np.float64)


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    """The (event name, payload) pairs of a server-sent event stream."""
    assert response.headers["content-type"].startswith("text/event-stream"), response.text
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_iterates_partial_images_then_the_image(url: str) -> None:
    stream = client(url).images.generate(
        model="fake", prompt="a red circle", stream=True, partial_images=3,
        extra_body={"num_inference_steps": 4, "seed": 3})
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 3 \
        + ["image_generation.completed"]
    *partials, completed = events
    assert [e.partial_image_index for e in partials] == [0, 1, 2]
    for event in events:
        assert (event.size, event.output_format, event.quality, event.background) \
            == ("16x16", "png", "auto", "auto")
        assert isinstance(event.created_at, int)
    assert completed.usage.total_tokens == 0
    assert completed.model_extra["diffbatch"]["seed"] == 3
    assert completed.model_extra["diffbatch"]["batch_size"] == 1
    final = pixels(completed.b64_json)
    for step, event in enumerate(partials, start=1):  # after steps 1, 2, 3 of 4
        assert np.abs(pixels(event.b64_json) - final * step / 4).max() <= 1.0
    # The streamed image is the image the same request gets unstreamed.
    plain = httpx.post(f"{url}{ROUTE}", json={"prompt": "a red circle", "seed": 3,
                                              "num_inference_steps": 4}, timeout=TIMEOUT_S)
    assert completed.b64_json == plain.json()["data"][0]["b64_json"]


def http_sample(url: str, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics text (0 when absent)."""
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def test_a_stream_read_to_its_end_counts_as_a_200_not_a_disconnect(url: str) -> None:
    ok = 'method="POST",route="/v1/images/generations",status="200"'
    before = (http_sample(url, "diffbatch_http_requests_total", ok),
              http_sample(url, "diffbatch_http_client_disconnects_total"))
    events = list(client(url).images.generate(model="fake", prompt="to the end", stream=True,
                                              partial_images=2))
    assert events[-1].type == "image_generation.completed"
    assert (http_sample(url, "diffbatch_http_requests_total", ok),
            http_sample(url, "diffbatch_http_client_disconnects_total")) \
        == (before[0] + 1, before[1])


def test_without_partial_images_the_image_is_one_event(url: str) -> None:
    response = httpx.post(f"{url}{ROUTE}", json={"prompt": "a cat", "stream": True,
                                                 "output_format": "jpeg"},
                          headers={"x-request-id": "mine"}, timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "mine"
    assert response.headers["cache-control"] == "no-cache"
    [(name, payload)] = events_of(response)
    assert name == payload["type"] == "image_generation.completed"
    assert base64.b64decode(payload["b64_json"])[:2] == b"\xff\xd8"  # a JPEG


def test_the_openai_client_streams_an_edit(url: str) -> None:
    events = list(client(url).images.edit(
        model="fake", image=("in.png", png(), "image/png"), prompt="a blue square",
        stream=True, partial_images=2, extra_body={"num_inference_steps": 3}))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 \
        + ["image_edit.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]


@pytest.mark.parametrize(("body", "param"), [
    ({"stream": True, "n": 2}, "n"),
    ({"stream": True, "response_format": "url"}, "response_format"),
    ({"stream": True, "partial_images": 4}, "partial_images"),
    ({"partial_images": 1}, "partial_images"),
    ({"stream": "yes"}, "stream"),
])
def test_what_cannot_be_streamed_is_refused_before_anything_runs(url: str, body: dict,
                                                                 param: str) -> None:
    response = httpx.post(f"{url}{ROUTE}", json={"prompt": "a cat", **body},
                          timeout=TIMEOUT_S)
    assert_openai_error(response, 400, param)
    form = {"prompt": "a cat", **{k: str(v).lower() for k, v in body.items()}}
    edit = httpx.post(f"{url}{EDITS_ROUTE}", data=form,
                      files={"image": ("in.png", png(), "image/png")}, timeout=TIMEOUT_S)
    assert_openai_error(edit, 400, param)


def test_a_request_failing_before_its_first_event_gets_a_json_error(url: str) -> None:
    response = httpx.post(f"{url}{ROUTE}", json={"prompt": f"a {POISON}", "stream": True,
                                                 "partial_images": 1}, timeout=TIMEOUT_S)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert "poisoned prompt" in response.json()["error"]["message"]


def test_a_request_failing_after_its_first_event_ends_with_an_error_event(url: str) -> None:
    import openai

    body = {"prompt": f"it {LATE_POISON}", "stream": True, "partial_images": 1}
    response = httpx.post(f"{url}{ROUTE}", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200  # the stream had started
    (first, _), (name, payload) = events_of(response)
    assert first == "image_generation.partial_image"
    assert name == payload["type"] == "error"
    assert payload["error"]["type"] == "server_error"
    assert "found late" in payload["error"]["message"]
    # The official client yields the partial image, then raises the error.
    stream = client(url).images.generate(model="fake", prompt=body["prompt"], stream=True,
                                         partial_images=1)
    assert next(stream).type == "image_generation.partial_image"
    with pytest.raises(openai.APIError, match="found late"):
        next(stream)


def test_a_streamed_request_shares_its_wave_with_a_plain_one() -> None:
    with gated_server(max_num_seqs=2) as (server, gate), \
            ThreadPoolExecutor(max_workers=3) as pool:
        blocker = pool.submit(httpx.post, f"{server.url}{ROUTE}", json={"prompt": "hold"},
                              timeout=TIMEOUT_S)
        assert gate.entered.wait(TIMEOUT_S)
        streamed = pool.submit(httpx.post, f"{server.url}{ROUTE}", timeout=TIMEOUT_S,
                               json={"prompt": "streamed", "stream": True,
                                     "partial_images": 1})
        plain = pool.submit(httpx.post, f"{server.url}{ROUTE}", json={"prompt": "plain"},
                            timeout=TIMEOUT_S)
        wait_until(lambda: server.engine.num_waiting == 2, what="both requests to queue")
        gate.release.set()
        assert blocker.result().status_code == 200
        events = events_of(streamed.result())
        assert plain.result().headers["x-diffbatch-batch-size"] == "2"
    assert [name for name, _ in events] == ["image_generation.partial_image",
                                            "image_generation.completed"]
    assert events[-1][1]["diffbatch"]["batch_size"] == 2


def test_the_request_timeout_after_the_first_event_is_an_error_event() -> None:
    with gated_server(PreviewGatedPipeline, request_timeout_s=1.0) as (server, gate):
        gate.release.set()  # previews at once; the wave then holds until `finish`
        response = httpx.post(f"{server.url}{ROUTE}", timeout=TIMEOUT_S, json={
            "prompt": "slow", "stream": True, "partial_images": 1})
        (first, _), (name, payload) = events_of(response)
        assert (first, name) == ("image_generation.partial_image", "error")
        assert payload["error"]["code"] == "timeout"
        assert "request timeout of 1 s" in payload["error"]["message"]
        # (counted as the engine delivers the abort, just after it stops tracking it)
        wait_until(lambda: server.engine.metrics.count("aborted") == 1, what="the abort")
        assert server.engine.num_unfinished == 0
