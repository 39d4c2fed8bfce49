"""The files of `POST /v1/images/edits`: read, check and decode an uploaded image and mask.

The HTTP layer's one place for what an upload must be, checked before anything is
decoded in full and long before anything reaches the engine:

1. the image is PNG, JPEG or WebP (the mask PNG, as OpenAI asks), told by Pillow
   from the bytes, whatever the part's declared content type or file name;
2. its width * height is within the server's pixel cap, read from the header, so a
   small file that would decode to a huge image is refused without decoding it;
3. the mask has the image's size and an alpha channel: OpenAI masks are transparent
   (alpha 0) where the image is to be edited. It becomes diffbatch's mask, 255 where
   to paint, 0 where to keep;
4. both are decoded (a truncated file is refused here) upright, as viewers show them
   (EXIF orientation), 16-bit grayscale scaled to 8 bits, and resized to the size to
   generate, the image with Lanczos, the mask with nearest neighbour (it stays binary).

Every refusal is an `InvalidRequestError` naming the part (`image` or `mask`) and
what the client sent, never a server path or Pillow's own message (which names a
Python object). Decoding runs in a worker thread (`asyncio.to_thread`), like encoding.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffbatch.errors import InvalidRequestError
from diffbatch.sampling_params import MAX_SIDE

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from PIL import Image
    from starlette.datastructures import FormData
    from starlette.requests import Request

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what `image` may be (Pillow's format names)
MASK_FORMATS = ("PNG",)  # what `mask` may be
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


@dataclass
class EditInputs:
    """The decoded inputs of one edit, at the size to generate."""

    image: torch.Tensor  # [H, W, 3] uint8 RGB
    mask: torch.Tensor | None  # [H, W] uint8, 255 = paint, 0 = keep; None: image-to-image
    upload_size: tuple[int, int]  # (width, height) of the image as uploaded


def _open(data: bytes, param: str, formats: tuple[str, ...], max_pixels: int) -> Image.Image:
    """Stages 1-2: identify the file and check its size from the header alone."""
    from PIL import Image, UnidentifiedImageError

    names = ", ".join("WebP" if f == "WEBP" else f for f in formats)
    if not data:
        raise InvalidRequestError(f"`{param}` is an empty file; upload a {names} image",
                                  param=param)
    try:
        with warnings.catch_warnings():  # our own pixel cap decides, below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError:
        raise _too_large(param, None, max_pixels) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidRequestError(
            f"`{param}` must be a {names} image; the uploaded file ({len(data)} bytes) is "
            "not one", param=param,
        ) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_large(param, (width, height), max_pixels)
    return image


def _too_large(param: str, size: tuple[int, int] | None, max_pixels: int) -> InvalidRequestError:
    side = math.isqrt(max_pixels)
    got = f", got {size[0]}x{size[1]} = {size[0] * size[1]}" if size else ""
    return InvalidRequestError(
        f"`{param}` must be at most {max_pixels} pixels (width * height, e.g. {side}x{side})"
        f"{got}; resize it before uploading", param=param,
    )


# EXIF orientations that turn the stored image by a quarter (width and height swap)
_QUARTER_TURNS = (5, 6, 7, 8)
_EXIF_ORIENTATION = 0x0112


def _upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as viewers show the image: after its EXIF orientation (a phone's
    portrait JPEG is stored sideways with a tag saying so), read without decoding."""
    width, height = image.size
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # an unreadable EXIF block: the pixels as stored
        return width, height
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def _decode(image: Image.Image, param: str, mode: str) -> Image.Image:
    """Decode `image` in `mode`, upright (its EXIF orientation applied) and, for a
    16-bit or float grayscale file, scaled to 8 bits rather than clipped."""
    from PIL import ImageOps

    try:
        image.seek(0)  # the first frame of an animated PNG or WebP
        upright = ImageOps.exif_transpose(image)
        return _eight_bit(upright if upright is not None else image).convert(mode)
    except (OSError, ValueError, SyntaxError, EOFError):
        raise InvalidRequestError(
            f"`{param}` could not be decoded (a truncated or corrupt "
            f"{image.format or 'image'} file)", param=param,
        ) from None


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit ("I;16"), 32-bit integer ("I") or float ("F") grayscale image as 8-bit
    "L": Pillow's own conversion clips every value above 255 (a 16-bit PNG would turn
    almost white). Integer images holding more than 8 bits are taken as 16-bit."""
    if not (image.mode.startswith("I") or image.mode == "F"):
        return image
    import numpy as np
    from PIL import Image

    values = np.asarray(image, dtype=np.float64)
    if image.mode != "F" and values.size and values.max() > 255:
        values = values / 257.0  # 0..65535 -> 0..255
    return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def auto_size(width: int, height: int, *, multiple: int, max_pixels: int,
              max_side: int = MAX_SIDE) -> tuple[int, int]:
    """The size `size: "auto"` generates for an image of `width` x `height`: its own,
    scaled down (keeping its aspect) to fit `max_pixels` and `max_side` per side, each
    side a multiple of `multiple` (at least one). Of the sides rounded down and the
    sides rounded to the nearest multiple (a multiple taken off the side rounded up the
    most while that crosses `max_pixels`), the closer aspect wins, then the larger size:
    rounding down alone made a 2047x2049 image 48x64, rounding to the nearest alone a
    square 16x24."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)), max_side / width,
                max_side / height)
    ideal_w, ideal_h = width * scale, height * scale
    top = max(multiple, max_side // multiple * multiple)

    def fit(rounding: Callable[[float], int]) -> tuple[int, int]:
        out_w, out_h = (min(top, max(multiple, rounding(ideal / multiple) * multiple))
                        for ideal in (ideal_w, ideal_h))
        while out_w * out_h > max_pixels and max(out_w, out_h) > multiple:
            if out_h == multiple or (out_w > multiple
                                     and (out_w / ideal_w, out_w) >= (out_h / ideal_h, out_h)):
                out_w -= multiple
            else:
                out_h -= multiple
        return out_w, out_h

    def rank(size: tuple[int, int]) -> tuple[float, int]:
        return abs(math.log(size[0] * height / (size[1] * width))), -size[0] * size[1]

    return min(fit(math.floor), fit(lambda x: math.floor(x + 0.5)), key=rank)


def decode_edit_inputs(
    image_data: bytes, mask_data: bytes | None, *, max_pixels: int,
    size: tuple[int, int] | None, multiple: int, max_output_pixels: int,
) -> EditInputs:
    """Check and decode one edit's uploads (stages 1-4 of the module docstring).

    Args:
        image_data: The bytes of the `image` part.
        mask_data: The bytes of the `mask` part, or None (image-to-image).
        max_pixels: Largest width * height of an upload (the server's pixel cap).
        size: (width, height) to generate, or None for "auto" (see `auto_size`).
        multiple: The model's size multiple (for "auto").
        max_output_pixels: Largest width * height the server generates (for "auto").

    Raises:
        InvalidRequestError: with `param` "image" or "mask".
    """
    import numpy as np
    import torch
    from PIL import Image

    # 1-2. Identify both files and check their sizes before decoding either.
    image = _open(image_data, "image", IMAGE_FORMATS, max_pixels)
    upload_size = _upright_size(image)
    mask = None
    if mask_data is not None:
        mask = _open(mask_data, "mask", MASK_FORMATS, max_pixels)
        mask_size = _upright_size(mask)
        if mask_size != upload_size:
            raise InvalidRequestError(
                f"`mask` must have the image's size ({upload_size[0]}x{upload_size[1]}), "
                f"got {mask_size[0]}x{mask_size[1]}", param="mask",
            )
        if not _has_alpha(mask):
            raise InvalidRequestError(
                "`mask` must have an alpha channel: transparent (alpha 0) where the image "
                f"should be edited, opaque elsewhere; the uploaded PNG is {mask.mode} without "
                "transparency", param="mask",
            )
    width, height = size or auto_size(*upload_size, multiple=multiple,
                                      max_pixels=max_output_pixels)
    # 3-4. Decode, turn OpenAI's alpha into a paint mask, resize to the output size.
    rgb = _decode(image, "image", "RGB")
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.LANCZOS)
    paint = None
    if mask is not None:
        alpha = np.asarray(_decode(mask, "mask", "RGBA"))[..., 3]
        painted = Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8))
        if painted.size != (width, height):
            painted = painted.resize((width, height), Image.Resampling.NEAREST)
        paint = torch.from_numpy(np.array(painted))
    return EditInputs(image=torch.from_numpy(np.array(rgb)), mask=paint,
                      upload_size=upload_size)


@dataclass
class EditForm:
    """The parts of an edit's multipart form: its text fields and its two files."""

    fields: dict[str, str]  # text fields by name, for `ImageEditRequest`
    image: bytes  # the `image` file
    mask: bytes | None  # the `mask` file, if one was sent


_FILE_PARTS = ("image", "mask")
MAX_FORM_FIELDS = 64  # far more than ImageEditRequest has: a form of thousands is refused
MAX_FORM_FILES = 4  # image and mask, and room to name a surplus one in the 400


@functools.cache
def _utf8_form_parser() -> type:
    """Starlette's multipart parser, refusing a text field that is not UTF-8 (made once,
    on first use: Starlette is imported only where a form is read)."""
    from starlette.formparsers import MultiPartParser

    class Utf8TextParser(MultiPartParser):
        def on_part_end(self) -> None:
            part = self._current_part
            if part.file is None:
                try:
                    part.data.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequestError(  # the parser closes its files on the way out
                        f"`{part.field_name}` must be UTF-8 text, got bytes that are not "
                        "UTF-8", param=part.field_name) from None
            super().on_part_end()

    return Utf8TextParser


async def _read_form(request: Request) -> FormData:
    """The request's multipart form, as `request.form()` reads it, except that a text
    field that is not UTF-8 is refused (Starlette would decode it as latin-1, turning a
    prompt's stray bytes into other characters)."""
    from starlette.exceptions import HTTPException
    from starlette.formparsers import MultiPartException

    try:
        async with contextlib.aclosing(request.stream()) as stream:
            return await _utf8_form_parser()(request.headers, stream, max_files=MAX_FORM_FILES,
                                             max_fields=MAX_FORM_FIELDS).parse()
    except MultiPartException as exc:  # as `request.form()` answers it
        raise HTTPException(status_code=400, detail=exc.message) from None


async def read_edit_form(request: Request) -> EditForm:
    """Read the multipart form of `POST /v1/images/edits` into its fields and files.

    Raises:
        InvalidRequestError: a missing `image`, a file part given as text (or text as
            a file), more than one image, or a text field given twice.
    """
    from starlette.datastructures import UploadFile

    form = await _read_form(request)
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    try:
        for name, value in form.multi_items():
            base = name.removesuffix("[]")
            if base in _FILE_PARTS:
                if not isinstance(value, UploadFile):
                    raise InvalidRequestError(
                        f"`{base}` must be a file part of the form (with a filename), got a "
                        "text field", param=base,
                    )
                if base in files:
                    raise InvalidRequestError(
                        f"one `{base}` per request: this server edits one image at a time",
                        param=base,
                    )
                files[base] = await value.read()
            elif isinstance(value, UploadFile):
                raise InvalidRequestError(
                    f"`{name}` must be a text field, got a file", param=name
                )
            elif name in fields:
                raise InvalidRequestError(f"`{name}` is given twice; send it once",
                                          param=name)
            else:
                fields[name] = value
    finally:
        await form.close()
    if "image" not in files:
        raise InvalidRequestError(
            "`image` is required: the image to edit, as a file part of the form",
            param="image",
        )
    return EditForm(fields=fields, image=files["image"], mask=files.get("mask"))
