"""How long a wave or a step may take before its worker counts as stuck: `StallBounds`.

A bound is `wave_stall_factor` x the expected time, at least `worker_stall_timeout_s`;
None (the heartbeat alone watches the worker) when either is 0 or nothing is
expected yet. The expectation comes from the learned cost curve of the shape itself,
never the default shape's scaled by pixels: attention grows faster than the pixel
count, so a first large wave would look stuck. Beyond its measured sizes the curve
assumes no batching gain, so the bound errs long.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from diffbatch.engine.cost_model import WINDOW, Shape

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.engine.cost_model import WaveCostModel
    from diffbatch.sampling_params import SamplingParamsKey


class StallBounds:
    """Stall bounds of waves (request mode) and steps (step mode); thread-safe."""

    def __init__(self, config: EngineConfig, cost: WaveCostModel) -> None:
        self.config = config
        self.cost = cost  # the learned wave curve
        self._tick_ms: dict[Shape, deque[float]] = {}  # step mode: recent tick times
        self._lock = threading.Lock()

    def observe_tick(self, shape: Shape, step_ms: float) -> None:
        """Step mode: a tick of a running batch of `shape` took `step_ms` in all (the
        joiners' encoding and the leavers' decoding included)."""
        with self._lock:
            self._tick_ms.setdefault(shape, deque(maxlen=WINDOW)).append(step_ms)

    def wave_s(self, key: SamplingParamsKey | None, size: int) -> float | None:
        """The bound of a wave of `size` requests of `key`."""
        if key is None:
            return None
        return self._bound_s(self.cost.estimate_ms(
            Shape.of(key), size, key.num_denoising_steps, proxy=False))

    def step_s(self, key: SamplingParamsKey | None, size: int) -> float | None:
        """Step mode: the bound of one step of a running batch of up to `size` requests
        of `key`, from the longer of the shape's longest recent tick and one step of a
        wave of `size` on its curve."""
        if key is None:
            return None
        shape = Shape.of(key)
        with self._lock:
            ticks = self._tick_ms.get(shape)
            longest = max(ticks) if ticks else None
        one_step = self.cost.estimate_ms(shape, size, 1, proxy=False)
        known = [ms for ms in (longest, one_step) if ms is not None]
        return self._bound_s(max(known) if known else None)

    def _bound_s(self, expected_ms: float | None) -> float | None:
        factor, floor_s = self.config.wave_stall_factor, self.config.worker_stall_timeout_s
        if expected_ms is None or factor <= 0 or floor_s <= 0:
            return None
        return max(factor * expected_ms / 1000.0, floor_s)


__all__ = ["StallBounds"]
