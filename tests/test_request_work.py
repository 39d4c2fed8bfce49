"""The work of one image of a request against the work limit (`diffbatch.request_work`)."""

from __future__ import annotations

import pytest

from diffbatch.request_work import describe_work, max_pixels, max_steps, pixel_weight

TINY = 64 * 64  # tiny-sd's default size
TINY_AUTO = 100 * TINY * 4  # "auto": 100 default images (4 default steps)


def test_pixel_steps_at_and_below_the_default_size() -> None:
    assert pixel_weight(TINY, TINY) == pixel_weight(32 * 32, TINY) == 1.0
    assert max_steps(TINY_AUTO, TINY, TINY) == 400
    assert max_steps(TINY_AUTO, 32 * 32, TINY) == 1600


def test_pixels_above_the_default_weigh_more() -> None:
    """One step at 1280x1280 took ~5,000 times a 64x64 step on tiny-sd: refused."""
    assert pixel_weight(4 * TINY, TINY) == 2.0
    assert max_steps(TINY_AUTO, 1280 * 1280, TINY) == 0
    assert max_steps(TINY_AUTO, 128 * 128, TINY) == 50
    assert max_steps(TINY_AUTO, 256 * 256, TINY) == 6
    sd = 512 * 512
    assert max_steps(100 * sd * 50, 1024 * 1024, sd) == 625
    assert max_steps(100 * sd * 50, 2048 * 2048, sd) == 78


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 50, 400, 401])
def test_max_pixels_is_the_inverse_of_max_steps(steps: int) -> None:
    pixels = max_pixels(TINY_AUTO, steps, TINY)
    assert max_steps(TINY_AUTO, pixels, TINY) >= steps
    assert max_steps(TINY_AUTO, pixels + 1, TINY) < steps


def test_the_refusal_says_how_the_work_was_counted() -> None:
    assert describe_work(64, 64, 8, TINY) == "64x64 x 8 steps = 32768 pixel-steps per image"
    text = describe_work(256, 256, 8, TINY)
    assert text.startswith("256x256 x 8 steps = 2097152 pixel-steps per image")
    assert "each pixel counted 4 times" in text


def test_the_refusal_names_the_steps_and_the_size_that_would_fit():
    from diffbatch import InvalidRequestError, PipelineInfo, SamplingParams
    from diffbatch.engine.request_checks import check_against_model

    info = PipelineInfo("Fake", 16, 16, 2, 5.0, size_multiple=8)
    limit = 100 * 16 * 16 * 2
    params = SamplingParams(height=64, width=64, num_inference_steps=20)
    with pytest.raises(InvalidRequestError) as refused:
        check_against_model(info, params, limit)
    assert refused.value.message.endswith(
        "ask for fewer steps or a smaller size (at most 3 steps at 64x64 or at most "
        "32x32 at 20 steps)")
    # each suggestion fits, and one step or 8 pixels more would not
    for fits in ({"num_inference_steps": 3}, {"height": 32, "width": 32}):
        check_against_model(info, SamplingParams(**{**params.__dict__, **fits}), limit)
    for over in ({"num_inference_steps": 4}, {"height": 40, "width": 40}):
        with pytest.raises(InvalidRequestError):
            check_against_model(info, SamplingParams(**{**params.__dict__, **over}), limit)
