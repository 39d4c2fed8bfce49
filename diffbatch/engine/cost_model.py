"""The learned cost curve: how long a wave of B requests takes, per shape and step count.

Every wave the engine runs is one observation: its shape, its step count, its size
B and its forward time. `WaveCostModel` keeps, per shape (height, width, images
per request, CFG on or off), step count and wave size, the last `WINDOW` forward
times and estimates with their lower quartile: a machine shared with other work
makes some waves take several times longer, and those spikes must not teach the
engine that big waves stopped paying (measured here: a 64x64 wave of 8 took 80 ms or
3,400 ms depending on what else ran).

Each step count has its own curve because the batching gain depends on it: the
fixed part of a wave (text encoding, decoding) batches differently from the
denoising steps, and weighs more at few steps (measured on `shapes` at 64x64: a
wave of 16 costs 8% less per image than one of 8 at its default 15 steps, and
25-40% less at 4 steps). A start-up calibration seeds the model's default shape at
one step count (`diffbatch.engine.calibration`); other step counts and shapes are
learned as they appear. Until then they borrow:

- a step count of a known shape: the shape's curve at the step count it knows best
  (most sizes measured), its times scaled by the step ratio; once the new step count
  has waves of its own, their times are used where they were measured, and the
  borrowed curve only gives the shape of the curve beyond them (its ratio between a
  size and the nearest measured one: `_anchored`);
- a new shape: the default shape's curve, scaled by the pixel ratio (and the step
  ratio): its wave times until the shape's first wave is measured, its capacity
  until two sizes of it are.

From the curve the model derives a shape's **capacity** at a step count, the wave
size beyond which a bigger wave stops paying:

    capacity = walking the ladder 1, 2, 4, 8, ... (up to the limit), keep each B
    whose cost per image, t(B) / B, is at least `MIN_GAIN` (5%) below that of the
    last B kept; the last B kept (a rung that gains less is skipped, not the end:
    the next is compared with the last kept one); a B is kept too where the served
    waves of about its size and of the last B kept (`MIN_SAMPLES` of each) show the
    gain in their median cost per image (`capacity_from_curve`).

A doubling that has not been measured yet is tried once the curve says the last
one still paid, and one more after a doubling that gained less than that
(`next_size_to_try`), so the curve grows with the traffic it sees (a wave of at
least `NEAR_RUNG` of a rung's size counts for the rung). A rung above the capacity
that has not run for `RETRY_AFTER_S` and `RETRY_AFTER_WAVES` waves (doubled with
each retry) is measured afresh the same way: a machine shared with other work
changes speed, and a rung measured in a slow spell that never runs again would
otherwise pin the capacity where that spell left it.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.sampling_params import SamplingParamsKey

# A doubling must cut the cost per image by this much to be worth its longer wave. 5%:
# what a bigger wave could still add is then within 5% of throughput (the most the
# engine gives up against the best fixed setting), and no smaller than the noise the
# lower-quartile estimate leaves.
MIN_GAIN = 0.05
WINDOW = 16  # observations kept per shape and wave size
# A wave of at least this share of a rung's size is evidence for the rung: a trial
# of the next doubling takes the whole backlog when that is smaller (a closed loop of
# 32 clients at capacity 8 leaves 10-14 waiting, never 16), and its cost per image,
# assumed for the full rung (no further gain), is what the rung would cost at most.
NEAR_RUNG = 0.75
MIN_SAMPLES = 4  # a size with fewer observations is tried again before it is trusted
# A rung above the capacity whose last observation is older than both of these (seconds,
# and waves of its curve since) is measured afresh when a trial is due: its old
# observations are dropped and it is tried `MIN_SAMPLES` times again; both double with
# each retry of the rung (a rung that really gains nothing costs its trials' latency
# ever more rarely). Measured on tiny-sd at 128x128, 2 cores: waves of 8 and 16 that
# first ran while another server loaded the machine took 73-81 ms per image, waves of
# 4 later 47; the capacity stayed at 4 for the next six minutes of load (no wave above
# it ran again to correct the curve), serving a closed loop of 32 clients at 19.7
# requests/s where waves of 16 served 22-23. The wave count keeps a slow model
# (seconds per wave) from spending most of its waves on trials; the time keeps a fast
# one from retrying every second.
RETRY_AFTER_S = 60.0
RETRY_AFTER_WAVES = 32


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
        """Short form for metrics and logs, e.g. "64x64/n1/cfg", or with a step count
        "64x64/s4/n1/cfg"."""
        at = "" if steps is None else f"/s{steps}"
        return (f"{self.width}x{self.height}{at}/n{self.num_outputs_per_prompt}"
                + ("/cfg" if self.cfg else ""))


@dataclass
class _Curve:
    """One shape's observations at one step count: wave size -> forward ms."""

    steps: int  # the step count of every wave below
    ms: dict[int, float] = field(default_factory=dict)  # size -> lower quartile of samples
    samples: dict[int, deque[float]] = field(default_factory=dict)  # size -> last WINDOW
    # size -> the last WINDOW waves run for served requests (no calibration wave)
    served: dict[int, deque[float]] = field(default_factory=dict)
    # rung -> `served_ms(rung)` since the last served wave (the capacity rule and the
    # load rule ask on every check of a forming wave; a wave changes it once)
    _served_ms: dict[int, float | None] = field(default_factory=dict)
    num_waves: int = 0  # waves observed so far
    # size -> (clock time, `num_waves`) of its last observation
    last_seen: dict[int, tuple[float, int]] = field(default_factory=dict)
    retries: dict[int, int] = field(default_factory=dict)  # rung -> times measured afresh

    def observe(self, size: int, forward_ms: float, served: bool, now: float) -> None:
        window = self.samples.setdefault(size, deque(maxlen=WINDOW))
        window.append(forward_ms)
        self.ms[size] = sorted(window)[(len(window) - 1) // 4]
        self.num_waves += 1
        self.last_seen[size] = (now, self.num_waves)
        if served:
            self.served.setdefault(size, deque(maxlen=WINDOW)).append(forward_ms)
            self._served_ms.clear()

    def is_stale(self, rung: int, now: float) -> bool:
        """Whether every observation that is evidence for `rung` (sizes from `NEAR_RUNG`
        x it up to it; at least one) is older than `RETRY_AFTER_S` and
        `RETRY_AFTER_WAVES` waves, each doubled for every earlier retry of the rung."""
        seen = [at for size, at in self.last_seen.items() if NEAR_RUNG * rung <= size <= rung]
        backoff = 2 ** self.retries.get(rung, 0)
        return bool(seen) and all(
            now - when >= RETRY_AFTER_S * backoff
            and self.num_waves - wave >= RETRY_AFTER_WAVES * backoff
            for when, wave in seen)

    def forget_near(self, rung: int) -> None:
        """Drop every observation that is evidence for `rung`, so it is measured afresh
        (at least one size of the curve is kept), and count the retry."""
        sizes = [size for size in self.ms if NEAR_RUNG * rung <= size <= rung]
        if len(sizes) >= len(self.ms):
            return
        self.retries[rung] = self.retries.get(rung, 0) + 1
        for size in sizes:
            for table in (self.ms, self.samples, self.served, self.last_seen):
                table.pop(size, None)
        self._served_ms.clear()

    def served_ms(self, rung: int) -> float | None:
        """Forward ms of a wave of `rung` as served: the median cost per image of the
        served waves of sizes from `NEAR_RUNG` x `rung` up to it, times `rung`; None
        with fewer than `MIN_SAMPLES` of them."""
        if rung not in self._served_ms:
            per_image = [ms / size for size, window in self.served.items()
                         if NEAR_RUNG * rung <= size <= rung for ms in window]
            self._served_ms[rung] = (statistics.median(per_image) * rung
                                     if len(per_image) >= MIN_SAMPLES else None)
        return self._served_ms[rung]

    def estimate_ms(self, size: int) -> float | None:
        """Forward ms of a wave of `size` at `steps`: measured, interpolated between the
        nearest measured sizes, or extrapolated from the nearest one (as no gain)."""
        if size in self.ms:
            return self.ms[size]
        if not self.ms:
            return None
        below = [b for b in self.ms if b < size]
        above = [b for b in self.ms if b > size]
        if below and above:
            lo, hi = max(below), min(above)
            frac = (size - lo) / (hi - lo)
            return self.ms[lo] + frac * (self.ms[hi] - self.ms[lo])
        # Outside the measured range: the same cost per image as the nearest size
        # (beyond the largest, no further gain is assumed).
        nearest = max(below) if below else min(above)
        return self.ms[nearest] * size / nearest


class WaveCostModel:
    """Learned wave cost per shape and step count; thread-safe. See the module
    docstring."""

    def __init__(self, limit: int, default_shape: Shape | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit  # no capacity above this (memory, --max-num-seqs-limit)
        self.default_shape = default_shape
        self.clock = clock
        self._curves: dict[tuple[Shape, int], _Curve] = {}
        self._lock = threading.Lock()

    def observe(self, shape: Shape, size: int, steps: int, forward_ms: float, *,
                served: bool = False) -> None:
        """Record one wave: `size` requests of `shape` at `steps` steps took `forward_ms`;
        `served`: it ran for served requests (not a calibration wave on an idle
        worker), so it also tells what a wave of its size costs while serving."""
        if size < 1 or steps < 1 or not math.isfinite(forward_ms) or forward_ms <= 0:
            return
        with self._lock:
            curve = self._curves.setdefault((shape, steps), _Curve(steps))
            curve.observe(size, forward_ms, served, self.clock())

    def served_estimate_ms(self, shape: Shape, size: int, steps: int) -> float | None:
        """Forward ms of a wave of `size` at `steps` steps as served waves of about that
        size at that step count took (their median cost per image; see
        `_Curve.served_ms`), or None until `MIN_SAMPLES` of them ran.

        The curve's estimate (`estimate_ms`) is the lower quartile of all waves, the
        calibration's included: right for comparing sizes, optimistic for what a size
        delivers while the same cores also parse requests and encode answers
        (measured on 2 cores, tiny-sd 64x64: served waves of 8 took 266 ms against a
        calibrated 134)."""
        with self._lock:
            curve = self._curves.get((shape, steps))
            return None if curve is None else curve.served_ms(size)

    def estimate_ms(self, shape: Shape, size: int, steps: int, *,
                    proxy: bool = True) -> float | None:
        """Forward ms of a wave of `size` at `steps` steps; None when nothing is known.
        `proxy=False`: from the shape's own curves only (any step count, not the default
        shape's scaled by pixels)."""
        with self._lock:
            return self._estimate(shape, size, steps, proxy)

    def _estimate(self, shape: Shape, size: int, steps: int, proxy: bool) -> float | None:
        """(Holding the lock.) `estimate_ms`; see the module docstring for what is
        borrowed where."""
        own = self._curves.get((shape, steps))
        if own is not None and min(own.ms) <= size <= max(own.ms):
            return own.estimate_ms(size)  # the common case: no other curve to look up
        guide = self._guide(shape, steps)
        if own is not None:
            return _anchored(own, guide, size)
        if guide is not None:
            return _scaled(guide, size, steps)
        borrowed = self._proxy(shape)
        if borrowed is None or not proxy:
            return None
        default, pixel_ratio = borrowed
        estimate = _scaled(default, size, steps)
        return None if estimate is None else estimate * pixel_ratio

    def _guide(self, shape: Shape, steps: int | None) -> _Curve | None:
        """(Holding the lock.) The shape's curve at another step count than `steps` that
        knows most sizes (the nearest step count on a tie); None if there is none."""
        others = [curve for (s, n), curve in self._curves.items()
                  if s == shape and n != steps]
        if not others:
            return None
        target = steps or 0
        return max(others, key=lambda c: (len(c.ms), -abs(c.steps - target), -c.steps))

    def _proxy(self, shape: Shape) -> tuple[_Curve, float] | None:
        """(Holding the lock.) The default shape's best-known curve and `shape`'s pixels
        over the default's, for a shape with no curve of its own; None for the default
        shape itself or when nothing is known of it."""
        default = self.default_shape
        if default is None or shape == default:
            return None
        curve = self._guide(default, None)
        return None if curve is None else (curve, shape.pixels / default.pixels)

    def _steps_of(self, shape: Shape, steps: int | None) -> int | None:
        """(Holding the lock.) `steps`, or where None the step count the shape is known
        best at."""
        if steps is not None:
            return steps
        best = self._guide(shape, None)
        return None if best is None else best.steps

    def capacity(self, shape: Shape, steps: int | None = None) -> int:
        """The shape's capacity at `steps` steps (None: at the step count it is known
        best at; see the module docstring); 1 <= capacity <= limit."""
        with self._lock:
            steps = self._steps_of(shape, steps)
            own = None if steps is None else self._curves.get((shape, steps))
            guide = self._guide(shape, steps)
            if own is not None:
                table = own.ms if guide is None else _merged(own, guide)
            else:
                table = {} if guide is None else guide.ms
            if len(table) >= 2 or (table and shape == self.default_shape):
                return capacity_from_curve(table, self.limit, _served_per_image(own))
            borrowed = self._proxy(shape)
            if borrowed is None:
                return min(self.limit, max(table)) if table else 1
            default, pixel_ratio = borrowed
            base = capacity_from_curve(default.ms, self.limit)
        scaled = base / pixel_ratio
        return max(1, min(self.limit, 1 << max(0, int(math.log2(max(scaled, 1.0))))))

    def next_size_to_try(self, shape: Shape, steps: int | None = None) -> int | None:
        """A wave size worth measuring for `shape` at `steps` steps (None: the step count
        it is known best at): the doubling after its capacity, while its own curve has
        fewer than `MIN_SAMPLES` observations of it (so one unlucky wave, run while the
        machine was busy, cannot pin the capacity), and the doubling after that one
        when it still cut the cost per image, if by less than `MIN_GAIN` (a weak rung
        may hide a strong one). None when the curve already says where gains stop, or
        before the step count has a curve of its own.

        A rung whose evidence is stale (`_Curve.is_stale`) is worth measuring afresh:
        it is returned as an untried one is, and `begin_trial` drops its old
        observations once a trial wave of it is actually chosen."""
        now = self.clock()
        with self._lock:
            steps = self._steps_of(shape, steps)
            own = None if steps is None else self._curves.get((shape, steps))
            if own is None:
                return None
            guide = self._guide(shape, steps)
            cap = capacity_from_curve(own.ms if guide is None else _merged(own, guide),
                                      self.limit, _served_per_image(own))
            for size in (cap * 2, cap * 4):
                if size > self.limit:
                    return None
                if own.is_stale(size, now) or _num_near(own, size) < MIN_SAMPLES:
                    return size
                if (_anchored(own, guide, size) / size
                        >= _anchored(own, guide, cap) / cap):
                    return None  # no gain at all: gains have stopped
            return None

    def begin_trial(self, shape: Shape, size: int, steps: int | None = None) -> None:
        """A trial wave of `size` (from `next_size_to_try`) was chosen: a stale rung's
        old observations are dropped now, so the trial's waves measure it afresh, and
        the retry is counted (`_Curve.forget_near`). Nothing happens for a rung that is
        merely untried, or asked about again while its trial runs."""
        now = self.clock()
        with self._lock:
            steps = self._steps_of(shape, steps)
            own = None if steps is None else self._curves.get((shape, steps))
            if own is not None and own.is_stale(size, now):
                own.forget_near(size)

    def num_sizes(self, shape: Shape, steps: int | None = None) -> int:
        """How many wave sizes of `shape` have been measured at `steps` steps (None: at
        the step count it is known best at)."""
        with self._lock:
            curve = self._curves.get((shape, self._steps_of(shape, steps)))
            return 0 if curve is None else len(curve.ms)

    def num_samples(self, shape: Shape, size: int, steps: int | None = None) -> int:
        """How many observations of a wave of `size` of `shape` at `steps` steps (None:
        as `num_sizes`) are kept."""
        with self._lock:
            curve = self._curves.get((shape, self._steps_of(shape, steps)))
            return 0 if curve is None else len(curve.samples.get(size, ()))

    def per_image_ms(self) -> dict[str, dict[int, float]]:
        """Curve label (shape and step count) -> wave size -> measured forward ms per
        image (for metrics)."""
        with self._lock:
            return {shape.label(steps): {b: ms / b for b, ms in sorted(curve.ms.items())}
                    for (shape, steps), curve in self._curves.items()}

    def served_per_image_ms(self) -> dict[str, dict[int, float]]:
        """Curve label -> wave size -> median forward ms per image of the served waves
        of exactly that size (for metrics; sizes no served wave had are left out)."""
        with self._lock:
            return {shape.label(steps): {b: statistics.median(window) / b
                                         for b, window in sorted(curve.served.items())}
                    for (shape, steps), curve in self._curves.items() if curve.served}

    def curves(self) -> list[tuple[Shape, int]]:
        """The (shape, step count) pairs with a curve of their own."""
        with self._lock:
            return list(self._curves)


def _scaled(curve: _Curve, size: int, steps: int) -> float | None:
    """`curve`'s estimate of a wave of `size`, scaled from its step count to `steps`."""
    estimate = curve.estimate_ms(size)
    return None if estimate is None else estimate * steps / curve.steps


def _anchored(own: _Curve, guide: _Curve | None, size: int) -> float | None:
    """A wave of `size` on `own`'s curve: measured or interpolated inside its measured
    range; outside it, `guide`'s ratio between `size` and `own`'s nearest measured
    size, times that size's time (the guide's step count cancels out). Without a guide,
    `own`'s own extrapolation (no further gain)."""
    lo, hi = min(own.ms), max(own.ms)
    if guide is None or lo <= size <= hi:
        return own.estimate_ms(size)
    nearest = lo if size < lo else hi
    at_size, at_nearest = guide.estimate_ms(size), guide.estimate_ms(nearest)
    if at_size is None or not at_nearest:
        return own.estimate_ms(size)
    return own.ms[nearest] * at_size / at_nearest


def _merged(own: _Curve, guide: _Curve) -> dict[int, float]:
    """`own`'s curve over the sizes either curve measured (see `_anchored`)."""
    return {size: _anchored(own, guide, size) for size in sorted({*own.ms, *guide.ms})}


def capacity_from_curve(ms: dict[int, float], limit: int,
                        served: Callable[[int], float | None] | None = None) -> int:
    """The capacity rule on measured forward times `ms` (wave size -> ms).

    Walks the ladder from the smallest measured size up to the largest measured one,
    or the rung just above it when that size is at least `NEAR_RUNG` of the rung
    (sizes between measured ones are interpolated; beyond the largest, its cost per
    image holds), and keeps each size whose cost per image is at least `MIN_GAIN`
    below that of the last size kept, returning the last one kept. A rung that
    gains too little does not end the walk: the next one is compared with the last
    size kept, so one noisy or weak rung cannot pin the capacity low.

    `served` (size -> the median cost per image of the served waves of about that
    size, None with fewer than `MIN_SAMPLES` of them) keeps a rung too where the curve
    does not but the served waves show the gain: lower quartiles taken at different
    times are noisy near the `MIN_GAIN` threshold (measured on tiny-sd at 128x128,
    learned from served waves alone: 45.9 ms per image at 8 against 46.6 at 16 by
    the curve, the quartile of 8 set by its first waves, while the medians were 52.2
    against 47.2; capacity 8 served a loop of 32 clients at 0.83 of waves of 16).
    Bigger waves of one load run under at least as much contention as its smaller
    ones, so the medians flatter the bigger wave only where the machine itself got
    faster between them; a capacity too large below saturation costs little, as the
    load rule sizes those waves (`diffbatch.engine.batch_policy`).
    """
    if not ms:
        return 1
    curve = _Curve(steps=1, ms=dict(ms))
    size = best = min(ms)
    best_cost = _per_image(curve, best)
    best_served = served(best) if served else None
    while size * 2 <= limit and NEAR_RUNG * size * 2 <= max(ms):
        size *= 2
        cost = _per_image(curve, size)
        size_served = served(size) if served else None
        served_gain = (size_served is not None and best_served is not None
                       and size_served <= (1.0 - MIN_GAIN) * best_served)
        if cost <= (1.0 - MIN_GAIN) * best_cost or served_gain:
            best, best_cost, best_served = size, cost, size_served
    return max(1, min(best, limit))


def _served_per_image(curve: _Curve | None) -> Callable[[int], float | None] | None:
    """Size -> the median cost per image of `curve`'s served waves of about that size
    (`_Curve.served_ms`; None with fewer than `MIN_SAMPLES` of them); None without
    any served wave."""
    if curve is None or not curve.served:
        return None

    def per_image(size: int) -> float | None:
        ms = curve.served_ms(size)
        return None if ms is None else ms / size
    return per_image


def _num_near(curve: _Curve, rung: int) -> int:
    """Observations that are evidence for `rung`: of sizes from `NEAR_RUNG` x it up to
    it."""
    return sum(len(window) for size, window in curve.samples.items()
               if NEAR_RUNG * rung <= size <= rung)


def _per_image(curve: _Curve, size: int) -> float:
    ms = curve.estimate_ms(size)
    assert ms is not None  # the curve has observations
    return ms / size


__all__ = ["MIN_GAIN", "Shape", "WaveCostModel", "capacity_from_curve"]
