"""Reading a LoRA adapter's weights file once, with the rules a server applies to it.

The worker reads an adapter here, and only here, when it loads one: the bytes are read
once (their digest names this version of the adapter), parsed from memory, and
checked before anything reaches the model:

- the file: a regular file (no device, pipe or socket), not a symlink that leads out of
  the adapter's own folder or `--lora-dir`, not empty, at most `--max-lora-file-mb`;
- the format: safetensors, unless the server opted in to pickle formats
  (`--lora-allow-pickle`: .bin, .pt, .pth, .ckpt, read with `weights_only`);
- the tensors: at least one, all floating point, all finite.

Whether the tensors fit the model (shapes, module names) is what loading them into
the model tells (`lora_residency.py`). Every `LoraFileError` reason is written for the
client: it names what is wrong with the file, never where the file is.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# The file `save_lora_weights` writes, preferred in a folder that holds several.
PREFERRED_NAMES = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin")
# Files in an adapter folder that are not adapter weights (training state).
_NOT_WEIGHTS = ("scheduler", "optimizer", "checkpoint", "training")


class LoraFileError(ValueError):
    """The adapter's file breaks a rule; `reason` completes "LoRA adapter 'x' ..."."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class LoraFileRules:
    """What a server accepts as an adapter file (see the module docstring)."""

    allow_pickle: bool = False  # --lora-allow-pickle
    max_bytes: int = 2 << 30  # --max-lora-file-mb, in bytes
    roots: tuple[str, ...] = ()  # folders symlinks may lead into (--lora-dir), besides
    # the adapter's own folder

    @property
    def suffixes(self) -> tuple[str, ...]:
        return SAFE_SUFFIXES + (PICKLE_SUFFIXES if self.allow_pickle else ())


@dataclass
class AdapterWeights:
    """An adapter file's tensors as read and checked, and the digest of its bytes."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    digest: str  # "sha256:<hex>" of the weights file's bytes


def read_adapter(path: str, rules: LoraFileRules) -> AdapterWeights:
    """Read and check the adapter at `path` (a weights file, or a folder holding one);
    raises `LoraFileError` with the reason when it breaks a rule."""
    file = weights_file(path, rules)
    try:
        with open(file, "rb") as f:
            data = f.read(rules.max_bytes + 1)
    except OSError as exc:
        raise LoraFileError(f"could not be read ({exc.strerror or type(exc).__name__})") \
            from None
    _check_size(len(data), rules)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tensors = _parse(data, safetensors=file.endswith(SAFE_SUFFIXES))
    check_tensors(tensors)
    return AdapterWeights(tensors, digest)


def weights_file(path: str, rules: LoraFileRules) -> str:
    """The real path of the weights file `path` names, checked against the file rules."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise LoraFileError("was not found (its file is gone)") from None
    except (OSError, ValueError) as exc:
        raise LoraFileError(f"could not be opened ({type(exc).__name__})") from None
    if stat.S_ISDIR(st.st_mode):
        folder, file = path, os.path.join(path, _choose(path, rules))
    else:
        folder, file = os.path.dirname(os.path.abspath(path)), path
        if not file.endswith(rules.suffixes):
            raise LoraFileError(_format_reason(file, rules))
    real = os.path.realpath(file)
    roots = {os.path.realpath(folder), *(os.path.realpath(r) for r in rules.roots)}
    if not any(os.path.commonpath([root, real]) == root for root in roots):
        raise LoraFileError("is a symlink that leads out of its folder; this server "
                            "loads adapter files that stay inside it")
    try:
        st = os.stat(real)
    except OSError:
        raise LoraFileError("is a broken symlink") from None
    if not stat.S_ISREG(st.st_mode):
        raise LoraFileError("is not a regular file (a device, pipe or socket)")
    _check_size(st.st_size, rules)
    return real


def check_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """At least one tensor, each floating point and finite."""
    import torch

    if not tensors:
        raise LoraFileError("holds no tensors")
    bad_type = [k for k, v in tensors.items()
                if not isinstance(v, torch.Tensor) or not v.is_floating_point()]
    if bad_type:
        key = bad_type[0]
        value = tensors[key]
        what = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) \
            else type(value).__name__
        raise LoraFileError(f"holds {len(bad_type)} entries that are not floating-point "
                            f"tensors, e.g. `{key:.120}` ({what})")
    not_finite = [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())]
    if not_finite:
        raise LoraFileError(
            f"is not finite: {len(not_finite)} of its {len(tensors)} tensors hold NaN or "
            f"infinite values, e.g. `{not_finite[0]:.120}`")


def _choose(folder: str, rules: LoraFileRules) -> str:
    """The weights file of an adapter folder: the one `save_lora_weights` names, or the
    only weights file there."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise LoraFileError(f"could not be listed ({type(exc).__name__})") from None
    weights = [n for n in names if n.endswith(SAFE_SUFFIXES + PICKLE_SUFFIXES)
               and not any(word in n for word in _NOT_WEIGHTS)]
    allowed = [n for n in weights if n.endswith(rules.suffixes)]
    for preferred in PREFERRED_NAMES:
        if preferred in allowed:
            return preferred
    if len(allowed) == 1:
        return allowed[0]
    if allowed:
        raise LoraFileError(f"is a folder with {len(allowed)} weights files and none named "
                            f"{PREFERRED_NAMES[0]!r}; keep one adapter per folder")
    if weights:
        raise LoraFileError(_format_reason(weights[0], rules))
    raise LoraFileError("is not a LoRA adapter: it must be a .safetensors weights file, or "
                        "a folder holding one, as `save_lora_weights` writes")


def _format_reason(file: str, rules: LoraFileRules) -> str:
    if file.endswith(PICKLE_SUFFIXES):
        return ("is a pickle file; this server loads safetensors files only (a server "
                "started with --lora-allow-pickle also loads .bin/.pt files)")
    return (f"is not a LoRA weights file: it must end in "
            f"{' or '.join(rules.suffixes)}, as `save_lora_weights` writes")


def _check_size(size: int, rules: LoraFileRules) -> None:
    if size == 0:
        raise LoraFileError("is an empty file")
    if size > rules.max_bytes:
        raise LoraFileError(
            f"is larger than this server's limit of {rules.max_bytes >> 20} MB for an adapter "
            "file (--max-lora-file-mb)")


def _parse(data: bytes, *, safetensors: bool) -> dict[str, torch.Tensor]:
    """The tensors in `data`; a file that does not parse gets its reason in plain words."""
    if safetensors:
        from safetensors.torch import load

        try:
            return dict(load(data))
        except Exception as exc:  # safetensors names the defect in its message
            text = str(exc)
            if "IncompleteBuffer" in text or "incomplete" in text.lower():
                raise LoraFileError("is truncated: the file is shorter than its safetensors "
                                    "header says") from None
            raise LoraFileError("is not a safetensors file (its header does not parse)") \
                from None
    import torch

    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:
        raise LoraFileError("is not a readable PyTorch weights file (truncated, or it "
                            "holds more than tensors)") from None
    if not isinstance(loaded, dict):
        raise LoraFileError(f"holds a {type(loaded).__name__}, not a dict of tensors")
    return {str(k): v for k, v in loaded.items()}
