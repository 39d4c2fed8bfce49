"""What `--compile` asks for: `CompileSettings`, built from the engine's options.

Compiling runs the denoiser (and, with "denoiser+vae", the VAE decoder) through
`torch.compile`; `diffbatch.pipelines.interception.compiled` does it per wave-size
bucket, inside the wave's one forward (docs/compile.md).

- `compile`: "off", "denoiser" or "denoiser+vae".
- `compile_buckets`: "auto" (powers of two up to the largest wave's denoiser rows),
  a list of row counts such as "1,2,4,8", or "dynamic" (one graph whose batch
  dimension is symbolic: no padding).
- `compile_backend`: a `torch.compile` backend by name ("inductor"; "eager" and
  "aot_eager" trace without generating code, for checking the mechanism cheaply), or
  "module:function" naming a custom backend callable.

`CompileSettings.mode` is inductor's mode ("default"; "reduce-overhead" adds CUDA
graphs, which `benchmarks/compile.py --parts device` measures on a GPU).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from diffbatch.options import Rule

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig

CompileTarget = Literal["off", "denoiser", "denoiser+vae"]
COMPILE_TARGETS: tuple[str, ...] = ("off", "denoiser", "denoiser+vae")
DYNAMIC = "dynamic"
# "auto" never compiles more buckets than rows up to this (each bucket is a compile)
MAX_AUTO_ROWS = 64


class CompileBuckets(Rule):
    """The `--compile-buckets` rule: "auto", "dynamic", or row counts "1,2,4,8"."""

    text = "'auto', 'dynamic' or increasing row counts >= 1 such as 1,2,4,8"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and self._parses(value)

    def parse(self, text: str) -> str:
        text = text.strip()
        if text in ("auto", DYNAMIC):
            return text
        try:
            rows = [int(part) for part in text.split(",")]
        except ValueError:
            raise self._bad(text) from None
        if not rows or any(r < 1 for r in rows) or rows != sorted(set(rows)):
            raise self._bad(text)
        return ",".join(str(r) for r in rows)


class CompileBackend(Rule):
    """The `--compile-backend` rule: a backend name, or "module:function"."""

    text = "a torch.compile backend name (inductor, eager, aot_eager) or module:function"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and bool(value.strip()) and " " not in value.strip()

    def parse(self, text: str) -> str:
        if not self.accepts(text):
            raise self._bad(text)
        return text.strip()


@dataclass(frozen=True)
class CompileSettings:
    """How the worker compiles: what, for which row counts, with which backend."""

    target: CompileTarget
    buckets: tuple[int, ...]  # denoiser row counts compiled; () with `dynamic`
    dynamic: bool  # one graph with a symbolic batch dimension instead of buckets
    backend: str
    mode: str
    cache_dir: str  # inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR)

    @property
    def enabled(self) -> bool:
        return self.target != "off"

    @property
    def vae(self) -> bool:
        return self.target == "denoiser+vae"

    def resolved_backend(self) -> str | Callable[..., Any]:
        """The backend for `torch.compile`: a name, or the callable "module:function"
        names (an import error raises here, and the worker falls back to eager)."""
        if ":" not in self.backend:
            return self.backend
        module, _, name = self.backend.partition(":")
        return getattr(importlib.import_module(module), name)

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding `rows` (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= rows), None)


def auto_buckets(max_rows: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first one holding `max_rows` (capped)."""
    buckets, size = [], 1
    while True:
        buckets.append(size)
        if size >= min(max_rows, MAX_AUTO_ROWS):
            return tuple(buckets)
        size *= 2


def parse_buckets(spec: str, max_rows: int) -> tuple[tuple[int, ...], bool]:
    """(buckets, dynamic) for a `compile_buckets` spec."""
    spec = CompileBuckets().parse(spec)
    if spec == DYNAMIC:
        return (), True
    if spec == "auto":
        return auto_buckets(max_rows), False
    return tuple(int(r) for r in spec.split(",")), False


def compile_settings(config: EngineConfig) -> CompileSettings:
    """The worker's `CompileSettings` from the engine's options."""
    from diffbatch.pipelines.tiny import cache_dir

    # the denoiser's rows of the largest wave: its requests, doubled by CFG
    buckets, dynamic = parse_buckets(config.compile_buckets, 2 * config.capacity_limit)
    return CompileSettings(
        target=config.compile, buckets=buckets, dynamic=dynamic,
        backend=config.compile_backend, mode="default",
        cache_dir=str(cache_dir() / "inductor"))
