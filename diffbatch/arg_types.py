"""argparse value types shared by every `diffbatch` subcommand.

Each parses one flag value and fails with "must be <rule>, got <value>", the same
wording the engine's own validation uses.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from diffbatch.cpus import parse_cpu_list


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= `low`."""
    return _int_in(low, None, f"an integer >= {low}")


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high`, both included."""
    return _int_in(low, high, f"an integer between {low} and {high}")


def _int_in(low: int, high: int | None, rule: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


def float_at_least(low: float, *, strict: bool) -> Callable[[str], float]:
    """A finite number >= `low` (> `low` when `strict`)."""
    rule = f"> {low:g}" if strict else f">= {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {rule}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be a finite number {rule}, got {text}")
        return value

    return parse


def port(text: str) -> int:
    """A TCP port, 0-65535."""
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {value}")
    return value


def directory(text: str) -> str:
    """An existing directory, made absolute."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be an existing directory, got {text!r}")
    return os.path.abspath(text)


def cpu_list(text: str) -> str:
    """A CPU list in `taskset -c` syntax ("1", "0-3,6"); kept as text."""
    try:
        parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def http_url(text: str) -> str:
    """An absolute http(s) URL, e.g. "https://img.example.com/api"."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"must be an absolute http:// or https:// URL, got {text!r}")
    return text.rstrip("/")
