"""The LoRA adapters an engine serves by name, and how a request's names become paths.

Names come from `--lora-modules name=path` (vLLM's flag), from adapters added at run
time (`add`, behind the server's opt-in `/v1/load_lora_adapter`), and from the
folders and files inside `--lora-dir`. A request's `lora` (one name, or a stack of
(name, scale) pairs) resolves to the adapters' real paths; with neither modules nor a
folder, the Python API takes paths as given. Every resolved path is checked to hold
LoRA weights at admission, so a folder that is no adapter fails its own request with
a 400 instead of inside a wave.
"""

from __future__ import annotations

import os
import threading

from diffbatch.engine.request_checks import resolve_lora
from diffbatch.errors import ConfigError, InvalidRequestError
from diffbatch.sampling_params import LoraStack, SamplingParams


class LoraRegistry:
    """Named adapters of one engine; see the module docstring. Thread-safe."""

    def __init__(self, modules: dict[str, str], lora_dir: str | None) -> None:
        self.lora_dir = lora_dir
        self._modules = {name: os.path.realpath(path) for name, path in modules.items()}
        self._lock = threading.Lock()
        for name, path in self._modules.items():  # a module that is no adapter: start-up fails
            try:
                resolve_lora(path, None)
            except InvalidRequestError as exc:
                raise ConfigError(f"--lora-modules {name}: {exc.message}",
                                  param="lora_modules") from None

    @property
    def enabled(self) -> bool:
        """Whether clients may name adapters (modules, runtime ones or a folder)."""
        return bool(self._modules) or self.lora_dir is not None

    def modules(self) -> dict[str, str]:
        """Adapter name -> path of the adapters served by name (not the folder's)."""
        with self._lock:
            return dict(self._modules)

    def names(self) -> list[str]:
        """Every adapter name a request may use: modules, then the folder's entries."""
        names = list(self.modules())
        if self.lora_dir is not None:
            try:
                entries = sorted(os.listdir(self.lora_dir))
            except OSError:
                entries = []
            for entry in entries:
                if entry in names or entry.startswith("."):
                    continue
                try:
                    resolve_lora(entry, self.lora_dir)
                except Exception:  # not an adapter: not listed
                    continue
                names.append(entry)
        return names

    def add(self, name: str, path: str) -> None:
        """Serve the adapter at `path` under `name` (checked to hold LoRA weights)."""
        if not name or name != name.strip() or name.startswith(".") \
                or any(c in name for c in "/=\x00"):
            raise InvalidRequestError(
                f"`lora_name` must be a plain name (no '/', '=', NUL, leading '.' or "
                f"surrounding spaces), got {name!r:.100}", param="lora_name")
        try:
            real = resolve_lora(path, None)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.message, param="lora_path") from None
        assert real is not None
        with self._lock:
            if name in self._modules:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r} is already loaded; unload it first",
                    param="lora_name")
            self._modules[name] = real

    def remove(self, name: str) -> bool:
        """Stop serving `name`; False if it was not served by name."""
        with self._lock:
            return self._modules.pop(name, None) is not None

    def resolve(self, params: SamplingParams) -> str | LoraStack | None:
        """`params.lora` with every adapter name replaced by its checked real path."""
        if params.lora is None:
            return None
        if isinstance(params.lora, str):
            return self._path(params.lora)
        return tuple((self._path(name), scale) for name, scale in params.lora)

    def _path(self, name: str) -> str:
        with self._lock:
            path = self._modules.get(name)
        if path is not None:
            return path
        resolved = resolve_lora(name, self.lora_dir)
        assert resolved is not None
        return resolved
