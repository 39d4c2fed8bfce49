"""The engine core's loop: a failing step fails only the running requests, and stop()."""

from __future__ import annotations

from diffbatch import Engine, SamplingParams
from tests.fake_pipelines import GatedPipeline


def submit(engine: Engine, prompt: str, request_id: str):
    _, future = engine._submit(prompt, SamplingParams(), request_id, 0)
    return future


def test_a_failing_step_fails_the_running_requests_and_the_loop_goes_on(gate, monkeypatch):
    with Engine(pipeline_class=GatedPipeline, executor="inproc", max_num_seqs=1) as engine:
        scheduler = engine.core.scheduler
        running = submit(engine, "runs", "a")
        assert gate.entered.wait(30)

        def broken_update(*args, **kwargs):
            monkeypatch.undo()  # fail once
            raise RuntimeError("a bug in the loop")

        monkeypatch.setattr(scheduler, "update_from_output", broken_update)
        gate.release.set()
        output = running.result(30)
        assert output.error is not None and "internal engine error" in output.error.message
        assert scheduler.running_request_ids() == []
        assert engine.generate(["after"])[0].ok


def test_stop_fails_every_open_request(gate):
    engine = Engine(pipeline_class=GatedPipeline, executor="inproc", max_num_seqs=1)
    try:
        running = submit(engine, "runs", "a")
        assert gate.entered.wait(30)
        waiting = submit(engine, "waits", "b")
        assert sorted(engine.core.scheduler.request_ids()) == ["a", "b"]
    finally:
        gate.release.set()
        engine.close()
    for future in (running, waiting):
        output = future.result(30)
        assert output.error is not None and "closed" in output.error.message
    assert engine.core.scheduler.request_ids() == []


class OrderedGatedPipeline(GatedPipeline):
    """A `GatedPipeline` that records each wave's prompts in order."""

    waves: list[list[str]] = []

    def forward(self, batch):
        if batch.prompts != ["warm-up"]:
            type(self).waves.append(list(batch.prompts))
        return super().forward(batch)


def test_max_head_wait_ms_reaches_the_grouped_scheduler_from_the_config(gate):
    """`max_head_wait_ms=0`: the oldest waiting request's group goes next at once, even
    when a later request has the better priority (the 2 s default would run `s1`
    first). Guards the path config -> engine core -> `GroupedScheduler`."""
    OrderedGatedPipeline.waves = []
    with Engine(pipeline_class=OrderedGatedPipeline, executor="inproc", max_num_seqs=1,
                scheduling_policy="grouped", max_head_wait_ms=0) as engine:
        running = engine._submit("a", SamplingParams(), "a", 0)[1]
        assert gate.entered.wait(30)
        other = SamplingParams(num_inference_steps=1)  # another key, another group
        old = engine._submit("old", other, "old", 1)[1]
        better = engine._submit("s1", SamplingParams(), "s1", 0)[1]
        gate.release.set()
        assert all(f.result(30).ok for f in (running, old, better))
    assert OrderedGatedPipeline.waves == [["a"], ["old"], ["s1"]]
