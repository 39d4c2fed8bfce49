"""The engine loop with more than one wave in flight (`max_waves_in_flight`), and what
happens to waves in flight when their worker dies or nobody waits for them any more.

`QueuedExecutor` behaves like the worker process: `submit_batch` returns at once
and the waves run in submission order, one at a time, when the test says so; it can
play a worker that died and is being replaced (`restarting`). The engine core runs
for real on its own threads.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import pytest

from diffbatch import (
    BatchRunnerOutput,
    ConfigError,
    DiffusionOutput,
    DiffusionRequest,
    Engine,
    EngineConfig,
    SamplingParams,
    SamplingParamsKey,
)
from diffbatch.engine.batch_policy import BatchPolicy
from diffbatch.engine.core import EngineCore
from diffbatch.errors import EngineDeadError, WorkerDiedError
from diffbatch.executor.abstract import Executor
from diffbatch.sched.output import SchedulerOutput
from tests.fake_pipelines import FakeBatchPipeline
from tests.process_utils import wait_until

TIMEOUT_S = 30.0


class QueuedExecutor(Executor):
    """Queues submitted waves; `run_next()` answers the oldest (like a worker's pipe)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.max_concurrent_waves = config.max_waves_in_flight
        self.forward_time_ms = 1.0  # what each answered wave reports
        self.submitted: queue.Queue[tuple[SchedulerOutput, Future[BatchRunnerOutput]]] = (
            queue.Queue()
        )
        self.unanswered = 0
        self.most_unanswered = 0  # the most waves it ever held at once
        self._lock = threading.Condition()
        self.restarting = False  # a dead worker's replacement is starting
        self.held = threading.Event()  # the loop asked `is_restarting` and was told to hold
        self.refused = 0  # waves submitted while restarting (refused, as the worker would)
        self.cancelled: list[Future[BatchRunnerOutput]] = []

    @property
    def is_restarting(self) -> bool:
        if self.restarting:
            self.held.set()
        return self.restarting

    def finish_restart(self) -> None:
        self.restarting = False
        self._notify_ready()

    def cancel(self, future: Future[BatchRunnerOutput]) -> None:
        self.cancelled.append(future)

    def wait_unanswered(self, count: int) -> None:
        with self._lock:
            assert self._lock.wait_for(lambda: self.unanswered == count, TIMEOUT_S)

    def submit_batch(self, scheduler_output: SchedulerOutput, *,
                     stall_after_s: float | None = None) -> Future[BatchRunnerOutput]:
        future: Future[BatchRunnerOutput] = Future()
        if self.restarting:
            self.refused += 1
            future.set_exception(WorkerDiedError("a replacement worker is starting",
                                                 started=False))
            return future
        with self._lock:
            self.unanswered += 1
            self.most_unanswered = max(self.most_unanswered, self.unanswered)
            self._lock.notify_all()
        self.submitted.put((scheduler_output, future))
        return future

    def run_next(self, fail: Exception | None = None) -> list[str]:
        """Answer the oldest submitted wave (or fail it with `fail`); its request ids."""
        wave, future = self.submitted.get(timeout=TIMEOUT_S)
        with self._lock:
            self.unanswered -= 1
        if fail is not None:
            future.set_exception(fail)
        else:
            future.set_result(BatchRunnerOutput(
                outputs={r.request_id: DiffusionOutput(r.request_id, images=[r.prompt],
                                                       batch_size=wave.num_requests)
                         for r in wave.requests},
                forward_time_ms=self.forward_time_ms,
            ))
        return wave.req_ids

    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        return self.submit_batch(scheduler_output).result()

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Harness:
    """An EngineCore on a QueuedExecutor; outputs land in `futures` by request id."""

    def __init__(self, max_num_seqs: int, max_waves_in_flight: int, start: bool = True,
                 executor: Executor | None = None) -> None:
        config = EngineConfig(model="fake", warmup=False, max_num_seqs=max_num_seqs,
                              max_waves_in_flight=max_waves_in_flight,
                              request_batch_max_wait_ms=0)
        self.executor = executor or QueuedExecutor(config)
        self.futures: dict[str, Future[DiffusionOutput]] = {}
        self.arrivals: dict[str, float] = {}
        policy = BatchPolicy(config, FakeBatchPipeline().info(), supports_request_batch=True)
        self.core = EngineCore(config, self.executor, policy=policy,
                               deliver=lambda request, out: self.futures[
                                   request.request_id].set_result(out))
        if start:
            self.core.start()

    def add(self, *request_ids: str, size: int = 64) -> None:
        params = SamplingParams(height=size, width=size, num_inference_steps=2,
                                guidance_scale=5.0, seed=0)
        requests = []
        for rid in request_ids:
            request = DiffusionRequest(rid, f"prompt {rid}", params.clone())
            request.key = SamplingParamsKey.from_params(params, cfg_enabled=True)
            self.futures[rid] = Future()
            self.arrivals[rid] = request.arrival_time
            requests.append(request)
        self.core.add_requests(requests)

    def result(self, rid: str) -> DiffusionOutput:
        return self.futures[rid].result(TIMEOUT_S)

    def wait_in_flight(self, count: int) -> None:
        """Wait until `count` waves are handed to the executor and tracked by the core
        (the executor sees a wave before the core records it)."""
        self.executor.wait_unanswered(count)

        def tracked() -> bool:
            with self.core.cond:
                return len(self.core.in_flight) >= count

        wait_until(tracked, timeout_s=TIMEOUT_S)

    def close(self) -> None:
        if self.core._thread is None:  # stepped by hand
            return
        self.core.stop()
        while isinstance(self.executor, QueuedExecutor) and not self.executor.submitted.empty():
            # let waves still queued finish
            self.executor.run_next()
        self.core.join(TIMEOUT_S)


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(max_num_seqs: int = 2, max_waves_in_flight: int = 2, start: bool = True,
             **kwargs) -> Harness:
        made.append(Harness(max_num_seqs, max_waves_in_flight, start, **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_a_full_wave_queues_behind_the_running_one_and_a_partial_one_does_not(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.add("a0", "a1")
    h.add("b0")  # half a wave: it could still grow, so it is not dispatched yet...
    h.add("b1")  # ...and when it is full, it goes while wave a still runs
    h.add("c0", "c1")  # a third full wave: no room (2 in flight)
    assert h.executor.run_next() == ["a0", "a1"]
    assert h.result("a0").ok and h.result("a1").ok  # delivered while b is still queued
    assert not h.futures["b0"].done()
    assert h.executor.run_next() == ["b0", "b1"]  # b0 waited for b1, not dispatched alone
    assert h.executor.run_next() == ["c0", "c1"]
    outs = [h.result(r) for r in ("b0", "b1", "c0", "c1")]
    assert [o.images for o in outs] == [["prompt b0"], ["prompt b1"], ["prompt c0"],
                                        ["prompt c1"]]
    assert {o.batch_size for o in outs} == {2}
    assert h.executor.most_unanswered == 2


def test_stepped_by_hand_each_decision_of_the_busy_loop(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2, start=False)
    h.add("a0", "a1")
    assert h.core.step()  # idle: dispatch a
    h.add("b0")
    with h.core.cond:
        assert h.core.dispatch.schedule() is None  # busy and b could still grow: keep it here
    h.add("b1")
    assert h.core.step()  # busy, b is full: dispatch it behind a
    assert [w.wave.req_ids for w in h.core.in_flight] == [["a0", "a1"], ["b0", "b1"]]
    h.add("c0", "c1")
    assert h.executor.run_next() == ["a0", "a1"]
    assert h.core.step()  # the done wave goes first...
    assert [w.wave.req_ids for w in h.core.in_flight] == [["b0", "b1"]]
    assert h.core.scheduler.num_running == 2  # a's requests are finished
    assert h.core.step()  # ...then c takes the freed room
    assert [w.wave.req_ids for w in h.core.in_flight] == [["b0", "b1"], ["c0", "c1"]]


def test_a_queued_wave_counts_its_wait_at_the_worker_as_queue_time(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.executor.forward_time_ms = 0.0  # each wave "starts" when it is answered
    h.add("a0", "a1")
    h.add("b0", "b1")
    h.executor.wait_unanswered(2)  # b is dispatched, queued behind a
    h.executor.run_next()
    a_done = time.monotonic()
    h.executor.run_next()
    b0 = h.result("b0")
    # b waited at the worker until a was done: its queue time runs up to then at least,
    # not just to its dispatch (which came before a was answered).
    assert b0.queue_time_ms >= (a_done - h.arrivals["b0"]) * 1000.0


def test_one_wave_in_flight_never_queues_a_second(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=1)
    h.add("a0", "a1")
    h.add("b0", "b1")
    h.add("c0", "c1")
    assert [h.executor.run_next() for _ in range(3)] == [["a0", "a1"], ["b0", "b1"],
                                                        ["c0", "c1"]]
    assert all(h.result(r).ok for r in ("a0", "a1", "b0", "b1", "c0", "c1"))
    assert h.executor.most_unanswered == 1


def test_a_queued_wave_that_fails_in_the_executor_fails_only_its_requests(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.add("a0", "a1")
    h.add("b0", "b1")
    h.executor.run_next(fail=EngineDeadError("worker process died (exit code -9)"))
    h.executor.run_next()
    for rid in ("a0", "a1"):
        out = h.result(rid)
        assert not out.ok and "exit code -9" in out.error.message
    assert h.result("b0").ok and h.result("b1").ok
    h.add("c0", "c1")  # the loop goes on
    assert h.executor.run_next() == ["c0", "c1"] and h.result("c1").ok


def test_an_abort_of_a_queued_wave_discards_only_its_result(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.add("a0", "a1")
    h.add("b0", "b1")
    h.executor.run_next()
    aborted = h.core.abort_requests(["b1"])
    assert [r.request_id for r in aborted] == ["b1"]
    h.executor.run_next()
    assert h.result("b0").ok
    assert not h.futures["b1"].done()  # the engine's caller answers an abort itself


def test_stop_with_waves_in_flight_waits_for_them_and_delivers_nothing_late(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.add("a0", "a1", "b0", "b1")
    h.wait_in_flight(2)
    open_requests = h.core.stop()
    assert sorted(r.request_id for r in open_requests) == ["a0", "a1", "b0", "b1"]
    joined = threading.Thread(target=h.core.join, args=(TIMEOUT_S,))
    joined.start()
    h.executor.run_next()
    h.executor.run_next()
    joined.join(TIMEOUT_S)
    assert not joined.is_alive()
    assert not any(f.done() for f in h.futures.values())  # the stop's caller answers them


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_max_waves_in_flight_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match=f"`max_waves_in_flight` must be an integer >= 1, "
                                          f"got {bad!r}"):
        EngineConfig(model="fake", max_waves_in_flight=bad)


def test_the_inproc_executor_holds_one_wave_whatever_the_config_says():
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=2,
                max_waves_in_flight=3, warmup=False) as engine:
        assert engine.core.max_waves_in_flight == 1
        outs = engine.generate(["a", "b", "c"], SamplingParams(seed=1), use_tqdm=False)
    assert all(o.ok for o in outs)




def test_a_wave_the_worker_died_under_reruns_in_halves_on_the_replacement(harness):
    """Only the crashed wave is touched: it runs again in halves; the wave queued behind
    it runs again as it was; nothing is dispatched until the replacement serves."""
    h = harness(max_num_seqs=4, max_waves_in_flight=2)
    h.add("a0", "a1", "a2", "a3")
    h.add("b0", "b1", "b2", "b3")  # full: queued at the "worker" behind a
    h.executor.wait_unanswered(2)
    h.executor.restarting = True
    h.executor.run_next(fail=WorkerDiedError("worker process died (exit code -9 (SIGKILL)) "
                                             "while running wave 1", started=True))
    h.executor.run_next(fail=WorkerDiedError("worker process died (exit code -9 (SIGKILL)) "
                                             "before it started wave 2", started=False))
    h.add("c0")  # arrives while the replacement starts: it waits, it does not fail
    assert h.executor.held.wait(TIMEOUT_S)  # the loop looked, and holds
    with h.core.cond:  # (the loop reads `is_restarting` holding this lock, then waits)
        assert h.executor.submitted.empty() and h.executor.refused == 0
        assert h.core.num_running == 8 and h.core.num_waiting == 1
    h.executor.finish_restart()
    assert h.executor.run_next() == ["a0", "a1"]
    assert h.executor.run_next() == ["a2", "a3"]
    assert h.executor.run_next() == ["b0", "b1", "b2", "b3"]
    assert h.executor.run_next() == ["c0"]
    outs = {rid: h.result(rid) for rid in ("a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3", "c0")}
    assert all(out.ok for out in outs.values())
    assert outs["a0"].batch_size == 2 and outs["b0"].batch_size == 4
    assert h.executor.refused == 0


def test_only_a_request_that_kills_the_worker_again_alone_fails(harness):
    h = harness(max_num_seqs=4, max_waves_in_flight=1)
    h.add("ok0", "bad", "ok1")
    died = WorkerDiedError("worker process died (exit code -11 (SIGSEGV)) while running "
                           "wave 1", started=True)
    h.executor.run_next(fail=died)  # the wave of 3 -> [ok0] and [bad, ok1]
    assert h.executor.run_next() == ["ok0"]
    assert h.executor.run_next(fail=died) == ["bad", "ok1"]  # -> [bad] and [ok1]
    assert h.executor.run_next(fail=died) == ["bad"]  # alone, again: it fails
    assert h.executor.run_next() == ["ok1"]
    assert h.result("ok0").ok and h.result("ok1").ok
    bad = h.result("bad")
    assert bad.error is not None and bad.error.status_code == 500
    assert "worker process died while running this request, and again" in bad.error.message
    assert "SIGSEGV" in bad.error.message
    h.add("after")
    assert h.executor.run_next() == ["after"] and h.result("after").ok


def test_a_wave_nobody_waits_for_is_cancelled_and_counted_running_until_it_stops(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.add("a0", "a1")
    h.wait_in_flight(1)
    h.core.abort_requests(["a0"])
    assert h.executor.cancelled == []  # a1 still wants it
    h.core.abort_requests(["a1"])
    [record] = h.core.in_flight
    assert h.executor.cancelled == [record.future]
    assert h.core.num_running == 2  # the worker is still busy with them
    h.executor.run_next()
    h.add("b0", "b1")
    assert h.executor.run_next() == ["b0", "b1"] and h.result("b1").ok
    assert h.core.num_running == 0
    assert not h.futures["a0"].done()  # the engine's caller answers an abort itself


def test_stop_cancels_the_waves_in_flight(harness):
    h = harness(max_num_seqs=2, max_waves_in_flight=2)
    h.add("a0", "a1", "b0", "b1")
    h.wait_in_flight(2)
    h.core.stop()
    assert len(h.executor.cancelled) == 2
