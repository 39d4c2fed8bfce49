"""How big a wave may be and how long to wait for it: `BatchPolicy`.

With fixed numbers (`max_num_seqs=8`, `request_batch_max_wait_ms=20`) it hands them
to the scheduler and the admission wait as they are. With "auto" (the default):

- **capacity** per shape is the knee of the learned cost curve
  (`WaveCostModel.capacity`), bounded by memory and `--max-num-seqs-limit`. The next
  doubling is probed only while a backlog persists: once `PERSIST_WAVES` waves in a
  row started with more requests waiting than that doubling, waves of it run until it
  has `MIN_SAMPLES` observations, and the curve then says whether it pays.
- **the admission wait** runs only while the worker is idle, and not at all when it
  was busy `BUSY_SHARE` of the last `LOAD_WINDOW_S` (sustained load: the queue refills
  while each wave runs). With `q` waiting, arrivals at rate `r` and wave times `t(B)`,
  waiting `d = k / r` for `k` more runs one wave of `q + k`; starting now runs the `q`
  and then the `k`. Each request's mean time to its answer, arrivals spread over `d`:

      wait:       (q * (d + T) + k * (d/2 + T)) / (q + k),   T = max(t(q+k), t(q))
      start now:  (q * t(q) + k * (max(t(q), d) + t(k) - d/2)) / (q + k)

  The engine waits for the `k` that saves the most, if any, never longer than the
  shape's single-request wave time (at most `MAX_WAIT_MS`): at low load `d` is long
  and waiting never pays; for a burst at an idle worker it pays until the wave is full.

`capacity` and `plan_wait` are queries; the engine reports what happens through
`observe_arrivals`, `observe_backlog` (once per wave it schedules) and `observe_wave`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffbatch.engine.admission import MAX_STABLE_WINDOW_MS
from diffbatch.engine.cost_model import MIN_SAMPLES, Shape, WaveCostModel
from diffbatch.engine.stall_bounds import StallBounds

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.outputs import TickStats
    from diffbatch.pipelines.interface import PipelineInfo
    from diffbatch.sampling_params import SamplingParamsKey

MAX_WAIT_MS = 1000.0  # never wait longer than this for a wave, whatever the curve says
LOAD_WINDOW_S = 1.0  # arrivals and busy time of this recent window give rate and load
BUSY_SHARE = 0.5  # a worker busy this share of the window has a sustained load
PERSIST_WAVES = 3  # waves in a row with a backlog beyond a doubling before it is probed
SLACK = 2.0  # Poisson arrivals: wait up to this many times the expected time


@dataclass(frozen=True)
class WaitPlan:
    """What the admission wait should do before the next wave."""

    target: int  # end the wait once this many requests wait (<= capacity)
    max_wait_ms: float  # and at the latest after this long; 0 = start now
    stable_window_ms: float  # or once no request arrived for this long

    @classmethod
    def start_now(cls, num_waiting: int) -> WaitPlan:
        """No wait: the next wave takes the `num_waiting` requests there are."""
        return cls(target=num_waiting, max_wait_ms=0.0, stable_window_ms=0.0)


def choose_wait(num_waiting: int, rate_per_s: float, wave_ms: Callable[[int], float],
                capacity: int, wait_bound_ms: float) -> WaitPlan:
    """The wait formula of the module docstring; `wave_ms(B)` is the learned wave time."""
    q = num_waiting
    if q < 1 or q >= capacity or not 0 < rate_per_s < math.inf:
        return WaitPlan.start_now(max(q, 1))
    t_q = wave_ms(q)
    best_k, best_saving = 0, 0.0
    for k in range(1, capacity - q + 1):
        d = 1000.0 * k / rate_per_s
        if d > wait_bound_ms:
            break
        t_all = max(wave_ms(q + k), t_q)  # a bigger wave is never faster
        wait = (q * (d + t_all) + k * (d / 2 + t_all)) / (q + k)
        now = (q * t_q + k * (max(t_q, d) + wave_ms(k) - d / 2)) / (q + k)
        if now - wait > best_saving:
            best_k, best_saving = k, now - wait
    if best_k == 0:
        return WaitPlan.start_now(q)
    max_wait = min(wait_bound_ms, SLACK * 1000.0 * best_k / rate_per_s)
    return WaitPlan(target=q + best_k, max_wait_ms=max_wait,
                    stable_window_ms=min(max_wait, SLACK * 1000.0 / rate_per_s))


class BatchPolicy:
    """Capacity and admission wait per batch key, fixed or learned; thread-safe.

    Args:
        config: the engine's config (`max_num_seqs`, `request_batch_max_wait_ms`,
            their "auto" values and the auto limit).
        info: the loaded pipeline's info (its default shape seeds the cost model).
        supports_request_batch: False pins the capacity to 1.
        limit: the largest wave "auto" may choose (default: the config's limit).
        clock: monotonic seconds (tests drive it).
    """

    def __init__(self, config: EngineConfig, info: PipelineInfo, *,
                 supports_request_batch: bool, limit: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.batching = supports_request_batch
        self.limit = 1 if not supports_request_batch else max(1, limit or config.capacity_limit)
        self.default_shape = Shape(info.default_height, info.default_width, 1,
                                   info.cfg_threshold is not None
                                   and info.default_guidance_scale > info.cfg_threshold)
        self.cost = WaveCostModel(self.limit, self.default_shape)
        # step mode: one step of a running batch of B requests, learned from the ticks
        self.step_cost = WaveCostModel(self.limit, self.default_shape)
        self.stalls = StallBounds(config, self.cost)  # when a worker counts as stuck
        self._clock = clock
        self._lock = threading.Lock()
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, count), last window
        self._busy: deque[tuple[float, float]] = deque()  # (end, forward s), last window
        self._backlog_waves: dict[tuple[Shape, int], int] = {}  # waves in a row (above)
        # Waves teach the cost model only once the engine serves: the warm-up wave
        # (first call, cold caches) would skew it.
        self.serving = False

    @property
    def learns(self) -> bool:
        """Whether anything is "auto" with a choice to make (then waves teach the curve)."""
        return self.batching and self.limit > 1 and (
            self.config.auto_capacity or self.config.auto_wait)

    def set_limit(self, limit: int) -> None:
        """Lower the auto limit (e.g. to what memory allows, found by calibration)."""
        self.limit = max(1, min(self.limit, limit))
        self.cost.limit = self.step_cost.limit = self.limit

    # -- capacity --------------------------------------------------------------------
    def capacity(self, key: SamplingParamsKey | None, num_waiting: int = 0) -> int:
        """Most requests in the next wave of `key` with `num_waiting` waiting: the
        learned knee, or the doubling above it while that is probed and the backlog
        fills it (module docstring). A query."""
        if not self.batching:
            return 1
        if not self.config.auto_capacity:
            return self.config.capacity_limit
        if key is None:
            return self.limit
        knee = self.cost.capacity(Shape.of(key), key.num_denoising_steps or None)
        probe = self._probe_size(key, knee)
        with self._lock:
            probing = self._backlog_waves.get(_curve(key), 0) >= PERSIST_WAVES
        return probe if probe is not None and probing and num_waiting >= probe else knee

    def _probe_size(self, key: SamplingParamsKey, knee: int) -> int | None:
        """The doubling above `knee` while it has fewer than `MIN_SAMPLES` waves."""
        size = knee * 2
        if size > self.limit or self.cost.num_samples(
                Shape.of(key), size, key.num_denoising_steps or None) >= MIN_SAMPLES:
            return None
        return size

    def observe_backlog(self, key: SamplingParamsKey | None, num_waiting: int) -> None:
        """The engine is about to schedule a wave of `key` with `num_waiting` waiting:
        count the waves in a row that found a backlog beyond the probe size."""
        if key is None or not self.learns or not self.config.auto_capacity:
            return
        knee = self.cost.capacity(Shape.of(key), key.num_denoising_steps or None)
        probe = self._probe_size(key, knee)
        with self._lock:
            count = self._backlog_waves.get(_curve(key), 0)
            persists = probe is not None and num_waiting > probe
            self._backlog_waves[_curve(key)] = count + 1 if persists else 0

    def step_capacity(self, key: SamplingParamsKey | None, demand: int = 0) -> int:
        """Step mode: most requests in the running batch of `key` with `demand` running
        or waiting: the knee of the tick curve once it knows two sizes (the wave curve's
        before), or the next doubling, up to the demand, while it has fewer than
        `MIN_SAMPLES` ticks and the demand exceeds the knee. A query."""
        if not self.batching:
            return 1
        if not self.config.auto_capacity:
            return self.config.capacity_limit
        if key is None:
            return self.limit
        shape = Shape.of(key)
        knee = self._step_knee(shape)
        probe = knee * 2
        if demand > knee and probe <= self.limit \
                and self.step_cost.num_samples(shape, probe) < MIN_SAMPLES:
            return min(probe, demand)
        return knee

    def _step_knee(self, shape: Shape) -> int:
        """The knee of the tick curve once it knows two sizes, the wave curve's before."""
        ticks_known = self.step_cost.num_sizes(shape) >= 2
        return (self.step_cost if ticks_known else self.cost).capacity(shape)

    # -- admission wait --------------------------------------------------------------
    def plan_wait(self, key: SamplingParamsKey | None, num_waiting: int) -> WaitPlan:
        """What the admission wait should do with `num_waiting` requests of `key` waiting
        at an idle worker (module docstring). A query."""
        capacity = self.capacity(key)
        if not self.batching or capacity <= 1:
            return WaitPlan.start_now(1)
        if not self.config.auto_wait:
            fixed = float(self.config.request_batch_max_wait_ms)
            return WaitPlan(target=capacity, max_wait_ms=fixed,
                            stable_window_ms=min(MAX_STABLE_WINDOW_MS, fixed / 5.0))
        if key is None:
            return WaitPlan.start_now(num_waiting)
        wave_ms = self._wave_ms(key)
        bound = self.wait_bound_ms(key)
        now = self._clock()
        if bound <= 0 or self._busy_share(now) >= BUSY_SHARE:
            return WaitPlan.start_now(num_waiting)
        return choose_wait(num_waiting, self._rate_per_s(now), wave_ms, capacity, bound)

    def wait_bound_ms(self, key: SamplingParamsKey) -> float:
        """The longest auto wait for `key`: its single-request wave time, at most
        `MAX_WAIT_MS` (0 while nothing is known of it)."""
        one = self._wave_ms(key)(1)
        return min(one, MAX_WAIT_MS) if math.isfinite(one) else 0.0

    def _wave_ms(self, key: SamplingParamsKey) -> Callable[[int], float]:
        """The learned wave time of `key` by size (inf where nothing is known)."""
        shape, steps = Shape.of(key), key.num_denoising_steps

        def wave_ms(size: int) -> float:
            estimate = self.cost.estimate_ms(shape, size, steps)
            return math.inf if estimate is None else estimate
        return wave_ms

    def _rate_per_s(self, now: float) -> float:
        """Requests per second that arrived after the first arrival of the window, over
        the time since it (0 with fewer than two arrivals)."""
        with self._lock:
            recent = [(at, n) for at, n in self._arrivals if at >= now - LOAD_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(now - recent[0][0], 1e-6)

    def _busy_share(self, now: float) -> float:
        """The share of the last `LOAD_WINDOW_S` the worker spent on waves."""
        since = now - LOAD_WINDOW_S
        with self._lock:
            busy = sum(max(0.0, end - max(since, end - forward_s))
                       for end, forward_s in self._busy if end > since)
        return busy / LOAD_WINDOW_S

    # -- observations ----------------------------------------------------------------
    def observe_arrivals(self, count: int) -> None:
        """`count` requests arrived together (only while serving: the warm-up request
        is no arrival)."""
        if not self.serving or count < 1:
            return
        now = self._clock()
        with self._lock:
            self._arrivals.append((now, count))
            while self._arrivals and self._arrivals[0][0] < now - LOAD_WINDOW_S:
                self._arrivals.popleft()

    def observe_wave(self, key: SamplingParamsKey | None, size: int, forward_ms: float,
                     num_forwards: int = 1) -> None:
        """A wave of `size` ended just now after `forward_ms`: it counts as busy time;
        a clean single forward also teaches the curve (fixed settings learn too: the
        curve bounds a wave's stall, `StallBounds`)."""
        if not self.serving:
            return
        now = self._clock()
        with self._lock:
            self._busy.append((now, forward_ms / 1000.0))
            while self._busy and self._busy[0][0] < now - LOAD_WINDOW_S:
                self._busy.popleft()
        if key is not None and num_forwards == 1:
            self.cost.observe(Shape.of(key), size, key.num_denoising_steps, forward_ms)

    def observe_tick(self, key: SamplingParamsKey | None, tick: TickStats) -> None:
        """Step mode: one tick of a running batch of `key`. Its whole time bounds the
        stall; its fused denoiser call's time teaches the tick curve."""
        if key is None or not self.serving or tick.batch_size < 1:
            return
        shape = Shape.of(key)
        self.stalls.observe_tick(shape, tick.step_ms)
        if self.learns and tick.forward_ms > 0:  # the curve's sizes are capacity units
            size = tick.batch_size if tick.batch_units is None else tick.batch_units
            self.step_cost.observe(shape, size, 1, tick.forward_ms)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per curve label: per-image ms by wave size, capacity and the longest wait
        (the auto wait's bound, or the fixed wait; for metrics); empty with fixed
        settings."""
        if not self.learns:
            return {}
        per_image = self.cost.per_image_ms()
        out: dict[str, dict[str, object]] = {}
        for shape, steps in self.cost.curves():
            one = self.cost.estimate_ms(shape, 1, steps) or 0.0
            wait = (min(one, MAX_WAIT_MS) if self.config.auto_wait
                    else float(self.config.request_batch_max_wait_ms))
            out[shape.label(steps)] = {"per_image_ms": per_image[shape.label(steps)],
                                       "capacity": self.step_cost.capacity(shape)
                                       if self.step_cost.num_sizes(shape) >= 2
                                       else self.cost.capacity(shape, steps),
                                       "wait_ms": wait}
        return out


def _curve(key: SamplingParamsKey) -> tuple[Shape, int]:
    return Shape.of(key), key.num_denoising_steps


__all__ = ["MAX_WAIT_MS", "BatchPolicy", "WaitPlan", "choose_wait"]
