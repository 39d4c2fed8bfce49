"""Which LoRA adapters are loaded into the worker's pipeline, and for whom.

At most `max_loras` adapters are resident. A wave (or, in step mode, a running
request) pins the adapters it uses for as long as it runs; loading another adapter
unloads the least recently used unpinned one, so an adapter a running wave uses is
never evicted. An adapter that fails to load is reported per adapter: only the
requests that use it fail (a 400 naming it when the adapter itself is at fault),
their wave mates run.

Adapters are kept by their `LoraRef` key (client name, path and version), never by
path alone: a file overwritten and loaded again is a new adapter here. Every load
reads the file once through `lora_files.read_adapter` (the file rules, finite
tensors) and hands the tensors, not the path, to the pipeline; loading them tells
whether they fit the model. An adapter loaded by name carries the digest its first
load computed, and a later load (after an eviction, or in a replacement worker)
refuses a file whose bytes changed since. `forget` drops an adapter's weights (at
once, or when the last wave using it ends). Errors name the client's adapter name
and the reason, never the server's path; what diffusers and PEFT log during a load
becomes one line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from diffbatch.errors import InvalidRequestError
from diffbatch.lora_ref import LoraRef
from diffbatch.worker.lora_files import AdapterWeights, LoraFileError, LoraFileRules, read_adapter

if TYPE_CHECKING:
    from diffbatch.pipelines.interface import BasePipeline
    from diffbatch.request import DiffusionRequest
    from diffbatch.sampling_params import LoraStack

logger = logging.getLogger(__name__)


class LoraLoadError(InvalidRequestError):
    """The request's LoRA adapter does not load into this model (the caller's 400)."""


class LoraResidency:
    """The resident adapters of one pipeline; see the module docstring."""

    def __init__(self, pipeline: BasePipeline, max_loras: int,
                 rules: LoraFileRules | None = None) -> None:
        self.pipeline = pipeline
        self.max_loras = max_loras
        self.rules = rules or LoraFileRules()
        self._resident: OrderedDict[str, str] = OrderedDict()  # key -> loaded name, LRU first
        self._pins: Counter[str] = Counter()  # key -> running users
        self._forgotten: set[str] = set()  # keys to unload when their last user ends
        self.num_loads = 0  # ever, for the metrics
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------
    @property
    def resident(self) -> list[str]:
        """Resident adapter keys, least recently used first."""
        return list(self._resident)

    def is_pinned(self, key: str) -> bool:
        return self._pins[key] > 0

    @staticmethod
    def paths(request: DiffusionRequest) -> list[str]:
        """The adapter keys (`LoraRef.key`, or plain paths) a request uses, in its
        stack's order."""
        return [key for key, _ in request.sampling_params.lora_stack]

    @staticmethod
    def stack_names(request: DiffusionRequest) -> LoraStack:
        """A request's stack with each adapter key replaced by its loaded name (the
        scales and the stack's order kept)."""
        return tuple((adapter_name(key), float(scale))
                     for key, scale in request.sampling_params.lora_stack)

    # -- changes ---------------------------------------------------------------------
    def load(self, key: str) -> str:
        """The engine's load of an adapter (at start-up, or `/v1/load_lora_adapter`):
        read and check its file, load it into the model, and return the key of the
        version read (its digest as stamp). It stays resident if there is room (a
        running step batch may pin every slot: then it is checked and unloaded).
        Raises `LoraLoadError` with the reason when the adapter is refused."""
        ref = LoraRef.parse(key)
        weights = self._read(ref)
        loaded = LoraRef(ref.name, ref.path, weights.digest).key
        self._forgotten.discard(loaded)
        if loaded in self._resident:
            self._resident.move_to_end(loaded)
            return loaded
        room = self._make_room(loaded, required=False)
        self._load_weights(loaded, ref, weights)
        if not room:
            self.pipeline.unload_lora(self._resident.pop(loaded))
        return loaded

    def forget(self, key: str) -> None:
        """Drop the weights of adapter `key` (unloaded by name): now, or when the last
        wave or request using it ends."""
        if key not in self._resident:
            return
        if self.is_pinned(key):
            self._forgotten.add(key)
        else:
            self.pipeline.unload_lora(self._resident.pop(key))

    def acquire(self, paths: Iterable[str]) -> dict[str, Exception]:
        """Make the adapters `paths` (keys) name resident and pin them; returns the
        error of each that did not load (those are not pinned). The caller keeps a
        wave's distinct adapters at or below `max_loras`."""
        errors: dict[str, Exception] = {}
        for key in dict.fromkeys(paths):
            if key not in self._resident:
                try:
                    ref = LoraRef.parse(key)
                    weights = self._read(ref)
                    if ref.stamp.startswith("sha256:") and weights.digest != ref.stamp:
                        raise LoraLoadError(
                            f"LoRA adapter {ref.name!r} changed on the server since it was "
                            "loaded; load it again", param="lora")
                    self._make_room(key, required=True)
                    self._load_weights(key, ref, weights)
                except Exception as exc:
                    errors[key] = exc
                    continue
            self._resident.move_to_end(key)
            self._pins[key] += 1
        return errors

    def release(self, paths: Iterable[str]) -> None:
        """Unpin what `acquire` pinned (each key once)."""
        for key in dict.fromkeys(paths):
            if self._pins[key] > 0:
                self._pins[key] -= 1
            if self._pins[key] == 0:
                del self._pins[key]
                if key in self._forgotten:
                    self._forgotten.discard(key)
                    self.forget(key)

    # -- loading ---------------------------------------------------------------------
    def _read(self, ref: LoraRef) -> AdapterWeights:
        try:
            return read_adapter(ref.path, self.rules)
        except LoraFileError as exc:
            raise LoraLoadError(f"LoRA adapter {ref.name!r} {exc.reason}", param="lora") \
                from None

    def _make_room(self, key: str, *, required: bool) -> bool:
        """Unload least recently used unpinned adapters until one more fits; False if
        every slot is pinned (an error when `required`)."""
        while len(self._resident) >= self.max_loras:
            victim = next((k for k in self._resident if not self.is_pinned(k)), None)
            if victim is None:
                if not required:
                    return False
                # an internal invariant: the runner splits such waves
                raise RuntimeError(
                    f"cannot load LoRA adapter {LoraRef.parse(key).name!r}: all "
                    f"{self.max_loras} resident adapters are in use by the running wave "
                    "(--max-loras)")
            self.pipeline.unload_lora(self._resident.pop(victim))
            self._forgotten.discard(victim)
            self.num_evictions += 1
            logger.info("unloaded LoRA adapter %r (least recently used)",
                        LoraRef.parse(victim).name)
        return True

    def _load_weights(self, key: str, ref: LoraRef, weights: AdapterWeights) -> None:
        """Load checked tensors into the model as adapter `key`; refuse them when they
        do not fit it or touch none of its layers."""
        name = adapter_name(key)
        messages: list[str] = []
        try:
            with _library_messages(messages):
                layers = self.pipeline.load_lora(name, weights.tensors)
        except Exception as exc:
            if not _is_the_adapters_fault(exc):
                raise
            reason = _model_reason(exc, name, messages)
            raise LoraLoadError(f"LoRA adapter {ref.name!r} {reason}", param="lora") from None
        if layers == 0:
            self.pipeline.unload_lora(name)
            raise LoraLoadError(
                f"LoRA adapter {ref.name!r} matches nothing: none of its "
                f"{len(weights.tensors)} tensors names a layer of this model (is it an "
                "adapter for another model?)", param="lora")
        self._resident[key] = name
        self.num_loads += 1
        logger.info("loaded LoRA adapter %r: %s%s", ref.name,
                    f"{layers} layers" if layers is not None else "loaded",
                    _summary(messages))


def adapter_name(key: str) -> str:
    """A stable adapter name for a LoRA key (peft names may not contain dots)."""
    shown = LoraRef.parse(key).name[:40]
    return "".join(c if c.isalnum() else "_" for c in shown) + f"_{zlib.crc32(key.encode()):08x}"


def _is_the_adapters_fault(exc: BaseException) -> bool:
    """Whether a failed LoRA load is the adapter's fault (a corrupt file, weights for
    another model), not the server's (no LoRA support, memory, file permissions)."""
    return not isinstance(exc, NotImplementedError | MemoryError | PermissionError) \
        and "OutOfMemory" not in type(exc).__name__


# torch's `load_state_dict` error (diffusers' denoisers), and transformers' load report
# (its text encoders), which it logs before raising a bare error
_SIZE_MISMATCH = re.compile(
    r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) "
    r"from checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
_REPORTED_MISMATCH = re.compile(
    r"(\S+)\s*\|\s*MISMATCH\s*\|[^\n]*?ckpt: torch\.Size\((\[[^\]]*\])\) vs "
    r"model: ?torch\.Size\((\[[^\]]*\])\)")


def _model_reason(exc: BaseException, name: str, messages: list[str]) -> str:
    """Why tensors that passed the file checks do not load into the model, in words
    that hold no server path (the tensors came from memory, not from a file)."""
    text = str(exc).replace(f".{name}.", ".")
    match = _SIZE_MISMATCH.search(text) or next(
        (m for m in (_REPORTED_MISMATCH.search(s.replace(f".{name}.", "."))
                     for s in messages) if m), None)
    if match:
        layer, given, wanted = match.groups()
        return (f"does not fit this model: its weight for `{layer:.160}` has shape "
                f"{given}, this model's layer takes {wanted}")
    if "NoMatchingPeftModule" in type(exc).__name__ or "not found in the base model" in text:
        return "matches nothing: none of its layers is a layer of this model (is it an " \
            "adapter for another model?)"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"does not fit this model: {first:.300}"


@contextlib.contextmanager
def _library_messages(messages: list[str]) -> Iterator[None]:
    """Collect into `messages` what diffusers, PEFT and transformers log or warn during
    a load, instead of letting it reach the log (a load then logs one line:
    `_summary`)."""

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    collect = _Collect(logging.WARNING)
    saved = []
    for name in ("diffusers", "peft", "transformers"):
        library = logging.getLogger(name)
        saved.append((library, library.handlers[:], library.propagate))
        library.handlers, library.propagate = [collect], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for library, handlers, propagate in saved:
            library.handlers, library.propagate = handlers, propagate
        messages.extend(str(w.message) for w in caught)


def _summary(messages: list[str]) -> str:
    """The library messages of one load in a few plain words (nothing for the expected
    ones: components the adapter does not touch, a second adapter in one model)."""
    notes = []
    untouched = sorted({m.group(1) for m in (re.search(r"No LoRA keys associated to (\w+)", s)
                                              for s in messages) if m})
    unexpected = [s for s in messages if "unexpected keys" in s]
    other = [s for s in messages if "No LoRA keys associated" not in s
             and "unexpected keys" not in s and "Already found a `peft_config`" not in s]
    if untouched:
        notes.append(f"nothing for {', '.join(untouched)}")
    if unexpected:
        notes.append("some of its weights match no layer and were left out")
    if other:
        notes.append(f"{len(other)} library note(s), e.g. {other[0].splitlines()[0]:.160}")
    return f" ({'; '.join(notes)})" if notes else ""
