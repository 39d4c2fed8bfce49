"""`diffbatch serve --compile`: compiled waves keep batching, adapters load without a
recompile, and a compile that fails leaves a server that answers.

The server traces the real tiny-sd UNet and VAE decoder with a backend that runs
dynamo's graphs as traced (like dynamo's "eager" backend) and refuses the
decoder's: guards, buckets, padding, recompiles and the fallback are dynamo's own,
without inductor's code generation, which takes minutes per bucket on a shared CPU.
Inductor's numbers and its on-disk cache are checked in tests/pipelines/test_compiled.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.pipelines.tiny_lora import make_tiny_lora
from tests.entrypoints.openai.test_edits import decode
from tests.entrypoints.test_cli_serve import START_TIMEOUT_S, metric_value, serve, stop

pytestmark = pytest.mark.slow

ROUTE = "/v1/images/generations"


class Compiled:
    """A `diffbatch serve tiny-sd --compile denoiser` process: its URL and log."""

    def __init__(self, url: str, log: Any) -> None:
        self.url, self.log = url, log

    def post(self, **body: Any) -> httpx.Response:
        response = httpx.post(f"{self.url}{ROUTE}", timeout=START_TIMEOUT_S, json={
            "prompt": "a red circle", "num_inference_steps": 2, **body})
        assert response.status_code == 200, response.text
        return response

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.url, name, **labels)

    def text(self) -> str:
        self.log.seek(0)
        return str(self.log.read())


def conditioned_only(graph: Any, example_inputs: list[Any]) -> Any:
    """A dynamo backend that runs the graphs taking text conditioning (the UNet's) as
    traced, and refuses the others (the VAE decoder's)."""
    inputs = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    if not any("encoder_hidden_states" in name for name in inputs):
        raise RuntimeError("this backend refuses graphs without text conditioning")
    return graph.forward


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compiled]:
    """Buckets of 2 and 4 UNet rows: a lone CFG request runs in bucket 2, a wave of
    two in bucket 4; adapters resolve by name in a LoRA folder."""
    root = tmp_path_factory.mktemp("compiled")
    make_tiny_lora(resolve_model_path("tiny-sd"), root / "loras" / "style", seed=1)
    proc, url, log = serve(root, "tiny-sd", "--executor", "inproc", "--compile",
                           "denoiser+vae", "--compile-backend", f"{__name__}:conditioned_only",
                           "--compile-buckets", "2,4",
                           "--max-num-seqs", "2", "--request-batch-max-wait-ms", "1000",
                           "--lora-dir", str(root / "loras"))
    try:
        yield Compiled(url, log)
    finally:
        stop(proc, log)


def test_start_up_compiles_each_bucket_before_ready(compiled: Compiled) -> None:
    text = compiled.text()
    assert "compiling unet bucket 1 of 2 (2 rows)" in text
    assert "compiling unet bucket 2 of 2 (4 rows)" in text
    assert "compiled unet in" in text and "buckets unet: 2,4" in text
    assert compiled.metric("diffbatch_compile_buckets") == 2
    assert compiled.metric("diffbatch_compile_compiles_total") == 2


def test_a_request_in_a_wave_equals_it_alone_within_one_level(compiled: Compiled) -> None:
    alone = compiled.post(seed=7)
    forwards = compiled.metric("diffbatch_compile_compiled_forwards_total")
    with ThreadPoolExecutor(2) as pool:
        pair = [f.result() for f in [pool.submit(compiled.post, seed=s, guidance_scale=g)
                                     for s, g in ((7, None), (8, 3.0))]]
    assert [r.headers["x-diffbatch-batch-size"] for r in pair] == ["2", "2"]
    difference = np.abs(decode(alone).astype(int) - decode(pair[0]).astype(int))
    assert difference.max() <= 1
    # the pair's 2 steps ran compiled in bucket 4, with no new graph
    assert compiled.metric("diffbatch_compile_compiled_forwards_total") == forwards + 2
    assert compiled.metric("diffbatch_compile_recompiles_total") == 0


def test_an_adapter_loaded_at_run_time_causes_no_recompile(compiled: Compiled) -> None:
    base = compiled.post(seed=9)
    styled = compiled.post(seed=9, lora="style")  # loaded now, into the UNet's layers
    again = compiled.post(seed=9)
    assert compiled.metric("diffbatch_compile_eager_forwards_total", reason="lora") == 2
    assert compiled.metric("diffbatch_compile_recompiles_total") == 0
    assert np.abs(decode(styled).astype(int) - decode(base).astype(int)).max() > 1
    assert np.array_equal(decode(again), decode(base))


def test_a_module_whose_compile_fails_serves_eagerly(compiled: Compiled) -> None:
    """The VAE decoder's compile fails (the backend refuses it): one log line, and the
    decoder runs eagerly while the UNet runs compiled."""
    compiled.post(seed=3)
    lines = [line for line in compiled.text().splitlines() if "runs eagerly" in line]
    assert len(lines) == 1 and "vae.decoder" in lines[0] and "refuses" in lines[0]
    assert compiled.metric("diffbatch_compile_failures_total") == 1
    assert compiled.metric("diffbatch_compile_eager_forwards_total", reason="off") > 0
