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


def test_arrivals_tell_the_policy_whether_the_engine_was_busy(gate, monkeypatch):
    """A gap in arrivals that ends while requests run is no pause in the load (a closed
    loop's clients are silent while their requests run): the core says which it was."""
    with Engine(pipeline_class=GatedPipeline, executor="inproc", max_num_seqs=1) as engine:
        seen: list[bool] = []
        observe = engine.core.policy.observe_arrivals

        def spy(count: int, *, busy: bool = False) -> None:
            seen.append(busy)
            observe(count, busy=busy)

        monkeypatch.setattr(engine.core.policy, "observe_arrivals", spy)
        running = submit(engine, "runs", "a")
        assert gate.entered.wait(30)
        waiting = submit(engine, "arrives while a runs", "b")
        gate.release.set()
        assert running.result(30).ok and waiting.result(30).ok
        assert engine.core.wait_idle(30)
        assert submit(engine, "arrives to an idle engine", "c").result(30).ok
    assert seen == [False, True, False]


def test_answered_waves_tell_the_policy_how_many_they_answered(gate, monkeypatch):
    """Before a wave's outputs go out, the policy hears how many requests it answered
    (a closed loop's clients come back right after) and how many the engine held then
    (a closed loop's population): the first wave's answers found the other requests
    still in the engine."""
    with Engine(pipeline_class=GatedPipeline, executor="inproc", max_num_seqs=2,
                request_batch_max_wait_ms=0) as engine:
        answered: list[tuple[int, int | None]] = []
        observe = engine.core.policy.observe_answers

        def spy(count: int, in_engine: int | None = None) -> None:
            answered.append((count, in_engine))
            observe(count, in_engine)

        monkeypatch.setattr(engine.core.policy, "observe_answers", spy)
        first = submit(engine, "a", "a")  # runs alone, held at the gate
        assert gate.entered.wait(30)
        rest = [submit(engine, p, p) for p in ("b", "c")]  # behind it
        gate.release.set()
        outputs = [future.result(30) for future in (first, *rest)]
        assert all(output.ok for output in outputs)
        assert answered[0] == (1, 3)  # "a", with "b" and "c" waiting
        assert sum(count for count, _ in answered) == 3
        assert all(in_engine >= count for count, in_engine in answered)


def test_a_policy_that_fails_on_answers_costs_no_answer(gate, monkeypatch):
    """The requests of a finished wave are out of the scheduler when the policy hears
    of them: a bug there still lets them be answered (it once left their callers
    waiting forever)."""
    gate.release.set()
    with Engine(pipeline_class=GatedPipeline, executor="inproc", max_num_seqs=4) as engine:
        def broken(*args, **kwargs) -> None:
            raise RuntimeError("policy bug")

        monkeypatch.setattr(engine.core.policy, "observe_answers", broken)
        outputs = [f.result(30) for f in (submit(engine, p, p) for p in ("a", "b"))]
        assert all(output.ok for output in outputs)
