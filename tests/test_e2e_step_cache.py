"""Step caching end to end: `--step-cache` and the request's `step_cache` over HTTP
with the official client, the response's `diffbatch` object and `/metrics`, on a real
transformer model in a worker process; a UNet model refuses it naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.config import EngineConfig, add_cli_args
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.errors import ConfigError, InvalidRequestError
from tests.entrypoints.openai.conftest import serve_in_thread
from tests.entrypoints.openai.test_input_validation import assert_openai_error

pytestmark = pytest.mark.slow

MODEL = "tiny-pixart"
STEPS = 6


def engine_from_flags(model: str, *flags: str) -> Engine:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([*flags, "--max-num-seqs", "4", "--torch-threads", "1",
                              "--calibration-budget-s", "0", "--no-warmup"])
    return Engine.from_config(dataclasses.replace(EngineConfig.from_cli_args(args),
                                                  model=model))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Engine, str]]:
    with engine_from_flags(MODEL, "--step-cache", "first_block:0.3") as engine:
        app = build_app(engine, served_model_name=MODEL, close_engine_on_shutdown=False)
        with serve_in_thread(app) as url:
            yield engine, url


def test_server_default_and_per_request_settings_are_counted_in_response_and_metrics(
        served: tuple[Engine, str]) -> None:
    import openai

    engine, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def generate(**extra: object) -> dict[str, object]:
        result = client.images.generate(prompt="a red circle", size="64x64", extra_body={
            "seed": 5, "num_inference_steps": STEPS, **extra})
        return result.model_dump()

    cached_before = engine.metrics.registry.get_sample_value(
        "diffbatch_step_cache_steps_total", {"model": MODEL, "outcome": "cached"}) or 0.0
    default = generate()  # the server's --step-cache
    own = generate(step_cache={"policy": "first_block", "threshold": 0.3, "max_cached_steps": 1})
    off = generate(step_cache="off")
    assert default["diffbatch"]["step_cache"] == "first_block:0.3"
    assert default["diffbatch"]["cached_steps"] > 0
    assert default["diffbatch"]["computed_steps"] + default["diffbatch"]["cached_steps"] == STEPS
    assert own["diffbatch"]["cached_steps"] < default["diffbatch"]["cached_steps"]
    assert off.get("diffbatch") is None
    assert default["data"][0]["b64_json"] != off["data"][0]["b64_json"]  # really cached
    cached = engine.metrics.registry.get_sample_value(
        "diffbatch_step_cache_steps_total", {"model": MODEL, "outcome": "cached"})
    computed = engine.metrics.registry.get_sample_value(
        "diffbatch_step_cache_steps_total", {"model": MODEL, "outcome": "computed"})
    assert cached - cached_before == default["diffbatch"]["cached_steps"] + \
        own["diffbatch"]["cached_steps"]
    assert computed is not None and computed >= 2 * STEPS - cached
    scraped = httpx.get(f"{url}/metrics").text
    assert 'diffbatch_step_cache_steps_total{model="tiny-pixart",outcome="cached"}' in scraped


def test_a_streamed_answer_counts_the_cached_steps_too(served: tuple[Engine, str]) -> None:
    import json

    _engine, url = served
    with httpx.stream("POST", f"{url}/v1/images/generations", timeout=120, json={
            "prompt": "a red circle", "size": "64x64", "stream": True, "seed": 5,
            "num_inference_steps": STEPS}) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    completed = events[-1]["diffbatch"]
    assert completed["cached_steps"] > 0
    assert completed["computed_steps"] + completed["cached_steps"] == STEPS


def test_a_bad_spec_is_a_400_naming_the_field(served: tuple[Engine, str]) -> None:
    _engine, url = served
    for bad in ("teacache", "first_block:-1", {"threshold": 0.1, "extra": 1}):
        response = httpx.post(f"{url}/v1/images/generations", json={
            "prompt": "p", "size": "64x64", "step_cache": bad})
        assert_openai_error(response, 400, "step_cache")


def test_a_unet_model_refuses_the_flag_and_the_field() -> None:
    with pytest.raises(ConfigError, match="--step-cache"):
        engine_from_flags("tiny-sd", "--executor", "inproc", "--step-cache", "first_block")
    with engine_from_flags("tiny-sd", "--executor", "inproc") as engine:
        with pytest.raises(InvalidRequestError, match="--step-cache") as refused:
            engine.generate("p", SamplingParams(step_cache="first_block",
                                                num_inference_steps=1), use_tqdm=False)
        assert refused.value.param == "step_cache"
