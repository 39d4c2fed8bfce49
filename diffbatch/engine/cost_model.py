"""The learned cost curve: how long a wave of B requests takes, per shape and step count.

Every wave the engine runs is one observation of its shape, step count, size and
forward time. Per size the model keeps the last `WINDOW` times and estimates with
their lower quartile, so a wave slowed by other work on the machine does not teach
that big waves stopped paying. Sizes between measured ones are interpolated.

A curve borrows what it has not measured: beyond its measured sizes it follows the
shape of a curve that knows them (the same shape at another step count, else the
model's default shape), anchored at its own nearest measured size; a curve with no
waves of its own is that curve scaled by the step ratio (and the pixel ratio).

The **capacity** of a curve is its knee (`knee`): walking the sizes from the smallest
measured one by doublings up to the largest measured one (or the limit), keep each
size whose cost per image is at least `MIN_GAIN` below that of the last size kept;
the capacity is the last one kept.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.sampling_params import SamplingParamsKey

# A doubling must cut the cost per image by this much to be worth its longer wave: what
# a bigger wave could still add is then within 5% of throughput.
MIN_GAIN = 0.05
WINDOW = 16  # observations kept per shape, step count and wave size
MIN_SAMPLES = 4  # a size with fewer observations is still being measured

Table = dict[int, float]  # wave size -> forward ms


@dataclass(frozen=True)
class Shape:
    """What decides a wave's cost per step, besides its size."""

    height: int
    width: int
    num_outputs_per_prompt: int  # n: images per request
    cfg: bool  # classifier-free guidance doubles the denoiser's batch

    @classmethod
    def of(cls, key: SamplingParamsKey) -> Shape:
        return cls(key.height, key.width, key.num_outputs_per_prompt, key.cfg_enabled)

    @property
    def pixels(self) -> int:
        """Output pixels of one request: n * H * W."""
        return self.num_outputs_per_prompt * self.height * self.width

    def label(self, steps: int | None = None) -> str:
        """Short form for metrics and logs, e.g. "64x64/n1/cfg" or "64x64/s4/n1/cfg"."""
        at = "" if steps is None else f"/s{steps}"
        return (f"{self.width}x{self.height}{at}/n{self.num_outputs_per_prompt}"
                + ("/cfg" if self.cfg else ""))


def interpolate(table: Table, size: int) -> float:
    """`table`'s forward ms at `size`: measured, interpolated between the nearest
    measured sizes, or beyond them at the nearest one's cost per image (no gain)."""
    if size in table:
        return table[size]
    below = [b for b in table if b < size]
    above = [b for b in table if b > size]
    if below and above:
        lo, hi = max(below), min(above)
        return table[lo] + (size - lo) / (hi - lo) * (table[hi] - table[lo])
    nearest = max(below) if below else min(above)
    return table[nearest] * size / nearest


def knee(table: Table, limit: int) -> int:
    """The capacity rule (module docstring) on `table`; 1 <= knee <= limit."""
    if not table:
        return 1
    top = min(limit, max(table))
    size, sizes = min(min(table), top), [top]
    while size < top:  # (the smallest measured size, its doublings, the top)
        sizes.insert(-1, size)
        size *= 2
    best, best_cost = sizes[0], interpolate(table, sizes[0]) / sizes[0]
    for size in sizes[1:]:
        cost = interpolate(table, size) / size
        if cost <= (1.0 - MIN_GAIN) * best_cost:
            best, best_cost = size, cost
    return best


class WaveCostModel:
    """Learned wave cost per shape and step count; thread-safe (module docstring)."""

    def __init__(self, limit: int, default_shape: Shape | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
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
            estimate = self._estimator(shape, steps, proxy)
        return None if estimate is None else estimate(size)

    def capacity(self, shape: Shape, steps: int | None = None) -> int:
        """The knee of `shape`'s curve at `steps` (None: the step count it is known best
        at), bounded by the limit. A shape with fewer than two sizes of its own that
        borrows the default shape's curve gets its knee divided by the pixel ratio
        (bigger images saturate the device with fewer of them)."""
        with self._lock:
            steps = self._steps_of(shape, steps)
            own = self._table(shape, steps) if steps is not None else {}
            guide = self._guide(shape, steps)
            if guide is None:
                return knee(own, self.limit) if own else 1
            table, _, from_default = guide
            estimate = self._estimator(shape, steps or 1, proxy=True)
            assert estimate is not None
            capacity = knee({b: estimate(b) for b in {*own, *table}}, self.limit)
        if len(own) < 2 and from_default:
            assert self.default_shape is not None
            scaled = max(1.0, capacity * self.default_shape.pixels / shape.pixels)
            capacity = max(1, min(self.limit, 1 << int(math.log2(scaled))))
        return capacity

    def num_samples(self, shape: Shape, size: int, steps: int | None = None) -> int:
        """Observations kept of a wave of `size` of `shape` at `steps` (None: the step
        count it is known best at)."""
        with self._lock:
            curve = self._samples.get((shape, self._steps_of(shape, steps) or 0), {})
            return len(curve.get(size, ()))

    def num_sizes(self, shape: Shape, steps: int | None = None) -> int:
        """How many wave sizes of `shape` have been measured at `steps` (None: as above)."""
        with self._lock:
            return len(self._samples.get((shape, self._steps_of(shape, steps) or 0), {}))

    def per_image_ms(self) -> dict[str, dict[int, float]]:
        """Curve label -> wave size -> estimated forward ms per image (for metrics)."""
        with self._lock:
            return {shape.label(steps): {b: ms / b for b, ms in
                                         sorted(self._table(shape, steps).items())}
                    for shape, steps in self._samples}

    def curves(self) -> list[tuple[Shape, int]]:
        """The (shape, step count) pairs with waves of their own."""
        with self._lock:
            return list(self._samples)

    # -- holding the lock ----------------------------------------------------------
    def _table(self, shape: Shape, steps: int) -> Table:
        """The curve's own estimates: the lower quartile of each size's window."""
        curve = self._samples.get((shape, steps), {})
        return {b: sorted(w)[(len(w) - 1) // 4] for b, w in curve.items()}

    def _steps_of(self, shape: Shape, steps: int | None) -> int | None:
        """`steps`, or where None the step count whose curve knows most sizes."""
        if steps is not None:
            return steps
        known = [(len(c), n) for (s, n), c in self._samples.items() if s == shape]
        return max(known)[1] if known else None

    def _guide(self, shape: Shape, steps: int | None) -> tuple[Table, float, bool] | None:
        """The curve `shape` at `steps` borrows from: its table, the factor that scales
        its times to `shape` at `steps`, and whether it is the default shape's (else
        the shape's own at another step count); None if there is none."""
        others = [(len(c), -abs(n - (steps or 0)), n) for (s, n), c in self._samples.items()
                  if s == shape and n != steps]
        if others:
            n = max(others)[2]
            table = self._table(shape, n)
            return table, (steps or n) / n, False
        default = self.default_shape
        if default is None or shape == default:
            return None
        n = self._steps_of(default, None)
        if n is None:
            return None
        return self._table(default, n), (steps or n) / n * shape.pixels / default.pixels, True

    def _estimator(self, shape: Shape, steps: int,
                   proxy: bool) -> Callable[[int], float] | None:
        """Size -> forward ms for `shape` at `steps` (module docstring); None if unknown."""
        own = self._table(shape, steps)
        guide = self._guide(shape, steps)
        if guide is not None and guide[2] and not proxy:
            guide = None
        if not own:
            if guide is None:
                return None
            table, scale = guide[0], guide[1]
            return lambda size: interpolate(table, size) * scale
        if guide is None:
            return lambda size: interpolate(own, size)
        borrowed = guide[0]
        lo, hi = min(own), max(own)

        def anchored(size: int) -> float:
            if lo <= size <= hi:
                return interpolate(own, size)
            nearest = lo if size < lo else hi
            return own[nearest] * interpolate(borrowed, size) / interpolate(borrowed, nearest)
        return anchored


__all__ = ["MIN_GAIN", "MIN_SAMPLES", "Shape", "WaveCostModel", "interpolate", "knee"]
