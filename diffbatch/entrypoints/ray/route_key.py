"""The routing key of a request: which requests could share a wave, and its adapters.

The diffbatch request router (`router.py`) sends requests with equal keys to the
same replica, so that replica's engine can batch them. A key has two parts:

- `batch`: the request's fields that enter the engine's batch key
  (`SamplingParamsKey`: size, steps, task, guidance, ...), taken by name from the
  `SamplingParams` the server builds, so a field added to or removed from the batch
  key (LoRA adapters, for one) changes the routing key with it;
- `adapters`: the LoRA adapters the request needs, so it goes where they are loaded
  (adapters are part of `batch` only as long as the engine's batch key holds them).

Fields the request leaves out stay unset (the model's default): on one deployment
every replica fills in the same defaults, so equal routing keys mean equal batch
keys. (A request that spells out a default value gets another routing key than one
that leaves it out, though the engine would batch them: a missed chance, never a
wrong wave.)

Only JSON generation requests get a key (`route_key_of_body`); a multipart edit, a
body that does not validate, or any other route gets none and is routed by load.
The key travels from Ray Serve's proxy (`proxy.py`, which reads the body) to the
router and the replica in the `x-diffbatch-route-key` header.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from diffbatch.errors import DiffbatchError
from diffbatch.sampling_params import SamplingParams, SamplingParamsKey

ROUTE_KEY_HEADER = "x-diffbatch-route-key"
GENERATIONS_PATH = "/v1/images/generations"
# Largest JSON body whose key is read in the proxy; a larger one is routed by load.
MAX_KEYED_BODY_BYTES = 1 << 20
# SamplingParams fields that name adapters: they form `adapters` (and `batch` too while
# the engine's batch key holds them).
ADAPTER_FIELDS = ("lora",)
# `SamplingParamsKey` fields no request carries (the engine derives them).
_DERIVED_FIELDS = ("cfg_enabled", "num_frames", "prompt_layout")


@dataclass(frozen=True)
class RouteKey:
    """What decides where a request is routed; see the module docstring."""

    batch: str  # the batch-key fields of the request, as canonical JSON
    adapters: tuple[str, ...] = ()  # sorted adapter names; () for the base model

    def encode(self) -> str:
        """The header value: compact JSON (ASCII only, so any header carries it)."""
        return json.dumps([self.batch, list(self.adapters)], separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> RouteKey | None:
        """The key `encode` wrote, or None for a value it did not write."""
        try:
            batch, adapters = json.loads(text)
        except (ValueError, TypeError):
            return None
        if not isinstance(batch, str) or not isinstance(adapters, list) \
                or not all(isinstance(a, str) for a in adapters):
            return None
        return cls(batch, tuple(adapters))


def route_key_of_params(params: SamplingParams) -> RouteKey:
    """The routing key of `params` as the server built them (defaults left unset)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(SamplingParamsKey):
        name = field.name
        if name in _DERIVED_FIELDS:
            continue
        if name == "lora_scale" and params.lora is None:
            continue  # the engine's key holds no scale without an adapter
        value = getattr(params, name, None)
        if value is not None:  # unset: the model's default
            values[name] = value
    batch = json.dumps(values, sort_keys=True, separators=(",", ":"), default=repr)
    adapters = sorted({a for name in ADAPTER_FIELDS for a in _names(getattr(params, name, None))})
    return RouteKey(batch, tuple(adapters))


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def route_key_of_generation(body: bytes) -> RouteKey | None:
    """The key of a `POST /v1/images/generations` JSON body; None if it does not
    validate (the replica answers it with the server's own 400)."""
    from pydantic import ValidationError

    from diffbatch.entrypoints.openai.protocol import ImageGenerationRequest

    try:
        request = ImageGenerationRequest.model_validate_json(body)
        size = request.image_size()
        given = {f.name: getattr(request, f.name) for f in dataclasses.fields(SamplingParams)
                 if f.name in ImageGenerationRequest.model_fields}
        width, height = size if size is not None else (None, None)
        params = SamplingParams(**{k: v for k, v in given.items() if v is not None},
                                width=width, height=height, num_outputs_per_prompt=request.n)
    except (ValidationError, DiffbatchError, ValueError, TypeError):
        return None
    return route_key_of_params(params)


def route_key_of_body(method: str, path: str, content_type: str, body: bytes) -> RouteKey | None:
    """The key of an HTTP request to a diffbatch application (any route prefix), or
    None for a request that gets none (see the module docstring)."""
    if method != "POST" or not path.rstrip("/").endswith(GENERATIONS_PATH):
        return None
    if content_type.split(";")[0].strip().lower() != "application/json":
        return None
    if len(body) > MAX_KEYED_BODY_BYTES:
        return None
    return route_key_of_generation(body)


def route_key_of_headers(headers: Any) -> RouteKey | None:
    """The key in an ASGI scope's headers (a list of (bytes, bytes)), if any."""
    name = ROUTE_KEY_HEADER.encode("latin-1")
    for key, value in headers or ():
        if key.lower() == name:
            return RouteKey.decode(value.decode("latin-1"))
    return None
