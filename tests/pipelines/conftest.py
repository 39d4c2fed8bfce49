"""Fixtures of the pipeline-layer tests: a private model cache, tiny pipelines, waves.

Every test here runs offline (HF_HUB_OFFLINE=1) against the built-in tiny models,
built into a session-scoped temporary cache so nothing touches ~/.cache. Requests
are built directly, the way the engine would: resolved params, the key from
`SamplingParamsKey.from_params`, and one generator per image seeded `seed + i`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from diffbatch.pipelines.diffusers_t2i import DiffusersT2IPipeline
from diffbatch.pipelines.interface import DiffusionRequestBatch
from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey

torch.set_num_threads(1)

TINY_NAMES = ("tiny-sd", "tiny-sd3", "tiny-flux", "tiny-pixart")
SIZE = 64  # keep every test at 64x64 and 2 steps: the machine is shared
STEPS = 2
TOLERANCE = 1e-4  # batch invariance: max abs difference, batched vs alone


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A session-wide DIFFBATCH_CACHE_DIR, so tests never build into ~/.cache."""
    folder = str(tmp_path_factory.mktemp("diffbatch-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFBATCH_CACHE_DIR", folder)
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield folder


@pytest.fixture(scope="session")
def load_tiny(model_cache_dir: str) -> Callable[[str], DiffusersT2IPipeline]:
    """Load (once per session) the batch-capable adapter over a tiny model."""
    from diffbatch.pipelines.registry import load_pipeline

    loaded: dict[str, DiffusersT2IPipeline] = {}

    def load(name: str) -> DiffusersT2IPipeline:
        if name not in loaded:
            pipeline = load_pipeline(name)
            assert isinstance(pipeline, DiffusersT2IPipeline)
            loaded[name] = pipeline
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def tiny_lora(model_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random LoRA adapter for tiny-sd, made once per session; returns its folder."""
    from diffbatch.pipelines.registry import resolve_model_path
    from diffbatch.pipelines.tiny_lora import make_tiny_lora

    out = tmp_path_factory.mktemp("tiny-lora")
    return make_tiny_lora(resolve_model_path("tiny-sd"), out, seed=0, rank=4)


def make_request(
    pipeline: Any, request_id: str, prompt: str, *, seed: int = 0,
    negative_prompt: str | None = None, n: int = 1, guidance_scale: float | None = None,
    **params: Any,
) -> DiffusionRequest:
    """A request with resolved params and its key, as the engine builds them."""
    info = pipeline.info()
    resolved = SamplingParams(
        height=params.pop("height", SIZE), width=params.pop("width", SIZE),
        num_inference_steps=params.pop("num_inference_steps", STEPS),
        guidance_scale=info.default_guidance_scale if guidance_scale is None else guidance_scale,
        negative_prompt=negative_prompt, num_outputs_per_prompt=n, seed=seed,
        output_type="pt", **params,
    )
    request = DiffusionRequest(request_id=request_id, prompt=prompt, sampling_params=resolved)
    cfg_enabled = pipeline.cfg_enabled(resolved)
    request.key = SamplingParamsKey.from_params(resolved, cfg_enabled=cfg_enabled)
    return request


def make_batch(requests: list[DiffusionRequest]) -> DiffusionRequestBatch:
    """A wave with one generator per output image, seeded `seed + i`, in request order."""
    generators = [
        torch.Generator().manual_seed(r.sampling_params.seed + i)
        for r in requests
        for i in range(r.sampling_params.num_outputs_per_prompt)
    ]
    return DiffusionRequestBatch(requests=requests, generators=generators)

