"""`POST /v1/images/edits`: the multipart form, its uploads, and what reaches the engine.

Runs the app in-process (httpx's ASGI transport) on a fake-pipeline engine whose
edits mix noise with the uploaded image only where the mask paints, so a test can
see that the image, the mask and the size arrived as sent. Every bad upload must be a
400 in the OpenAI shape naming the part, without anything reaching a forward. The
official `openai` client's `images.edit` runs against a real server at the end.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from diffbatch.entrypoints.openai.uploads import auto_size, decode_edit_inputs
from diffbatch.errors import InvalidRequestError
from tests.entrypoints.openai.conftest import app_client, serve_in_thread
from tests.entrypoints.openai.test_input_validation import assert_openai_error
from tests.fake_pipelines import FakeBatchPipeline, NoEditPipeline

ROUTE = "/v1/images/edits"
MAX_PIXELS = 32 * 32  # the app's --max-image-pixels; the fake model's multiple is 8


def png(size: tuple[int, int] = (16, 16), mode: str = "RGB", color: Any = (200, 30, 30),
        fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format=fmt)
    return buffer.getvalue()


def mask_png(size: tuple[int, int] = (16, 16), box: tuple[int, int, int, int] = (0, 0, 8, 16),
             ) -> bytes:
    """An OpenAI mask: opaque, transparent (alpha 0) inside `box` (where to edit)."""
    image = Image.new("RGBA", size, (0, 0, 0, 255))
    image.paste((0, 0, 0, 0), box)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def decode(response: httpx.Response, index: int = 0) -> np.ndarray:
    data = response.json()["data"][index]["b64_json"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=0) as engine:
        yield engine


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine, max_image_pixels=MAX_PIXELS,
                          max_upload_bytes=64 * 1024) as client:
        yield client


async def edit(client: httpx.AsyncClient, image: bytes | None = None, mask: bytes | None = None,
               **fields: Any) -> httpx.Response:
    files = {}
    if image is not None:
        files["image"] = ("in.png", image, "image/png")
    if mask is not None:
        files["mask"] = ("mask.png", mask, "image/png")
    data = {"prompt": "a red cat", "seed": "1", **{k: str(v) for k, v in fields.items()}}
    if not files:  # still a multipart form: text parts without a filename
        return await client.post(ROUTE, files={k: (None, v) for k, v in data.items()})
    return await client.post(ROUTE, data=data, files=files)


# -- what works ----------------------------------------------------------------------------
async def test_image_to_image_returns_the_images_size_and_mixes_in_the_image(client) -> None:
    response = await edit(client, png((16, 24)), n=2, strength="0.5")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["size"] == "16x24" and len(body["data"]) == 2
    first = decode(response).astype(int)
    assert first.shape == (24, 16, 3)
    assert abs(first[..., 0].mean() - (0.5 * 200 + 0.5 * 127)) < 40  # half image, half noise
    assert response.headers["x-diffbatch-seed"] == "1"
    assert response.headers["x-diffbatch-batch-size"] == "1"  # alone in its wave


@pytest.mark.parametrize("strength", [0.3, 0.9])
async def test_the_strength_sent_is_the_share_of_noise_in_the_edit(client, strength: float,
                                                                   ) -> None:
    """The fake edit is `strength` x the noise a generation of the same prompt and seed
    gives, plus the rest of the image: exact, so a strength lost anywhere on the HTTP
    path (the task's default, 0.8, would arrive instead) fails."""
    edited = await edit(client, png(), strength=str(strength), seed="5")
    assert edited.status_code == 200, edited.text
    generated = await client.post("/v1/images/generations", json={
        "prompt": "a red cat", "seed": 5, "size": "16x16"})
    noise = decode(generated).astype(float)
    expected = strength * noise + (1 - strength) * np.array([200, 30, 30])
    assert np.abs(decode(edited).astype(float) - expected).max() <= 1.0  # 8-bit rounding


async def test_inpainting_changes_only_the_transparent_part_of_the_mask(client) -> None:
    response = await edit(client, png(), mask_png(box=(0, 0, 8, 16)))
    assert response.status_code == 200, response.text
    out = decode(response).astype(int)
    assert (out[:, 8:] == [200, 30, 30]).all()  # opaque in the mask: kept as uploaded
    assert (out[:, :8] != [200, 30, 30]).any()  # transparent: painted


async def test_a_size_resizes_the_image_and_mask(client) -> None:
    response = await edit(client, png((16, 16)), mask_png(box=(0, 0, 8, 16)), size="32x8")
    assert response.status_code == 200, response.text
    out = decode(response).astype(int)
    assert out.shape == (8, 32, 3)
    assert (out[:, 16:] == [200, 30, 30]).all() and (out[:, :16] != [200, 30, 30]).any()


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
async def test_jpeg_and_webp_images_are_taken(client, fmt: str) -> None:
    response = await edit(client, png(fmt=fmt), output_format="webp")
    assert response.status_code == 200, response.text
    assert response.json()["output_format"] == "webp"


async def test_auto_size_fits_the_work_limit_too(client, engine: Engine) -> None:
    """With no `size`, an edit is scaled down until its work fits the limit (51,200
    pixel-steps per image here), and refused only when even 8x8 would not fit."""
    assert engine.max_request_work == 100 * 16 * 16 * 2
    scaled = await edit(client, png((32, 32)), num_inference_steps=100)  # 32x32 would be 102,400
    assert scaled.status_code == 200, scaled.text
    assert scaled.json()["size"] == "16x16" and decode(scaled).shape == (16, 16, 3)
    smallest = await edit(client, png((32, 32)), num_inference_steps=800)  # 8x8: 51,200
    assert smallest.json()["size"] == "8x8", smallest.text
    refused = await edit(client, png((32, 32)), num_inference_steps=801)
    message = assert_openai_error(refused, 400, "num_inference_steps")["message"]
    assert "8x8 x 801 steps = 51264 pixel-steps per image" in message


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_not_clipped() -> None:
    values = np.linspace(0, 65535, 16 * 16).astype(np.uint16).reshape(16, 16)
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, format="PNG")
    inputs = decode_edit_inputs(buffer.getvalue(), None, max_pixels=MAX_PIXELS, size=None,
                                multiple=8, max_output_pixels=MAX_PIXELS)
    got = inputs.image.numpy().astype(int)
    assert (got[..., 0] == got[..., 2]).all()  # gray
    assert np.abs(got[..., 0] - np.rint(values / 257)).max() <= 1


def test_an_exif_rotated_photo_is_edited_as_viewers_show_it() -> None:
    stored = Image.new("RGB", (24, 16), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 12, 16))  # left half red, as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise: the stored left is the top
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif, quality=95)
    inputs = decode_edit_inputs(buffer.getvalue(), None, max_pixels=MAX_PIXELS, size=None,
                                multiple=8, max_output_pixels=MAX_PIXELS)
    assert inputs.upload_size == (16, 24)
    image = inputs.image.numpy().astype(int)
    assert image.shape == (24, 16, 3)
    assert image[:10, :, 0].mean() > 200 and image[:10, :, 2].mean() < 50  # red on top
    assert image[14:, :, 2].mean() > 200 and image[14:, :, 0].mean() < 50
    # a mask is compared with the image as shown
    with pytest.raises(InvalidRequestError, match="image's size \\(16x24\\), got 24x16"):
        decode_edit_inputs(buffer.getvalue(), mask_png((24, 16)), max_pixels=MAX_PIXELS,
                           size=None, multiple=8, max_output_pixels=MAX_PIXELS)


def test_auto_size_keeps_the_aspect_within_the_cap() -> None:
    assert auto_size(16, 24, multiple=8, max_pixels=1024) == (16, 24)
    assert auto_size(20, 13, multiple=8, max_pixels=1024) == (24, 16)  # nearest multiples
    assert auto_size(3, 3, multiple=8, max_pixels=1024) == (8, 8)
    width, height = auto_size(100, 50, multiple=8, max_pixels=1024)
    assert width * height <= 1024 and (width, height) == (40, 24)
    # a near-square image stays square (each side rounded down alone made it 48x64)
    assert auto_size(2047, 2049, multiple=16, max_pixels=64 * 64) == (64, 64)
    # a tall image under the pixel cap still fits each side (8192 by default)
    assert auto_size(64, 9000, multiple=8, max_pixels=2**20) == (56, 8192)
    assert auto_size(9000, 64, multiple=8, max_pixels=2**20, max_side=4096) == (4096, 32)


# -- what is refused -------------------------------------------------------------------------
BAD_UPLOADS = [
    # (image, mask, fields, status, param, words in the message)
    (None, None, {}, 400, "image", "`image` is required"),
    (b"not an image at all", None, {}, 400, "image", "PNG, JPEG, WebP"),
    (png(fmt="GIF"), None, {}, 400, "image", "PNG, JPEG, WebP"),
    (png((40, 40)), None, {}, 400, "image", "at most 1024 pixels"),
    (png(), mask_png((16, 8)), {}, 400, "mask", "the image's size (16x16)"),
    (png(), png(), {}, 400, "mask", "alpha channel"),
    (png(), png(mode="RGBA", color=(0, 0, 0, 0), fmt="WEBP"), {}, 400, "mask", "PNG"),
    (png()[:60], None, {}, 400, "image", "could not be decoded"),
    (png(), None, {"n": "eleven"}, 400, "n", "integer"),
    (png(), None, {"strength": "0"}, 400, "strength", "> 0"),
    (png(), None, {"strength": "1.5"}, 400, "strength", "<= 1"),
    (png(), None, {"size": "12x8"}, 400, "size", "multiples of 8"),
    (png(), None, {"size": "64x64"}, 400, "size", "larger than this server generates"),
    (png(), None, {"input_fidelity": "high"}, 400, "input_fidelity", "not supported"),
    (png(), None, {"colour": "red"}, 400, "colour", "unknown field"),
    (png(), None, {"model": "other"}, 404, "model", "not served here"),
]


@pytest.mark.parametrize(("image", "mask", "fields", "status", "param", "words"), BAD_UPLOADS)
async def test_bad_uploads_are_refused_before_the_engine(
    client, engine: Engine, image, mask, fields, status, param, words,
) -> None:
    forwards, rejected = len(FakeBatchPipeline.wave_sizes), engine.metrics.count("rejected")
    response = await edit(client, image, mask, **fields)
    error = assert_openai_error(response, status, param,
                                "model_not_found" if status == 404 else None)
    assert words in error["message"]
    assert "/tmp" not in response.text and "BytesIO" not in response.text
    assert len(FakeBatchPipeline.wave_sizes) == forwards  # nothing reached a forward
    assert engine.metrics.count("rejected") == rejected + 1
    assert engine.num_waiting == engine.num_running == 0


async def test_form_shape_errors(client) -> None:
    text_image = await client.post(ROUTE, data={"prompt": "p", "image": "https://x/y.png"},
                                   files={"other": ("x", b"1")})
    assert_openai_error(text_image, 400, "image")
    two = await client.post(ROUTE, data={"prompt": "p"},
                            files=[("image", ("a.png", png())), ("image", ("b.png", png()))])
    assert "one `image` per request" in assert_openai_error(two, 400, "image")["message"]
    json_body = await client.post(ROUTE, json={"prompt": "p"})
    assert "multipart" in assert_openai_error(json_body, 415, None,
                                              "unsupported_media_type")["message"]
    too_big = await client.post(ROUTE, data={"prompt": "p"},
                                files={"image": ("a.png", b"\0" * 70_000)})
    assert_openai_error(too_big, 413, None, "payload_too_large")
    # a text field that is not UTF-8 is refused, not decoded as latin-1 ("\xff\xfe" -> "ÿþ")
    not_utf8 = await client.post(ROUTE, files={"prompt": (None, b"\xff\xfe a cat"),
                                               "image": ("a.png", png(), "image/png")})
    assert "UTF-8" in assert_openai_error(not_utf8, 400, "prompt")["message"]
    # while UTF-8 text with the same characters is a prompt like any other
    assert (await edit(client, png(), prompt="ÿþ a cat")).status_code == 200
    too_many = await client.post(ROUTE, files=[("image", ("a.png", png(), "image/png")),
                                               *[(f"f{i}", (None, b"x")) for i in range(70)]])
    assert too_many.status_code == 400 and "fields" in too_many.json()["error"]["message"]


async def test_a_model_without_edit_pipelines_names_itself() -> None:
    with Engine(pipeline_class=NoEditPipeline, executor="inproc") as engine:
        async with app_client(engine, served_model_name="no-edits") as client:
            plain = await edit(client, png())
            painted = await edit(client, png(), mask_png())
    assert "'no-edits'" in assert_openai_error(plain, 400, "image")["message"]
    assert "inpaint" in assert_openai_error(painted, 400, "mask")["message"]


# -- the official client, unmodified -------------------------------------------------------
def test_official_openai_client_edits(engine: Engine, tmp_path) -> None:
    import openai

    image_path, mask_path = tmp_path / "cat.png", tmp_path / "mask.png"
    image_path.write_bytes(png())
    mask_path.write_bytes(mask_png(box=(0, 0, 8, 16)))
    app = build_app(engine, served_model_name="fake", max_image_pixels=MAX_PIXELS,
                    api_key="k", close_engine_on_shutdown=False)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        with open(image_path, "rb") as image, open(mask_path, "rb") as mask:
            result = client.images.edit(image=image, mask=mask, prompt="a red cat", n=2,
                                        size="16x16", extra_body={"seed": 3, "strength": 0.9})
        assert len(result.data) == 2 and result.size == "16x16"
        out = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))))
        assert (out[:, 8:, :3] == [200, 30, 30]).all()
        with open(image_path, "rb") as image:
            plain = client.images.edit(image=image, prompt="a red cat")
        assert len(plain.data) == 1 and plain.data[0].b64_json
        with pytest.raises(openai.BadRequestError) as refused, open(mask_path, "rb") as mask:
            client.images.edit(image=("a.png", b"\x89PNG", "image/png"), mask=mask, prompt="p")
        assert refused.value.param == "image"
