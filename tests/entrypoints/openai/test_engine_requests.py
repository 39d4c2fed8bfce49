"""What an HTTP request hands the engine: every field arrives, streamed or not.

The app runs in-process on a fake-pipeline engine whose `_add` (the one door of both
`generate_async` and `generate_stream`) is watched, so a test compares the
`DiffusionRequest` each path builds from the same body, field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import torch

from diffbatch import Engine
from diffbatch.lora_ref import LoraRef
from diffbatch.request import DiffusionRequest
from tests.entrypoints.openai.conftest import app_client
from tests.entrypoints.openai.test_edits import mask_png, png
from tests.fake_pipelines import FakeBatchPipeline

# Every engine-side field of a generation a stream may have (one image: `n` is 1), none
# at its default; `partial_images` is the streamed request's only extra.
GENERATION = {"prompt": "a red cat", "size": "24x16", "negative_prompt": "blur",
              "num_inference_steps": 3, "guidance_scale": 2.5, "seed": 11, "lora": "style",
              "lora_scale": 0.5, "priority": -7}
EDIT = {"prompt": "a red cat", "size": "24x16", "negative_prompt": "blur",
        "num_inference_steps": "3", "guidance_scale": "2.5", "seed": "11", "lora": "style",
        "lora_scale": "0.5", "priority": "-7", "strength": "0.4"}


@pytest.fixture(scope="module")
def engine(lora_dir: str) -> Iterator[Engine]:
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=0, lora_dir=lora_dir) as engine:
        yield engine


@pytest.fixture
def added(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[DiffusionRequest]:
    """Every request the engine is handed from now on."""
    seen: list[DiffusionRequest] = []
    add = engine._add

    def watched(requests: list[DiffusionRequest]) -> Any:
        seen.extend(requests)
        return add(requests)

    monkeypatch.setattr(engine, "_add", watched)
    return seen


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine) as client:
        yield client


def fields_of(request: DiffusionRequest) -> dict[str, Any]:
    """What the engine computes from: prompt, priority and every sampling parameter
    (tensors as lists); the previews are a stream's own and are left out."""
    params = {f.name: getattr(request.sampling_params, f.name)
              for f in dataclasses.fields(request.sampling_params) if f.name != "partial_images"}
    params = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    return {"prompt": request.prompt, "priority": request.priority, **params}


async def test_a_streamed_generation_hands_the_engine_what_a_plain_one_does(client, added,
                                                                           ) -> None:
    plain = await client.post("/v1/images/generations", json=GENERATION)
    assert plain.status_code == 200, plain.text
    streamed = await client.post("/v1/images/generations", json={**GENERATION, "stream": True,
                                                                     "partial_images": 1})
    assert streamed.status_code == 200, streamed.text
    assert [r.sampling_params.partial_images for r in added] == [0, 1]
    first, second = (fields_of(r) for r in added)
    assert first == second
    assert (first["priority"], first["seed"], first["lora_scale"]) == (-7, 11, 0.5)
    assert LoraRef.parse(first["lora"]).name == "style"  # resolved in the LoRA folder
    assert (first["width"], first["height"]) == (24, 16)
    assert (first["negative_prompt"], first["num_inference_steps"],
            first["guidance_scale"]) == ("blur", 3, 2.5)


async def test_a_streamed_edit_hands_the_engine_what_a_plain_one_does(client, added) -> None:
    for streamed in ({}, {"stream": "true", "partial_images": "1"}):
        response = await client.post("/v1/images/edits", data={**EDIT, **streamed},
                                     files={"image": ("in.png", png((24, 16)), "image/png"),
                                            "mask": ("m.png", mask_png((24, 16)), "image/png")})
        assert response.status_code == 200, response.text
    assert [r.sampling_params.partial_images for r in added] == [0, 1]
    first, second = (fields_of(r) for r in added)
    assert first == second
    assert (first["priority"], first["seed"], first["strength"]) == (-7, 11, 0.4)
    assert LoraRef.parse(first["lora"]).name == "style"
    assert first["image"] is not None and first["mask"] is not None


async def test_lora_without_adapters_configured_is_a_400_naming_the_flag() -> None:
    """Without `--lora-dir` the engine would take `lora` as a path on the server: the
    server refuses it before the engine sees it."""
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=1,
                request_batch_max_wait_ms=0) as engine:
        async with app_client(engine) as client:
            for route, send in (
                ("/v1/images/generations", {"json": {"prompt": "p", "lora": "style"}}),
                ("/v1/images/edits", {"data": {"prompt": "p", "lora": "style"},
                                      "files": {"image": ("in.png", png(), "image/png")}}),
            ):
                response = await client.post(route, **send)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "lora" and "--lora-" in error["message"], error
            assert engine.metrics.count("completed") == 0


@pytest.mark.parametrize(("quality", "steps"), [
    ("low", 1), ("medium", 2), ("auto", 2), ("standard", 2), ("high", 4), ("hd", 4)])
async def test_openai_quality_sets_the_step_count(client, added, quality: str,
                                                  steps: int) -> None:
    """`quality` asks for a share of the model's default steps (2 here), unless the
    request gives its own `num_inference_steps`."""
    response = await client.post("/v1/images/generations",
                                 json={"prompt": "p", "quality": quality})
    assert response.status_code == 200, response.text
    given = await client.post("/v1/images/generations",
                              json={"prompt": "p", "quality": quality, "num_inference_steps": 3})
    assert given.status_code == 200, given.text
    assert [r.sampling_params.num_inference_steps for r in added] == [steps, 3]
