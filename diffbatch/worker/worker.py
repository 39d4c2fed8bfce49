"""The worker process program: load the pipeline once, then serve calls over a pipe.

`MultiprocExecutor` starts it as its own program, `python -m diffbatch.worker
--conn-fd N --lifeline-fd M`, so nothing of the user's script is re-imported (no
`if __name__ == "__main__":` needed). `main()` wraps the inherited socket in a
`Connection`, starts the lifeline watcher (the worker exits the moment the engine
process is gone, even in the middle of a wave), reads the `WorkerStart` message and
runs `worker_main`, which

1. fixes glibc's malloc thresholds (`diffbatch.worker.malloc`), pins itself to
   `worker_cpus` (if configured), sets torch's thread count (if configured) and
   builds the runner, which loads the pipeline;
2. sends `WorkerReady` with the pipeline's info, or with the load error and exits;
3. serves: a receive thread reads the pipe (calls go to an inbox, a `WorkerCancel`
   flags its call at once, even mid-wave), a heartbeat thread sends
   `WorkerHeartbeat` every `heartbeat_interval_s` (a frozen worker falls silent),
   and the main thread takes calls from the inbox in order, runs each on the runner
   with a `should_stop` that reads its cancel flag (a cancelled call that has not
   started is answered with aborted outputs without running) and an
   `on_partial_image` that sends each partial image as a `WorkerPartialImage` while
   the wave runs, packs the result's large tensors into shared memory
   (`diffbatch.ipc.shm`) and sends a `WorkerReply`.

An exception while handling one call becomes an error reply; it never ends the
loop. The loop ends on a "shutdown" call or when the pipe closes (the engine
process is gone).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from diffbatch.cpus import parse_cpu_list, pin_to_cpus
from diffbatch.errors import ConfigError, InvalidRequestError
from diffbatch.ipc import shm
from diffbatch.ipc.messages import (
    UNREADABLE_CALL_ID,
    WORKER_METHODS,
    ByteSink,
    WorkerCall,
    WorkerCancel,
    WorkerError,
    WorkerHeartbeat,
    WorkerJoined,
    WorkerPartialImage,
    WorkerReady,
    WorkerReply,
    WorkerStart,
    heartbeat_interval_s,
    recv_message,
    send_message,
)
from diffbatch.outputs import BatchRunnerOutput, PartialImage
from diffbatch.worker import lifeline
from diffbatch.worker.malloc import tune_malloc
from diffbatch.worker.step_runner import StepRunner

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s [worker %(process)d] %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    """The program's entry: connect, watch the lifeline, read `WorkerStart`, serve.

    Returns the exit code: 0 after a shutdown call or a closed pipe, 2 when the
    first message is not a `WorkerStart`.
    """
    parser = argparse.ArgumentParser(prog="python -m diffbatch.worker",
                                     description="diffbatch worker process (started by "
                                     "the engine; not meant to be run by hand)")
    parser.add_argument("--conn-fd", type=int, required=True,
                        help="inherited socket to the engine process")
    parser.add_argument("--lifeline-fd", type=int, default=None,
                        help="inherited pipe read end; EOF means the engine process is gone")
    args = parser.parse_args(argv)
    if args.lifeline_fd is not None:  # `__main__` started it already; again is harmless
        lifeline.on_exit(_sweep_own_segments)
        lifeline.watch(args.lifeline_fd)
    conn = Connection(args.conn_fd)
    try:
        start = recv_message(conn)
    except (EOFError, OSError):
        return 0  # the engine went away before it said what to load
    if not isinstance(start, WorkerStart):
        return 2
    worker_main(start.config, conn, start.log_level)
    return 0


def _sweep_own_segments() -> None:
    """Remove the shared-memory segments this worker created (the engine is gone and
    will never unlink them)."""
    shm.sweep(shm.segment_prefix(os.getpid()))


def worker_main(
    config: EngineConfig,
    conn: Connection,
    log_level: int | None = None,
) -> None:
    """Run the worker: load, report ready, serve calls until shutdown or pipe close.

    It may also run in a process started by `multiprocessing` (tests do), with the
    engine's end of a `Pipe` as `conn`.
    `log_level` is the engine process's diffbatch log level; a new process starts
    with logging unconfigured.
    """
    # NOTE: Ctrl-C in a terminal reaches the whole process group; the engine process
    # decides when the worker stops, so the worker ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_level is not None and not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format=_LOG_FORMAT)
    start = time.monotonic()
    tuned = tune_malloc()  # before torch allocates anything
    try:
        if config.worker_cpus is not None:  # before torch starts threads: they inherit it
            _pin(config.worker_cpus)
        runner = _load_runner(config)
        info = runner.info()
        steps = StepRunner(runner) if config.step_execution else None
    except BaseException as exc:  # a load failure is reported, then the worker exits
        logger.error("worker %d failed to load the pipeline: %s", os.getpid(), exc)
        _send_quietly(conn, WorkerReady(os.getpid(), error=WorkerError.from_exception(exc)))
        conn.close()
        return
    logger.info("worker %d ready (%s) in %.1f s%s", os.getpid(), info.name,
                time.monotonic() - start, "" if tuned else " (malloc thresholds left as they were)")
    if not _send_quietly(conn, WorkerReady(os.getpid(), info=info)):
        return
    _serve(runner, conn, config.shm_threshold_bytes,
           heartbeat_interval_s(config.worker_stall_timeout_s), steps,
           threads=_thread_count())
    conn.close()
    logger.info("worker %d exiting", os.getpid())


def _thread_count() -> Callable[[], int]:
    """What the heartbeat reports as torch's thread count (read in the main thread at
    start: OpenMP's count is per thread, the heartbeat's own would say nothing)."""
    import torch

    fixed = torch.get_num_threads()
    return lambda: fixed


def _pin(worker_cpus: str) -> None:
    try:
        pin_to_cpus(parse_cpu_list(worker_cpus))
    except OSError as exc:  # e.g. the CPUs are outside this container's cpuset
        raise ConfigError(f"could not pin the worker to CPUs {worker_cpus!r}: {exc}") from None
    logger.info("worker %d pinned to CPUs %s", os.getpid(), worker_cpus)


def _load_runner(config: EngineConfig) -> Any:
    """Set torch's threads, then build the runner (which loads the pipeline)."""
    import torch

    from diffbatch.worker.model_runner import ModelRunner

    if config.torch_num_threads is not None:
        torch.set_num_threads(config.torch_num_threads)
    return ModelRunner(config)


class _Channel:
    """The worker's sending end: replies and heartbeats come from two threads, so
    each message is written whole under a lock (a `Connection` for `send_message`)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send_bytes(self, data: bytes) -> None:
        with self._lock:
            self.conn.send_bytes(data)


class _Unreadable:
    """Inbox entry for a call that did not unpickle here (answered in its place)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class Inbox:
    """Calls received and not yet run, in order, and the ids of cancelled calls.

    The receive thread puts and cancels; the main thread takes calls in order and
    asks whether its current call was cancelled (a set lookup, once per step).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: deque[WorkerCall | _Unreadable] = deque()
        self._closed = False
        self._cancelled: set[int] = set()

    def put(self, item: WorkerCall | _Unreadable) -> None:
        with self._cond:
            self._calls.append(item)
            self._cond.notify()

    def close(self) -> None:
        """The pipe closed: the engine is gone, nobody reads replies any more."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def get(self) -> WorkerCall | _Unreadable | None:
        """The next call, waiting for one; None once the pipe closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._calls or self._closed)
            return None if self._closed else self._calls.popleft()

    def drain(self) -> list[WorkerCall | _Unreadable]:
        """Every call received so far, without waiting (step mode, between ticks)."""
        with self._cond:
            calls = list(self._calls)
            self._calls.clear()
            return calls

    @property
    def closed(self) -> bool:
        return self._closed

    def cancelled_among(self, call_ids: Callable[[], set[int]]) -> set[int]:
        """Which of `call_ids()` were cancelled (step mode: each request is a call); the
        ids are only asked for when some call was cancelled (between every two ticks)."""
        return call_ids() & self._cancelled if self._cancelled else set()

    def forget(self, call_id: int) -> None:
        """Forget a cancel of this call only (step mode: calls end out of order)."""
        self._cancelled.discard(call_id)

    def cancel(self, call_id: int) -> None:
        self._cancelled.add(call_id)

    def is_cancelled(self, call_id: int) -> bool:
        return call_id in self._cancelled

    def done(self, call_id: int) -> None:
        """Forget cancels of this call and older ones (ids increase)."""
        self._cancelled = {c for c in self._cancelled if c > call_id}


def _receive(conn: Connection, inbox: Inbox) -> None:
    """The receive thread: calls into the inbox, cancels flagged at once."""
    while True:
        try:
            message = recv_message(conn)
        except (EOFError, OSError):
            logger.info("worker %d: pipe closed, the engine process is gone", os.getpid())
            inbox.close()
            return
        except Exception as exc:  # a call that does not unpickle here: answer with the error
            logger.error("worker %d: could not read a call: %s", os.getpid(), exc)
            inbox.put(_Unreadable(exc))
            continue
        if isinstance(message, WorkerCancel):
            inbox.cancel(message.call_id)
        elif isinstance(message, WorkerCall):
            inbox.put(message)
        else:
            logger.error("worker %d: ignoring unexpected message %r", os.getpid(), type(message))


def _beat(channel: _Channel, interval_s: float, stop: threading.Event,
          ticks: Callable[[], int], threads: Callable[[], int] = lambda: 0,
          compiled: Callable[[], dict[str, float]] = dict) -> None:
    """The heartbeat thread: one `WorkerHeartbeat` per interval while serving, with the
    running batch's tick count (step mode; the engine sees a batch that stopped) and
    the compile counts (for /metrics)."""
    while not stop.wait(interval_s):
        if not _send_quietly(channel, WorkerHeartbeat(time.monotonic(), ticks(), threads(),
                                                      compiled())):
            return


def _serve(runner: Any, conn: Connection, threshold_bytes: int,
           heartbeat_s: float = 0.0, steps: StepRunner | None = None,
           threads: Callable[[], int] = lambda: 0) -> None:
    """Serve calls until a shutdown call or a closed pipe; see the module docstring."""
    channel = _Channel(conn)
    inbox = Inbox()
    threading.Thread(target=_receive, args=(conn, inbox), daemon=True,
                     name="diffbatch-worker-receive").start()
    stop_beating = threading.Event()
    # Request mode: a wave's pipeline asks `should_stop` between its denoising steps
    # (every diffusers pipeline does), so the number of asks is its progress: the
    # heartbeat carries it, and the engine's stuck-wave bound counts from the last step.
    steps_done = [0]  # written by the main thread only

    def should_stop_after_a_step(call_id: int) -> bool:
        steps_done[0] += 1
        return inbox.is_cancelled(call_id)

    if heartbeat_s > 0:
        ticks = (lambda: steps_done[0]) if steps is None else (lambda: steps.num_ticks)
        stats = getattr(runner, "compile_stats", None)
        compiled = dict if stats is None else stats.as_dict
        threading.Thread(target=_beat, args=(channel, heartbeat_s, stop_beating, ticks,
                                             threads, compiled),
                         daemon=True, name="diffbatch-worker-heartbeat").start()
    accepted = _accepted_kwargs(runner)
    try:
        if steps is not None:
            steps.send_partial_images_to(functools.partial(_send_partial_image, channel,
                                                           threshold_bytes=threshold_bytes))
            steps.report_joins_to(
                lambda call_ids: _send_quietly(channel, WorkerJoined(call_ids)))
            serve_steps(steps, runner, inbox,
                        lambda reply: _send_reply(channel, reply), threshold_bytes)
            return
        while True:
            call = inbox.get()
            if call is None:
                return
            if isinstance(call, _Unreadable):
                reply = WorkerReply(UNREADABLE_CALL_ID, error=WorkerError.from_exception(call.exc))
            elif call.method == "shutdown":
                return
            else:
                should_stop = functools.partial(should_stop_after_a_step, call.call_id)
                on_partial_image = functools.partial(_send_partial_image, channel,
                                                     call.call_id,
                                                     threshold_bytes=threshold_bytes)
                reply = _handle(runner, call, threshold_bytes, should_stop,
                                on_partial_image, accepted)
                inbox.done(call.call_id)
            if not _send_reply(channel, reply):
                return
    finally:
        stop_beating.set()


def serve_steps(
    steps: StepRunner, runner: Any, inbox: Inbox, send: Callable[[WorkerReply], bool],
    threshold_bytes: int | None,
) -> None:
    """Step mode's loop: run ticks back to back while requests run, taking joins and
    cancels between ticks; each request is answered the tick it leaves the batch.

    Other calls (the engine's start-up calibration waves) run as in request mode,
    between ticks. `threshold_bytes` None: replies are not packed into shared memory
    (an in-process caller).
    """
    while True:
        calls = [] if not steps.idle else [inbox.get()]
        calls += inbox.drain()
        if inbox.closed:
            return
        for call in calls:
            if call is None:
                return
            if isinstance(call, _Unreadable):
                reply = WorkerReply(UNREADABLE_CALL_ID,
                                    error=WorkerError.from_exception(call.exc))
            elif call.method == "shutdown":
                return
            elif call.method == "join":
                steps.join(call.arg)
                continue
            else:
                reply = _handle(runner, call, threshold_bytes) \
                    if threshold_bytes is not None else _run_call(runner, call)
            if not send(reply):
                return
        for call_id in inbox.cancelled_among(steps.call_ids):
            output = steps.cancel(call_id)
            inbox.forget(call_id)
            if output is not None and not send(WorkerReply(call_id, result=BatchRunnerOutput(
                    outputs={output.request_id: output}, num_forwards=0,
                    ticks=steps.take_ticks()))):
                return
        finished = steps.tick()
        ticks = steps.take_ticks() if finished else []
        for i, (call_id, output) in enumerate(finished):
            result = BatchRunnerOutput(outputs={output.request_id: output},
                                       forward_time_ms=output.execute_time_ms,
                                       ticks=ticks if i == 0 else [])
            reply = _pack_reply(call_id, result, threshold_bytes)
            if not send(reply):
                return


def _run_call(runner: Any, call: WorkerCall) -> WorkerReply:
    """Run a call in process (no shared memory); an exception becomes an error reply."""
    try:
        return WorkerReply(call.call_id, result=getattr(runner, call.method)(call.arg))
    except Exception as exc:
        return WorkerReply(call.call_id, error=WorkerError.from_exception(exc))


_RUNNER_KWARGS = ("should_stop", "on_partial_image")


def _accepted_kwargs(runner: Any) -> frozenset[str]:
    """Which of `should_stop` and `on_partial_image` the runner's `execute_batch` takes
    (test runners may take neither)."""
    try:
        parameters = inspect.signature(runner.execute_batch).parameters
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(name for name in _RUNNER_KWARGS if name in parameters)


def _send_partial_image(channel: _Channel, call_id: int, partial: PartialImage, *,
                        threshold_bytes: int) -> None:
    """Send one partial image of call `call_id` now (from the forward's thread).

    A preview that cannot be sent is dropped: the call's reply still comes, and it is
    what the request's caller waits for.
    """
    try:
        packed = shm.pack(partial, threshold_bytes)
    except Exception as exc:  # e.g. /dev/shm is full; pack() already cleaned up
        logger.warning("worker %d: dropping a partial image: %s", os.getpid(), exc)
        return
    if not _send_quietly(channel, WorkerPartialImage(call_id, packed)):
        shm.release(packed)


def _handle(
    runner: Any, call: WorkerCall, threshold_bytes: int,
    should_stop: Callable[[], bool] = lambda: False,
    on_partial_image: Callable[[PartialImage], None] | None = None,
    accepted: frozenset[str] = frozenset(),
) -> WorkerReply:
    """Run one call and pack its result; any exception becomes an error reply.

    A wave cancelled before it starts is answered with aborted outputs, unrun.
    """
    try:
        if call.method not in WORKER_METHODS:
            raise ValueError(f"unknown worker method {call.method!r}")
        if call.method == "execute_batch" and should_stop():
            result = BatchRunnerOutput.aborted(call.arg.req_ids)
        elif call.method == "execute_batch":
            given = {"should_stop": should_stop, "on_partial_image": on_partial_image}
            result = runner.execute_batch(
                call.arg, **{name: given[name] for name in accepted})
        else:
            result = getattr(runner, call.method)(call.arg)
    except Exception as exc:  # (a refused input, e.g. a bad adapter, is no worker error)
        logger.log(logging.INFO if isinstance(exc, InvalidRequestError) else logging.ERROR,
                   "worker %d: %s raised %s", os.getpid(), call.method, type(exc).__name__)
        return WorkerReply(call.call_id, error=WorkerError.from_exception(exc))
    return _pack_reply(call.call_id, result, threshold_bytes)


def _pack_reply(call_id: int, result: Any, threshold_bytes: int | None) -> WorkerReply:
    """The reply carrying `result`, its large tensors moved to shared memory (None:
    left in place, for an in-process caller)."""
    if threshold_bytes is None:
        return WorkerReply(call_id, result=result)
    try:
        packed = shm.pack(result, threshold_bytes)
    except Exception as exc:  # e.g. /dev/shm is full; pack() already cleaned up
        logger.error("worker %d: packing a result failed: %s", os.getpid(), exc)
        return WorkerReply(call_id, error=WorkerError.from_exception(exc))
    return WorkerReply(call_id, result=packed)


def _send_reply(conn: ByteSink, reply: WorkerReply) -> bool:
    """Send a reply; a result that does not pickle becomes an error reply instead.

    Returns False if the engine process is gone (the segments are released then).
    """
    try:
        send_message(conn, reply)
    except (BrokenPipeError, EOFError, OSError):
        shm.release(reply.result)  # nobody will read these segments
        logger.info("worker %d: pipe closed while replying, the engine process is gone",
                    os.getpid())
        return False
    except Exception as exc:  # pickling failed before anything was written
        shm.release(reply.result)
        logger.error("worker %d: could not send the reply: %s", os.getpid(), exc)
        error = WorkerReply(reply.call_id, error=WorkerError.from_exception(exc))
        return _send_quietly(conn, error)
    return True


def _send_quietly(conn: ByteSink, message: Any) -> bool:
    """Send `message`; False (instead of raising) if the engine process is gone."""
    try:
        send_message(conn, message)
    except (BrokenPipeError, EOFError, OSError):
        logger.info("worker %d: pipe closed while sending, the engine process is gone",
                    os.getpid())
        return False
    return True
