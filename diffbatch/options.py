"""Rules for option values: one object parses a flag's text and checks a given value.

`EngineConfig` declares each field's rule once (`option(...)` in its field
metadata). The same rule checks a value given in Python (`Engine(max_num_seqs=0)`),
parses a command-line flag (`--max-num-seqs 0`) and converts a Ray Serve builder
string (`max_num_seqs=0`), so all three say the same thing: "`max_num_seqs` must be
'auto' or an integer >= 1, got 0".

    Rule
    ├── IntRange, FloatRange    numbers with bounds (bool is never a number here)
    ├── OneOf                   a closed set of strings
    ├── Text, CpuList, Directory
    ├── TorchName               a torch device or dtype, by name or as the object
    ├── Flag                    a boolean
    ├── Optional(rule)          None or what `rule` takes
    └── OrAuto(rule)            "auto" or what `rule` takes
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"


class Rule:
    """Parses text into a value and checks values; `text` is the rule in words."""

    text: str = "a value"

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        """The value `text` stands for; ValueError("must be <rule>, got <text>") if none."""
        raise NotImplementedError

    def convert(self, value: Any) -> Any:
        """A given value as this rule's type: strings are parsed, others checked."""
        if isinstance(value, str) and not self.accepts(value):
            return self.parse(value)
        if not self.accepts(value):
            raise ValueError(f"must be {self.text}, got {value!r}")
        return value

    def _bad(self, given: Any) -> ValueError:
        return ValueError(f"must be {self.text}, got {given!r}")

    def _parses(self, value: Any) -> bool:
        """Whether `parse` takes `value`: `accepts` for rules whose values are their
        own text form."""
        try:
            self.parse(value)
        except ValueError:
            return False
        return True

    def _parse_number(self, text: str, convert: Callable[[str], Any]) -> Any:
        """`convert(text)`, checked: the text quoted when it is no number, the value not."""
        try:
            value = convert(text.strip())
        except (ValueError, AttributeError):
            raise self._bad(text) from None
        if not self.accepts(value):
            raise self._bad(value)
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class IntRange(Rule):
    low: int
    high: int | None = None

    @property
    def text(self) -> str:  # type: ignore[override]
        if self.high is None:
            return f"an integer >= {self.low}"
        return f"an integer between {self.low} and {self.high}"

    def accepts(self, value: Any) -> bool:
        return (isinstance(value, int) and not isinstance(value, bool) and value >= self.low
                and (self.high is None or value <= self.high))

    def parse(self, text: str) -> int:
        return self._parse_number(text, int)


@dataclass(frozen=True)
class FloatRange(Rule):
    low: float
    strict: bool = False  # > low instead of >= low

    @property
    def text(self) -> str:  # type: ignore[override]
        return f"a finite number {'>' if self.strict else '>='} {self.low:g}"

    def accepts(self, value: Any) -> bool:
        return (_is_number(value) and math.isfinite(value)
                and (value > self.low if self.strict else value >= self.low))

    def parse(self, text: str) -> float:
        return self._parse_number(text, float)


@dataclass(frozen=True)
class OneOf(Rule):
    choices: tuple[str, ...]

    @property
    def text(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.choices

    def parse(self, text: str) -> str:
        if not self.accepts(text):
            raise self._bad(text)
        return text


@dataclass(frozen=True)
class Text(Rule):
    text: str = "a non-empty string"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and bool(value.strip())

    def parse(self, text: str) -> str:
        if not self.accepts(text):
            raise self._bad(text)
        return text


@dataclass(frozen=True)
class TorchName(Rule):
    """A torch device ("cpu", "cuda:1") or dtype ("bf16") by name, or the torch object
    itself (`torch.device`, `torch.dtype`, told by its type's name: no torch import
    here); names are matched case-insensitively, "torch." prefix allowed."""

    kind: str  # "device" or "dtype": the torch type a given object may be
    pattern: str  # what a name must match (fully), lower case
    text: str = "a torch name"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, str):
            name = value.strip().lower().removeprefix("torch.")
            return re.fullmatch(self.pattern, name) is not None
        return type(value).__name__ == self.kind and type(value).__module__ == "torch"

    def parse(self, text: str) -> str:
        if not self.accepts(text):
            raise self._bad(text)
        return text


@dataclass(frozen=True)
class Flag(Rule):
    text: str = "true or false"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)

    def parse(self, text: str) -> bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise self._bad(text)


@dataclass(frozen=True)
class CpuList(Rule):
    text: str = "a CPU list such as '1' or '0-3,6'"

    def accepts(self, value: Any) -> bool:
        from diffbatch.cpus import parse_cpu_list

        try:
            parse_cpu_list(value)
        except ValueError:
            return False
        return True

    def parse(self, text: str) -> str:
        from diffbatch.cpus import parse_cpu_list

        parse_cpu_list(text)  # its ValueError says what is wrong with the list
        return text


@dataclass(frozen=True)
class Directory(Rule):
    text: str = "an existing directory"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str | os.PathLike) and os.path.isdir(value)

    def parse(self, text: str) -> str:
        if not self.accepts(text):
            raise self._bad(text)
        return os.path.abspath(text)


@dataclass(frozen=True)
class Optional(Rule):
    inner: Rule

    @property
    def text(self) -> str:  # type: ignore[override]
        return f"{self.inner.text}, or None"

    def accepts(self, value: Any) -> bool:
        return value is None or self.inner.accepts(value)

    def parse(self, text: str) -> Any:
        return self.inner.parse(text)

    def convert(self, value: Any) -> Any:
        return None if value is None else self.inner.convert(value)


@dataclass(frozen=True)
class OrAuto(Rule):
    inner: Rule

    @property
    def text(self) -> str:  # type: ignore[override]
        return f"'{AUTO}' or {self.inner.text}"

    def accepts(self, value: Any) -> bool:
        return value == AUTO or self.inner.accepts(value)

    def parse(self, text: str) -> Any:
        if text.strip().lower() == AUTO:
            return AUTO
        try:
            return self.inner.parse(text)
        except ValueError as exc:  # "must be <inner rule>, got <value>", with "auto" added
            raise ValueError(str(exc).replace("must be ", f"must be '{AUTO}' or ", 1)) from None


def argparse_type(rule: Rule) -> Callable[[str], Any]:
    """`rule.parse` as an argparse `type=`: its ValueError becomes argparse's error."""

    def parse(text: str) -> Any:
        try:
            return rule.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = type(rule).__name__  # argparse names the type in some errors
    return parse


@dataclass(frozen=True)
class Option:
    """How one config field is given and checked: its rule, help and flag."""

    rule: Rule
    help: str
    flag: str | None = None  # the command-line flag; None: --field-name; "" = no flag
    metavar: str | None = None
    default_help: str | None = None  # what the default means, when its value says little
    group: str = "engine"  # the --help group it is listed under
    nargs: str | None = None  # argparse's nargs for a flag taking several values


def option(default: Any = None, *, default_factory: Any = None, **kwargs: Any) -> Any:
    """A dataclass field carrying its `Option` in the metadata."""
    meta = {"option": Option(**kwargs)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


__all__ = [
    "AUTO",
    "CpuList",
    "Directory",
    "Flag",
    "FloatRange",
    "IntRange",
    "OneOf",
    "Option",
    "Optional",
    "OrAuto",
    "Rule",
    "Text",
    "argparse_type",
    "option",
]
