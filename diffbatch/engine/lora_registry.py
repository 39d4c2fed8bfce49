"""The LoRA adapters an engine serves by name, and how a request's names become refs.

Names come from `--lora-modules name=path` (vLLM's flag), from adapters added at run
time (`add`, behind the server's opt-in `/v1/load_lora_adapter`), and from the
folders and files inside `--lora-dir`. A request's `lora` (one name, or a stack of
(name, scale) pairs) resolves to one `LoraRef` key per adapter; with neither modules
nor a folder, the Python API takes paths as given.

An adapter is validated when it is loaded, by the runner (`Executor.load_lora`: the
file read once, its rules, finite tensors, shapes that fit the model), not at first
use: at start-up for every module (a bad one fails start-up, naming it) and every
`--lora-dir` entry (a bad one is logged and refused with its reason), and at `add`
(a 400 naming the client's adapter name and the reason). A validated adapter's ref
carries the digest of the bytes read, so loading a name again after its file was
overwritten serves the new weights, and `remove` drops the old ones in the runner.
A `--lora-dir` entry added or rewritten after start-up carries its file's stat
signature instead and is validated by the runner at its first use.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from diffbatch.engine.request_checks import resolve_lora
from diffbatch.errors import ConfigError, InvalidRequestError
from diffbatch.lora_ref import LoraRef, stat_stamp
from diffbatch.sampling_params import LoraStack, SamplingParams, check_text

if TYPE_CHECKING:
    from diffbatch.executor.abstract import Executor

logger = logging.getLogger(__name__)


class LoraRegistry:
    """Named adapters of one engine; see the module docstring. Thread-safe."""

    def __init__(self, modules: dict[str, str], lora_dir: str | None) -> None:
        self.lora_dir = lora_dir
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._modules: dict[str, LoraRef] = {}
        self._loading: set[str] = set()  # names an `add` is loading now
        # --lora-dir entry -> (its stat stamp when validated, its ref or why it is refused)
        self._dir_entries: dict[str, tuple[str, LoraRef | str]] = {}
        for name, path in modules.items():  # a module that is no adapter: start-up fails
            try:
                resolved = resolve_lora(path, None)
            except InvalidRequestError as exc:
                raise ConfigError(f"--lora-modules {name}: {exc.message}",
                                  param="lora_modules") from None
            assert resolved is not None
            self._modules[name] = LoraRef(name, resolved)

    def attach(self, executor: Executor) -> None:
        """Validate every adapter known at start-up in `executor`'s runner, which then
        loads adapters added later. A module that is refused raises `ConfigError`
        naming it; a refused `--lora-dir` entry is logged and refused when asked for."""
        self._executor = executor
        for name, ref in self.modules_refs().items():
            try:
                loaded = LoraRef.parse(executor.load_lora(ref.key))
            except InvalidRequestError as exc:
                raise ConfigError(f"--lora-modules {name}: {exc.message}",
                                  param="lora_modules") from None
            with self._lock:
                self._modules[name] = loaded
        if self.lora_dir is not None:
            for entry in self._dir_listing():
                if entry not in self._modules:
                    self._validate_dir_entry(entry)

    @property
    def enabled(self) -> bool:
        """Whether clients may name adapters (modules, runtime ones or a folder)."""
        return bool(self._modules) or self.lora_dir is not None

    def modules(self) -> dict[str, str]:
        """Adapter name -> path of the adapters served by name (not the folder's)."""
        with self._lock:
            return {name: ref.path for name, ref in self._modules.items()}

    def modules_refs(self) -> dict[str, LoraRef]:
        with self._lock:
            return dict(self._modules)

    def names(self) -> list[str]:
        """Every adapter name a request may use: modules, then the folder's entries
        (less those refused at load, unless their file changed since)."""
        names = list(self.modules())
        for entry in self._dir_listing():
            if entry in names:
                continue
            try:
                path = resolve_lora(entry, self.lora_dir)
            except Exception:  # not an adapter: not listed
                continue
            assert path is not None
            with self._lock:
                known = self._dir_entries.get(entry)
            if known is not None and isinstance(known[1], str) and known[0] == stat_stamp(path):
                continue
            names.append(entry)
        return names

    def add(self, name: str, path: str) -> None:
        """Serve the adapter at `path` under `name`, once the runner has read, checked
        and loaded it; raises `InvalidRequestError` naming the reason otherwise."""
        if not name or name != name.strip() or name.startswith(".") \
                or any(c in name for c in "/=\x00"):
            raise InvalidRequestError(
                f"`lora_name` must be a plain name (no '/', '=', NUL, leading '.' or "
                f"surrounding spaces), got {name!r:.100}", param="lora_name")
        check_text("lora_path", path, allow_nul=False)
        try:
            real = resolve_lora(path, None)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.message, param="lora_path") from None
        assert real is not None
        with self._lock:
            if name in self._modules or name in self._loading:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r} is already loaded; unload it first",
                    param="lora_name")
            self._loading.add(name)
        try:
            ref = LoraRef(name, real)
            if self._executor is not None:
                try:
                    ref = LoraRef.parse(self._executor.load_lora(ref.key))
                except InvalidRequestError as exc:
                    raise InvalidRequestError(exc.message, param="lora_path") from None
            with self._lock:
                self._modules[name] = ref
        finally:
            with self._lock:
                self._loading.discard(name)

    def remove(self, name: str) -> bool:
        """Stop serving `name` and drop its weights in the runner (once no running wave
        uses them); False if it was not served by name."""
        with self._lock:
            ref = self._modules.pop(name, None)
        if ref is None:
            return False
        if self._executor is not None:
            self._executor.unload_lora(ref.key)
        return True

    def resolve(self, params: SamplingParams) -> str | LoraStack | None:
        """`params.lora` with every adapter name replaced by its `LoraRef` key."""
        if params.lora is None:
            return None
        if isinstance(params.lora, str):
            return self._key(params.lora)
        return tuple((self._key(name), scale) for name, scale in params.lora)

    def _key(self, name: str) -> str:
        with self._lock:
            ref = self._modules.get(name)
        if ref is not None:
            return ref.key
        path = resolve_lora(name, self.lora_dir)
        assert path is not None
        stamp = stat_stamp(path)
        with self._lock:
            known = self._dir_entries.get(name)
        if known is not None and known[0] == stamp:
            if isinstance(known[1], str):
                raise InvalidRequestError(known[1], param="lora")
            return known[1].key
        return LoraRef(name, path, stamp).key  # validated by the runner at first use

    def _dir_listing(self) -> list[str]:
        if self.lora_dir is None:
            return []
        try:
            return sorted(e for e in os.listdir(self.lora_dir) if not e.startswith("."))
        except OSError:
            return []

    def _validate_dir_entry(self, entry: str) -> None:
        """Load a `--lora-dir` entry in the runner once and remember the outcome."""
        assert self._executor is not None
        try:
            path = resolve_lora(entry, self.lora_dir)
        except InvalidRequestError:  # not an adapter (notes, training state): skipped
            return
        assert path is not None
        stamp = stat_stamp(path)
        outcome: LoraRef | str
        try:
            outcome = LoraRef.parse(self._executor.load_lora(LoraRef(entry, path).key))
        except InvalidRequestError as exc:
            outcome = exc.message
            logger.warning("--lora-dir: refusing %s", exc.message)
        except Exception as exc:  # the server's fault (memory, permissions): not the entry's
            logger.warning("--lora-dir: could not check %r at start-up (%s); it is checked "
                           "at its first use", entry, type(exc).__name__)
            return
        with self._lock:
            self._dir_entries[entry] = (stamp, outcome)
