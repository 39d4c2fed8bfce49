"""The learned cost curve and the capacity rule, on synthetic curves."""

from __future__ import annotations

import pytest

from diffbatch.engine.cost_model import (
    MIN_SAMPLES,
    RETRY_AFTER_S,
    RETRY_AFTER_WAVES,
    Shape,
    WaveCostModel,
    capacity_from_curve,
)
from tests.clock import ManualClock

SHAPE = Shape(64, 64, 1, True)


def curve(per_wave_ms, sizes=(1, 2, 4, 8, 16, 32)) -> dict[int, float]:
    return {b: per_wave_ms(b) for b in sizes}


@pytest.mark.parametrize(
    ("name", "ms", "limit", "expected"),
    [
        # every image costs the same: batching never pays
        ("flat per image", curve(lambda b: 10.0 * b), 32, 1),
        # a fixed cost amortised by the wave: pays while the fixed part dominates
        ("linear with fixed cost", curve(lambda b: 10.0 + 10.0 * b), 32, 16),
        # the wave takes the same time whatever its size: every doubling pays
        ("constant wave", curve(lambda b: 50.0), 32, 32),
        # saturates: free up to 8 images, then linear
        ("saturating at 8", curve(lambda b: 40.0 * max(b, 8) / 8), 32, 8),
        # gets slower per image beyond 8 (e.g. out of cache)
        ("regressing at 8", {1: 40.0, 2: 42.0, 4: 45.0, 8: 50.0, 16: 200.0, 32: 800.0}, 32, 8),
        # the limit wins
        ("limited", curve(lambda b: 50.0), 4, 4),
        # a weak rung (2 saves 2.5% per image) hides a strong one (4 saves 40%)
        ("weak rung then a gain", {1: 40.0, 2: 78.0, 4: 96.0, 8: 190.0}, 32, 4),
        # two weak rungs in a row add up to a gain worth having (6% at 4)
        ("two weak rungs", {1: 40.0, 2: 78.0, 4: 150.0}, 32, 4),
        # small gains that add up to less than 5%: batching never pays
        ("gains under 5%", {1: 40.0, 2: 78.0, 4: 153.0}, 32, 1),
    ],
)
def test_capacity_rule_on_synthetic_curves(name, ms, limit, expected):
    assert capacity_from_curve(ms, limit) == expected, name


def test_capacity_is_not_claimed_beyond_what_was_measured():
    """Only sizes inside the measured range count: no gain is assumed past the largest."""
    assert capacity_from_curve({1: 40.0, 2: 40.0}, 32) == 2
    assert capacity_from_curve({}, 32) == 1


def test_served_waves_keep_a_rung_whose_gain_the_quartiles_hide():
    """The curve's quartiles say 16 gains 2% per image over 8 (not kept); the served
    waves' medians say 10%: 16 is kept. The medians alone never drop a rung the
    curve keeps, and a rung with too few served waves says nothing."""
    ms = {1: 120.0, 8: 8 * 45.9, 16: 16 * 45.0, 32: 32 * 45.0}
    medians = {8: 52.2, 16: 47.2, 32: 47.4}
    assert capacity_from_curve(ms, 32) == 8
    assert capacity_from_curve(ms, 32, medians.get) == 16
    assert capacity_from_curve(ms, 32, {8: 52.2}.get) == 8
    assert capacity_from_curve({1: 40.0, 2: 40.0}, 32, {1: 10.0, 2: 30.0}.get) == 2


def test_a_shape_learned_from_served_waves_takes_the_gain_they_show():
    """Tiny-sd at 128x128 as served under a closed loop of 32 clients: the first waves
    of 8 ran fast (42-46 ms per image), the later ones at 50-57; the waves of 16 at
    46-51. The quartile of 8 comes from its first waves and hides 16's gain; the
    medians show it, and the capacity is 16 (32 gains nothing over 16)."""
    model = WaveCostModel(limit=32)
    shape = Shape(128, 128, 1, True)
    model.observe(shape, 1, 4, 121.0, served=True)
    for per_image in (42.5, 45.5, 45.6, 49.6, 51.1, 51.3, 53.1, 53.2, 55.0, 57.3):
        model.observe(shape, 8, 4, 8 * per_image, served=True)
    for per_image in (46.6, 46.9, 47.1, 47.4, 47.6, 48.8, 51.0):
        model.observe(shape, 16, 4, 16 * per_image, served=True)
    for per_image in (47.4, 47.5, 47.5, 47.6):
        model.observe(shape, 32, 4, 32 * per_image, served=True)
    assert model.capacity(shape, 4) == 16
    assert model.next_size_to_try(shape, 4) is None  # 32 measured: no gain, no trial


def test_the_served_estimate_follows_every_new_served_wave():
    """The served medians are kept between waves; each served wave renews them."""
    model = WaveCostModel(limit=32)
    for _ in range(MIN_SAMPLES):
        model.observe(SHAPE, 8, 4, 80.0, served=True)
    assert model.served_estimate_ms(SHAPE, 8, 4) == pytest.approx(80.0)
    for _ in range(MIN_SAMPLES + 1):
        model.observe(SHAPE, 8, 4, 160.0, served=True)
    assert model.served_estimate_ms(SHAPE, 8, 4) == pytest.approx(160.0)
    model.observe(SHAPE, 8, 4, 1.0)  # a calibration wave: not a served one
    assert model.served_estimate_ms(SHAPE, 8, 4) == pytest.approx(160.0)


def test_observations_are_interpolated_and_extrapolated_with_no_gain():
    model = WaveCostModel(limit=32)
    model.observe(SHAPE, 4, steps=4, forward_ms=100.0)
    model.observe(SHAPE, 1, steps=4, forward_ms=40.0)
    assert model.estimate_ms(SHAPE, 4, steps=4) == pytest.approx(100.0)
    # between measured sizes: interpolated; beyond: the nearest size's cost per image
    assert model.estimate_ms(SHAPE, 2, steps=4) == pytest.approx(40.0 + (100.0 - 40.0) / 3)
    assert model.estimate_ms(SHAPE, 8, steps=4) == pytest.approx(200.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(SHAPE, 2, steps=4, forward_ms=bad)  # ignored
    assert model.estimate_ms(SHAPE, 2, steps=4) == pytest.approx(60.0)


def test_each_step_count_has_its_own_curve_and_borrows_the_shape_of_another():
    """A wave's fixed part batches differently from its steps, so the gain of a bigger
    wave depends on the step count: a curve per step count, and a step count not seen
    yet borrows the curve the shape is known best at."""
    model = WaveCostModel(limit=32, default_shape=SHAPE)
    at_15 = {1: 300.0, 2: 480.0, 4: 800.0, 8: 1500.0}  # a calibration at 15 steps
    for size, ms in at_15.items():
        model.observe(SHAPE, size, 15, ms)
    assert model.capacity(SHAPE) == model.capacity(SHAPE, 15) == 8  # stopped measuring at 8
    # nothing at 4 steps yet: the 15-step curve scaled by the step ratio, its capacity
    assert model.estimate_ms(SHAPE, 2, steps=4) == pytest.approx(480.0 * 4 / 15)
    assert model.capacity(SHAPE, 4) == 8
    assert model.next_size_to_try(SHAPE, 4) is None  # no wave of its own yet
    # waves at 4 steps: their own times where measured; elsewhere the 15-step curve's
    # ratio to the nearest measured size (8 -> 2: 480 / 1500 of 8's 480 ms)
    for _ in range(MIN_SAMPLES):
        model.observe(SHAPE, 8, 4, 480.0)  # 60 ms per image
    assert model.estimate_ms(SHAPE, 8, steps=4) == pytest.approx(480.0)
    assert model.estimate_ms(SHAPE, 2, steps=4) == pytest.approx(480.0 * 480.0 / 1500.0)
    assert model.capacity(SHAPE, 4) == 8 and model.next_size_to_try(SHAPE, 4) == 16
    # 16 at 4 steps: 45 ms per image, 25% below 8's (at 15 steps, what would have been
    # compared with the calibration's 8, a 16 scaled to 15 steps looked dearer)
    for _ in range(MIN_SAMPLES):
        model.observe(SHAPE, 16, 4, 720.0)
    assert model.capacity(SHAPE, 4) == 16 and model.next_size_to_try(SHAPE, 4) == 32
    assert model.capacity(SHAPE, 15) == 16  # the 15-step curve borrows 4's ratio past 8
    assert model.estimate_ms(SHAPE, 8, steps=15) == pytest.approx(1500.0)  # its own
    # the stall bound's estimate (proxy=False) still reads the shape's other step counts
    assert model.estimate_ms(SHAPE, 8, steps=1, proxy=False) is not None
    assert model.served_estimate_ms(SHAPE, 8, 4) is None  # no served wave anywhere


def test_contention_spikes_do_not_move_the_curve_but_a_lasting_change_does():
    model = WaveCostModel(limit=32)
    for ms in (100.0, 100.0, 100.0, 3400.0, 100.0, 2000.0, 100.0, 100.0):
        model.observe(SHAPE, 8, steps=4, forward_ms=ms)  # a busy neighbour now and then
    assert model.estimate_ms(SHAPE, 8, steps=4) == pytest.approx(100.0)
    for _ in range(16):  # the machine is now slower for good
        model.observe(SHAPE, 8, steps=4, forward_ms=150.0)
    assert model.estimate_ms(SHAPE, 8, steps=4) == pytest.approx(150.0)


def test_an_unseen_shape_borrows_the_default_curve_scaled_by_pixels():
    model = WaveCostModel(limit=32, default_shape=SHAPE)
    assert model.estimate_ms(Shape(128, 128, 1, True), 1, steps=4) is None  # nothing yet
    for b, ms in curve(lambda b: 10.0 + 10.0 * b).items():
        model.observe(SHAPE, b, steps=4, forward_ms=ms)
    big = Shape(128, 128, 1, True)  # 4x the pixels
    assert model.estimate_ms(big, 1, steps=4) == pytest.approx(4 * 20.0)
    assert model.capacity(SHAPE) == 16
    assert model.capacity(big) == 4  # 16 scaled by 1/4
    assert model.capacity(Shape(32, 32, 1, True)) == 32  # 64, bounded by the limit


def test_next_size_to_try_grows_the_curve_while_gains_continue():
    model = WaveCostModel(limit=16)
    model.observe(SHAPE, 1, 4, 40.0)
    model.observe(SHAPE, 2, 4, 42.0)
    assert model.capacity(SHAPE) == 2 and model.next_size_to_try(SHAPE) == 4
    model.observe(SHAPE, 4, 4, 44.0)
    assert model.next_size_to_try(SHAPE) == 8
    model.observe(SHAPE, 8, 4, 200.0)  # no gain at 8 in one wave: maybe a busy moment
    assert model.capacity(SHAPE) == 4 and model.next_size_to_try(SHAPE) == 8
    for _ in range(3):  # confirmed by four waves: the curve knows where gains stop
        model.observe(SHAPE, 8, 4, 200.0)
    assert model.capacity(SHAPE) == 4 and model.next_size_to_try(SHAPE) is None
    unlucky = WaveCostModel(limit=16)
    unlucky.observe(SHAPE, 1, 4, 40.0)
    unlucky.observe(SHAPE, 2, 4, 400.0)  # one wave of 2 while a neighbour ran
    assert unlucky.capacity(SHAPE) == 1 and unlucky.next_size_to_try(SHAPE) == 2
    for _ in range(3):
        unlucky.observe(SHAPE, 2, 4, 42.0)  # the lower quartile of 4 forgets the spike
    assert unlucky.capacity(SHAPE) == 2
    limited = WaveCostModel(limit=2)
    limited.observe(SHAPE, 1, 4, 40.0)
    limited.observe(SHAPE, 2, 4, 40.0)
    assert limited.next_size_to_try(SHAPE) is None  # the limit stops exploring



def test_a_rung_measured_in_a_slow_spell_is_measured_afresh_once_stale():
    """Waves of 8 and 16 that ran while the machine was busy (tiny-sd 128x128: 73-81
    ms per image against 47 for the waves of 4 that ran later) must not pin the
    capacity at 4 for good: once they are `RETRY_AFTER_S` and `RETRY_AFTER_WAVES`
    waves old, the next doubling is tried again, and what the fresh waves show
    decides."""
    clock = ManualClock(1000.0)
    model = WaveCostModel(limit=32, clock=clock)
    shape = Shape(128, 128, 1, True)
    for _ in range(MIN_SAMPLES):  # the slow spell
        model.observe(shape, 8, 4, 8 * 80.0, served=True)
        model.observe(shape, 16, 4, 16 * 75.0, served=True)
    for _ in range(RETRY_AFTER_WAVES):  # then waves of 4 on a quiet machine
        model.observe(shape, 4, 4, 4 * 47.0, served=True)
    assert model.capacity(shape, 4) == 4
    assert model.next_size_to_try(shape, 4) is None  # 8 and 16 look measured: no gain
    clock.now += RETRY_AFTER_S / 2
    assert model.next_size_to_try(shape, 4) is None  # not stale yet: too recent
    clock.now += RETRY_AFTER_S
    assert model.next_size_to_try(shape, 4) == 8  # stale: worth trying again
    assert model.num_samples(shape, 8, 4) == MIN_SAMPLES  # (asking forgets nothing)
    model.begin_trial(shape, 8, 4)  # a trial wave of 8 was chosen
    assert model.num_samples(shape, 8, 4) == 0  # its old waves are forgotten
    assert model.capacity(shape, 4) == 4  # (forgetting a rung that gained nothing)
    model.begin_trial(shape, 8, 4)  # asked again while the trial runs: nothing more
    for _ in range(MIN_SAMPLES):
        model.observe(shape, 8, 4, 8 * 42.0, served=True)
    assert model.capacity(shape, 4) == 8
    assert model.next_size_to_try(shape, 4) == 16  # stale as well: measured afresh
    model.begin_trial(shape, 16, 4)
    for _ in range(MIN_SAMPLES):
        model.observe(shape, 16, 4, 16 * 38.0, served=True)
    assert model.capacity(shape, 4) == 16


def test_a_rung_that_keeps_gaining_nothing_is_retried_ever_more_rarely():
    clock = ManualClock(1000.0)
    model = WaveCostModel(limit=32, clock=clock)

    def run_waves(size: int, count: int) -> None:
        for _ in range(count):
            model.observe(SHAPE, size, 4, size * 40.0)  # no gain at any size

    run_waves(8, MIN_SAMPLES)
    run_waves(4, RETRY_AFTER_WAVES)
    clock.now += RETRY_AFTER_S
    assert model.next_size_to_try(SHAPE, 4) == 8  # stale
    clock.now += RETRY_AFTER_S  # asked about, never tried: the wait does not double
    assert model.next_size_to_try(SHAPE, 4) == 8
    model.begin_trial(SHAPE, 8, 4)  # the first retry
    run_waves(8, MIN_SAMPLES)  # confirms: no gain
    run_waves(4, RETRY_AFTER_WAVES)
    clock.now += RETRY_AFTER_S
    assert model.next_size_to_try(SHAPE, 4) is None  # the second waits twice as long
    run_waves(4, RETRY_AFTER_WAVES)
    clock.now += RETRY_AFTER_S
    assert model.next_size_to_try(SHAPE, 4) == 8


def test_a_rung_that_ran_within_a_few_waves_is_not_retried():
    """Time alone does not make a rung stale: a slow model runs few waves a minute, and
    retrying after every minute would make most of its waves trials."""
    clock = ManualClock(1000.0)
    model = WaveCostModel(limit=32, clock=clock)
    for _ in range(MIN_SAMPLES):
        model.observe(SHAPE, 4, 4, 4 * 40.0)
        model.observe(SHAPE, 8, 4, 8 * 40.0)  # no gain
    clock.now += 10 * RETRY_AFTER_S
    model.observe(SHAPE, 4, 4, 4 * 40.0)
    assert model.capacity(SHAPE, 4) == 4 and model.next_size_to_try(SHAPE, 4) is None


def test_waves_near_a_rung_count_for_it():
    """A closed loop at capacity 8 leaves 10-14 requests waiting: trials of the next
    rung take those, never 16. Waves of 12 or more count for 16 (at their own cost
    per image); a wave of 10 does not."""
    model = WaveCostModel(limit=32)
    for b in (1, 2, 4, 8):
        model.observe(SHAPE, b, 4, 40.0 + 20.0 * b)  # 8: 25 ms per image
    assert model.capacity(SHAPE) == 8 and model.next_size_to_try(SHAPE) == 16
    for _ in range(MIN_SAMPLES):
        model.observe(SHAPE, 10, 4, 40.0 + 20.0 * 10)
    assert model.capacity(SHAPE) == 8 and model.next_size_to_try(SHAPE) == 16
    for size in (12, 13, 14, 12):  # 23.3-22.9 ms per image: 7-8% below 8's
        model.observe(SHAPE, size, 4, 40.0 + 20.0 * size)
    assert model.capacity(SHAPE) == 16 and model.next_size_to_try(SHAPE) == 32
    assert capacity_from_curve({1: 40.0, 2: 40.0, 3: 40.0}, 32) == 4
    assert capacity_from_curve({1: 40.0, 2: 40.0, 3: 40.0}, 2) == 2  # the limit holds


def test_served_estimate_is_the_median_of_served_waves_about_the_size():
    model = WaveCostModel(limit=32)
    for b in (1, 2, 4, 8, 16):  # calibration waves: not what serving delivers
        model.observe(SHAPE, b, 4, 40.0 + 7.0 * b)
    assert model.served_estimate_ms(SHAPE, 8, 4) is None
    # served waves of 6 to 8 count for 8 at their cost per image; 5 and 9 do not
    for size, ms in ((8, 240.0), (6, 210.0), (8, 400.0), (5, 50.0), (9, 90.0)):
        model.observe(SHAPE, size, 4, ms, served=True)
    assert model.served_estimate_ms(SHAPE, 8, 4) is None  # 3 of them: too few
    model.observe(SHAPE, 7, 4, 7 * 32.0, served=True)
    # per image: 30, 35, 50, 32 -> median 33.5, times 8
    assert model.served_estimate_ms(SHAPE, 8, 4) == pytest.approx(268.0)
    assert model.served_estimate_ms(SHAPE, 8, 8) is None  # served waves of its own only
    # the curve still compares sizes by the lower quartile of all waves
    assert model.estimate_ms(SHAPE, 8, 4) == pytest.approx(96.0)
    assert model.served_estimate_ms(Shape(128, 128, 1, True), 8, 4) is None


def test_next_size_to_try_looks_past_a_weak_rung_but_not_past_a_loss():
    weak = WaveCostModel(limit=16)
    weak.observe(SHAPE, 1, 4, 40.0)
    for _ in range(4):
        weak.observe(SHAPE, 2, 4, 78.0)  # 2.5% cheaper per image: not enough, but a gain
    assert weak.capacity(SHAPE) == 1 and weak.next_size_to_try(SHAPE) == 4
    for _ in range(4):
        weak.observe(SHAPE, 4, 4, 96.0)  # 40% cheaper than a wave of 1
    assert weak.capacity(SHAPE) == 4 and weak.next_size_to_try(SHAPE) == 8
    loss = WaveCostModel(limit=16)
    loss.observe(SHAPE, 1, 4, 40.0)
    for _ in range(4):
        loss.observe(SHAPE, 2, 4, 90.0)  # dearer per image: gains have stopped
    assert loss.capacity(SHAPE) == 1 and loss.next_size_to_try(SHAPE) is None


def test_per_image_table_for_metrics():
    model = WaveCostModel(limit=8)
    model.observe(SHAPE, 1, 4, 40.0)
    model.observe(SHAPE, 4, 4, 80.0)
    assert model.per_image_ms() == {"64x64/s4/n1/cfg": {1: 40.0, 4: 20.0}}
    assert model.served_per_image_ms() == {}  # calibration waves are not served ones
    for ms in (100.0, 120.0, 200.0):
        model.observe(SHAPE, 4, 4, ms, served=True)
    assert model.served_per_image_ms() == {"64x64/s4/n1/cfg": {4: 30.0}}
