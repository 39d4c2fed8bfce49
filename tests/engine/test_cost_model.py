"""The learned cost curve: estimates, borrowing, and the capacity rule on synthetic curves."""

from __future__ import annotations

import pytest

from diffbatch.engine.cost_model import (
    MIN_GAIN,
    WINDOW,
    Shape,
    WaveCostModel,
    interpolate,
    knee,
    spread_at,
)

DEFAULT = Shape(64, 64, 1, True)
SIZES = (1, 2, 4, 8, 16, 32, 64)


def table(wave_ms) -> dict[int, float]:
    return {size: wave_ms(size) for size in SIZES}


# -- the capacity rule on synthetic curves ------------------------------------------


def test_a_flat_curve_pays_up_to_the_limit():
    """A wave costs the same whatever its size: every doubling halves the cost per
    image, so the knee is the largest size measured, bounded by the limit."""
    assert knee(table(lambda b: 100.0), limit=64) == 64
    assert knee(table(lambda b: 100.0), limit=16) == 16
    assert knee(table(lambda b: 100.0), limit=12) == 12  # the limit itself is a rung


def test_a_linear_curve_never_pays():
    """No fixed cost to share: a bigger wave only takes longer, capacity 1."""
    assert knee(table(lambda b: 30.0 * b), limit=64) == 1


def test_a_saturating_curve_stops_where_the_gain_drops_below_min_gain():
    """fixed + per-image cost: the cost per image approaches the per-image cost, and
    the knee is the last size that still cut it by MIN_GAIN."""
    ms = table(lambda b: 100.0 + 300.0 * b)
    per_image = {b: ms[b] / b for b in SIZES}
    assert knee(ms, limit=64) == 16
    assert per_image[16] <= (1 - MIN_GAIN) * per_image[4]
    assert all(per_image[b] > (1 - MIN_GAIN) * per_image[16] for b in (32, 64))


def test_a_regressing_curve_stays_below_where_bigger_waves_cost_more():
    """The device saturates at 8 and bigger waves get dearer per image (memory
    pressure): the knee is 8, not the largest size measured."""
    ms = {1: 100.0, 2: 110.0, 4: 130.0, 8: 160.0, 16: 400.0, 32: 900.0}
    assert knee(ms, limit=64) == 8


def test_one_weak_rung_does_not_end_the_walk():
    """A rung that gains less than MIN_GAIN is skipped, the next compared with the
    last one kept: a noisy point cannot pin the capacity low."""
    ms = {1: 100.0, 2: 100.0 * 2 * 0.97, 4: 100.0 * 4 * 0.5}
    assert knee(ms, limit=64) == 4


def test_interpolates_between_and_extrapolates_without_gain_beyond():
    ms = {2: 100.0, 8: 160.0}
    assert interpolate(ms, 4) == pytest.approx(120.0)
    assert interpolate(ms, 16) == pytest.approx(320.0)  # 8's cost per image
    assert interpolate(ms, 1) == pytest.approx(50.0)


# -- the model ---------------------------------------------------------------------


def test_estimates_with_the_median_so_slow_spikes_do_not_teach():
    model = WaveCostModel(limit=64)
    for ms in (100.0, 101.0, 102.0, 900.0, 103.0, 950.0):
        model.observe(DEFAULT, 8, 4, ms)
    assert model.estimate_ms(DEFAULT, 8, 4) == pytest.approx(102.5)


def observe_curve(model: WaveCostModel, wave_ms, repeats: int = 4, noise=lambda b, i: 1.0):
    for i in range(repeats):
        for size in SIZES:
            model.observe(DEFAULT, size, 4, wave_ms(size) * noise(size, i))


@pytest.mark.parametrize("factor", [12.0, 0.2])
def test_one_bad_sample_at_two_does_not_move_the_knee(factor):
    """On a saturating curve with a wave of size 2 slowed by a neighbour (or sped up
    by running alone), the capacity is the clean curve's knee."""
    curve = lambda b: 100.0 + 300.0 * b  # noqa: E731
    clean, noisy = WaveCostModel(limit=64), WaveCostModel(limit=64)
    observe_curve(clean, curve)
    observe_curve(noisy, curve, noise=lambda b, i: factor if (b, i) == (2, 1) else 1.0)
    assert noisy.capacity(DEFAULT, 4) == clean.capacity(DEFAULT, 4) == 16


def test_a_doubling_within_the_spread_keeps_the_larger_wave():
    """8 -> 16 cuts the median cost per image by less than MIN_GAIN, but the waves
    vary by more than the gap: unsure, so the larger wave is kept."""
    curve = lambda b: 100.0 + 300.0 * b  # noqa: E731 (its knee is 16 when exact)
    noisy = WaveCostModel(limit=32)
    observe_curve(noisy, curve, noise=lambda b, i: (0.8, 1.2, 0.9, 1.1)[i])
    assert noisy.capacity(DEFAULT, 4) == 32
    exact = WaveCostModel(limit=32)
    observe_curve(exact, curve)
    assert exact.capacity(DEFAULT, 4) == 16


def test_spreads_between_measured_sizes_take_the_wider_neighbour():
    assert spread_at({2: 0.1, 8: 0.3}, 4) == pytest.approx(0.3)
    assert spread_at({2: 0.1}, 16) == pytest.approx(0.1)
    assert spread_at({}, 4) == 0.0


def test_keeps_only_the_last_window_of_observations():
    model = WaveCostModel(limit=64)
    for _ in range(WINDOW):
        model.observe(DEFAULT, 4, 4, 500.0)
    for _ in range(WINDOW):
        model.observe(DEFAULT, 4, 4, 100.0)
    assert model.estimate_ms(DEFAULT, 4, 4) == pytest.approx(100.0)
    assert model.num_samples(DEFAULT, 4) == {4: WINDOW}


def test_ignores_observations_that_say_nothing():
    model = WaveCostModel(limit=8)
    for size, steps, ms in ((0, 4, 10.0), (2, 0, 10.0), (2, 4, float("nan")), (2, 4, 0.0)):
        model.observe(DEFAULT, size, steps, ms)
    assert model.tables() == {}
    assert model.capacity(DEFAULT, 4) == 1


def test_capacity_is_bounded_by_the_limit():
    model = WaveCostModel(limit=4)
    for size in SIZES:
        model.observe(DEFAULT, size, 4, 100.0)
    assert model.capacity(DEFAULT, 4) == 4


def test_another_step_count_borrows_the_shape_of_the_known_curve():
    model = WaveCostModel(limit=64, default_shape=DEFAULT)
    for size in SIZES:
        model.observe(DEFAULT, size, 4, 4 * (50.0 + 5.0 * size))
    assert model.estimate_ms(DEFAULT, 8, 8) == pytest.approx(2 * model.estimate_ms(DEFAULT, 8, 4))
    assert model.capacity(DEFAULT, 8) == model.capacity(DEFAULT, 4)
    # its own waves anchor the borrowed shape
    model.observe(DEFAULT, 1, 8, 1000.0)
    ratio = model.estimate_ms(DEFAULT, 16, 4) / model.estimate_ms(DEFAULT, 1, 4)
    assert model.estimate_ms(DEFAULT, 16, 8) == pytest.approx(1000.0 * ratio)


def test_a_new_shape_prices_a_request_as_default_requests_of_as_many_pixels():
    model = WaveCostModel(limit=64, default_shape=DEFAULT)
    for size in SIZES * 2:
        model.observe(DEFAULT, size, 4, 200.0 + 10.0 * size)
    big = Shape(128, 128, 1, True)  # one request counts as four of 64x64
    assert model.estimate_ms(big, 2, 4) == pytest.approx(model.estimate_ms(DEFAULT, 8, 4))
    assert model.estimate_ms(big, 2, 8) == pytest.approx(2 * model.estimate_ms(DEFAULT, 8, 4))
    assert model.estimate_ms(big, 2, 4, proxy=False) is None  # (stall bounds never guess)
    assert model.capacity(big, 4) == model.capacity(DEFAULT, 4) // 4
