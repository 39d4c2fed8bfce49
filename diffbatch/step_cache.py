"""What a request asks of the step cache: `StepCacheConfig`, parsed from a spec.

A step cache skips most of a diffusion transformer on denoising steps where its
first block's output barely changed since the last fully computed step, reusing
the request's own cached residual of the remaining blocks instead
(`diffbatch.pipelines.interception.step_cache` runs it, per request, inside the
wave's fused forward).

Specs, the same for `--step-cache`, `SamplingParams.step_cache` and the HTTP
`step_cache` field:

- `"off"` (or `"none"`): no caching, whatever the server default;
- `"first_block"` or `"first_block:0.08"`: the first-block rule of diffusers'
  `FirstBlockCacheConfig` at that threshold (default `DEFAULT_THRESHOLD`), optionally
  followed by `,warmup=N` (the first N forwards always compute) and `,max_cached=M`
  (at most M cached forwards in a row);
- `"taylorseer[:threshold]"`: the same decisions, but a cached step adds a first-order
  forecast of the tail residual from the last two computed steps instead of the last
  one (cache-dit's DBCache with its TaylorSeer calibrator, order 1);
- a dict `{"policy", "threshold", "warmup_steps", "max_cached_steps"}` (all but
  `policy` optional), or a `StepCacheConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from diffbatch.errors import InvalidRequestError
from diffbatch.options import Rule

StepCachePolicy = Literal["first_block", "taylorseer", "off"]
POLICIES: tuple[str, ...] = ("first_block", "taylorseer", "off")
_ALIASES = {"fbc": "first_block", "first-block": "first_block", "none": "off"}
# diffusers' `FirstBlockCacheConfig` default
DEFAULT_THRESHOLD = 0.05
MAX_THRESHOLD = 10.0


@dataclass(frozen=True)
class StepCacheConfig:
    """One request's step-cache settings.

    `threshold`: a step reuses the cached tail when the mean absolute change of the
    first block's residual, relative to its mean magnitude at the last computed
    step, is at most this. `warmup_steps`: the first forwards always compute.
    `max_cached_steps`: most consecutive cached forwards before one computes again
    (None: no cap).
    """

    policy: StepCachePolicy = "first_block"
    threshold: float = DEFAULT_THRESHOLD
    warmup_steps: int = 0
    max_cached_steps: int | None = None

    @property
    def enabled(self) -> bool:
        return self.policy != "off"

    def spec(self) -> str:
        """The short form, e.g. "first_block:0.05" (warm-up and cap shown when set)."""
        if not self.enabled:
            return "off"
        text = f"{self.policy}:{self.threshold:g}"
        if self.warmup_steps:
            text += f",warmup={self.warmup_steps}"
        if self.max_cached_steps is not None:
            text += f",max_cached={self.max_cached_steps}"
        return text

    @classmethod
    def parse(cls, value: Any, param: str = "step_cache") -> StepCacheConfig:
        """A spec (see the module docstring) as a config; `InvalidRequestError` if bad."""
        if isinstance(value, StepCacheConfig):
            config = value
        elif value is False:
            config = cls(policy="off")
        elif isinstance(value, str):
            config = _from_text(value, param)
        elif isinstance(value, dict):
            unknown = sorted(set(value) - {"policy", "threshold", "warmup_steps",
                                           "max_cached_steps"})
            if unknown:
                raise InvalidRequestError(
                    f"`{param}` takes policy, threshold, warmup_steps and max_cached_steps, "
                    f"got {unknown}", param=param)
            config = cls(policy=_policy(value.get("policy", "first_block"), param),
                         threshold=value.get("threshold", DEFAULT_THRESHOLD),
                         warmup_steps=value.get("warmup_steps", 0),
                         max_cached_steps=value.get("max_cached_steps"))
        else:
            raise InvalidRequestError(
                f"`{param}` must be a string such as \"first_block:0.05\" or \"off\", or a "
                f"dict, got {type(value).__name__}", param=param)
        config._check(param)
        return config

    def _check(self, param: str) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not math.isfinite(self.threshold) \
                or not 0.0 <= self.threshold <= MAX_THRESHOLD:
            raise InvalidRequestError(
                f"`{param}` threshold must be a number between 0 and {MAX_THRESHOLD:g}, "
                f"got {self.threshold!r}", param=param)
        for name, value, low in (("warmup_steps", self.warmup_steps, 0),
                                 ("max_cached_steps", self.max_cached_steps, 1)):
            if name == "max_cached_steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(
                    f"`{param}` {name} must be an integer >= {low}, got {value!r}",
                    param=param)


def _policy(name: Any, param: str) -> StepCachePolicy:
    name = _ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in POLICIES:
        raise InvalidRequestError(
            f"`{param}` policy must be one of {list(POLICIES)}, got {name!r}", param=param)
    return name


def _from_text(text: str, param: str) -> StepCacheConfig:
    """ "policy[:threshold][,warmup=N][,max_cached=M]" as a config."""
    head, *options = text.strip().lower().split(",")
    name, _, threshold = head.partition(":")
    policy = _policy(name.strip(), param)
    bad = InvalidRequestError(
        f"`{param}` must be POLICY[:THRESHOLD][,warmup=N][,max_cached=M], e.g. "
        f"\"first_block:0.05\" or \"off\", got {text!r}", param=param)
    if policy == "off":
        if threshold or options:
            raise bad
        return StepCacheConfig(policy="off")
    values: dict[str, Any] = {}
    try:
        if threshold:
            values["threshold"] = float(threshold)
        for option in options:
            key, _, value = option.partition("=")
            name = {"warmup": "warmup_steps", "max_cached": "max_cached_steps"}[key.strip()]
            values[name] = int(value)
    except (KeyError, ValueError):
        raise bad from None
    return StepCacheConfig(policy=policy, **values)


class StepCacheSpec(Rule):
    """The `--step-cache` rule: a spec as text, kept as its short form."""

    text = "POLICY[:THRESHOLD] with POLICY one of " + ", ".join(POLICIES)

    def accepts(self, value: Any) -> bool:
        return self._parses(value)

    def parse(self, text: str) -> str:
        try:
            return StepCacheConfig.parse(text).spec()
        except InvalidRequestError as exc:
            raise ValueError(f"must be {self.text}, got {text!r} ({exc.message})") from None

    def convert(self, value: Any) -> Any:
        if isinstance(value, str | dict | StepCacheConfig):
            try:
                return StepCacheConfig.parse(value).spec()
            except InvalidRequestError as exc:
                raise ValueError(f"must be {self.text}, got {value!r} ({exc.message})") \
                    from None
        raise self._bad(value)
