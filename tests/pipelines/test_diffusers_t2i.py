"""Tests of the diffusers adapter: one call per wave, batch invariance, quirks, LoRA, logs."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffbatch.engine.request_checks import check_against_model
from diffbatch.errors import ConfigError, InvalidRequestError, ModelNotFoundError, WaveInterrupted
from diffbatch.pipelines.diffusers_edit import call_parameters
from diffbatch.pipelines.diffusers_t2i import (
    DiffusersPerRequestPipeline,
    DiffusersT2IPipeline,
    resolve_device,
    resolve_dtype,
)
from diffbatch.pipelines.library_logs import TorchvisionFallbackFilter, TruncatedPromptFilter
from diffbatch.pipelines.registry import resolve_model_path
from diffbatch.sampling_params import SamplingParams
from tests.pipelines.conftest import SIZE, TINY_NAMES, TOLERANCE, make_batch, make_request

PROMPTS = [("a red cat", None), ("a blue dog", "blurry"), ("a green tree photo", "ugly bad")]
# Flux takes negative prompts only with true CFG; without it they are not used at all.
FLUX_TRUE_CFG = {"true_cfg_scale": 2.0}


def _wave(pipeline: DiffusersT2IPipeline, name: str, n: int = 1, **params: object) -> list:
    extra = dict(FLUX_TRUE_CFG) if name == "tiny-flux" else {}
    # Flux runs true CFG only for requests with a negative prompt (diffusers' rule):
    # one without is keyed apart, so this wave gives each one
    prompts = [(p, "" if n is None and name == "tiny-flux" else n) for p, n in PROMPTS]
    return [
        make_request(pipeline, f"req-{i}", prompt, seed=100 + 10 * i, negative_prompt=negative,
                     n=n, extra=dict(extra), **params)
        for i, (prompt, negative) in enumerate(prompts)
    ]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", TINY_NAMES)
def test_info(name: str, load_tiny) -> None:
    info = load_tiny(name).info()
    expected = {"tiny-sd": "StableDiffusionPipeline", "tiny-sd3": "StableDiffusion3Pipeline",
                "tiny-flux": "FluxPipeline", "tiny-pixart": "PixArtSigmaPipeline"}[name]
    assert info.name == expected
    assert (info.default_height, info.default_width) == (64, 64)
    assert info.default_num_inference_steps == 4
    assert info.size_multiple == 16  # VAE x8 times UNet blocks / patch size / Flux packing
    assert info.device == "cpu"
    assert info.cfg_threshold == (None if name == "tiny-flux" else 1.0)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_wave_returns_one_output_per_request(name: str, load_tiny) -> None:
    pipeline = load_tiny(name)
    requests = _wave(pipeline, name)
    outputs = pipeline.forward(make_batch(requests))
    assert [o.request_id for o in outputs] == ["req-0", "req-1", "req-2"]
    for out in outputs:
        assert out.ok
        assert out.images.shape == (1, 3, SIZE, SIZE)
        assert out.images.dtype == torch.float32
        assert out.images.min() >= 0.0 and out.images.max() <= 1.0
    assert _max_diff(outputs[0].images, outputs[1].images) > 1e-2


@pytest.mark.parametrize("name", TINY_NAMES)
def test_batch_invariance(name: str, load_tiny) -> None:
    """Each request's images equal the same request run alone (different negatives too)."""
    pipeline = load_tiny(name)
    requests = _wave(pipeline, name)
    batched = pipeline.forward(make_batch(requests))
    for request, out in zip(requests, batched, strict=True):
        alone = pipeline.forward(make_batch([request]))[0]
        assert _max_diff(out.images, alone.images) <= TOLERANCE, request.request_id


@pytest.mark.parametrize("name", TINY_NAMES)
def test_negative_prompts_are_per_request(name: str, load_tiny) -> None:
    pipeline = load_tiny(name)
    extra = dict(FLUX_TRUE_CFG) if name == "tiny-flux" else {}
    requests = [
        make_request(pipeline, f"r{i}", "a red cat", seed=5, negative_prompt=neg, extra=dict(extra))
        for i, neg in enumerate(["" if name == "tiny-flux" else None, "blurry ugly", ""])
    ]  # (Flux: a request without a negative prompt runs no true CFG, keyed apart)
    kwargs = pipeline.call_kwargs(make_batch(requests))
    assert kwargs["negative_prompt"] == ["", "blurry ugly", ""]
    out = pipeline.forward(make_batch(requests))
    assert _max_diff(out[0].images, out[1].images) > 1e-3  # same seed, other negative
    assert _max_diff(out[0].images, out[2].images) <= TOLERANCE  # None means "" here


def test_flux_ignores_negative_prompts_without_true_cfg(load_tiny) -> None:
    pipeline = load_tiny("tiny-flux")
    request = make_request(pipeline, "r", "a red cat", negative_prompt="blurry")
    assert "negative_prompt" not in pipeline.call_kwargs(make_batch([request]))
    assert not pipeline.cfg_enabled(request.sampling_params)


def test_a_pipeline_whose_true_cfg_is_on_by_default_keeps_its_negative_prompts(
        load_tiny) -> None:
    """QwenImage's `true_cfg_scale` defaults to 4 (Flux's to 1): its negative prompts
    count without any `extra`, and admission takes them."""
    import copy
    import inspect

    diffusers = pytest.importorskip("diffusers")
    qwen = getattr(diffusers, "QwenImagePipeline", None)
    if qwen is None:
        pytest.skip("this diffusers has no QwenImagePipeline")
    flux = load_tiny("tiny-flux")
    qwen_like = copy.copy(flux)
    qwen_like._call_params = dict(inspect.signature(qwen.__call__).parameters)
    assert qwen_like._true_cfg_default() > 1.0 and flux._true_cfg_default() == 1.0
    assert qwen_like._uses_negative_prompt({}) and not flux._uses_negative_prompt({})
    assert not qwen_like._uses_negative_prompt({"true_cfg_scale": 1.0})


def test_a_negative_prompt_the_model_would_drop_is_refused_at_admission(load_tiny) -> None:
    """Flux uses a negative prompt only with true CFG: without it the request is told so
    (it would otherwise get the same image as without one); SD takes it as it is."""
    flux, sd = load_tiny("tiny-flux").info(), load_tiny("tiny-sd").info()
    assert (flux.negative_prompt, sd.negative_prompt) == ("true_cfg", "yes")
    size = {"height": 64, "width": 64, "num_inference_steps": 2}
    with pytest.raises(InvalidRequestError, match="no effect on FluxPipeline") as info:
        check_against_model(flux, SamplingParams(negative_prompt="blurry", **size), None)
    assert info.value.param == "negative_prompt"
    for accepted in (SamplingParams(**size), SamplingParams(negative_prompt="", **size),
                     SamplingParams(negative_prompt="blurry", **size,
                                    extra={"true_cfg_scale": 2.0})):
        check_against_model(flux, accepted, None)
    check_against_model(sd, SamplingParams(negative_prompt="blurry", **size), None)
    no_negative = dataclasses.replace(sd, negative_prompt="no")
    with pytest.raises(InvalidRequestError, match="not supported by"):
        check_against_model(no_negative, SamplingParams(negative_prompt="x", **size), None)


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-flux"])
def test_n_images_per_prompt(name: str, load_tiny) -> None:
    pipeline = load_tiny(name)
    requests = _wave(pipeline, name, n=2)[:2]
    batched = pipeline.forward(make_batch(requests))
    for request, out in zip(requests, batched, strict=True):
        assert out.images.shape == (2, 3, SIZE, SIZE)
        assert _max_diff(out.images[0], out.images[1]) > 1e-2  # own generator per image
        alone = pipeline.forward(make_batch([request]))[0]
        assert _max_diff(out.images, alone.images) <= TOLERANCE


def test_sd3_custom_sigmas(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd3")
    default = make_request(pipeline, "a", "a red cat", seed=3)
    custom = make_request(pipeline, "b", "a red cat", seed=3, sigmas=(1.0, 0.3))
    assert pipeline.call_kwargs(make_batch([custom]))["sigmas"] == [1.0, 0.3]
    a = pipeline.forward(make_batch([default]))[0].images
    b = pipeline.forward(make_batch([custom]))[0].images
    assert _max_diff(a, b) > 1e-3


def test_info_declares_the_call_arguments_extras_may_use(load_tiny) -> None:
    """What the engine checks `extra`, `sigmas` and `timesteps` against at admission."""
    accepted = load_tiny("tiny-sd3").info().call_arguments
    assert "sigmas" in accepted and "max_sequence_length" in accepted
    for name in ("timesteps", "no_such_knob", "prompt_embeds", "prompt", "generator"):
        assert name not in accepted


def test_custom_schedules_the_scheduler_cannot_take_are_not_declared(load_tiny) -> None:
    """SD's `__call__` takes `sigmas` and `timesteps`, its DDIM scheduler neither: the
    engine refuses them at admission (400), not as a failed wave."""
    pipeline = load_tiny("tiny-sd")
    assert "sigmas" in call_parameters(pipeline.pipe)
    accepted = pipeline.info().call_arguments
    assert "sigmas" not in accepted and "timesteps" not in accepted
    params = SamplingParams(height=64, width=64, num_inference_steps=2, sigmas=[1.0, 0.5])
    with pytest.raises(InvalidRequestError, match="`sigmas` is not supported") as info:
        check_against_model(pipeline.info(), params, None)
    assert info.value.param == "sigmas"


def test_a_device_this_torch_cannot_use_is_a_config_error_naming_it() -> None:
    assert resolve_device("CPU") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device 'cuda' is not available here") as info:
            resolve_device("cuda")
        assert info.value.param == "device"


def test_generator_count_must_match(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    batch = make_batch([make_request(pipeline, "r", "a red cat", n=2)])
    batch.generators = batch.generators[:1]
    with pytest.raises(ValueError, match="1 requests x 2 images but 1 generators"):
        pipeline.forward(batch)


def test_mixed_keys_are_refused(load_tiny) -> None:
    pipeline = load_tiny("tiny-sd")
    a = make_request(pipeline, "a", "a red cat")
    b = make_request(pipeline, "b", "a red cat", guidance_scale=2.0)
    with pytest.raises(ValueError, match="one SamplingParamsKey"):
        pipeline.forward(make_batch([a, b]))


def test_per_request_pipeline_refuses_a_batch_of_two(model_cache_dir: str, load_tiny) -> None:
    pipeline = DiffusersPerRequestPipeline.from_pretrained(resolve_model_path("tiny-sd"))
    assert DiffusersPerRequestPipeline.supports_request_batch is False
    requests = _wave(pipeline, "tiny-sd")[:2]
    with pytest.raises(ValueError, match="got a batch of 2"):
        pipeline.forward(make_batch(requests))
    one = pipeline.forward(make_batch(requests[:1]))
    batched = load_tiny("tiny-sd").forward(make_batch(requests))
    assert _max_diff(one[0].images, batched[0].images) <= TOLERANCE


def test_folder_without_model_index_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"model_index\.json"):
        DiffusersT2IPipeline.from_pretrained(str(tmp_path))


def test_resolve_dtype() -> None:
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.float64) is torch.float64
    with pytest.raises(ConfigError, match="dtype must be one of"):
        resolve_dtype("float8")


def _log_record(message: str) -> logging.LogRecord:
    return logging.LogRecord(TorchvisionFallbackFilter.LOGGER, logging.WARNING, __file__, 1,
                             message, None, None)


def test_torchvision_fallback_filter_drops_exactly_that_notice() -> None:
    fallback = _log_record(
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
        "`CLIPImageProcessorPil` for backward compatibility. Install torchvision to use the "
        "default backend, or import `CLIPImageProcessorPil` directly to silence this warning."
    )
    assert not TorchvisionFallbackFilter().filter(fallback)
    for other in ("Could not import module 'Foo'.",
                  "`CLIPImageProcessor` requires torchvision, which is broken",
                  "torchvision (not installed)"):
        assert TorchvisionFallbackFilter().filter(_log_record(other)), other
    installed = logging.getLogger(TorchvisionFallbackFilter.LOGGER).filters
    assert sum(isinstance(f, TorchvisionFallbackFilter) for f in installed) == 1
    TorchvisionFallbackFilter.install()  # idempotent
    assert sum(isinstance(f, TorchvisionFallbackFilter) for f in installed) == 1


def test_truncation_warnings_keep_the_note_and_drop_the_prompt() -> None:
    cut = logging.LogRecord(
        "diffusers.pipelines.x", logging.WARNING, __file__, 1,
        "The following part of your input was truncated because CLIP can only handle "
        "sequences up to 77 tokens: ['my card number is 4111']", None, None)
    assert TruncatedPromptFilter().filter(cut)
    assert cut.getMessage() == ("a prompt was truncated because CLIP can only handle "
                                "sequences up to 77 tokens (the cut text is not logged)")
    other = logging.LogRecord("diffusers", logging.WARNING, __file__, 1, "unrelated %s",
                              ("warning",), None)
    assert TruncatedPromptFilter().filter(other) and other.getMessage() == "unrelated warning"


def test_a_huggingface_hub_warning_is_printed_once_not_again_by_the_root_logger() -> None:
    """The hub prints through its own handler; with a root handler configured (as the
    CLI and the worker do) its records must not reach that one too."""
    from huggingface_hub.utils import logging as hub_logging

    seen: list[logging.LogRecord] = []
    root_handler = logging.Handler()
    root_handler.emit = seen.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(root_handler)
    try:
        hub_logging.get_logger("huggingface_hub.file_download").warning("retrying")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert not [r for r in seen if r.name.startswith("huggingface_hub")]


_ENGINE_START = """
import logging
from diffbatch import Engine, SamplingParams
LONG = " ".join(["a red circle"] * 40) + " and the secret word zebrafinch42"
for executor in ("inproc", "mp"):
    with Engine("tiny-sd", executor=executor, torch_num_threads=1, max_num_seqs=1,
                request_batch_max_wait_ms=0) as engine:
        out = engine.generate([LONG], SamplingParams(num_inference_steps=1), use_tqdm=False)
        assert out[0].ok, out[0].error
logging.getLogger("transformers.utils.import_utils").warning("another transformers warning")
"""


@pytest.mark.slow
def test_an_engine_logs_no_torchvision_warning_and_no_prompt(model_cache_dir: str) -> None:
    # A fresh interpreter: in this one diffusers' pipeline modules may be imported already.
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _ENGINE_START], capture_output=True,
                          text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchvision" not in done.stderr, done.stderr
    assert "another transformers warning" in done.stderr  # other warnings still show
    # a prompt past CLIP's 77 tokens: noted, in process and in the worker, never shown
    assert done.stderr.count("a prompt was truncated because CLIP") == 2, done.stderr
    assert "zebrafinch42" not in done.stderr


@pytest.mark.parametrize("name", TINY_NAMES)
def test_a_wave_nobody_waits_for_stops_at_the_next_denoising_step(name: str, load_tiny) -> None:
    """`should_stop` turning true mid-loop stops the diffusers call at that step's end:
    two steps of the twenty asked for, and no decoding."""
    pipeline = load_tiny(name)
    pipe = pipeline.pipe
    denoiser = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
    calls = {"denoiser": 0, "should_stop": 0, "decode": 0}
    hook = denoiser.register_forward_hook(
        lambda *_: calls.__setitem__("denoiser", calls["denoiser"] + 1))
    original_decode = pipe.vae.decode

    def counted_decode(*args, **kwargs):
        calls["decode"] += 1
        return original_decode(*args, **kwargs)

    pipe.vae.decode = counted_decode

    def should_stop() -> bool:  # false before the loop and after step 0, true after step 1
        calls["should_stop"] += 1
        return calls["should_stop"] >= 3

    requests = _wave(pipeline, name, num_inference_steps=20)[:2]
    batch = dataclasses.replace(make_batch(requests), should_stop=should_stop)
    try:
        with pytest.raises(WaveInterrupted), torch.inference_mode():
            pipeline.forward(batch)
    finally:
        hook.remove()
        del pipe.vae.decode
    per_step = 2 if name == "tiny-flux" else 1  # Flux's true CFG: two denoiser calls a step
    assert calls["denoiser"] == 2 * per_step and calls["decode"] == 0
    # The next wave runs in full: nothing of the interruption stays behind.
    assert all(out.ok for out in pipeline.forward(make_batch(requests[:1])))


def test_a_hub_id_that_cannot_be_reached_says_so(monkeypatch) -> None:
    """Offline, diffusers says the repository has no model_index.json; the cause is that
    the hub could not be reached and the model is not cached."""
    from diffusers import DiffusionPipeline
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(model: str, **kwargs: object) -> None:
        try:
            raise LocalEntryNotFoundError("cannot find the requested files in the local cache")
        except LocalEntryNotFoundError as exc:
            raise OSError(f"{model} does not appear to have a file named model_index.json.") \
                from exc

    monkeypatch.setattr(DiffusionPipeline, "load_config", offline)
    with pytest.raises(ModelNotFoundError, match="hub could not be reached") as info:
        DiffusersT2IPipeline.from_pretrained("someone/some-model")
    assert "hf download someone/some-model" in info.value.message
