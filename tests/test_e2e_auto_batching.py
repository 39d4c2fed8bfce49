"""An engine with no tuning options batches a burst and does not wait at low load.

Real worker process, real `tiny-sd` pipeline, the defaults `max_num_seqs="auto"`
and `request_batch_max_wait_ms="auto"` (start-up calibration included).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.engine.batch_policy import LOAD_WINDOW_S
from diffbatch.engine.cost_model import knee

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=2)


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny-sd") as engine:
        yield engine


def admissions(engine: Engine) -> dict[str, float]:
    """Waves run so far by why their admission wait ended ("none": no wait)."""
    counts: dict[str, float] = {}
    for metric in engine.metrics.registry.collect():
        if metric.name == "diffbatch_waves":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    reason = sample.labels["admission"]
                    counts[reason] = counts.get(reason, 0.0) + sample.value
    return counts


def test_defaults_are_auto_and_calibrated(engine):
    assert engine.config.max_num_seqs == "auto"
    assert engine.config.request_batch_max_wait_ms == "auto"
    shape = engine.policy.default_shape
    assert engine.policy.cost.estimate_ms(shape, 1, 4) is not None  # calibration ran
    # The capacity is what the capacity rule makes of the calibrated curve. On a quiet
    # machine tiny-sd at 64x64 gains from waves, but a calibration that ran while the
    # cores were busy can measure no gain (capacity 1); the burst below still runs
    # waves larger than one: what waits when a wave ends goes in the next one.
    [((calibrated, steps), curve)] = engine.policy.cost.tables().items()  # its own curve
    assert calibrated == shape
    spreads = engine.policy.cost.spreads(shape, steps)
    assert engine.policy.cost.capacity(shape, steps) == knee(curve, engine.policy.limit, spreads)
    text = engine.metrics.registry.get_sample_value(
        "diffbatch_capacity_requests", {"shape": shape.label(steps)})
    assert text == engine.policy.cost.capacity(shape, steps)


def test_a_burst_forms_waves_larger_than_one(engine):
    async def burst():
        return await asyncio.gather(*(
            engine.generate_async(f"a burst {i}", PARAMS.clone(seed=i)) for i in range(16)))

    outs = asyncio.run(burst())
    assert all(out.ok for out in outs)
    assert max(out.batch_size for out in outs) > 1
    # the learned curve per size, on /metrics (a wave of more than one too)
    learned = engine.policy.cost.tables()
    assert any(size > 1 for table in learned.values() for size in table)
    for (shape, steps), table in learned.items():
        for size, ms in table.items():
            assert engine.metrics.registry.get_sample_value(
                "diffbatch_learned_cost_per_image_ms",
                {"shape": shape.label(steps), "wave_size": str(size)}) == pytest.approx(ms / size)


def test_low_load_runs_waves_of_one_without_waiting(engine):
    # Low load as the policy sees it: its load window holds no arrival of an earlier
    # test's burst, only lone requests.
    start, i = time.monotonic(), 0
    while time.monotonic() - start <= LOAD_WINDOW_S:
        assert engine.generate([f"settle {i}"], PARAMS.clone(seed=50 + i))[0].ok
        i += 1
    before = admissions(engine)
    for i in range(6):  # one request at a time: each alone, never held back
        out = engine.generate([f"alone {i}"], PARAMS.clone(seed=100 + i))[0]
        assert out.ok and out.batch_size == 1
    after = admissions(engine)
    waited = {reason: after.get(reason, 0.0) - before.get(reason, 0.0) for reason in after}
    assert waited.get("none", 0.0) == 6
    assert sum(waited.values()) == 6


def test_step_mode_learns_its_batch_from_the_ticks_without_a_calibration():
    """No calibration: the wave curve is empty (capacity 1), so the running batch must
    grow from what its own ticks measure while a burst waits."""
    with Engine("tiny-sd", step_execution=True, calibration_budget_s=0) as engine:
        shape = engine.policy.default_shape
        assert engine.policy.cost.capacity(shape) == 1

        async def burst():
            return await asyncio.gather(*(
                engine.generate_async(f"a burst {i}", PARAMS.clone(seed=i,
                                                                   num_inference_steps=8))
                for i in range(12)))

        outs = asyncio.run(burst())
        assert all(out.ok for out in outs)
        assert max(out.batch_size for out in outs) > 1
        assert len(engine.policy.step_cost.num_samples(shape, 1)) >= 2  # learned from the ticks
