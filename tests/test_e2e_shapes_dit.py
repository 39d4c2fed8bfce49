"""The shipped diffusion transformer `shapes-dit`: a stock diffusers folder that draws what
it is asked, reads ordinary-length prompts, and keeps batch invariance in both modes."""

from __future__ import annotations

import pytest
import torch

from diffbatch import Engine, SamplingParams
from diffbatch.models import packaged_models
from scripts.shapes_data import judge_matches

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("shapes-dit" not in packaged_models(),
                       reason="shapes-dit model not shipped"),
]

TOLERANCE = 1e-4  # batch invariance: max abs difference, batched vs alone
# SGLang's bench_serving random prompt: 44 tokens here (its words are outside the
# vocabulary, so they are spelled byte by byte)
BENCH_PROMPT = "Random prompt 0 for benchmarking diffusion models"


def pt(seed: int, **params) -> SamplingParams:
    return SamplingParams(seed=seed, output_type="pt", **params)


@pytest.fixture(scope="module")
def request_engine():
    with Engine("shapes-dit", max_num_seqs=4, request_batch_max_wait_ms=0, executor="inproc",
                torch_num_threads=1, warmup=False) as engine:
        yield engine


def test_the_folder_loads_with_plain_diffusers_and_draws_the_prompt():
    import json

    from diffusers import PixArtSigmaPipeline

    folder = packaged_models()["shapes-dit"]
    with open(f"{folder}/diffbatch_defaults.json", encoding="utf-8") as f:
        defaults = json.load(f)
    pipe = PixArtSigmaPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.tokenizer.model_max_length == pipe.text_encoder.config.max_position_embeddings
    prompt = "a large red circle on a white background"  # circles: 37 of 40 held out
    image = pipe(prompt, height=64, width=64,
                 num_inference_steps=defaults["num_inference_steps"],
                 guidance_scale=defaults["guidance_scale"],
                 generator=torch.Generator().manual_seed(0), use_resolution_binning=False,
                 clean_caption=False, output_type="np").images[0]
    verdict = judge_matches((image * 255).round().astype("uint8"), prompt)
    assert verdict == {"colour": True, "shape": True, "background": True}, verdict


def test_the_serving_defaults_come_from_the_folder(request_engine):
    info = request_engine.info
    assert (info.default_height, info.default_width) == (64, 64)
    assert info.default_num_inference_steps == 10
    assert info.model_max_pixels == 256 * 256
    assert info.max_prompt_tokens == 300


async def test_a_44_token_prompt_is_accepted_over_http_and_a_longer_one_than_300_is_not(
        request_engine):
    import httpx
    from transformers import CLIPTokenizer

    from diffbatch.entrypoints.openai.api_server import build_app

    tokenizer = CLIPTokenizer.from_pretrained(packaged_models()["shapes-dit"],
                                              subfolder="tokenizer")
    assert len(tokenizer(BENCH_PROMPT).input_ids) == 44
    app = build_app(request_engine, served_model_name="shapes-dit",
                    close_engine_on_shutdown=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        fits = await client.post("/v1/images/generations", json={
            "prompt": BENCH_PROMPT, "num_inference_steps": 2})
        too_long = await client.post("/v1/images/generations", json={
            "prompt": " ".join([BENCH_PROMPT] * 8)})  # 338 tokens
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["data"]) == 1
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["param"] == "prompt"
    assert "300 tokens" in too_long.json()["error"]["message"]


def test_request_mode_batch_invariance(request_engine):
    prompts = ["a red circle", "a small blue square on a black background",
               "a large green triangle at the bottom", BENCH_PROMPT]
    params = [pt(10 + i, num_inference_steps=4) for i in range(4)]
    batched = request_engine.generate(prompts, params, use_tqdm=False)
    assert [o.batch_size for o in batched] == [4] * 4
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        [alone] = request_engine.generate([prompt], [p], use_tqdm=False)
        assert alone.batch_size == 1
        assert (out.images - alone.images).abs().max().item() <= TOLERANCE


def test_step_mode_batch_invariance(request_engine):
    """Requests of different step counts and guidance share the running batch; each image
    equals its solo run in request mode."""
    prompts = ["a yellow square in the top left", "a pink circle on a gray background",
               "a cyan triangle"]
    params = [pt(20, num_inference_steps=6), pt(21, num_inference_steps=3),
              pt(22, num_inference_steps=4, guidance_scale=2.0)]
    with Engine("shapes-dit", step_execution=True, max_num_seqs=4, executor="inproc",
                torch_num_threads=1, warmup=False) as step_engine:
        stepped = step_engine.generate(prompts, params, use_tqdm=False)
        sizes = step_engine.metrics.registry
        ticks = sizes.get_sample_value("diffbatch_step_batch_size_requests_count")
        rows = sizes.get_sample_value("diffbatch_step_batch_size_requests_sum")
    assert rows > ticks  # some steps ran several requests at once
    for prompt, p, out in zip(prompts, params, stepped, strict=True):
        assert out.ok, out.error
        [alone] = request_engine.generate([prompt], [p], use_tqdm=False)
        assert (out.images - alone.images).abs().max().item() <= TOLERANCE
