"""A pipeline's execution device, found once instead of at every step's lookup.

diffusers' `DiffusionPipeline._execution_device` looks for offloading hooks each time
it is read: it builds `components` from the constructor's signature, then walks every
submodule of every component. Measured here: 5-9 ms per call for `tiny-sd` on the
CPU (8% of a one-request, 4-step wave at 64x64), more for a full-size model's
thousands of modules. diffbatch would pay it once per wave in request mode and once
per request in step mode, where every request runs its own pipeline call.

The device cannot change while diffbatch serves a pipeline: it is moved once at
loading, and no offloading hook is added afterwards. `pin_execution_device(pipe)`
computes it once, the diffusers way, and keeps it on the instance (copies of the
pipeline keep it). `pinned_device()` routes the class property through the pin for
the length of a pipeline call only: from the first call that enters to the last that
leaves (calls interleave in step mode), every pinned pipeline returns its pin and any
other computes as before; outside calls the class is diffusers' own.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

_PINNED = "_diffbatch_execution_device"
_lock = threading.Lock()
_entered = 0  # pipeline calls inside `pinned_device`, over all threads and tasks


def pin_execution_device(pipe: Any) -> None:
    """Compute `pipe._execution_device` now, for `pinned_device` to return.

    A no-op for objects that are not diffusers pipelines (custom pipelines).
    """
    lookup = getattr(type(pipe), "_execution_device", None)  # the property, if a pipeline
    if not isinstance(lookup, property) or lookup.fget is None:
        return
    pipe.__dict__.pop(_PINNED, None)
    # computed the diffusers way (a class that overrides the property keeps its own)
    pipe.__dict__[_PINNED] = lookup.fget(pipe)


@contextlib.contextmanager
def pinned_device() -> Iterator[None]:
    """Within: pinned pipelines return their pinned execution device."""
    global _entered
    original = _original()
    with _lock:
        if _entered == 0 and original is not None:
            _set(_pinned_property(original))
        _entered += 1
    try:
        yield
    finally:
        with _lock:
            _entered -= 1
            if _entered == 0 and original is not None:
                _set(original)


@functools.cache
def _original() -> property | None:
    """diffusers' own `DiffusionPipeline._execution_device` (None if it has none)."""
    from diffusers import DiffusionPipeline

    original = DiffusionPipeline.__dict__.get("_execution_device")
    return original if isinstance(original, property) and original.fget is not None else None


@functools.cache
def _pinned_property(original: property) -> property:
    compute = original.fget
    assert compute is not None

    @functools.wraps(compute)
    def execution_device(self: Any) -> Any:
        pinned = self.__dict__.get(_PINNED)
        return pinned if pinned is not None else compute(self)

    return property(execution_device)


def _set(value: property) -> None:
    from diffusers import DiffusionPipeline

    DiffusionPipeline._execution_device = value  # type: ignore[attr-defined]
