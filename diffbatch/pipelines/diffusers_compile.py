"""`--compile` for diffusers pipelines: which modules compile, and when a call stays eager.

The denoiser (`unet` or `transformer`) compiles per wave-size bucket, and with
"denoiser+vae" the VAE's `decoder` module too (the VAE's `decode` calls it with the
wave's latents). Each gets a `CompiledForward` (`interception/compiled.py`); the
denoiser's calls run eagerly where a feature changes the module at run time: rows
that carry LoRA adapters, requests that cache steps, packed calls of several sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from diffbatch.compile import CompileSettings
from diffbatch.pipelines.diffusers_lora import DENOISERS
from diffbatch.pipelines.interception.compiled import (
    CompiledForward,
    CompileStats,
    EagerReason,
    configure_dynamo,
)


def compile_pipe(pipe: Any, settings: CompileSettings, run_once: Callable[[], Any], *,
                 eager_reason: EagerReason,
                 shared: frozenset[str] = frozenset()) -> CompileStats:
    """Compile `pipe`'s modules per `settings`, capture their arguments from
    `run_once()` and warm every bucket; returns the counts."""
    stats = CompileStats()
    configure_dynamo(settings, max(1, len(settings.buckets)) * 2)
    forwards: list[CompiledForward] = []
    try:
        for name in DENOISERS:
            module = getattr(pipe, name, None)
            if module is not None:
                forwards.append(CompiledForward(module, name, settings, stats,
                                                eager_reason=eager_reason, shared=shared))
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        if settings.vae and decoder is not None:
            forwards.append(CompiledForward(decoder, "vae.decoder", settings, stats))
        with contextlib.ExitStack() as stack:
            for forward in forwards:
                stack.enter_context(forward.capture())
            run_once()
    except BaseException:
        for forward in forwards:  # hooks stay in place: eager from now on
            forward.disable_quietly()
        raise
    for forward in forwards:
        forward.warm()
    return stats
