"""The learned cost curve: how long a wave of B requests takes, per shape and step count.

Per size it keeps the last `WINDOW` forward times and estimates with their median,
and their spread (the interquartile range, relative to the median), so no decision
rests on one slow or fast timing; between measured sizes it interpolates. Elsewhere
a curve follows a guide, anchored at its nearest measured size: the same shape at the
step count known at most sizes (times scale with steps), else the default shape's
curve, a request priced as default-size requests of as many pixels.

The **capacity** is the knee: from the smallest measured size, by doublings up to
the largest (or the limit), keep each size unless there is evidence that it does not
cut the cost per image by `MIN_GAIN` against the last size kept: its cost per image
above that mark by more than the two sizes' spreads. When unsure, the larger wave is
kept: a wave slowed by other work (a co-tenant, a busy start) must not pin the
capacity low, and on every model measured the cost per image falls or stays flat with
the wave size, up to memory.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.sampling_params import SamplingParamsKey

MIN_GAIN = 0.05  # a doubling must cut the cost per image this much to be worth it
WINDOW = 16  # observations kept per shape, step count and wave size
MIN_SAMPLES = 4  # a size with fewer observations is still being measured

Table = dict[int, float]  # wave size -> forward ms
Spreads = dict[int, float]  # wave size -> spread of its forward ms, relative to them


@dataclass(frozen=True)
class Shape:
    """What decides a wave's cost per step, besides its size."""

    height: int
    width: int
    num_outputs_per_prompt: int  # n: images per request
    cfg: bool  # classifier-free guidance doubles the denoiser's batch
    num_frames: int | None = None  # a video's frames; None for images

    @classmethod
    def of(cls, key: SamplingParamsKey) -> Shape:
        return cls(key.height, key.width, key.num_outputs_per_prompt, key.cfg_enabled,
                   key.num_frames)

    @property
    def pixels(self) -> int:
        """Output pixels of one request: n * H * W (times the frames of a video)."""
        return self.num_outputs_per_prompt * self.height * self.width * (self.num_frames or 1)

    def label(self, steps: int) -> str:
        """Short form for metrics and logs, e.g. "64x64/s4/n1/cfg" ("/f9": 9 frames)."""
        return (f"{self.width}x{self.height}/s{steps}/n{self.num_outputs_per_prompt}"
                + ("/cfg" if self.cfg else "")
                + (f"/f{self.num_frames}" if self.num_frames is not None else ""))


def interpolate(table: Table, size: float) -> float:
    """`table`'s forward ms at `size`: measured, interpolated between the nearest
    measured sizes, or beyond them at the nearest one's cost per image (no gain)."""
    if size in table:
        return table[int(size)]
    below = [b for b in table if b < size]
    above = [b for b in table if b > size]
    if below and above:
        lo, hi = max(below), min(above)
        return table[lo] + (size - lo) / (hi - lo) * (table[hi] - table[lo])
    nearest = max(below) if below else min(above)
    return table[nearest] * size / nearest


def spread_at(spreads: Spreads, size: float) -> float:
    """The relative spread at `size`: the largest of the nearest measured sizes' (a
    size between two measured ones is known no better than either)."""
    if not spreads:
        return 0.0
    if size in spreads:
        return spreads[int(size)]
    below = [b for b in spreads if b < size]
    above = [b for b in spreads if b > size]
    return max(spreads[max(below)] if below else 0.0, spreads[min(above)] if above else 0.0)


def knee(table: Table, limit: int, spreads: Spreads | None = None) -> int:
    """The capacity rule (module docstring) on `table`; 1 <= knee <= limit.
    `spreads` (None: exact figures) says how far each size's figure may be off."""
    if not table:
        return 1
    spreads = spreads or {}
    top = min(limit, max(table))
    best = size = min(min(table), top)
    best_cost = interpolate(table, size) / size
    while size < top:  # the smallest measured size, its doublings, the top
        size = min(size * 2, top)
        cost = interpolate(table, size) / size
        # evidence that it does not pay: even its low end is above the kept size's
        # high end, lowered by MIN_GAIN
        low = cost * (1.0 - spread_at(spreads, size))
        high = (1.0 - MIN_GAIN) * best_cost * (1.0 + spread_at(spreads, best))
        if not low > high:
            best, best_cost = size, cost
    return best


class WaveCostModel:
    """Learned wave cost per shape and step count; thread-safe (module docstring)."""

    def __init__(self, limit: int, default_shape: Shape | None = None) -> None:
        self.limit = limit  # no capacity above this (memory, --max-num-seqs-limit)
        self.default_shape = default_shape
        self._samples: dict[tuple[Shape, int], dict[int, deque[float]]] = {}
        self._lock = threading.Lock()

    def observe(self, shape: Shape, size: int, steps: int, forward_ms: float) -> None:
        """Record one wave: `size` requests of `shape` at `steps` steps took `forward_ms`."""
        if size < 1 or steps < 1 or not math.isfinite(forward_ms) or forward_ms <= 0:
            return
        with self._lock:
            curve = self._samples.setdefault((shape, steps), {})
            curve.setdefault(size, deque(maxlen=WINDOW)).append(forward_ms)

    def estimate_ms(self, shape: Shape, size: int, steps: int, *,
                    proxy: bool = True) -> float | None:
        """Forward ms of a wave of `size` at `steps` steps; None when nothing is known.
        `proxy=False`: from the shape's own curves only, never the default shape's."""
        with self._lock:
            curve = self._curve(shape, steps, proxy)
        return None if curve is None else curve[1](size)

    def capacity(self, shape: Shape, steps: int = 0) -> int:
        """The knee of `shape`'s curve at `steps` (0: the step count known at most
        sizes), bounded by the limit; 1 while nothing is known."""
        with self._lock:
            curve = self._curve(shape, steps, proxy=True)
        if curve is None:
            return 1
        sizes, estimate, spreads = curve
        return knee({size: estimate(size) for size in sizes}, self.limit, spreads)

    def num_samples(self, shape: Shape, steps: int) -> dict[int, int]:
        """Wave size -> observations kept of `shape` at `steps`."""
        with self._lock:
            return {b: len(w) for b, w in self._samples.get((shape, steps), {}).items()}

    def spreads(self, shape: Shape, steps: int) -> Spreads:
        """The relative spread of each size `shape` has waves of at `steps`."""
        with self._lock:
            return self._spreads(shape, steps)

    def tables(self) -> dict[tuple[Shape, int], Table]:
        """Each (shape, step count) with waves of its own: its estimates by size."""
        with self._lock:
            return {curve: self._table(*curve) for curve in self._samples}

    # -- holding the lock ----------------------------------------------------------
    def _table(self, shape: Shape, steps: int) -> Table:
        """The curve's own estimates: the median of each size's window."""
        curve = self._samples.get((shape, steps), {})
        return {b: statistics.median(w) for b, w in sorted(curve.items())}

    def _spreads(self, shape: Shape, steps: int) -> Spreads:
        """Each size's spread: its window's interquartile range over its median (up to
        four samples, their range; with one, none: a size seen once is taken at its
        figure, and the policy's probe, not the knee, gives it more waves)."""
        spreads: Spreads = {}
        for b, window in self._samples.get((shape, steps), {}).items():
            ms = sorted(window)
            n = len(ms)
            low, high = ms[(n - 1) // 4], ms[n - 1 - (n - 1) // 4]
            spreads[b] = (high - low) / statistics.median(ms)
        return spreads

    def _curve(self, shape: Shape, steps: int, proxy: bool,
               ) -> tuple[set[int], Callable[[float], float], Spreads] | None:
        """`shape` at `steps` (module docstring): the sizes known, its own and its
        guide's, size -> forward ms, and the spreads of the sizes measured (its own
        where it has them, else the guide's); None if nothing is known."""
        own, default = self._table(shape, steps), self.default_shape
        for guide in (shape, default if proxy and default != shape else None):
            known = [(len(c), -abs(n - steps), n) for (s, n), c in self._samples.items()
                     if s == guide and (s, n) != (shape, steps)]
            if known and guide is not None:
                n = max(known)[2]  # most sizes, then the nearest step count
                table, pixels = self._table(guide, n), shape.pixels / guide.pixels
                break
        else:
            return ((set(own), lambda size: interpolate(own, size), self._spreads(shape, steps))
                    if own else None)
        spreads = {**self._spreads(guide, n), **self._spreads(shape, steps)}

        def borrowed(size: float) -> float:  # a request of `shape` counts `pixels` of guide's
            return interpolate(table, size * pixels) * (steps or n) / n

        if not own:
            return set(table), borrowed, spreads
        lo, hi = min(own), max(own)

        def anchored(size: float) -> float:
            if lo <= size <= hi:
                return interpolate(own, size)
            nearest = lo if size < lo else hi
            return own[nearest] * borrowed(size) / borrowed(nearest)
        return {*own, *table}, anchored, spreads


__all__ = ["MIN_GAIN", "MIN_SAMPLES", "Shape", "WaveCostModel", "interpolate", "knee",
           "spread_at"]
