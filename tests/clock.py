"""A clock the test moves by hand, for code that takes a `clock` callable."""

from __future__ import annotations


class ManualClock:
    """Returns `now`, which only the test changes (`clock.now += 1.5`)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
