"""The work limit (`--max-request-work`) written in JSON Schema, for `/openapi.json`.

The server refuses (400) a request whose images each ask for more than `L`
pixel-steps (width x height x num_inference_steps, the pixels above the model's
default size weighted: `diffbatch.request_work`). JSON Schema has no product, but
the sizes the spec declares are a finite set, so the requests the limit lets through
are a finite union of boxes, one per step cap:

    size in {the declared sizes whose step cap `max_steps(L, width x height)` is c},
    steps <= c

`work_limit_boxes` writes them as the branches of one `anyOf`, which the request
schemas require (`allOf`). A request the spec calls valid is one whose work the
server accepts, and the other way round, so clients and fuzzers (schemathesis
`--checks all`) can trust the spec in both directions.

What a field that is left out (or null) stands for is part of the boxes: no
`num_inference_steps` is the model's default, and no `size` (or "auto") the size
"auto" makes: the model's default size for a generation; for an edit, the uploaded
image's size scaled down to fit the pixel cap *and* the work limit, so an edit
without a size is refused only when even the smallest size (one size multiple
squared) would be over the limit.

NOTE: the limit is per image, and `n` (at most 10) multiplies it. A per-request limit
(x n) is a staircase of ten boxes per pixel count, which JSON Schema can state but
schemathesis cannot generate from: jsonschema_rs, which it builds its data from,
gives up ("outgrew intersections") beyond about thirty object boxes, and ten pixel
counts are already a hundred. One box per step cap stays within that for the sizes
`openapi.declared_sides` declares.
"""

from __future__ import annotations

from typing import Any

from diffbatch import request_work

AUTO = "auto"


def work_limit_boxes(
    limit: int, sizes: list[tuple[int, int]], *, auto_pixels: int, default_steps: int,
    max_steps: int, default_pixels: int,
) -> list[dict[str, Any]] | None:
    """The `anyOf` branches that state `limit` (see the module docstring); None when no
    request the other fields allow reaches it.

    Args:
        limit: The most pixel-steps (width x height x steps) of one image.
        sizes: The (width, height) sizes the spec declares.
        auto_pixels: The pixels of the size an absent or "auto" `size` stands for.
        default_steps: The steps an absent (or null) `num_inference_steps` stands for.
        max_steps: The largest `num_inference_steps` the spec allows.
        default_pixels: The pixels of the model's default size (above it, pixels weigh
            more: `request_work`).
    """
    by_cap: dict[int, list[str]] = {}  # step cap -> the sizes that have it
    for width, height in sizes:
        cap = request_work.max_steps(limit, width * height, default_pixels)
        by_cap.setdefault(min(max_steps, cap), []).append(f"{width}x{height}")
    auto_cap = min(max_steps, request_work.max_steps(limit, auto_pixels, default_pixels))
    by_cap.setdefault(auto_cap, [])
    if set(by_cap) == {max_steps}:
        return None
    boxes = []
    for cap, names in sorted(by_cap.items(), reverse=True):
        if cap < 1:
            continue  # sizes over the limit at one step: no box lets them through
        is_auto = cap == auto_cap
        alternatives = ([AUTO] if is_auto else []) + names
        # An absent (or null) size is "auto": only the auto box may leave it out.
        size: dict[str, Any] = {"pattern": f"^(?:{'|'.join(alternatives)})$"}
        required = []
        if not is_auto:
            size["type"] = "string"
            required.append("size")
        properties: dict[str, Any] = {"size": size}
        if cap < max_steps:
            steps: dict[str, Any] = {"maximum": cap}
            if default_steps > cap:  # absent (or null) steps would be too many
                steps["type"] = "integer"
                required.append("num_inference_steps")
            properties["num_inference_steps"] = steps
        boxes.append({"properties": properties, "required": required})
    return boxes


def describe(limit: int) -> str:
    """The limit in words, for the `num_inference_steps` description."""
    return (f"This server refuses (400) a request whose width x height x "
            f"num_inference_steps is above {limit} (--max-request-work; per image, n "
            "multiplies it; above the model's default size each pixel counts "
            f"(pixels / default pixels) ** {request_work.SIZE_EXPONENT - 1:g} times); the "
            "request schema states it exactly, in its `allOf`")
