"""How big a wave may be and how long to wait for it: `BatchPolicy`.

Fixed numbers (`max_num_seqs=8`, `request_batch_max_wait_ms=20`) pass through. "auto":

- **capacity** per shape is the knee of the learned cost curve, bounded by memory and
  `--max-num-seqs-limit`. The next doubling is probed only while a backlog persists:
  after `PERSIST_WAVES` waves in a row started with enough waiting to fill it, until it has
  `MIN_SAMPLES` waves; the curve then says whether it pays (on the median and spread
  of its waves: without evidence that it costs more per image, the larger size wins,
  and the doubling above it is probed next, so a capacity learned too small heals).
- **the admission wait** runs only at an idle worker not under sustained load (busy
  `BUSY_SHARE` of the last `LOAD_WINDOW_S`: the queue refills while each wave runs).
  With `q` waiting, arrivals at rate `r` and wave times `t(B)`, waiting `d = k / r`
  for `k` more runs one wave of `q + k`; starting now runs the `q`, then the `k`.
  Each request's mean time to its answer, arrivals spread over `d`:

      wait:       (q * (d + T) + k * (d/2 + T)) / (q + k),   T = max(t(q+k), t(q))
      start now:  (q * t(q) + k * (max(t(q), d) + t(k) - d/2)) / (q + k)

  It waits for the `k` that saves the most, if any, at most one request's wave time
  (and `MAX_WAIT_MS`): at low load `d` is long and waiting never pays.
- **requests sent together** share a wave: where the rule above starts now, an idle
  worker still waits until no request has arrived for `TOGETHER_MS` and none is on
  its way in through the front end (at most `TOGETHER_MAX_MS`), so a client's batch
  sent at once (a page's four requests) arrives whole; a lone request pays
  `TOGETHER_MS`.
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
PERSIST_WAVES = 3  # waves in a row with a backlog that fills a doubling before it is probed
SLACK = 2.0  # Poisson arrivals: wait up to this many times the expected time
TOGETHER_MS = 2.0  # arrivals this close to each other were sent together
TOGETHER_MAX_MS = 20.0  # and a run of them is gathered for at most this long


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
    `supports_request_batch=False` pins the capacity to 1; tests drive `clock`."""

    def __init__(self, config: EngineConfig, info: PipelineInfo, *, supports_request_batch: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.batching = supports_request_batch
        self.limit = max(1, config.capacity_limit) if supports_request_batch else 1
        self.default_shape = Shape(info.default_height, info.default_width, 1,
                                   info.cfg_threshold is not None
                                   and info.default_guidance_scale > info.cfg_threshold,
                                   getattr(info, "default_num_frames", None))
        self.cost = WaveCostModel(self.limit, self.default_shape)
        # step mode: one step of a running batch of B requests, learned from the ticks
        self.step_cost = WaveCostModel(self.limit, self.default_shape)
        self.stalls = StallBounds(config, self.cost)  # when a worker counts as stuck
        self._clock = clock
        self._lock = threading.Lock()
        # the last window's (time, requests that arrived, forward s of a wave that ended)
        self._events: deque[tuple[float, int, float]] = deque()
        self._backlog_waves: dict[SamplingParamsKey | None, int] = {}  # waves in a row (above)
        self.serving = False  # waves teach only once serving (the warm-up would skew them)

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
        knee, probe = self._knee_and_probe(key)
        if probe is None or num_waiting < probe:
            return knee
        with self._lock:
            return probe if self._backlog_waves.get(key, 0) >= PERSIST_WAVES else knee

    def step_capacity(self, key: SamplingParamsKey | None, demand: int = 0) -> int:
        """Step mode: most requests in the running batch of `key` with `demand` running
        or waiting: the knee, or toward the doubling above it while it is measured. A query."""
        knee, probe = self._knee_and_probe(key)
        return min(probe, demand) if probe and demand > knee else knee

    def _knee_and_probe(self, key: SamplingParamsKey | None) -> tuple[int, int | None]:
        """The knee of `key`'s curve and the doubling above it while that has fewer than
        `MIN_SAMPLES` waves (ticks in step mode, whose keys have step count 0); with
        nothing to choose, the fixed capacity and no probe."""
        if not self.batching or not self.config.auto_capacity or key is None:
            fixed = self.limit if self.config.auto_capacity else self.config.capacity_limit
            return (fixed if self.batching else 1), None
        shape, steps = Shape.of(key), key.num_denoising_steps
        knee = self.curve_capacity(shape, steps)
        model, at = (self.cost, steps) if steps else (self.step_cost, 1)
        probe = knee * 2
        measured = probe > self.limit or model.num_samples(shape, at).get(probe, 0) >= MIN_SAMPLES
        return knee, None if measured else probe

    def curve_capacity(self, shape: Shape, steps: int) -> int:
        """The knee of the tick curve once it knows two sizes (step mode), else that of
        the wave curve at `steps` (0: the step count it is known best at)."""
        if len(self.step_cost.num_samples(shape, 1)) >= 2:
            return self.step_cost.capacity(shape, 1)
        return self.cost.capacity(shape, steps)

    def observe_backlog(self, key: SamplingParamsKey | None, num_waiting: int) -> None:
        """The engine is about to schedule a wave of `key` with `num_waiting` waiting:
        count the waves in a row that found a backlog that fills the probe size (with
        a wave running and a full one queued behind it, a closed loop of 4x the
        capacity leaves exactly 2x waiting)."""
        probe = self._knee_and_probe(key)[1]
        with self._lock:
            if probe is not None and num_waiting >= probe:
                self._backlog_waves[key] = self._backlog_waves.get(key, 0) + 1
            else:
                self._backlog_waves.pop(key, None)

    # -- admission wait --------------------------------------------------------------
    def plan_wait(self, key: SamplingParamsKey | None, num_waiting: int) -> WaitPlan:
        """The admission wait for `num_waiting` of `key` at an idle worker. A query."""
        capacity = self.capacity(key)
        if capacity <= 1:
            return WaitPlan.start_now(1)
        if not self.config.auto_wait:
            fixed = float(self.config.request_batch_max_wait_ms)
            return WaitPlan(target=capacity, max_wait_ms=fixed,
                            stable_window_ms=min(MAX_STABLE_WINDOW_MS, fixed / 5.0))
        rate_per_s, busy_share = self._load()
        if key is None or busy_share >= BUSY_SHARE:
            return WaitPlan.start_now(num_waiting)
        shape, steps = Shape.of(key), key.num_denoising_steps
        plan = choose_wait(num_waiting, rate_per_s,
                           lambda size: self.cost.estimate_ms(shape, size, steps) or math.inf,
                           capacity, self.wait_bound_ms(shape, steps))
        if plan.max_wait_ms > 0 or num_waiting >= capacity:
            return plan
        return WaitPlan(target=capacity, max_wait_ms=TOGETHER_MAX_MS,
                        stable_window_ms=TOGETHER_MS)  # (module docstring)

    def wait_bound_ms(self, shape: Shape, steps: int) -> float:
        """The longest wait: the fixed one, or one request's wave time, at most
        `MAX_WAIT_MS` (0 while nothing is known of it)."""
        if not self.config.auto_wait:
            return float(self.config.request_batch_max_wait_ms)
        return min(self.cost.estimate_ms(shape, 1, steps) or 0.0, MAX_WAIT_MS)

    def _load(self) -> tuple[float, float]:
        """Of the last `LOAD_WINDOW_S`: the requests per second that arrived after its
        first arrival, over the time since it (0 with fewer than two arrivals), and the
        share of it the worker spent on waves."""
        now = self._clock()
        since = now - LOAD_WINDOW_S
        with self._lock:
            arrivals = [(at, n) for at, n, _ in self._events if n and at >= since]
            busy_s = sum(max(0.0, end - max(since, end - forward_s))
                         for end, _, forward_s in self._events if end > since)
        rate = 0.0 if len(arrivals) < 2 else (
            sum(n for _, n in arrivals[1:]) / max(now - arrivals[0][0], 1e-6))
        return rate, busy_s / LOAD_WINDOW_S

    # -- observations ----------------------------------------------------------------
    def _record(self, arrivals: int, forward_s: float) -> None:
        now = self._clock()
        with self._lock:
            self._events.append((now, arrivals, forward_s))
            while self._events[0][0] < now - LOAD_WINDOW_S:
                self._events.popleft()

    def observe_arrivals(self, count: int) -> None:
        """`count` requests arrived together (only while serving: the warm-up request
        is no arrival)."""
        if self.serving and count >= 1:
            self._record(count, 0.0)

    def observe_wave(self, key: SamplingParamsKey | None, size: int, forward_ms: float,
                     num_forwards: int = 1) -> None:
        """A wave of `size` ended just now after `forward_ms`: busy time; a clean single
        forward also teaches the curve (fixed settings too: it bounds stalls)."""
        if not self.serving:
            return
        self._record(0, forward_ms / 1000.0)
        if key is not None and num_forwards == 1:
            self.cost.observe(Shape.of(key), size, key.num_denoising_steps, forward_ms)

    def observe_tick(self, key: SamplingParamsKey | None, tick: TickStats) -> None:
        """Step mode: one tick of a running batch of `key`. Its whole time bounds the
        stall; its fused denoiser call's time teaches the tick curve."""
        if key is None or not self.serving or tick.batch_size < 1:
            return
        shape = Shape.of(key)
        self.stalls.observe_tick(shape, tick.step_ms)
        if self.learns:  # the curve's sizes are capacity units
            size = tick.batch_size if tick.batch_units is None else tick.batch_units
            self.step_cost.observe(shape, size, 1, tick.forward_ms)


__all__ = ["MAX_WAIT_MS", "TOGETHER_MAX_MS", "TOGETHER_MS", "BatchPolicy", "WaitPlan",
           "choose_wait"]
