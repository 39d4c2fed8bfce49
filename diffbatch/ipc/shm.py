"""Tensors across processes through POSIX shared memory.

The worker returns results that hold image tensors (a 512x512 RGB float image is
3 MiB). Pickling those over the pipe costs several milliseconds per image, so
`pack()` copies every tensor (torch or numpy) larger than a threshold into a fresh
shared-memory segment and leaves only a small `ShmTensorHandle` in its place; the
rest of the result is pickled as usual. `unpack()` runs in the receiving process,
copies each tensor out and unlinks its segment.

Segment lifetime, the contract this file keeps:

- the producer creates a segment, writes it, closes its descriptor and forgets it;
- the consumer owns it from then on: `unpack()` (success) or `release()` (a reply
  that is dropped unread: abort, error, shutdown) unlinks it;
- a segment whose reply never arrives (the worker died after packing) is found by
  its name, `diffbatch_<producer pid>_<random>`, and removed by `sweep()`, which the
  executor runs when its worker dies or shuts down.

NOTE: segments are written with `pwrite` and read with `preadv` on the segment's file
descriptor, not through `multiprocessing.shared_memory.SharedMemory` mappings:
- it is faster for image-sized tensors (measured in docs/benchmarks.md, "Measured
  reasons in the code"): a fresh mapping page-faults on every 4 KiB page in both
  processes, while one syscall copies straight in or out;
- a full /dev/shm (Docker's default is 64 MiB) fails the write with ENOSPC, and the
  tensor stays inline, where writing through a mapping would kill the worker with
  SIGBUS;
- `SharedMemory` registers segments with multiprocessing's resource tracker, which
  unlinks them when the *producer's* processes exit (the consumer may not have read
  them yet) and prints "leaked shared_memory" warnings; plain `shm_open` does not,
  since the consumer owns unlinking.
`_posixshmem` is the C module behind `SharedMemory`. Reading and writing a shm
descriptor is Linux behaviour (macOS shm objects only map), like the engine's target.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's, without stubs
import copy
import dataclasses
import errno
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from diffbatch.config import DEFAULT_SHM_THRESHOLD_BYTES

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "diffbatch_"  # every segment name starts with this
_SHM_DIR = "/dev/shm"  # where Linux shows POSIX segments (used by `sweep` only)
_FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)  # no room: keep the tensor inline
_warned_full = False


@dataclass(frozen=True)
class ShmTensorHandle:
    """A picklable stand-in for one tensor whose bytes sit in a shared-memory segment."""

    name: str  # segment name, "diffbatch_<producer pid>_<hex>"
    shape: tuple[int, ...]  # the tensor's shape
    dtype: str  # "torch.bfloat16" for torch, numpy's dtype.str (e.g. "<f4") for numpy
    nbytes: int  # bytes of data in the segment (its size may be rounded up to a page)
    kind: Literal["torch", "numpy"] = "torch"  # which array type to rebuild


def segment_prefix(pid: int | None = None) -> str:
    """The name prefix of the segments that process `pid` (default: this one) creates."""
    return f"{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_"


# ---------------------------------------------------------------------------
# Walking nested results
# ---------------------------------------------------------------------------


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply `leaf` to every leaf of a nested structure, copying only what changes.

    Walks dataclass instances, dicts, lists and tuples (named tuples included);
    anything else is a leaf. The input is never mutated: a container whose
    children all come back unchanged is returned as is, otherwise a shallow copy
    with the new children is.
    """
    if isinstance(obj, ShmTensorHandle | InlineTensor | torch.Tensor | np.ndarray):
        return leaf(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed: dict[Any, Any] = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            new = _map(value, leaf)
            if new is not value:
                changed[f.name] = new
        if not changed:
            return obj
        # NOTE: copy + setattr, not dataclasses.replace: replace re-runs __init__ and
        # __post_init__ (validation) and cannot set init=False fields.
        out = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(out, name, value)
        return out
    if isinstance(obj, dict):
        changed = {}
        for key, value in obj.items():
            new = _map(value, leaf)
            if new is not value:
                changed[key] = new
        if not changed:
            return obj
        copied = copy.copy(obj)
        copied.update(changed)
        return copied
    if isinstance(obj, list | tuple):
        items = [_map(value, leaf) for value in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        if isinstance(obj, list):
            return type(obj)(items) if type(obj) is not list else items
        return obj._make(items) if hasattr(obj, "_make") else type(obj)(items)
    return leaf(obj)


def handles(obj: Any) -> list[ShmTensorHandle]:
    """Every `ShmTensorHandle` inside a packed structure."""
    found: list[ShmTensorHandle] = []

    def collect(value: Any) -> Any:
        if isinstance(value, ShmTensorHandle):
            found.append(value)
        return value

    _map(obj, collect)
    return found


# ---------------------------------------------------------------------------
# Producer side
# ---------------------------------------------------------------------------


def _write_segment(data: np.ndarray) -> str:
    """Create a fresh segment holding the bytes of `data` ([nbytes] uint8); its name."""
    name = f"{segment_prefix()}{secrets.token_hex(6)}"
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, data.nbytes)
        view, done = data.data, 0  # the array's own memoryview (1-D, uint8)
        while done < data.nbytes:
            done += os.pwrite(fd, view[done:], done)
    except BaseException:
        _posixshmem.shm_unlink("/" + name)
        raise
    finally:
        os.close(fd)
    return name


@dataclass(frozen=True)
class InlineTensor:
    """A small torch tensor as raw bytes, so it pickles as one memcpy.

    NOTE: pickling a torch tensor goes through `torch.save`/`torch.load` of its storage,
    far slower than plain bytes for an image-sized uint8 tensor (measured in
    docs/benchmarks.md); on the engine thread that stalls the worker between waves.
    Small tensors therefore travel as bytes too.
    """

    data: bytes  # the tensor's contiguous bytes
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.uint8", "torch.bfloat16"

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> InlineTensor:
        src = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        data = src.reshape(-1).view(torch.uint8).numpy().tobytes() if src.numel() else b""
        return cls(data, tuple(tensor.shape), str(tensor.dtype))

    def to_tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return flat.view(dtype).reshape(self.shape)


def _to_shm(value: Any, threshold_bytes: int, created: list[ShmTensorHandle]) -> Any:
    """Move one tensor or array above the threshold into a segment; small torch tensors
    become `InlineTensor` bytes; leave anything else."""
    global _warned_full
    kind: Literal["torch", "numpy"]
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        nbytes = value.numel() * value.element_size()
        if nbytes <= threshold_bytes:
            return InlineTensor.from_tensor(value)
        src = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        data = src.reshape(-1).view(torch.uint8).numpy()  # [nbytes], shares src's memory
        kind, dtype = "torch", str(value.dtype)
    elif type(value) is np.ndarray and not value.dtype.hasobject:
        nbytes = value.nbytes
        if nbytes <= threshold_bytes:
            return value
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        kind, dtype = "numpy", value.dtype.str
    else:
        return value
    try:
        name = _write_segment(data)
    except OSError as exc:
        if exc.errno not in _FULL_ERRNOS:
            raise
        if not _warned_full:
            _warned_full = True
            logger.warning("shared memory is full (%s); sending tensors of %d+ bytes inline "
                           "(slower); give the container a larger /dev/shm", exc, nbytes)
        return value
    handle = ShmTensorHandle(name, tuple(value.shape), dtype, nbytes, kind)
    created.append(handle)
    return handle


def pack(obj: Any, threshold_bytes: int = DEFAULT_SHM_THRESHOLD_BYTES) -> Any:
    """Return `obj` with every tensor/array above `threshold_bytes` moved to shared memory.

    The caller hands the result to exactly one consumer, which must `unpack()` or
    `release()` it. If packing fails halfway, the segments made so far are unlinked.
    """
    created: list[ShmTensorHandle] = []
    try:
        return _map(obj, lambda value: _to_shm(value, threshold_bytes, created))
    except BaseException:
        _unlink_all(created)
        raise


# ---------------------------------------------------------------------------
# Consumer side
# ---------------------------------------------------------------------------


def _from_shm(handle: ShmTensorHandle) -> torch.Tensor | np.ndarray:
    """Copy one tensor out of its segment, then unlink the segment."""
    if handle.kind == "numpy":
        out: Any = np.empty(handle.nbytes, dtype=np.uint8)
        view = memoryview(out)
    else:
        out = torch.empty(handle.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
    fd = _posixshmem.shm_open("/" + handle.name, os.O_RDONLY, 0o600)
    try:
        done = 0
        while done < handle.nbytes:
            got = os.preadv(fd, [view[done:]], done)
            if got == 0:
                raise OSError(errno.EIO, f"shared memory segment {handle.name} is truncated")
            done += got
    finally:
        os.close(fd)
        _unlink(handle.name)
    if handle.kind == "numpy":
        return out.view(np.dtype(handle.dtype)).reshape(handle.shape)
    return out.view(getattr(torch, handle.dtype.removeprefix("torch."))).reshape(handle.shape)


def _unpack_leaf(value: Any) -> Any:
    if isinstance(value, ShmTensorHandle):
        return _from_shm(value)
    if isinstance(value, InlineTensor):
        return value.to_tensor()
    return value


def unpack(obj: Any) -> Any:
    """Return `obj` with every `ShmTensorHandle` replaced by its tensor; unlinks the segments.

    If one segment cannot be read, every other segment of `obj` is still unlinked
    before the error is raised.
    """
    try:
        return _map(obj, _unpack_leaf)
    except BaseException:
        release(obj)
        raise


def _unlink(name: str) -> bool:
    """Unlink one segment by name; False if it is already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _unlink_all(found: list[ShmTensorHandle]) -> int:
    removed = 0
    for handle in found:
        try:
            removed += _unlink(handle.name)
        except OSError as exc:
            logger.warning("could not unlink shared memory segment %s: %s", handle.name, exc)
    return removed


def release(obj: Any) -> int:
    """Unlink the segments of a packed object without reading it; returns how many.

    For replies that are dropped unread (abort, error, shutdown). Never raises for a
    segment that is already gone.
    """
    return _unlink_all(handles(obj))


def sweep(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix`; returns how many.

    The executor calls it with its dead or stopped worker's `segment_prefix(pid)`
    to remove segments packed for replies that never arrived. Needs a listable
    `/dev/shm` (Linux); elsewhere it does nothing.
    """
    if not prefix.startswith(SEGMENT_PREFIX) or not os.path.isdir(_SHM_DIR):
        return 0
    removed = 0
    for name in os.listdir(_SHM_DIR):
        if name.startswith(prefix):
            try:
                removed += _unlink(name)
            except OSError as exc:
                logger.warning("could not unlink shared memory segment %s: %s", name, exc)
    if removed:
        logger.info("removed %d leftover shared memory segment(s) named %s*", removed, prefix)
    return removed
