"""How big a wave may be and how long to wait for it: `BatchPolicy`.

With fixed numbers (`max_num_seqs=8`, `request_batch_max_wait_ms=20`) it hands
them to the scheduler and the admission wait as they are. With "auto" (the
default) it chooses both per shape, from the learned cost curve
(`diffbatch.engine.cost_model`) and the observed arrival rate:

- capacity per shape comes from `WaveCostModel.capacity` (the wave size beyond
  which a bigger wave stops cutting the cost per image by 5%), bounded by the
  limit; with a backlog bigger than that, the next doubling is tried so the curve
  keeps learning (`capacity`: once a backlog beyond the trial size has outlasted
  two waves);
- below saturation a wave takes no more than the load needs (`wave_size_for_load`,
  rule below);
- the admission wait follows the rule below.

**Wave size at the load seen.** The capacity is where a bigger wave stops paying in
throughput; a load that does not need that throughput pays for it in latency (on
tiny-sd at 64x64 a wave of 32 runs two thirds longer than one of 16). So with `n`
requests waiting, more than the load's size `L`, the next wave takes `L` of them, not
all: but only while the backlog is at most `BACKLOG_FACTOR * L` (a deeper one says
waves of `L` do not keep up, whatever the curve says) and only if splitting lowers
the sum of the `n` requests' latencies by `MIN_GAIN` (a pair at low load still runs
as one wave: two waves of one take longer for both). Under an overload the capacity
holds.

`L` is the ladder size (1, 2, 4, ... below the capacity) that answers soonest on
average at the sustained arrival rate `r`, among those that keep up with room to
spare: a wave of `L` taking `s(L)` as served keeps the worker busy
`rho = r * s(L) / L` of the time; it qualifies when `rho <= 1 / LOAD_HEADROOM` (a
rate near what waves of `L` deliver leaves no slack for a slower spell, and a
saturated server measures its own throughput as the rate: without the margin, waves
of 8 on tiny-sd 64x64, a few percent dearer per image than 16, would be picked under
a closed loop and cost ~10% of its throughput, measured), and a queue served that
way answers in about `s(L) / (1 - rho)` (an M/M/1 queue's mean time in the system,
with a wave as its service: the wave times of a shared machine vary, so the
deterministic queue's smaller factor would be optimistic). So a small wave that
just qualifies loses to a bigger one whose lower cost per image leaves more slack:
on tiny-sd at 128x128, where the cost per image keeps falling to waves of 12-16, 11
requests/s pick waves of 8, not the waves of 4 that qualify too. No qualifying size
below the capacity: the capacity.

`s(L)` is what served waves of about `L` took (the median of their cost per image,
`WaveCostModel.served_estimate_ms`), the curve's `t(L)` until four of them ran: the
curve's lower quartile, calibration included, is the worker on cores nobody else
needs, and a saturated server's arrival rate is its own throughput (a closed loop of
clients sends as fast as it is answered), so an optimistic `t(L)` would keep calling
a smaller wave enough and cost throughput (measured on 2 cores, tiny-sd 64x64, 32
clients: served waves of 8 took 266 ms against a calibrated 134).

The admission wait runs only while nothing is in flight (as a fixed wait does).
With `q` requests waiting, arrivals at rate `r` per second and a learned wave time
`t(B)`, waiting for `k` more takes about `d = k / r` and then runs one wave of
`q + k`; starting now runs the `q` at once and the `k` in the next wave, which can
start when both the first wave is done and they have arrived. Measured from each
request's own arrival (arrivals spread evenly over `d`, so on average `d / 2`
after now), the mean latencies are

    wait:       (q * (d + T) + k * (d/2 + T)) / (q + k),  T = max(t(q+k), t(q))
    start now:  (q * t(q) + k * (max(t(q), d) + t(k) - d/2)) / (q + k)

(`T`: a bigger wave is never faster than the one that could start now, whatever a
noisy point of the learned curve says.)

The engine waits for the `k` (up to capacity) that saves the most, only if it saves
anything, and never longer than `wait_bound_ms` (the shape's single-request wave
time, capped at `MAX_WAIT_MS`): at low load `d` is long and waiting never pays;
under a burst it pays until the wave is full. Under a sustained load (the arrivals
of the last `SUSTAINED_WINDOW_S`, or of a younger stream's own life, would keep the
worker busy `BUSY_UTILIZATION` of the time or more at the capacity's cost per image),
with arrivals no faster than `BURST_RATE_FACTOR` times that rate, no wait runs: the
queue refills while each wave runs, and a worker idle in a wait delays everyone
behind it. (A burst, even one that keeps the worker busy for seconds, still waits for
its last requests.) The rule is in `choose_wait`, a pure function of those numbers;
docs/serving.md walks through it.

Three kinds of requests not here yet are waited for too, where the wave would
otherwise start without them: requests announced by the HTTP layer while it still
reads their bodies (`INCOMING_WAIT_MS` at most); the clients of a wave answered a
moment ago that a closed loop sends right back (`diffbatch.engine.returning`), where
one wave of them all turns the loop faster (`holding_pays`); and a burst that may be
right behind an idle server's first request (`FIRST_REQUEST_HOLD_SHARE`). A stream
younger than `MIN_SUSTAINED_SPAN_S` is not split by the load rule: it has no
sustained rate yet.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffbatch.cpus import parse_cpu_list
from diffbatch.engine.admission import MAX_STABLE_WINDOW_MS
from diffbatch.engine.cost_model import MIN_GAIN, MIN_SAMPLES, Shape, WaveCostModel
from diffbatch.engine.returning import MAX_RETURN_WINDOW_MS, ReturningClients
from diffbatch.worker.threads import omp_num_threads, usable_cpu_count

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.outputs import TickStats
    from diffbatch.pipelines.interface import PipelineInfo
    from diffbatch.sampling_params import SamplingParamsKey

MAX_WAIT_MS = 1000.0  # never wait longer than this for a wave, whatever the curve says
# Announced requests (their HTTP bodies are still being read) are waited for this long
# at most: they are already here, only not parsed yet.
INCOMING_WAIT_MS = 20.0
RATE_SMOOTHING = 0.2  # weight of the newest inter-arrival gap
# A gap this many times the smoothed one, ending while the engine had nothing to do
# (or one as long as `SUSTAINED_WINDOW_S`), is a pause, not part of the stream: the
# estimate starts afresh from the next gap (averaged in, a quiet spell of seconds would
# outweigh the ~20 gaps of the burst after it, whose first waves would then start small
# for want of a rate). A gap while requests run is no pause: a closed loop of clients
# falls silent while its requests run and answers in a clump after each wave, and
# taken for pauses its clumps read as new streams of one wave each, a fraction of the
# rate the server sustains (measured: `shapes` at 64x64, 32 clients, capacity 16, the
# load rule then split the backlog into waves of 8 and served ~10% less).
NEW_STREAM_GAP_FACTOR = 10.0
# Sustained load: arrivals over this window, against the capacity's cost per image,
# give the server's utilization; from `BUSY_UTILIZATION` on, no admission wait runs
# (an idle worker then costs every later request the wait, not just these). A stream
# younger than the window (it began after a pause) is measured over its own age, at
# least `MIN_SUSTAINED_SPAN_S`: a load that starts after a quiet spell is load from its
# first second, not after five (waits in its first seconds grow waves that a load
# near capacity then keeps: each wave's arrivals fill the next).
SUSTAINED_WINDOW_S = 5.0
MIN_SUSTAINED_SPAN_S = 1.0
BUSY_UTILIZATION = 0.5
# A burst is arrivals far faster than the window's average: collecting the rest of it
# costs milliseconds, and the rule below weighs that, busy or not.
BURST_RATE_FACTOR = 3.0
# A backlog beyond this many waves of `L` means waves of `L` are not keeping up.
BACKLOG_FACTOR = 2
# Below saturation a wave of `L` qualifies when its throughput as served covers the
# sustained arrival rate this many times over (module docstring).
LOAD_HEADROOM = 1.25
# An idle server's first request (none in the last `SUSTAINED_WINDOW_S`) waits this
# share of its wave time (at most `INCOMING_WAIT_MS`) for a second one, and goes on
# waiting while more come that close together, up to the wait's bound, where a wave's
# fixed cost makes that pay (`t(1) - t(C)/C` beyond the hold). A burst at an idle
# server (a batch job starting, a benchmark's clients) reaches the engine a few
# milliseconds apart, and without the hold its first request runs alone while the
# rest wait for it (measured on tiny-sd 64x64, 32 or 64 requests at once: a wave of 1
# of 130-380 ms ahead of every burst). A lone request pays the share at most.
FIRST_REQUEST_HOLD_SHARE = 0.2
SLACK = 1.5  # the wait's deadline allows Poisson arrivals this much beyond the mean
TICKS_KEPT = 64  # step mode: recent tick times kept per shape (for the stall bound)
# A backlog beyond a trial wave's size counts as sustained (worth a trial that leaves
# requests behind it) once it has lasted this many of the capacity's wave times.
SUSTAINED_BACKLOG_WAVES = 2.0


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


def choose_wait(
    num_waiting: int,
    rate_per_s: float,
    wave_ms: Callable[[int], float],
    capacity: int,
    wait_bound_ms: float,
) -> WaitPlan:
    """The wait rule of the module docstring; `wave_ms(B)` is the learned wave time."""
    q = num_waiting
    if q < 1 or q >= capacity or rate_per_s <= 0 or not math.isfinite(rate_per_s):
        return WaitPlan.start_now(max(q, 1))
    t_q = wave_ms(q)
    best_k, best_saving = 0, 0.0
    for k in range(1, capacity - q + 1):
        d = 1000.0 * k / rate_per_s
        if d > wait_bound_ms:
            break
        # a bigger wave is never faster: a learned curve that dips there (noise, or
        # a size seen once) must not make waiting look free
        t_all = max(wave_ms(q + k), t_q)
        wait = (q * (d + t_all) + k * (d / 2 + t_all)) / (q + k)
        now = (q * t_q + k * (max(t_q, d) + wave_ms(k) - d / 2)) / (q + k)
        if now - wait > best_saving:
            best_k, best_saving = k, now - wait
    if best_k == 0:
        return WaitPlan.start_now(q)
    gap_ms = 1000.0 / rate_per_s
    max_wait = min(wait_bound_ms, SLACK * 1000.0 * best_k / rate_per_s)
    # a quiet spell of a few mean gaps means the burst is over
    return WaitPlan(target=q + best_k, max_wait_ms=max_wait,
                    stable_window_ms=min(max_wait, 3.0 * gap_ms))


def _hold_for(plan: WaitPlan, expected: int, capacity: int, hold_ms: float) -> WaitPlan:
    """`plan`, made to wait up to `hold_ms` for `expected` requests in all (at most
    `capacity`) where it would start with fewer."""
    target = min(capacity, expected)
    if plan.target >= target or hold_ms <= 0:
        return plan
    return WaitPlan(target=target, max_wait_ms=max(plan.max_wait_ms, hold_ms),
                    stable_window_ms=max(plan.stable_window_ms, hold_ms))


def _hold_for_a_burst(plan: WaitPlan, capacity: int, bound_ms: float,
                      gap_ms: float) -> WaitPlan:
    """`plan`, made to go on waiting (up to `capacity` requests and `bound_ms`) for as
    long as requests keep arriving less than `gap_ms` apart."""
    if plan.target >= capacity or gap_ms <= 0:
        return plan
    return WaitPlan(target=capacity, max_wait_ms=max(plan.max_wait_ms, bound_ms),
                    stable_window_ms=max(plan.stable_window_ms, gap_ms))


def holding_pays(num_waiting: int, num_returning: int, due_ms: float,
                 wave_ms: Callable[[int], float], *, overlaps: bool = True) -> bool:
    """Whether a closed loop runs faster when the `num_waiting` requests wait
    `due_ms` for `num_returning` clients to come back and all go as one wave than
    when they start now and the others follow in the next, with `wave_ms` as `t`:
    the loop's turn takes `due + t(q + k)` one way, and the other
    `max(t(q), due) + t(k)` where the first wave runs while the others come back
    (`overlaps`: the forward runs on an accelerator, or on CPUs the front end does
    not need), `t(q) + due + t(k)` where it does not: the front end that reads the
    returning requests (and answers the wave before) needs the CPUs the wave runs on,
    so each slows the other down (measured on 2 CPUs, tiny-sd 64x64, 16 clients:
    waves of 1 and 15 in turn served ~60 images/s, one wave of 16 per turn ~80)."""
    q, k = num_waiting, num_returning
    if q < 1 or k < 1:
        return False
    first = max(wave_ms(q), due_ms) if overlaps else wave_ms(q) + due_ms
    return due_ms + wave_ms(q + k) < first + wave_ms(k)


def forward_overlaps_front_end(config: EngineConfig, info: PipelineInfo,
                               env: Mapping[str, str] | None = None) -> bool:
    """Whether a wave's forward leaves the front end (HTTP, encoding, this process)
    CPUs of its own: on an accelerator, or where the worker's CPUs or threads
    (`worker_cpus`, `torch_num_threads`, else the `OMP_NUM_THREADS` of `env`, the
    environment the worker inherits: this process' by default) are fewer than the CPUs
    this process may use. By default the worker takes them all."""
    if info.device != "cpu":
        return True
    usable = usable_cpu_count()
    worker = usable_cpu_count(parse_cpu_list(config.worker_cpus)) \
        if config.worker_cpus else usable
    env = os.environ if env is None else env
    threads = config.torch_num_threads or omp_num_threads(env) or worker
    return min(worker, threads) < usable


def load_capacity(rate_per_s: float, wave_ms: Callable[[int], float], capacity: int) -> int:
    """The ladder size (1, 2, 4, ... below `capacity`) with the shortest expected time
    in the system at `rate_per_s`, `wave_ms(L) / (1 - rho)` with
    `rho = rate_per_s * wave_ms(L) / L`, among those with `rho <= 1 / LOAD_HEADROOM`
    (module docstring); `capacity` when none qualifies or the capacity itself would
    answer sooner."""
    def time_in_system_ms(size: int) -> float:
        """inf where `size` does not qualify (or nothing is known of it)."""
        ms = wave_ms(size)
        if not 0 < ms < math.inf:
            return math.inf
        busy = max(rate_per_s, 0.0) * ms / (1000.0 * size)
        qualifies = busy < 1.0 if size == capacity else busy * LOAD_HEADROOM <= 1.0
        return ms / (1.0 - busy) if qualifies else math.inf

    ladder = [1 << i for i in range(max(capacity - 1, 0).bit_length())]  # below capacity
    best_ms, best = min((time_in_system_ms(size), size) for size in [*ladder, capacity])
    return best if best_ms < math.inf else capacity  # ties went to the smaller size


def latency_sum_ms(num_waiting: int, wave_size: int, wave_ms: Callable[[int], float]) -> float:
    """The sum of `num_waiting` requests' times to their answers when they run in
    waves of `wave_size` (the last one smaller), one after another."""
    total, done, clock = 0.0, 0, 0.0
    while done < num_waiting:
        size = min(wave_size, num_waiting - done)
        clock += wave_ms(size)
        total += size * clock
        done += size
    return total


def wave_size_for_load(num_waiting: int, rate_per_s: float,
                       wave_ms: Callable[[int], float], capacity: int,
                       served_ms: Callable[[int], float] | None = None) -> int:
    """Most requests the next wave should take, with `num_waiting` waiting, arrivals
    at a sustained `rate_per_s`, the learned wave time `wave_ms(B)` and the wave time
    as served `served_ms(B)` (default: `wave_ms`): the load's size `L`
    (`load_capacity` on `served_ms`) where the module docstring's rule splits the
    backlog, else `capacity`."""
    if num_waiting <= 1 or capacity <= 1:
        return capacity
    size = load_capacity(rate_per_s, served_ms or wave_ms, capacity)
    if size >= min(num_waiting, capacity) or num_waiting > BACKLOG_FACTOR * size:
        return capacity
    split = latency_sum_ms(num_waiting, size, wave_ms)
    whole = latency_sum_ms(num_waiting, capacity, wave_ms)
    return size if split <= (1.0 - MIN_GAIN) * whole else capacity


class ArrivalRate:
    """Requests per second, from the gaps between arrival events; thread-safe.

    Requests added together (one `generate` call) are one event of several
    requests: a list of prompts does not look like a burst still arriving. A pause
    (a gap `NEW_STREAM_GAP_FACTOR` times the smoothed one that ends with the engine
    idle, or one `SUSTAINED_WINDOW_S` long) is not averaged in: the stream after it is
    measured afresh, its rate and its sustained rate.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: float | None = None
        self._gap_s_per_request: float | None = None
        self._stream_start: float | None = None  # the first arrival after the last pause
        self._after_quiet = False  # the last arrival came after a quiet window (or first)
        self._recent: deque[tuple[float, int]] = deque()  # (time, count), last window
        self._recent_count = 0
        self._lock = threading.Lock()

    def observe(self, count: int = 1, *, busy: bool = False) -> None:
        """`count` requests arrived now; `busy`: others were waiting or running (then a
        long gap before these is no pause, see `NEW_STREAM_GAP_FACTOR`)."""
        now = self.clock()
        with self._lock:
            if count > 0:
                self._after_quiet = (self._last is None
                                     or now - self._last >= SUSTAINED_WINDOW_S)
            if self._last is not None and count > 0:
                gap = (now - self._last) / count
                old = self._gap_s_per_request
                if now - self._last >= SUSTAINED_WINDOW_S or (
                        not busy and old is not None and gap > NEW_STREAM_GAP_FACTOR * old):
                    self._gap_s_per_request = None  # a pause: the next gap starts afresh
                    self._stream_start = now
                elif old is None:
                    self._gap_s_per_request = gap
                else:
                    self._gap_s_per_request = old + RATE_SMOOTHING * (gap - old)
            self._last = now
            if self._stream_start is None:
                self._stream_start = now
            if count > 0:
                self._recent.append((now, count))
                self._recent_count += count
                self._forget_before(now - SUSTAINED_WINDOW_S)

    def sustained_rate_per_s(self, min_span_s: float = MIN_SUSTAINED_SPAN_S) -> float:
        """Requests per second over the last `SUSTAINED_WINDOW_S`, or over the stream's
        age where it began after a pause less than that ago (at least `min_span_s`; by
        default `MIN_SUSTAINED_SPAN_S`: a burst, however dense, counts spread over a
        second or more, so it is no sustained load)."""
        now = self.clock()
        with self._lock:
            self._forget_before(now - SUSTAINED_WINDOW_S)
            start = self._stream_start
            if start is None or now - start >= SUSTAINED_WINDOW_S:
                return self._recent_count / SUSTAINED_WINDOW_S
            count = sum(n for at, n in self._recent if at >= start)
            return count / max(now - start, min_span_s)

    def came_after_quiet(self) -> bool:
        """Whether the last arrival event came after `SUSTAINED_WINDOW_S` without any,
        or was the first ever: an idle server's first request, of a stream whose rate
        nothing tells yet."""
        with self._lock:
            return self._after_quiet

    def is_sustained(self) -> bool:
        """Whether the stream has lasted `MIN_SUSTAINED_SPAN_S` since its last pause, so
        that `sustained_rate_per_s` measures a rate and not a burst's first requests
        spread over a second they have not lasted yet."""
        with self._lock:
            start = self._stream_start
        return start is not None and self.clock() - start >= MIN_SUSTAINED_SPAN_S

    def _forget_before(self, since: float) -> None:
        """(Holding the lock.)"""
        while self._recent and self._recent[0][0] < since:
            self._recent_count -= self._recent.popleft()[1]

    def rate_per_s(self) -> float:
        """The smoothed rate, lowered when the time since the last arrival says the
        stream has slowed down (0 until two arrival events were seen)."""
        with self._lock:
            gap, last = self._gap_s_per_request, self._last
        if gap is None or last is None:
            return 0.0
        idle = self.clock() - last
        return 1.0 / max(gap, idle, 1e-6)


class BatchPolicy:
    """Capacity and admission wait per batch key, fixed or learned; thread-safe.

    Args:
        config: the engine's config (`max_num_seqs`, `request_batch_max_wait_ms`,
            their "auto" values and the auto limit).
        info: the loaded pipeline's info (its default shape seeds the cost model).
        supports_request_batch: False pins the capacity to 1.
        limit: the largest wave "auto" may choose (the config's limit, or what
            memory allows, whichever is smaller).
        overlaps: whether a forward runs beside the front end's work without either
            slowing the other (`holding_pays`); None: `forward_overlaps_front_end`.
    """

    def __init__(
        self, config: EngineConfig, info: PipelineInfo, *, supports_request_batch: bool,
        limit: int | None = None, clock: Callable[[], float] = time.monotonic,
        overlaps: bool | None = None,
    ) -> None:
        self.config = config
        self.overlaps = forward_overlaps_front_end(config, info) if overlaps is None \
            else overlaps
        self.batching = supports_request_batch
        self.limit = 1 if not supports_request_batch else max(1, limit or config.capacity_limit)
        self.default_shape = Shape(info.default_height, info.default_width, 1,
                                   info.cfg_threshold is not None
                                   and info.default_guidance_scale > info.cfg_threshold)
        self.cost = WaveCostModel(self.limit, self.default_shape, clock)
        # step mode: one step of a running batch of B requests (its fused denoiser
        # call), learned from the ticks; the calibration's wave curve stands in until it
        # knows two sizes of a shape
        self.step_cost = WaveCostModel(self.limit, self.default_shape, clock)
        self.arrivals = ArrivalRate(clock)
        self.returns = ReturningClients(clock)  # a closed loop's clients, expected back
        self._last_wait_ms: dict[str, float] = {}  # shape label -> last planned wait
        self._tick_ms: dict[Shape, deque[float]] = {}  # step mode: recent tick times
        # since when a backlog of the shape has stood beyond its next trial size
        self._deep_backlog_since: dict[Shape, float] = {}
        # the trial size the last admission wait of the shape held a closed loop for
        self._trial_holds: dict[Shape, int] = {}
        self._clock = clock
        self._lock = threading.Lock()
        # Waves teach the cost model only once the engine serves: the warm-up wave
        # (first call, cold caches) would skew it.
        self.serving = False

    @property
    def learns(self) -> bool:
        """Whether anything here is "auto" and has a choice to make (then waves feed
        the cost model); a capacity of 1 leaves nothing to learn."""
        return self.batching and self.limit > 1 and (
            self.config.auto_capacity or self.config.auto_wait)

    def set_limit(self, limit: int) -> None:
        """Lower the auto limit (e.g. to what memory allows, found by calibration)."""
        self.limit = max(1, min(self.limit, limit))
        self.cost.limit = self.step_cost.limit = self.limit

    # -- capacity ------------------------------------------------------------------
    def capacity(self, key: SamplingParamsKey | None, num_waiting: int = 0) -> int:
        """Most requests in the next wave of `key`, with `num_waiting` requests waiting.

        The learned capacity, or the smaller size the sustained load needs where
        splitting the backlog pays (`wave_size_for_load`; no trial runs then: the load
        does not need more throughput). With a backlog beyond the capacity, a wave of
        the next untried doubling (`WaveCostModel.next_size_to_try`) measures whether it
        pays, so the curve keeps learning: once a backlog beyond the trial size has
        outlasted `SUSTAINED_BACKLOG_WAVES` waves of the capacity (a sustained
        overload, where the throughput the trial may find is worth its latency). A
        backlog no bigger than the trial runs in waves of the capacity: a trial of all
        of it would answer its first half a wave later (a burst of 64 at capacity 16 on
        tiny-sd 128x128 ran as 16, 16 and a trial of 32 that took 1.2-1.8 s, where a
        third wave of 16 answers half of those 32 requests 0.6-0.9 s sooner, for a
        wave ~3% cheaper per image; a load the capacity cannot keep up with grows its
        backlog beyond the trial size, and a closed loop's trial is held for by
        `_hold_for_returning`).
        """
        capacity = self._learned_capacity(key)
        if key is None or not self.batching or not self.config.auto_capacity:
            return capacity
        shape = Shape.of(key)
        wave_ms = self._wave_ms(shape, key.num_denoising_steps)
        # (the scheduler asks on every check of a forming wave: a lone request, the
        # common case at low load, is answered without reading the arrival window).
        # A stream younger than `MIN_SUSTAINED_SPAN_S` has no sustained rate to size
        # waves by: its count spread over a second reads a burst's first requests as
        # a light load, and the load rule would split them (measured on tiny-sd 64x64,
        # 32 or 64 requests at once on an idle server: a wave of 4 went ahead of the
        # waves of 16-32 while the rest were still arriving, every burst).
        size = capacity if num_waiting <= 1 or not self.arrivals.is_sustained() \
            else wave_size_for_load(
            num_waiting, self.arrivals.sustained_rate_per_s(), wave_ms, capacity,
            self._served_ms(shape, key.num_denoising_steps, wave_ms))
        now = self._clock()
        if size < capacity:  # the load needs less than the capacity: no trial either
            with self._lock:
                self._deep_backlog_since.pop(shape, None)
            return size
        steps = key.num_denoising_steps
        trial = self.cost.next_size_to_try(shape, steps) if num_waiting > capacity else None
        with self._lock:
            # held: the admission wait held for a closed loop's clients to run this trial
            held = trial is not None and self._trial_holds.get(shape) == trial
            if not held:
                if trial is None or num_waiting <= trial:
                    self._deep_backlog_since.pop(shape, None)
                    return capacity
                since = self._deep_backlog_since.setdefault(shape, now)
        if not held:
            capacity_ms = wave_ms(capacity)
            if math.isfinite(capacity_ms) and (
                    (now - since) * 1000.0 < SUSTAINED_BACKLOG_WAVES * capacity_ms):
                return capacity
        self.cost.begin_trial(shape, trial, steps)  # (outside this policy's lock)
        return trial

    def _wave_ms(self, shape: Shape, steps: int) -> Callable[[int], float]:
        """The learned wave time of `shape` at `steps` by size (inf where nothing is
        known)."""
        def wave_ms(size: int) -> float:
            estimate = self.cost.estimate_ms(shape, size, steps)
            return math.inf if estimate is None else estimate
        return wave_ms

    def _served_ms(self, shape: Shape, steps: int,
                   wave_ms: Callable[[int], float]) -> Callable[[int], float]:
        """The wave time of `shape` at `steps` by size as served waves measured it,
        the learned curve's (`wave_ms`) where too few served waves of about that size
        ran yet (a size the load rule picks is then served, measured and dropped if it
        does not deliver)."""
        def served_ms(size: int) -> float:
            estimate = self.cost.served_estimate_ms(shape, size, steps)
            return wave_ms(size) if estimate is None else estimate
        return served_ms

    def _learned_capacity(self, key: SamplingParamsKey | None) -> int:
        """The capacity of `key` itself, with no trial wave."""
        if not self.batching:
            return 1
        if not self.config.auto_capacity:
            return self.config.capacity_limit
        if key is None:
            return self.limit
        # (step mode's keys carry no step count: 0, the curve the shape is known best at)
        return self.cost.capacity(Shape.of(key), key.num_denoising_steps or None)

    def step_capacity(self, key: SamplingParamsKey | None, demand: int = 0) -> int:
        """Step mode: most requests in the running batch of `key`, with `demand`
        requests of it running or waiting.

        A tick is one step of the batch, so the capacity rule of the wave curve holds
        for the tick curve (`step_cost`: batch size -> tick time, from the ticks
        themselves). Until that curve knows two sizes of the shape, the calibration's
        wave curve decides. With more demand than the capacity, the next doubling the
        tick curve has not measured `MIN_SAMPLES` times is tried, as waves do: a
        calibration that ran on a busy machine cannot pin the batch small for good.
        """
        if not self.batching:
            return 1
        if not self.config.auto_capacity:
            return self.config.capacity_limit
        if key is None:
            return self.limit
        shape = Shape.of(key)
        learned = self._step_curve(shape)
        capacity = learned.capacity(shape)
        if demand <= capacity:
            return capacity
        if learned is self.step_cost:
            trial = self.step_cost.next_size_to_try(shape)
        else:
            trial = capacity * 2
            if trial > self.limit or self.step_cost.num_samples(shape, trial) >= MIN_SAMPLES:
                trial = None
        if trial is not None and trial > capacity:
            self.step_cost.begin_trial(shape, trial)
            return min(trial, demand)
        return capacity

    def _step_curve(self, shape: Shape) -> WaveCostModel:
        """The curve step mode's capacity of `shape` comes from: the tick curve once it
        knows two batch sizes, the calibration's wave curve before."""
        return self.step_cost if self.step_cost.num_sizes(shape) >= 2 else self.cost

    # -- admission wait --------------------------------------------------------------
    def plan_wait(
        self, key: SamplingParamsKey | None, num_waiting: int, num_incoming: int = 0
    ) -> WaitPlan:
        """What the admission wait should do with `num_waiting` requests of `key` idle
        and `num_incoming` announced ones still on their way (see `ArrivalNotice`)."""
        capacity = self._learned_capacity(key)
        if not self.batching or capacity <= 1:
            return WaitPlan.start_now(1)
        wait = self.config.request_batch_max_wait_ms
        if not self.config.auto_wait:
            fixed = float(wait)
            return self._planned(key, WaitPlan(
                target=capacity, max_wait_ms=fixed,
                stable_window_ms=min(MAX_STABLE_WINDOW_MS, fixed / 5.0)))
        if key is None:
            return WaitPlan.start_now(num_waiting)
        shape = Shape.of(key)
        wave_ms = self._wave_ms(shape, key.num_denoising_steps)
        one = wave_ms(1)
        if not math.isfinite(one):  # nothing learned yet: no grounds to wait
            return WaitPlan.start_now(num_waiting)
        bound = min(one, MAX_WAIT_MS)
        rate = self.arrivals.rate_per_s()
        if self._busy_with_a_steady_stream(rate, wave_ms(capacity) / capacity):
            # the queue refills while each wave runs, and a worker idle in a wait delays
            # everything behind it: start now (as a fixed wait of 0 does)
            plan = WaitPlan.start_now(num_waiting)
        else:
            plan = choose_wait(num_waiting, rate, wave_ms, capacity, wait_bound_ms=bound)
            # A burst already at the door: the first request's wave would otherwise
            # start alone and the rest wait for it to finish.
            plan = _hold_for(plan, num_waiting + num_incoming, capacity,
                             min(bound, INCOMING_WAIT_MS))
            if self.arrivals.came_after_quiet():
                # An idle server's first request: a burst may be right behind it.
                gap_ms = min(INCOMING_WAIT_MS, FIRST_REQUEST_HOLD_SHARE * one)
                # (it pays where a wave of one costs more than that wait beyond the
                # request's share of a full wave: two learned points, not the difference
                # of two noisy neighbours)
                if one - wave_ms(capacity) / capacity > gap_ms:
                    plan = _hold_for_a_burst(plan, capacity, bound, gap_ms)
        plan = self._hold_for_returning(plan, key, num_waiting, num_incoming, capacity,
                                        wave_ms, bound)
        return self._planned(key, plan)

    def _planned(self, key: SamplingParamsKey | None, plan: WaitPlan) -> WaitPlan:
        """`plan`, recorded as `key`'s last planned wait (metrics; nothing to record
        with fixed settings, whose snapshot is empty)."""
        if key is not None and self.learns:
            with self._lock:
                self._last_wait_ms[Shape.of(key).label(key.num_denoising_steps)] = \
                    plan.max_wait_ms
        return plan

    def _hold_for_returning(self, plan: WaitPlan, key: SamplingParamsKey, num_waiting: int,
                            num_incoming: int, capacity: int,
                            wave_ms: Callable[[int], float], bound_ms: float) -> WaitPlan:
        """`plan`, holding for the clients of a wave answered a moment ago that a
        closed loop sends right back (`diffbatch.engine.returning`), at any load:

        - where the loop is bigger than the capacity and the next doubling is untried
          (`WaveCostModel.next_size_to_try`), for a trial wave of that size. Such a
          loop never leaves a backlog beyond the capacity (its other clients are in
          the running wave or on their way back), so the trial a backlog would run
          never runs; what the trial finds decides from then on;
        - else up to the capacity, where one wave of them all turns the loop faster
          (`holding_pays`, both ways on the learned curve: served medians for some
          sizes and the curve's lower quartile for others would compare unlike
          numbers), or where that wave was measured fewer than `MIN_SAMPLES` times
          (as the trial rule, one slow wave is no ground to judge by: measured on
          `shapes`, a single wave of 16 slower per image than the 15s beside it kept
          a loop of 16 at waves of 1 and 15 for good).
        """
        shape, steps = Shape.of(key), key.num_denoising_steps
        with self._lock:
            self._trial_holds.pop(shape, None)
        # (nothing runs while the admission wait plans: the engine holds the waiting
        # requests; the announced ones are among those coming back, as below)
        returning = self.returns.expected(in_engine=num_waiting)
        if returning is None:
            return plan
        demand = num_waiting + max(num_incoming, returning.count)
        hold_ms = min(bound_ms, returning.window_left_ms)
        if self.config.auto_capacity and demand > capacity:
            trial = self.cost.next_size_to_try(shape, steps)
            if trial is not None and num_waiting < trial <= demand:
                with self._lock:  # (`capacity` then sizes the wave for the trial)
                    self._trial_holds[shape] = trial
                return _hold_for(plan, trial, trial, hold_ms)
        target = min(capacity, demand)
        if target <= num_waiting:
            return plan
        if (self.cost.num_samples(shape, target, steps) < MIN_SAMPLES
                or holding_pays(num_waiting, target - num_waiting, returning.due_ms, wave_ms,
                                overlaps=self.overlaps)):
            return _hold_for(plan, target, capacity, hold_ms)
        return plan

    def _busy_with_a_steady_stream(self, rate_per_s: float, per_image_ms: float) -> bool:
        """Whether the arrivals of the last `SUSTAINED_WINDOW_S` would keep the worker
        busy `BUSY_UTILIZATION` of the time or more at `per_image_ms`, and come no faster
        now than `BURST_RATE_FACTOR` times their rate (faster: a burst, whose rest is
        milliseconds away)."""
        sustained = self.arrivals.sustained_rate_per_s()
        return (sustained * per_image_ms / 1000.0 >= BUSY_UTILIZATION
                and rate_per_s < BURST_RATE_FACTOR * sustained)

    # -- learning --------------------------------------------------------------------
    def observe_arrivals(self, count: int, *, busy: bool = False) -> None:
        """`count` requests arrived together, `busy`: with others waiting or running;
        only while serving (the start-up warm-up request is no arrival: a first request
        right after it would look like a burst and wait for followers that never
        come)."""
        if self.serving:
            self.arrivals.observe(count, busy=busy)
            self.returns.arrived(count)

    def observe_answers(self, count: int, in_engine: int | None = None) -> None:
        """A wave's `count` requests were answered just now (while serving); the engine
        held `in_engine` requests right before (these included; None: not counted).

        The steady stream a loop's returns are told from is the arrivals' rate over
        the stream's own age, however young (down to one return window): spread over
        the second a load rule counts a young stream's arrivals over, an open stream's
        first waves at 48/s read as 15/s and their answers as a loop's, twice in a row
        (measured, tiny-sd 64x64)."""
        if self.serving:
            self.returns.answered(count, self.arrivals.sustained_rate_per_s(
                min_span_s=MAX_RETURN_WINDOW_MS / 1000.0), in_engine)

    def observe_wave(self, key: SamplingParamsKey | None, size: int, forward_ms: float,
                     num_forwards: int = 1) -> None:
        """Feed one finished wave to the cost model (only clean single-forward waves).

        Fixed settings learn too: the curve is also what a wave's stall bound is
        measured against (`stall_bound_s`).
        """
        if key is None or num_forwards != 1 or not self.serving:
            return
        shape = Shape.of(key)
        with self._lock:
            if self._trial_holds.get(shape, size + 1) <= size:
                del self._trial_holds[shape]  # the held-for trial ran
        self.cost.observe(shape, size, key.num_denoising_steps, forward_ms, served=True)

    # -- stalls ----------------------------------------------------------------------
    def stall_bound_s(self, key: SamplingParamsKey | None, size: int) -> float | None:
        """How long a wave of `size` requests of `key` may run before its worker counts
        as stuck: `wave_stall_factor` x its expected forward time, and at least
        `worker_stall_timeout_s`; None (no bound, the heartbeat alone watches the
        worker) when the factor or the timeout is 0 or nothing is expected yet.

        NOTE: the expectation comes from the shape's own curve only, never from the
        default shape's scaled by pixels: attention grows faster than the pixel count,
        so a first 2048x2048 wave would look stuck. Waves of a measured shape at an
        unmeasured size or step count are estimated from the curve, which extrapolates
        to larger waves with no batching gain (an over-estimate, so the bound errs long).
        """
        if key is None:
            return None
        return self._stall_bound_s(self.cost.estimate_ms(
            Shape.of(key), size, key.num_denoising_steps, proxy=False))

    def _stall_bound_s(self, expected_ms: float | None) -> float | None:
        """`wave_stall_factor` x `expected_ms`, at least `worker_stall_timeout_s`; None
        when either is 0 or nothing is expected."""
        factor, floor_s = self.config.wave_stall_factor, self.config.worker_stall_timeout_s
        if expected_ms is None or factor <= 0 or floor_s <= 0:
            return None
        return max(factor * expected_ms / 1000.0, floor_s)

    def observe_tick(self, key: SamplingParamsKey | None, tick: TickStats) -> None:
        """Step mode: one tick of a running batch of `key`. Its whole time bounds the
        stall; its fused denoiser call's time teaches the tick curve. That leaves out
        the joiners' text encoding and the leavers' decoding, so every tick teaches,
        also when each has joins and leaves (requests of one or two steps)."""
        if key is None or not self.serving or tick.batch_size < 1:
            return
        shape = Shape.of(key)
        with self._lock:
            ticks = self._tick_ms.setdefault(shape, deque(maxlen=TICKS_KEPT))
            ticks.append(tick.step_ms)
        if self.learns and tick.forward_ms > 0:
            self.step_cost.observe(shape, tick.batch_size, 1, tick.forward_ms)

    def step_stall_bound_s(self, key: SamplingParamsKey | None, size: int) -> float | None:
        """Step mode: how long a running batch of `key` (up to `size` requests) may go
        without finishing a step before its worker counts as stuck:
        `wave_stall_factor` x the expected step time, and at least
        `worker_stall_timeout_s`; None when the factor or the timeout is 0 or nothing
        is expected yet (as `stall_bound_s`).

        The expected step time is the longer of the shape's longest recent tick (a tick
        includes the joiners' text encoding and the leavers' decoding) and one step of
        a wave of `size` on the shape's own learned curve: both err long.
        """
        if key is None:
            return None
        shape = Shape.of(key)
        with self._lock:
            ticks = self._tick_ms.get(shape)
            longest_tick = max(ticks) if ticks else None
        one_step = self.cost.estimate_ms(shape, size, 1, proxy=False)
        known = [ms for ms in (longest_tick, one_step) if ms is not None]
        return self._stall_bound_s(max(known) if known else None)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per curve (shape and step count, e.g. "64x64/s4/n1/cfg"): per-image ms by
        wave size (the curve's, and served waves' median), capacity, last planned wait
        (metrics); empty with fixed settings (the curve decides nothing there)."""
        if not self.learns:
            return {}
        with self._lock:
            waits = dict(self._last_wait_ms)
        per_image = self.cost.per_image_ms()
        served = self.cost.served_per_image_ms()
        out: dict[str, dict[str, object]] = {}
        for shape, steps in self.cost.curves():
            label = shape.label(steps)
            learned = self._step_curve(shape)  # step mode: the tick curve, once it knows
            capacity = (learned.capacity(shape) if learned is self.step_cost
                        else self.cost.capacity(shape, steps))
            out[label] = {"per_image_ms": per_image[label],
                          "served_per_image_ms": served.get(label, {}),
                          "capacity": capacity,
                          "wait_ms": waits.get(label, 0.0)}
        return out


__all__ = ["MAX_WAIT_MS", "ArrivalRate", "BatchPolicy", "WaitPlan", "choose_wait",
           "load_capacity", "wave_size_for_load"]
