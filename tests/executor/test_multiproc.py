"""Tests for MultiprocExecutor: the worker process, shm results, death, restart, shutdown.

The worker always runs the real `ModelRunner`; most tests give it a small fake
pipeline defined here, by dotted name as any custom pipeline class is given
(`pipeline_class`), and one runs the built-in `tiny-sd` model. Every test here
starts worker processes, which pay torch's import time, so all are marked slow.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import pytest
import torch

from diffbatch.config import EngineConfig
from diffbatch.errors import (
    EngineClosedError,
    EngineDeadError,
    ModelLoadError,
    ModelNotFoundError,
    WorkerDiedError,
)
from diffbatch.executor.multiproc import MultiprocExecutor
from diffbatch.ipc import shm
from diffbatch.ipc.messages import (
    WorkerCall,
    WorkerHeartbeat,
    WorkerReady,
    WorkerReply,
    recv_message,
    send_message,
)
from diffbatch.ipc.shm import ShmTensorHandle
from diffbatch.outputs import BatchRunnerOutput, DiffusionOutput, PartialImage
from diffbatch.pipelines.interface import BasePipeline, DiffusionRequestBatch, PipelineInfo
from diffbatch.request import DiffusionRequest
from diffbatch.sampling_params import SamplingParams
from diffbatch.sched.output import SchedulerOutput
from diffbatch.worker.worker import worker_main
from tests.process_utils import SHM_DIR, segments_of, wait_gone, worker_pids

pytestmark = pytest.mark.slow

IMAGE_SHAPE = (1, 3, 512, 512)  # float32: 3 MiB, above the 1 MiB shm threshold
DEADLINE_S = 120.0  # upper bound for waits on worker start-up (imports torch)


# --- fake pipelines, loaded inside the worker by dotted name ------------------------------


class FakeWorkerPipeline(BasePipeline):
    """Behaviour per prompt: "fail" -> an error output, "raise" -> the forward raises,
    "block" -> touch the marker file in `extra["marker"]` and hang, "steps" -> touch it,
    then step (10 ms each, up to ten minutes) until the wave is stopped; else a 3 MiB
    image (float, `output_type="pt"`) filled with the request's position in its wave.
    A wave whose first prompt is "preview" first sends the partial images its requests
    ask for, as a loop of 3 steps would: 3 MiB each, filled with their step."""

    supports_request_batch = True

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> FakeWorkerPipeline:
        return cls()

    def info(self) -> PipelineInfo:
        return PipelineInfo(
            name=type(self).__name__, default_height=64, default_width=64,
            default_num_inference_steps=2, default_guidance_scale=5.0, size_multiple=8,
        )

    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        first = batch.requests[0]
        if first.prompt == "steps":
            Path(first.sampling_params.extra["marker"]).write_text(str(os.getpid()))
            idle = threading.Event()
            for _ in range(60_000):
                batch.check_interrupt()
                idle.wait(0.01)
        plan = batch.partial_image_plan(3)
        if first.prompt == "preview" and plan is not None:
            for step in sorted(plan.rows):
                rows = len(plan.rows_at(step))
                plan.send(step, torch.full((rows, *IMAGE_SHAPE[1:]), float(step)))
        return [self._one(r, i) for i, r in enumerate(batch.requests)]

    def _one(self, request: DiffusionRequest, index: int) -> DiffusionOutput:
        if request.prompt == "raise":
            raise RuntimeError("unexpected pipeline bug")
        if request.prompt == "fail":
            return DiffusionOutput.from_error(request.request_id, ValueError("pipeline broke"))
        if request.prompt == "block":
            Path(request.sampling_params.extra["marker"]).write_text(str(os.getpid()))
            threading.Event().wait()
        images = torch.full(IMAGE_SHAPE, float(index))
        return DiffusionOutput(request.request_id, images=images, metadata={"pid": os.getpid()})


class Unreadable:
    """Pickles here, but refuses to unpickle in the worker."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def _refuse_to_unpickle():
    raise RuntimeError("cannot rebuild this object here")


class MissingModelPipeline(FakeWorkerPipeline):
    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> FakeWorkerPipeline:
        raise ModelNotFoundError(f"model {model!r} is not served here", param="model")


class BrokenPipeline(FakeWorkerPipeline):
    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> FakeWorkerPipeline:
        raise ValueError("weights are corrupt")


LOADS_FILE_ENV = "DIFFBATCH_TEST_LOADS_FILE"


class FlakyLoadPipeline(FakeWorkerPipeline):
    """Appends its worker's pid to the file named by `$DIFFBATCH_TEST_LOADS_FILE` on
    every load. The first load serves; the second hangs (a start to be killed from
    outside); from the third on, loads serve when the file's first line is "serve"
    and fail otherwise."""

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> FakeWorkerPipeline:
        path = Path(os.environ[LOADS_FILE_ENV])
        with path.open("a") as loads:
            loads.write(f"{os.getpid()}\n")
        lines = path.read_text().split()
        if len(lines) == 2 + (lines[0] == "serve"):
            threading.Event().wait()
        if len(lines) > 2 + (lines[0] == "serve") and lines[0] != "serve":
            raise RuntimeError("the model cannot be loaded any more")
        return cls()


FAKE = f"{__name__}.FakeWorkerPipeline"
MODEL = "test/fake"  # a hub id the fake pipelines take and never look up


# --- helpers -------------------------------------------------------------------------------


def make_config(pipeline_class: str = FAKE, **kwargs) -> EngineConfig:
    """A config for the fake pipeline; a forward that raises fails its whole wave."""
    return EngineConfig(model=MODEL, warmup=False, torch_num_threads=1,
                        pipeline_class=pipeline_class, batch_error_isolation="none", **kwargs)


def request(request_id: str, prompt: str = "a cat", **extra) -> DiffusionRequest:
    return DiffusionRequest(request_id, prompt,
                            SamplingParams(seed=1, output_type="pt", extra=extra))


def wave(wave_id: int, *requests: DiffusionRequest) -> SchedulerOutput:
    return SchedulerOutput(wave_id=wave_id, requests=list(requests), key=None)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for_file(path: Path, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def worker_children() -> set[int]:
    """Pids of this process's live worker processes."""
    return worker_pids(os.getpid())


def recv_reply(conn) -> WorkerReply:
    """The next message from a worker that is not a heartbeat."""
    while isinstance(message := recv_message(conn), WorkerHeartbeat):
        pass
    return message


def run_one(executor: MultiprocExecutor, req: DiffusionRequest) -> DiffusionOutput:
    """`req` run in a wave of its own; its output."""
    return executor.execute_batch(wave(0, req)).outputs[req.request_id]


@pytest.fixture(scope="module")
def executor():
    ex = MultiprocExecutor(make_config())
    yield ex
    ex.shutdown()


# --- tests ---------------------------------------------------------------------------------


def test_ready_sets_info_and_is_healthy(executor):
    assert executor.info.name == "FakeWorkerPipeline"
    assert executor.info.default_height == 64
    assert executor.worker_pid not in (None, os.getpid())
    assert executor.is_healthy
    executor.check_health()


def test_execute_batch_returns_per_request_outputs_through_shm(executor, monkeypatch):
    seen = []
    real_unpack = shm.unpack

    def spy(obj):
        handles = shm.handles(obj)
        seen.append([(h.nbytes, (SHM_DIR / h.name).exists()) for h in handles])
        return real_unpack(obj)

    monkeypatch.setattr(shm, "unpack", spy)
    result = executor.execute_batch(wave(1, request("r1"), request("r2"), request("r3")))

    assert isinstance(result, BatchRunnerOutput)
    assert result.req_ids == ["r1", "r2", "r3"]
    for i, rid in enumerate(result.req_ids):
        out = result.outputs[rid]
        assert out.ok and out.batch_size == 3
        assert out.metadata["pid"] == executor.worker_pid
        assert torch.equal(out.images, torch.full(IMAGE_SHAPE, float(i)))
    assert seen == [[(3 * 512 * 512 * 4, True)] * 3]  # three images crossed in shm
    assert segments_of(executor.worker_pid) == []  # and were unlinked on arrival


def test_partial_images_cross_through_shm_before_the_wave_returns(executor):
    got: list[tuple[PartialImage, bool, list[str]]] = []
    future = None

    def listener(partial: PartialImage) -> None:  # on the executor's reader thread
        got.append((partial, future is not None and future.done(),
                    segments_of(executor.worker_pid)))

    executor.set_partial_image_listener(listener)
    try:
        previewing = request("p", "preview")
        previewing.sampling_params.partial_images = 2  # after steps 1 and 2 of 3
        future = executor.submit_batch(wave(5, previewing, request("q")))
        result = future.result(DEADLINE_S)
    finally:
        executor.set_partial_image_listener(lambda partial: None)
    assert result.outputs["p"].ok and result.outputs["q"].ok
    assert [(p.request_id, p.index, p.step) for p, _, _ in got] == [("p", 0, 1), ("p", 1, 2)]
    for partial, wave_done, _ in got:
        assert not wave_done  # handed out while the call was still open
        assert torch.equal(partial.image, torch.full(IMAGE_SHAPE[1:], float(partial.step)))
    assert segments_of(executor.worker_pid) == []  # each unlinked on arrival


def test_a_wave_of_one(executor):
    out = run_one(executor, request("solo"))
    assert out.request_id == "solo" and out.ok
    assert out.images.shape == IMAGE_SHAPE


def test_runner_errors_become_error_outputs_and_worker_keeps_serving(executor):
    pid = executor.worker_pid
    result = executor.execute_batch(wave(2, request("ok"), request("bad", "fail")))
    assert result.outputs["ok"].ok
    assert result.outputs["bad"].error.message == "ValueError: pipeline broke"

    # A forward that raises fails every request of its wave (no isolation here), not
    # the worker.
    result = executor.execute_batch(wave(3, request("x1", "raise"), request("x2")))
    assert result.req_ids == ["x1", "x2"]
    for out in result.outputs.values():
        assert out.error.message == "RuntimeError: unexpected pipeline bug"
        assert out.error.status_code == 500
    out = run_one(executor, request("x3", "raise"))
    assert out.error.message == "RuntimeError: unexpected pipeline bug"

    # A call the worker cannot even read is answered with the error too.
    out = run_one(executor, request("odd", obj=Unreadable()))
    assert out.request_id == "odd"
    assert out.error.message == "RuntimeError: cannot rebuild this object here"

    assert run_one(executor, request("after")).ok
    assert executor.worker_pid == pid
    executor.check_health()


def test_submitted_calls_queue_at_the_worker_and_each_gets_its_own_answer(executor):
    assert executor.max_concurrent_waves == 2  # the config's max_waves_in_flight
    futures = [
        executor.submit_batch(wave(30, request("q0"), request("q1"))),
        executor.submit_batch(wave(32, request("q2", "fail"))),
        executor.submit_batch(wave(33, request("q3", obj=Unreadable()))),  # unreadable there
        executor.submit_batch(wave(31, request("q4", "raise"))),
        executor.submit_batch(wave(34, request("q5"))),
    ]  # all sent before the first answer is read
    first = futures[0].result(DEADLINE_S)
    assert first.req_ids == ["q0", "q1"] and all(o.ok for o in first.outputs.values())
    assert torch.equal(first.outputs["q1"].images, torch.full(IMAGE_SHAPE, 1.0))
    assert futures[1].result(DEADLINE_S).outputs["q2"].error.message == (
        "ValueError: pipeline broke")
    assert futures[2].result(DEADLINE_S).outputs["q3"].error.message == (
        "RuntimeError: cannot rebuild this object here")
    assert futures[3].result(DEADLINE_S).outputs["q4"].error.message == (
        "RuntimeError: unexpected pipeline bug")
    last = futures[4].result(DEADLINE_S).outputs["q5"]
    assert last.request_id == "q5" and last.ok
    assert segments_of(executor.worker_pid) == []


@pytest.mark.parametrize(
    ("factory", "exc_type", "message"),
    [
        ("MissingModelPipeline", ModelNotFoundError, "model 'test/fake' is not served here"),
        ("BrokenPipeline", ModelLoadError, "could not load the model .*ValueError: weights "
         "are corrupt"),
    ],
)
def test_load_failure_fails_startup_with_the_workers_message(factory, exc_type, message):
    before = worker_children()
    with pytest.raises(exc_type, match=message) as info:
        MultiprocExecutor(make_config(f"{__name__}.{factory}"))
    if exc_type is ModelNotFoundError:
        assert info.value.param == "model" and info.value.status_code == 404
    assert worker_children() <= before  # the failed worker was reaped


def test_an_executor_at_a_scripts_top_level_works_without_a_main_guard(tmp_path):
    """The worker is its own program: the user's script runs once, in its own process."""
    runs = tmp_path / "runs"
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        with open({str(runs)!r}, "a") as f:
            f.write("ran\\n")
        from diffbatch.config import EngineConfig
        from diffbatch.executor.multiproc import MultiprocExecutor
        from diffbatch.request import DiffusionRequest
        from diffbatch.sampling_params import SamplingParams
        from diffbatch.sched.output import SchedulerOutput
        config = EngineConfig(model="{MODEL}", warmup=False, torch_num_threads=1,
                              pipeline_class="{FAKE}")
        ex = MultiprocExecutor(config, startup_timeout_s=60)
        r = DiffusionRequest("top", "a cat", SamplingParams(seed=1))
        out = ex.execute_batch(SchedulerOutput(wave_id=1, requests=[r], key=None))
        print("ok" if out.outputs["top"].ok else "failed")
        ex.shutdown()
    """))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert runs.read_text() == "ran\n"  # the worker never re-ran the script


def test_a_killed_engine_process_takes_its_worker_down_mid_wave(tmp_path):
    """SIGKILL of the engine process: the worker exits although it is inside a wave."""
    marker = tmp_path / "running"
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        from diffbatch.config import EngineConfig
        from diffbatch.executor.multiproc import MultiprocExecutor
        from diffbatch.request import DiffusionRequest
        from diffbatch.sampling_params import SamplingParams
        from diffbatch.sched.output import SchedulerOutput
        config = EngineConfig(model="{MODEL}", warmup=False, torch_num_threads=1,
                              pipeline_class="{FAKE}")
        ex = MultiprocExecutor(config, startup_timeout_s=60)
        params = SamplingParams(seed=1, extra={{"marker": {str(marker)!r}}})
        r = DiffusionRequest("b", "block", params)
        ex.execute_batch(SchedulerOutput(wave_id=1, requests=[r], key=None))  # never returns
    """))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    engine = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env)
    try:
        wait_for_file(marker)
        worker_pid = int(marker.read_text())
        engine.kill()
        engine.wait(DEADLINE_S)
        assert wait_gone(worker_pid), "the worker outlived its engine process"
        assert segments_of(worker_pid) == []
    finally:
        if engine.poll() is None:
            engine.kill()


def test_killed_worker_fails_the_call_then_a_replacement_serves(tmp_path):
    ex = MultiprocExecutor(make_config())
    try:
        old_pid = ex.worker_pid
        marker = tmp_path / "running"
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(ex.execute_batch,
                                  wave(7, request("b1", "block", marker=str(marker))))
            wait_for_file(marker)  # the worker is inside the forward now
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=r"exit code -9 \(SIGKILL\).*wave 7"):
                pending.result(timeout=60)

        # Unhealthy until the replacement is up; calls meanwhile fail clearly.
        assert not ex.is_healthy
        with pytest.raises(EngineDeadError, match="died"):
            ex.check_health()
        with pytest.raises(EngineDeadError, match="replacement worker is starting"):
            run_one(ex, request("during-restart"))

        assert ex.wait_healthy(DEADLINE_S)
        ex.check_health()
        assert ex.worker_pid not in (None, old_pid) and ex.num_restarts == 1
        assert ex.execute_batch(wave(8, request("again"))).outputs["again"].ok
        assert process_gone(old_pid) and segments_of(old_pid) == []

        # A worker that dies while idle is caught by check_health too.
        idle_pid = ex.worker_pid
        os.kill(idle_pid, signal.SIGKILL)
        # Wait until it is gone (its sentinel; joining here would race the reader
        # thread, which reaps it), not a fixed sleep.
        assert wait_gone(idle_pid)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            ex.check_health()
        assert ex.wait_healthy(DEADLINE_S) and ex.worker_pid not in (None, idle_pid)
        assert run_one(ex, request("third")).ok

        process = ex._worker.process
        ex.shutdown()
        assert process.returncode == 0  # an idle worker exits on the shutdown call
    finally:
        ex.shutdown()


def _loads(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split() if line.isdigit()]


def _wait_for_loads(path: Path, count: int) -> list[int]:
    deadline = time.monotonic() + DEADLINE_S
    while len(_loads(path)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} loads in {path}"
        time.sleep(0.02)
    return _loads(path)


def test_a_dead_worker_reads_as_exited_after_its_pidfd_number_is_reused():
    """The reader closes a dead worker's pidfd; the number is free at once and the
    replacement's pipes can take it. `exited()` (what `check_health` asks of the worker it
    still holds) must not then wait on somebody else's pipe and answer "running"."""
    ex = MultiprocExecutor(make_config())
    try:
        ex.stop_restarting()  # no replacement: nothing else takes the number meanwhile
        worker = ex._worker
        number = worker.sentinel
        assert number is not None
        read_end, write_end = os.pipe()  # while the number is taken: a different one
        os.kill(worker.pid, signal.SIGKILL)
        assert wait_gone(worker.pid)
        worker.join_reader(DEADLINE_S)  # its reader has handled the death
        assert ex._worker is None
        with pytest.raises(OSError):
            os.fstat(number)  # closed, free to be reused
        try:
            os.dup2(read_end, number)  # a quiet pipe now has the old pidfd's number
            assert worker.exited()
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                ex.check_health()
        finally:
            for fd in {read_end, write_end, number}:
                os.close(fd)
    finally:
        ex.shutdown()


def test_a_replacement_killed_while_loading_is_started_again(tmp_path, monkeypatch):
    loads = tmp_path / "loads"
    loads.write_text("serve\n")
    monkeypatch.setenv(LOADS_FILE_ENV, str(loads))
    ex = MultiprocExecutor(make_config(f"{__name__}.FlakyLoadPipeline"))
    try:
        first = ex.worker_pid
        os.kill(first, signal.SIGKILL)
        replacement = _wait_for_loads(loads, 2)[1]  # it hangs in its load
        assert ex.is_restarting
        os.kill(replacement, signal.SIGKILL)
        # a second start, after a pause, serves; work waits for it meanwhile
        assert ex.wait_healthy(DEADLINE_S)
        assert _loads(loads)[2] == ex.worker_pid
        assert ex.num_restarts == 1 and ex.num_deaths == 1
        assert run_one(ex, request("after")).ok
    finally:
        ex.shutdown()


def test_the_executor_is_dead_for_good_only_after_every_restart_attempt_failed(
        tmp_path, monkeypatch):
    monkeypatch.setattr("diffbatch.executor.multiproc.RESTART_PAUSES_S", (0.05, 0.05))
    loads = tmp_path / "loads"
    monkeypatch.setenv(LOADS_FILE_ENV, str(loads))
    ex = MultiprocExecutor(make_config(f"{__name__}.FlakyLoadPipeline"))
    try:
        os.kill(ex.worker_pid, signal.SIGKILL)
        os.kill(_wait_for_loads(loads, 2)[1], signal.SIGKILL)  # the hanging start
        assert not ex.wait_healthy(DEADLINE_S)  # then two loads that raise
        assert len(_loads(loads)) == 4 and not ex.is_restarting
        with pytest.raises(EngineDeadError, match=r"starting a replacement failed: .*"
                           "cannot be loaded any more"):
            ex.check_health()
    finally:
        ex.shutdown()


def test_a_worker_death_fails_every_queued_call_with_its_own_name(tmp_path):
    ex = MultiprocExecutor(make_config())
    try:
        pid = ex.worker_pid
        marker = tmp_path / "running"
        running = ex.submit_batch(wave(40, request("b", "block", marker=str(marker))))
        queued = ex.submit_batch(wave(41, request("q1"), request("q2")))
        wait_for_file(marker)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"SIGKILL\)\) while running wave 40") as died:
            running.result(DEADLINE_S)
        assert died.value.started  # it was running: it may be what killed the worker
        with pytest.raises(WorkerDiedError,
                           match=r"SIGKILL\)\) before it started wave 41 \(2 ") as died:
            queued.result(DEADLINE_S)
        assert not died.value.started  # only queued behind it: safe to run again as it was
        assert ex.wait_healthy(DEADLINE_S)
        assert run_one(ex, request("after")).ok
        assert segments_of(pid) == []
    finally:
        ex.shutdown()


def test_worker_cpus_pins_the_worker_process():
    before = os.sched_getaffinity(0)
    cpu = max(before)
    ex = MultiprocExecutor(make_config(worker_cpus=str(cpu)))
    try:
        assert os.sched_getaffinity(ex.worker_pid) == {cpu}
        assert run_one(ex, request("pinned")).ok
    finally:
        ex.shutdown()
    assert os.sched_getaffinity(0) == before  # only the worker was pinned


def test_shutdown_mid_call_and_leftovers_leave_nothing(tmp_path):
    ex = MultiprocExecutor(make_config(), shutdown_timeout_s=2.0)
    pid = ex.worker_pid
    # A segment of a reply that never arrived (as if the worker packed, then died).
    orphan = SharedMemory(name=f"{shm.segment_prefix(pid)}orphan", create=True, size=64)
    orphan.close()
    assert segments_of(pid) == [f"{shm.segment_prefix(pid)}orphan"]

    marker = tmp_path / "running"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_one, ex, request("b", "block", marker=str(marker)))
        wait_for_file(marker)
        ex.shutdown()  # the worker is stuck in the forward: shutdown escalates to SIGTERM
        with pytest.raises(EngineClosedError,
                           match=r"shut down while running wave 0 \(1 request\)"):
            pending.result(timeout=60)

    assert process_gone(pid)
    assert pid not in worker_children()
    assert segments_of(pid) == []
    assert not ex.is_healthy and ex.worker_pid is None
    ex.shutdown()  # twice is fine
    with pytest.raises(EngineClosedError):
        ex.check_health()
    with pytest.raises(EngineClosedError):
        run_one(ex, request("late"))


def test_worker_answers_calls_and_exits_when_the_pipe_closes():
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=worker_main, args=(make_config(), child_conn), daemon=True)
    process.start()
    child_conn.close()
    try:
        ready = recv_message(conn)
        assert isinstance(ready, WorkerReady) and ready.ok and ready.pid == process.pid
        send_message(conn, WorkerCall(2, "no_such_method"))
        reply = recv_reply(conn)
        assert reply.call_id == 2 and "unknown worker method" in reply.error.message
        send_message(conn, WorkerCall(3, "execute_batch", wave(3, request("r"))))
        reply = recv_reply(conn)
        assert reply.call_id == 3
        assert isinstance(reply.result.outputs["r"].images, ShmTensorHandle)
        shm.release(reply.result)
        send_message(conn, WorkerCall(4, "execute_batch", "not a wave"))  # the runner raises
        reply = recv_reply(conn)
        assert reply.call_id == 4 and reply.error.message.startswith("AttributeError: ")
        conn.close()  # as if the engine process died
        process.join(DEADLINE_S)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()


def test_real_model_runner_on_tiny_sd_matches_inproc():
    from diffbatch.executor.inproc import InprocExecutor

    config = EngineConfig(model="tiny-sd", warmup=False, torch_num_threads=1)
    params = SamplingParams(height=64, width=64, num_inference_steps=2, guidance_scale=5.0,
                            seed=3, num_outputs_per_prompt=2, output_type="pt")
    requests = [DiffusionRequest(f"r{i}", prompt, params.clone(seed=10 + i,
                                                               partial_images=1 - i))
                for i, prompt in enumerate(["a red circle", "a blue square"])]
    ex = MultiprocExecutor(config)
    got_partials: list[PartialImage] = []
    try:
        assert ex.info.size_multiple >= 1
        ex.set_partial_image_listener(got_partials.append)
        got = ex.execute_batch(wave(1, *requests))
    finally:
        ex.shutdown()
    inproc = InprocExecutor(config)
    want_partials: list[PartialImage] = []
    inproc.set_partial_image_listener(want_partials.append)
    want = inproc.execute_batch(wave(1, *requests))
    assert got.req_ids == want.req_ids == ["r0", "r1"]
    for rid in got.req_ids:
        assert got.outputs[rid].ok, got.outputs[rid].error
        assert got.outputs[rid].images.shape == (2, 3, 64, 64)
        torch.testing.assert_close(got.outputs[rid].images, want.outputs[rid].images,
                                   atol=1e-5, rtol=1e-4)
    # r0's one preview (after step 1 of 2) of each of its two images, from either executor
    assert [(p.request_id, p.step, p.image_index) for p in got_partials] \
        == [(p.request_id, p.step, p.image_index) for p in want_partials] \
        == [("r0", 1, 0), ("r0", 1, 1)]
    for mine, theirs in zip(got_partials, want_partials, strict=True):
        torch.testing.assert_close(mine.image, theirs.image, atol=1e-5, rtol=1e-4)


def test_cancel_stops_a_running_wave_and_drops_the_queued_one(tmp_path):
    ex = MultiprocExecutor(make_config())
    try:
        marker = tmp_path / "running"
        running = ex.submit_batch(wave(50, request("s", "steps", marker=str(marker))))
        queued = ex.submit_batch(wave(51, request("q")))
        wait_for_file(marker)
        ex.cancel(queued)  # not started: dropped, never run
        ex.cancel(running)  # stops at its next step
        out = running.result(60)
        assert out.outputs["s"].aborted
        dropped = queued.result(60)
        assert dropped.outputs["q"].aborted and dropped.num_forwards == 0
        assert run_one(ex, request("after")).ok  # the worker serves on
        ex.cancel(running)  # an answered call: ignored
    finally:
        ex.shutdown()


# The stall timeouts below leave a loaded machine's scheduling gaps (a second and more
# on two busy cores) out of the "frozen" verdict, unless the test is about that verdict.
def test_a_frozen_worker_is_killed_and_replaced_and_its_wave_fails_as_started(tmp_path):
    ex = MultiprocExecutor(make_config(worker_stall_timeout_s=3.0))
    pid = ex.worker_pid
    try:
        marker = tmp_path / "running"
        running = ex.submit_batch(wave(60, request("b", "block", marker=str(marker))))
        wait_for_file(marker)
        assert ex.health_stats()["up"] == 1.0
        os.kill(pid, signal.SIGSTOP)  # frozen: its heartbeat thread stops too
        with pytest.raises(WorkerDiedError, match=r"frozen: no heartbeat for .* killed\) while "
                                                  r"running wave 60") as died:
            running.result(DEADLINE_S)
        assert died.value.started
        assert wait_gone(pid)
        stats = ex.health_stats()
        assert stats["frozen"] == 1 and stats["deaths"] == 1
        assert ex.wait_healthy(DEADLINE_S) and ex.worker_pid not in (None, pid)
        assert run_one(ex, request("after")).ok
        assert segments_of(pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        ex.shutdown()


def wait_for_heartbeats(ex: MultiprocExecutor, span_s: float, running) -> None:
    """Wait until the worker's heartbeats have spanned `span_s` seconds, counted as they
    arrive (no sleep), while `running` stays unanswered."""
    idle = threading.Semaphore(0)
    worker = ex._worker
    seen = worker.last_heard
    deadline = time.monotonic() + DEADLINE_S
    while worker.last_heard - seen < span_s:
        assert time.monotonic() < deadline and not running.done()
        idle.acquire(timeout=0.05)


def test_a_busy_worker_keeps_its_heartbeat(tmp_path):
    """A long wave is not a frozen worker: the heartbeat comes from a thread of its own."""
    ex = MultiprocExecutor(make_config(worker_stall_timeout_s=2.0))
    try:
        marker = tmp_path / "running"
        running = ex.submit_batch(wave(70, request("s", "steps", marker=str(marker))))
        wait_for_file(marker)
        wait_for_heartbeats(ex, 5.0, running)  # a few stall timeouts' worth
        assert ex.health_stats()["frozen"] == 0 and ex.is_healthy
        ex.cancel(running)
        assert running.result(60).outputs["s"].aborted
    finally:
        ex.shutdown()


def test_a_wave_past_its_stall_bound_is_stuck_and_its_worker_replaced(tmp_path):
    """A forward that hangs while the heartbeat thread lives: once the wave has run past
    the bound it was submitted with, counted from its own start (not while it waited
    behind another wave), the worker is killed and replaced like a frozen one."""
    ex = MultiprocExecutor(make_config(worker_stall_timeout_s=3.0))
    pid = ex.worker_pid
    try:
        ahead, hung = tmp_path / "ahead", tmp_path / "hung"
        running = ex.submit_batch(wave(80, request("s", "steps", marker=str(ahead))))
        queued = ex.submit_batch(wave(81, request("b", "block", marker=str(hung))),
                                 stall_after_s=1.0)
        wait_for_file(ahead)
        wait_for_heartbeats(ex, 2.0, running)  # longer than the bound of the queued wave
        assert ex.is_healthy and ex.health_stats()["stuck_waves"] == 0
        ex.cancel(running)
        assert running.result(60).outputs["s"].aborted
        wait_for_file(hung)  # the queued wave now runs, and hangs
        # (the bound is 1 s, stretched on a machine busier than it has CPUs)
        with pytest.raises(WorkerDiedError, match=r"stuck: wave 81 \(1 request\) ran .* past "
                           r"its bound of \d+\.\d s .* killed\) while running wave 81") as died:
            queued.result(DEADLINE_S)
        assert died.value.started
        stats = ex.health_stats()
        assert (stats["stuck_waves"], stats["frozen"], stats["deaths"]) == (1, 1, 1)
        assert wait_gone(pid)
        assert ex.wait_healthy(DEADLINE_S) and ex.worker_pid not in (None, pid)
        assert run_one(ex, request("after")).ok
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        ex.shutdown()


def test_a_wave_that_keeps_finishing_steps_is_not_stuck_however_long_it_runs(tmp_path):
    """The stall bound counts from the wave's last denoising step (its pipeline's ask
    between steps, which the heartbeat reports): a slow wave that keeps stepping, on a
    machine too busy to run it in its expected time, is not killed as stuck."""
    ex = MultiprocExecutor(make_config(worker_stall_timeout_s=3.0))
    try:
        marker = tmp_path / "stepping"
        running = ex.submit_batch(wave(90, request("s", "steps", marker=str(marker))),
                                  stall_after_s=1.0)
        wait_for_file(marker)
        wait_for_heartbeats(ex, 5.0, running)  # 5x its bound, each step within it
        assert ex.is_healthy and ex.health_stats()["stuck_waves"] == 0
        ex.cancel(running)
        assert running.result(60).outputs["s"].aborted
    finally:
        ex.shutdown()


def test_a_worker_whose_engine_is_gone_exits_before_it_imports_torch() -> None:
    """The lifeline is watched from the first line of `python -m diffbatch.worker`: an
    engine killed during a worker's start-up does not leave it importing for seconds."""
    import socket

    ours, theirs = socket.socketpair()  # the engine's end stays open: no EOF there
    read_end, write_end = os.pipe()
    os.close(write_end)  # the engine is gone before the worker starts
    try:
        worker = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "diffbatch.worker",
             "--conn-fd", str(theirs.fileno()), "--lifeline-fd", str(read_end)],
            pass_fds=(theirs.fileno(), read_end), capture_output=True, text=True,
            timeout=DEADLINE_S)
    finally:
        os.close(read_end)
        ours.close()
        theirs.close()
    assert worker.returncode == 0, worker.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in worker.stderr.splitlines()
                if line.startswith("import time:")}
    assert "diffbatch.worker.lifeline" in imported
    assert "torch" not in imported


def test_the_stuck_wave_bound_stretches_with_the_machines_load(monkeypatch):
    """A wave past its bound on an idle machine is stuck; on a machine with 4x more
    runnable processes than CPUs the same wave is only slow (every wave is), and its
    worker lives until the stretched bound."""
    import threading
    from types import SimpleNamespace

    from diffbatch.executor import multiproc

    executor = multiproc.MultiprocExecutor.__new__(multiproc.MultiprocExecutor)
    executor.num_frozen = executor.num_stuck_waves = 0
    killed: list[bool] = []
    process = SimpleNamespace(kill=lambda: killed.append(True))
    call = SimpleNamespace(stall_after_s=1.0, in_batch=False, what="wave 1 (1 request)")
    worker = SimpleNamespace(stalled=None, pid=1, _proc_lock=threading.Lock(),
                             process=process, running_call=lambda: (call, 100.0))
    monkeypatch.setattr(multiproc, "cpu_contention", lambda: 4.0)
    executor._check_running_call(worker, now=103.0)  # 3 s: within 4 x 1 s
    assert not killed and worker.stalled is None
    executor._check_running_call(worker, now=104.5)
    assert killed and "x 4.0 for the machine's load" in worker.stalled
    killed.clear()
    worker.stalled = None
    monkeypatch.setattr(multiproc, "cpu_contention", lambda: 1.0)
    executor._check_running_call(worker, now=101.5)  # idle: 1.5 s is past 1 s
    assert killed and "load" not in worker.stalled


def test_more_torch_threads_than_the_workers_cpus_is_warned_about(caplog):
    import logging

    from diffbatch.executor.multiproc import _worker_env

    first_cpu = sorted(os.sched_getaffinity(0))[0]
    with caplog.at_level(logging.INFO, logger="diffbatch"):
        env = _worker_env(EngineConfig(torch_num_threads=64, worker_cpus=str(first_cpu)))
        assert env["OMP_NUM_THREADS"] == "64"  # the user's number is kept
        _worker_env(EngineConfig(torch_num_threads=1, worker_cpus=str(first_cpu)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"torch_num_threads=64 is more than the 1 CPU(s) the worker may use "
        f"(worker_cpus={first_cpu}): the threads beyond them only take turns, and every "
        "forward waits for the slowest"]
