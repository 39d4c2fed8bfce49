"""argparse value types for the flags that are not engine options (server, bench, Ray).

Each is a `diffbatch.options` rule used as an argparse `type=`, so every flag fails
with the wording the engine's own validation uses: "must be <rule>, got <value>".
The engine's flags are generated from `EngineConfig` with the same rules.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from diffbatch.options import CpuList, Directory, FloatRange, IntRange, argparse_type


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= `low`."""
    return argparse_type(IntRange(low))


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high`, both included."""
    return argparse_type(IntRange(low, high))


def float_at_least(low: float, *, strict: bool) -> Callable[[str], float]:
    """A finite number >= `low` (> `low` when `strict`)."""
    return argparse_type(FloatRange(low, strict=strict))


port = argparse_type(IntRange(0, 65535))  # a TCP port
directory = argparse_type(Directory())  # an existing directory, made absolute
cpu_list = argparse_type(CpuList())  # a CPU list in `taskset -c` syntax, kept as text


def http_url(text: str) -> str:
    """An absolute http(s) URL, e.g. "https://img.example.com/api"."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"must be an absolute http:// or https:// URL, got {text!r}")
    return text.rstrip("/")
