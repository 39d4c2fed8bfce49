"""Which LoRA adapters are loaded into the worker's pipeline, and for whom.

At most `max_loras` adapters are resident. A wave (or, in step mode, a running
request) pins the adapters it uses for as long as it runs; loading another adapter
unloads the least recently used unpinned one, so an adapter a running wave uses is
never evicted. An adapter that fails to load is reported per adapter: only the
requests that use it fail (a 400 naming it when the adapter itself is at fault),
their wave mates run.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from diffbatch.errors import InvalidRequestError, ModelNotFoundError

if TYPE_CHECKING:
    from diffbatch.pipelines.interface import BasePipeline
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import LoraStack

logger = logging.getLogger(__name__)


class LoraLoadError(InvalidRequestError):
    """The request's LoRA adapter does not load into this model (the caller's 400)."""


class LoraResidency:
    """The resident adapters of one pipeline; see the module docstring."""

    def __init__(self, pipeline: BasePipeline, max_loras: int) -> None:
        self.pipeline = pipeline
        self.max_loras = max_loras
        self._resident: OrderedDict[str, str] = OrderedDict()  # path -> name, LRU first
        self._pins: Counter[str] = Counter()  # path -> running users
        self.num_loads = 0  # ever, for the metrics
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------
    @property
    def resident(self) -> list[str]:
        """Resident adapter paths, least recently used first."""
        return list(self._resident)

    def is_pinned(self, path: str) -> bool:
        return self._pins[path] > 0

    @staticmethod
    def paths(request: DiffusionRequest) -> list[str]:
        """The adapter paths a request uses, in its stack's order."""
        return [path for path, _ in request.sampling_params.lora_stack]

    @staticmethod
    def stack_names(request: DiffusionRequest) -> LoraStack:
        """A request's stack with each adapter path replaced by its loaded name (the
        scales and the stack's order kept)."""
        return tuple((adapter_name(path), float(scale))
                     for path, scale in request.sampling_params.lora_stack)

    # -- changes ---------------------------------------------------------------------
    def acquire(self, paths: Iterable[str]) -> dict[str, Exception]:
        """Make `paths` resident and pin them; returns the error of each path that did
        not load (those are not pinned). The caller keeps a wave's distinct adapters
        at or below `max_loras`."""
        errors: dict[str, Exception] = {}
        for path in dict.fromkeys(paths):
            if path not in self._resident:
                try:
                    self._load(path)
                except Exception as exc:
                    errors[path] = exc
                    continue
            self._resident.move_to_end(path)
            self._pins[path] += 1
        return errors

    def release(self, paths: Iterable[str]) -> None:
        """Unpin what `acquire` pinned (each path once)."""
        for path in dict.fromkeys(paths):
            if self._pins[path] > 0:
                self._pins[path] -= 1
            if self._pins[path] == 0:
                del self._pins[path]

    def _load(self, path: str) -> None:
        if not os.path.exists(path):
            raise ModelNotFoundError(f"LoRA adapter {_shown(path)!r} not found", param="lora")
        while len(self._resident) >= self.max_loras:
            victim = next((p for p in self._resident if not self.is_pinned(p)), None)
            if victim is None:  # an internal invariant: the runner splits such waves
                raise RuntimeError(
                    f"cannot load LoRA adapter {_shown(path)!r}: all {self.max_loras} "
                    "resident adapters are in use by the running wave (--max-loras)")
            self.pipeline.unload_lora(self._resident.pop(victim))
            self.num_evictions += 1
            logger.info("unloaded LoRA adapter %s (least recently used)", _shown(victim))
        name = adapter_name(path)
        try:
            self.pipeline.load_lora(name, path)
        except Exception as exc:
            if not _is_the_adapters_fault(exc):
                raise
            raise LoraLoadError(
                f"LoRA adapter {_shown(path)!r} could not be loaded into this model: "
                f"{type(exc).__name__}: {exc}", param="lora") from exc
        self._resident[path] = name
        self.num_loads += 1


def adapter_name(path: str) -> str:
    """A stable adapter name for a LoRA path (peft names may not contain dots)."""
    name = os.path.basename(os.path.normpath(path)) or "adapter"
    return "".join(c if c.isalnum() else "_" for c in name) + f"_{zlib.crc32(path.encode()):08x}"


def _shown(path: str) -> str:
    """What an error shows of an adapter path: its last part, never the server's folders."""
    return os.path.basename(os.path.normpath(path)) or "adapter"


def _is_the_adapters_fault(exc: BaseException) -> bool:
    """Whether a failed LoRA load is the adapter's fault (a corrupt file, weights for
    another model), not the server's (no LoRA support, memory, file permissions)."""
    return not isinstance(exc, NotImplementedError | MemoryError | PermissionError) \
        and "OutOfMemory" not in type(exc).__name__
