"""Clients that send their next request as soon as they are answered: `ReturningClients`.

A closed loop of clients (a benchmark's `--max-concurrency`, a pool of workers that
each send their next request when the last is answered, a page that regenerates)
comes back right after each wave's answers, in a clump. When the loop holds about as
many clients as a wave, the engine is idle when the first of them comes back, and
without a reason to wait it starts that one alone while the others are still being
answered; they then wait for it, run as the next wave, and the pattern repeats: waves
of 1 and 15 in turn instead of 16 on `shapes` at 64x64 with 16 clients.

`ReturningClients` records, after each wave is answered, the arrivals of the next
`MAX_RETURN_WINDOW_MS` (up to the wave's size) and how long after the answers they
came. A wave's clients came back when those arrivals are at least `MIN_RETURN_SHARE`
of the wave and clearly more than the steady stream alone brings in the time they
took (`CROWD_FACTOR` times its mean, plus one: an open stream of arrivals has no
reason to crowd after answers; a wave smaller than that tells nothing either way). When the last
`ANSWERS_KEPT` waves that could tell all came back, the clients of the newest one
that have not come back yet are expected: due when the loop's clients were back
lately (the longest of those waves' times), and worth waiting for until
`RETURN_SLACK` times that. Whether waiting for them pays is the admission wait's
call (`BatchPolicy.plan_wait`). A loop that stops coming back costs at most one
window before the next answered wave shows it, and `UNTOLD_WAVES_FORGET` waves in a
row that tell nothing (an open stream's small waves) forget what came before them.

A loop near saturation often cannot show itself that way: its steady rate is its own
throughput, and clients that take half a turn to come back are no denser than that
rate's stream (16 clients answered every ~200 ms and back over ~100 ms read as 80/s
for 100 ms: 8 expected, `CROWD_FACTOR` asks for 25). Split into two cohorts (waves of
12 and 4 in turn, each running while the other comes back), none of its waves tells,
and the split lasts. Such a loop shows itself by its size instead: a fixed number of
clients, each with at most one request in the engine, never has more requests in the
engine than it has clients, and has them all there whenever none is on its way back.
So the engine also records how many requests it held when each wave was answered;
when over the last `POPULATION_WAVES` answers that number never went above `N` and
was `N` at least `POPULATION_HITS` times, one of them among the last two (`N` at
least `MIN_POPULATION`; a loop's cohorts take turns, and a count that no longer comes
back to `N` is a loop that has gone), the clients
are a closed population of `N`, and those not in the engine are expected back, due
as arrivals after answers came lately (`RETURN_QUANTILE` of their lags). An open
stream's count at its answers wanders with the queue (by the spread of Poisson
counts, arrivals at 5 per wave time reach their maximum of eight answers once or
twice; an estimate, not a measurement), and one that overloads the engine grows it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# The longest a wave's clients may take to come back and still count as a loop.
# Measured on 2 cores (`shapes` 64x64, 16 clients, answers as b64 PNG, a machine
# running at half its speed): the arrivals came 15-105 ms after their wave ended
# (5th to 95th percentile).
MAX_RETURN_WINDOW_MS = 250.0
ANSWERS_KEPT = 2  # this many answered waves in a row must show the loop
# This many answered waves in a row that tell nothing (too small to tell, or answered
# again before their clients were back) forget what the waves before them showed. An
# open stream's waves mostly tell nothing, and now and then one of them passes for a
# loop by chance (a few of its arrivals close together right after the answers): a
# verdict kept across them would make two such chances, however far apart, a loop
# for good, and hold every wave after them for clients that are no loop's (measured:
# Poisson arrivals at 48/s on tiny-sd 64x64, every wait of a 5 s run held 38 ms for
# them, waves of 10 where 4 keep up). A real loop's telling waves come every other
# wave at worst (waves of 1 and 15 in turn).
UNTOLD_WAVES_FORGET = 3
MIN_RETURN_SHARE = 0.5  # of a wave's requests, back within the window
# A crowd is at least this many times the steady stream's mean count, plus one. At 2,
# a Poisson stream at 12/s on `shapes` (waves of 4-8, near saturation) passed for a
# loop twice in a row about once in 40 waves (measured: 3-7 of 209 arrivals found
# clients expected back); at 3 a wave of 8 needs 5 arrivals where 1.2 are expected.
CROWD_FACTOR = 3.0
RETURN_SLACK = 1.5  # the expected clients are waited for this times as long as the
# loop's clients took to come back lately
POPULATION_WAVES = 8  # answers whose count of requests in the engine shows a population
POPULATION_HITS = 4  # of them with the population's every client in the engine
MIN_POPULATION = 4  # a smaller loop loses little to a split, and pins its count by chance
LAGS_KEPT = 64  # arrivals after answers whose lags give a population's return time
MIN_LAGS = 4  # a population's return time goes by at least this many of them
RETURN_QUANTILE = 0.9  # of those lags: when a population's clients are all back


@dataclass(frozen=True)
class Returning:
    """Answered clients expected back now."""

    count: int
    due_ms: float  # when they should all be back, from now (as the loop's were lately)
    window_left_ms: float  # how long they may still be waited for


@dataclass
class _Answer:
    """One answered wave and the arrivals after it so far."""

    at: float  # clock seconds
    size: int
    steady_rate_per_s: float  # of the arrivals lately: what comes without any loop
    lags_s: list[float] = field(default_factory=list)  # of arrivals after it, <= size

    def span_s(self) -> float:
        """How long after the answers the arrivals counted came."""
        return self.lags_s[-1] if self.lags_s else MAX_RETURN_WINDOW_MS / 1000.0

    def came_back(self) -> bool | None:
        """Whether its clients came back; None when the wave is too small to tell
        them from the steady stream."""
        crowd = CROWD_FACTOR * self.steady_rate_per_s * self.span_s() + 1.0
        if self.size < crowd:
            return None
        return len(self.lags_s) >= max(MIN_RETURN_SHARE * self.size, crowd)


class ReturningClients:
    """Which answered clients are expected back now; thread-safe (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: _Answer | None = None
        # (came back?, how long it took) of the last answered waves that could tell
        self._seen: deque[tuple[bool, float]] = deque(maxlen=ANSWERS_KEPT)
        self._untold = 0  # answered waves in a row since the last that could tell
        # requests in the engine at each of the last answers (the population test)
        self._in_engine: deque[int] = deque(maxlen=POPULATION_WAVES)
        # how long after the last answers the arrivals within their windows came
        self._lags_s: deque[float] = deque(maxlen=LAGS_KEPT)
        self._lock = threading.Lock()

    def answered(self, size: int, steady_rate_per_s: float,
                 in_engine: int | None = None) -> None:
        """A wave of `size` requests was answered now; `steady_rate_per_s`: the arrival
        rate sustained lately; `in_engine`: the requests the engine held right before
        the answers (waiting, running and these), None where not counted."""
        if size < 1:
            return
        with self._lock:
            now = self._clock()
            self._settle(now)
            self._last = _Answer(now, size, steady_rate_per_s)
            if in_engine is not None:
                self._in_engine.append(in_engine)

    def arrived(self, count: int) -> None:
        """`count` requests arrived now."""
        with self._lock:
            last = self._last
            now = self._clock()
            if last is not None and now - last.at < MAX_RETURN_WINDOW_MS / 1000.0:
                room = last.size - len(last.lags_s)
                last.lags_s.extend([now - last.at] * min(count, room))
                self._lags_s.extend([now - last.at] * min(count, LAGS_KEPT))

    def population(self) -> int | None:
        """The number of clients of a closed loop the engine's counts at its last
        answers show (module docstring), or None."""
        with self._lock:
            return self._population()

    def _population(self) -> int | None:
        """(Holding the lock.)"""
        counts = self._in_engine
        if len(counts) < POPULATION_WAVES:
            return None
        size = max(counts)
        if size < MIN_POPULATION or counts.count(size) < POPULATION_HITS \
                or size not in (counts[-1], counts[-2]):
            return None  # (not lately: the loop has gone, an open stream follows it)
        return size

    def expected(self, in_engine: int | None = None) -> Returning | None:
        """The answered clients still expected back, if any; `in_engine`: the requests
        the engine holds now (a closed population's others are expected back)."""
        with self._lock:
            last = self._last
            if last is None:
                return None
            if not all(came_back for came_back, _ in self._seen):
                return None  # a wave that could tell showed no loop
            if len(self._seen) < ANSWERS_KEPT:
                return self._population_expected(last, in_engine)
            back_s = max(span for _, span in self._seen)
            return self._due(last, last.size - len(last.lags_s), back_s)

    def _population_expected(self, last: _Answer, in_engine: int | None) -> Returning | None:
        """(Holding the lock.) The clients of a closed population not in the engine, due
        as the arrivals after answers came lately."""
        size = self._population()
        if size is None or in_engine is None or len(self._lags_s) < MIN_LAGS:
            return None
        lags = sorted(self._lags_s)
        back_s = lags[min(len(lags) - 1, int(RETURN_QUANTILE * len(lags)))]
        return self._due(last, size - in_engine, back_s)

    def _due(self, last: _Answer, count: int, back_s: float) -> Returning | None:
        """(Holding the lock.) `count` clients expected back `back_s` after `last`'s
        answers, waited for until `RETURN_SLACK` times that; None when there are none
        or that window has closed."""
        elapsed_s = self._clock() - last.at
        window_s = min(RETURN_SLACK * back_s, MAX_RETURN_WINDOW_MS / 1000.0)
        if count <= 0 or elapsed_s >= window_s:
            return None
        return Returning(count, due_ms=1000.0 * max(back_s - elapsed_s, 0.0),
                         window_left_ms=1000.0 * (window_s - elapsed_s))

    def _settle(self, now: float) -> None:
        """(Holding the lock.) Record whether the last answered wave's clients came
        back. One answered again before its window closed and before all its clients
        were back tells nothing either way, nor does one too small to tell; after
        `UNTOLD_WAVES_FORGET` of those in a row, what earlier waves showed is
        forgotten."""
        last = self._last
        if last is None:
            return
        complete = len(last.lags_s) >= last.size
        came_back = (None if not complete and now - last.at < MAX_RETURN_WINDOW_MS / 1000.0
                     else last.came_back())
        if came_back is not None:
            self._seen.append((came_back, last.span_s()))
            self._untold = 0
            return
        self._untold += 1
        if self._untold >= UNTOLD_WAVES_FORGET:
            self._seen.clear()
