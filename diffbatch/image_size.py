"""Image size limits: the largest square under a pixel cap, and the 400 that names it.

Two layers cap image sizes, each its own limit, each once:

- the HTTP server: its pixel limit (`--max-image-pixels`, `max_image_pixels`), the
  same whatever model it serves, and `MAX_SIDE` per side, checked on the parsed
  `size` before anything else (`OpenAIServingImages.check_size`);
- the engine, when a request is added, for every caller alike: what the loaded
  model takes, its size multiple and its own pixel cap (`model_max_pixels`, from
  `PipelineInfo`; a model folder declares it in `diffbatch_defaults.json`).

NOTE: the server does not repeat the model's checks. A size within the server's
limit that the model does not take reaches the engine and is refused there, with
the same kind of answer. Both refuse a size over their cap the way OpenAI refuses
an unsupported size: 400 with `param: "size"` (a 413 would reach the `openai`
client as a bare status error), naming the largest square size that works, in the
one message `size_too_large` writes. The server's message quotes the
model's cap and multiple too (what "works" means), but only the engine checks them.
"""

from __future__ import annotations

import math

from diffbatch.errors import InvalidRequestError
from diffbatch.sampling_params import MAX_SIDE


def largest_square(max_pixels: int, multiple: int = 1, max_side: int = MAX_SIDE) -> int:
    """Side of the largest square of at most `max_pixels` pixels and `max_side` per side
    whose side is a multiple of `multiple` (0 when there is none)."""
    side = min(max_side, math.isqrt(max_pixels))
    return side // multiple * multiple


def size_too_large(
    given: str, maker: str, max_pixels: int, square: int, *, max_side: int | None = None,
) -> InvalidRequestError:
    """The 400 (param "size") for `given` ("WxH") over the cap of `maker` ("this server",
    a pipeline's name), naming the largest square size `square` (0: none)."""
    per_side = f" and {max_side} per side" if max_side is not None else ""
    largest = f"; the largest square size is {square}x{square}" if square else ""
    return InvalidRequestError(
        f"`size` {given} is larger than {maker} generates: at most {max_pixels} pixels "
        f"(width * height){per_side}{largest}",
        param="size",
    )
