"""Capacity units: how much of a batch's capacity one request takes.

A wave (request mode) or a running batch (step mode) holds up to its capacity, counted
in requests; under a size-free key (mixed resolution, `SamplingParamsKey.any_size`) a
request takes instead its pixels over the key's reference size (the model's default,
the size the capacity is learned at), so a batch of mixed sizes is bounded by its
pixels: a 128x128 request takes 4 units on a 64x64 model. Either way a batch holds at
most `max_requests` requests, and an empty batch always takes one. The scheduler forms
waves and picks joiners with `may_take`; the worker admits joiners with it too, so
both sides of step mode count the same units.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffbatch.sampling_params import SamplingParams, SamplingParamsKey


def capacity_units(params: SamplingParams, key: SamplingParamsKey | None) -> float:
    """Units a request with `params` takes in a batch of `key`: 1, or under a size-free
    key its pixels over the key's reference size (None: no key, counted as sized)."""
    if key is None or not key.any_size or params.height is None or params.width is None:
        return 1.0
    return params.height * params.width / (key.height * key.width)


def batch_units(params: Iterable[SamplingParams], key: SamplingParamsKey | None) -> float:
    """Units of a batch of `key` holding requests with `params` (their count when
    `key` is sized)."""
    return sum(capacity_units(p, key) for p in params)


def rounded_units(params: Collection[SamplingParams], key: SamplingParamsKey | None) -> int:
    """A batch's units as a whole size (what the policy's curve is keyed by): its
    number of requests under a sized key, else its units rounded, at least 1; 0 for
    an empty batch."""
    if not params:
        return 0
    if key is None or not key.any_size:
        return len(params)
    return max(1, round(batch_units(params, key)))


def may_take(num_held: int, held: Iterable[SamplingParams], candidate: SamplingParams,
             key: SamplingParamsKey | None, limit: float, max_requests: int) -> bool:
    """Whether a batch of `key` holding `num_held` requests with params `held` may take
    `candidate` too: an empty one always; else while it stays within `limit` units
    (requests, when `key` is sized) and, under a size-free key, `max_requests`
    requests. `held` is only read under a size-free key (pass a generator)."""
    if num_held == 0:
        return True
    if key is None or not key.any_size:
        return num_held < limit
    if num_held >= max_requests:
        return False
    return batch_units(held, key) + capacity_units(candidate, key) <= limit + 1e-9


__all__ = ["batch_units", "capacity_units", "may_take", "rounded_units"]
