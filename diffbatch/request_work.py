"""How much work one image of a request asks for, against the work limit.

The engine refuses (400) a request whose images each ask for more work than
`max_request_work` (`--max-request-work`; "auto": 100 times the model's default
image). Work is counted in pixel-steps, with the pixels above the model's default
size weighted:

    work = steps x pixels x max(1, (pixels / default_pixels) ** 0.5)

A denoising step's cost does not grow with the pixel count alone: self-attention
over the latent grows with its square, convolutions linearly, so a size far above the
model's own costs far more per pixel. Measured on `tiny-sd` (default 64x64) on a
2-core CPU: one step at 1280x1280 (400 times the pixels) took about 125 s, 5,000
times a 64x64 step, which is 400 ** 1.42. Counted by pixels alone, that request
passed the automatic limit and held the worker for minutes; with the weight above it
is 8,000 times the default image's step and is refused. At and below the default
size the work is the plain pixel-steps.

Every place that applies the limit asks this module, so they agree to the step: the
engine's check (`diffbatch.engine.request_checks`), the size `size: "auto"` gives
an edit (`max_pixels`) and the limit as the OpenAPI spec states it
(`diffbatch.entrypoints.openai.work_limit`).
"""

from __future__ import annotations

import math

# How much faster than its pixels a step's cost grows above the default size.
SIZE_EXPONENT = 1.5


def pixel_weight(pixels: int, default_pixels: int) -> float:
    """How many times each pixel of an image of `pixels` counts (1 up to the default)."""
    if pixels <= default_pixels:
        return 1.0
    return (pixels / default_pixels) ** (SIZE_EXPONENT - 1.0)


def step_work(pixels: int, default_pixels: int) -> float:
    """The work of one denoising step of one image of `pixels`."""
    return pixels * pixel_weight(pixels, default_pixels)


def max_steps(limit: int, pixels: int, default_pixels: int) -> int:
    """The most steps an image of `pixels` may run within `limit` (0: not even one)."""
    return math.floor(limit / step_work(pixels, default_pixels))


def max_pixels(limit: int, steps: int, default_pixels: int) -> int:
    """The most pixels an image may have to run `steps` within `limit`."""
    budget = limit / steps  # the most work one step may take
    if budget <= default_pixels:
        pixels = math.floor(budget)
    else:  # p ** 1.5 / d ** 0.5 <= budget
        pixels = math.floor((budget * default_pixels ** (SIZE_EXPONENT - 1.0))
                            ** (1.0 / SIZE_EXPONENT))
    # settle the float rounding on the side `max_steps` agrees with
    while pixels > 0 and max_steps(limit, pixels, default_pixels) < steps:
        pixels -= 1
    while max_steps(limit, pixels + 1, default_pixels) >= steps:
        pixels += 1
    return pixels


def describe_work(width: int, height: int, steps: int, default_pixels: int,
                  pixels: int | None = None) -> str:
    """A request's work per image in words, for the 400 that refuses it; `pixels`:
    those of a whole video (all its frames), else width x height."""
    frames = 1 if pixels is None else pixels // (width * height)
    pixels = width * height * frames
    work = steps * step_work(pixels, default_pixels)
    weight = pixel_weight(pixels, default_pixels)
    shape = f"{width}x{height}" + (f" x {frames} frames" if frames > 1 else "")
    text = f"{shape} x {steps} steps = {work:.0f} pixel-steps per image"
    if weight > 1.0:
        text += (f" (each pixel counted {weight:.3g} times: above the model's default size "
                 "a step's cost grows faster than its pixels)")
    return text


__all__ = ["SIZE_EXPONENT", "describe_work", "max_pixels", "max_steps", "pixel_weight",
           "step_work"]
