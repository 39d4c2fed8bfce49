"""`MultiprocExecutor`: the runner in a worker process, results through shared memory.

The default executor for serving. It keeps the pipeline (and torch's threads) out
of the engine process, so a crash in native code kills only the worker. The
worker's life, as the serving worker of one executor:

    starting --WorkerReady--> serving --exit/kill--> dead --replacement ready--> serving
       |  load error, timeout    |                    ^  |  3 starts in a row fail
       v                         | no heartbeat, or   |  v
    (start-up raises)            v a wave past bound  |  dead for good (unhealthy)
                               stalled --SIGKILL------+
    any state --shutdown()--> closed

- start-up runs `python -m diffbatch.worker` as its own program (never a re-import of
  the user's script, so no `__main__` guard is needed) with one end of a socket pair
  and the read end of a lifeline pipe, sends `WorkerStart` and waits for
  `WorkerReady`; a load error is raised here as the same diffbatch error class (or
  a RuntimeError quoting the worker), so start-up fails clearly. The worker exits
  on its own when this process is gone (the lifeline's write end closes with it);
- each submit call sends one `WorkerCall` and returns a future at once; the
  worker runs calls in the order they were sent, so while one wave runs the next
  can already wait in the pipe (`max_concurrent_waves` = the config's
  `max_waves_in_flight`), and the worker starts it without a round trip through
  the engine. `execute_batch` is `submit_batch(...).result()`;
- `cancel(future)` sends a `WorkerCancel` for the call behind `future`: the worker
  stops it at the next denoising step (or drops it before it starts) and answers
  with aborted outputs;
- one reader thread per worker waits on the pipe *and* the process's pidfd (no
  polling), unpacks each reply's shared-memory tensors and resolves the future of
  the call it answers; a `WorkerPartialImage` (sent while a wave runs, before its
  reply) is unpacked the same way and handed to the partial-image listener. It also
  watches for a worker that stopped making progress (stalled): the worker sends a
  heartbeat every second or so from a thread of its own, so when none came for
  `worker_stall_timeout_s` the process is stopped or starved ("frozen"); when the
  heartbeat lives but the running wave is past the stall bound it was submitted with
  (`submit_batch(stall_after_s=...)`, a multiple of its expected time), its forward
  hangs ("stuck"). Either way the reader kills it (SIGKILL) and handles the death
  below;
- a worker that dies fails every pending call with `WorkerDiedError` at once (the
  oldest with `started=True`: it was running; the rest never started, and calls
  submitted while a replacement starts are refused the same way); the executor
  turns unhealthy (`is_restarting`), sweeps the dead worker's segments and starts a
  replacement in the background (again after a pause if that start fails, up to
  three attempts); `check_health()` passes again once it is ready,
  and the ready listener (`set_ready_listener`) is called, so the engine can hold
  its queue meanwhile and re-run what the dead worker was running;
- step mode: the requests the worker reported joining its running batch
  (`WorkerJoined`) are not failed but held, and re-run from their start on the
  replacement in halves, as the engine re-runs a crashed wave of request mode: each
  half is an isolated join (a batch of its own, which nothing else joins), sent
  before anything the engine sends the replacement, and a half the worker dies under
  again is split again. Only a request that kills a worker again when re-run alone
  fails. Their futures stay the engine's, so the engine sees a request finish as if
  no crash had happened (a stream's previews are sent again, and the engine's
  partial-image router drops the indices already sent). The requests still in the
  worker's queue never started and fail `started=False` (the engine queues them
  again), except those of an isolated join, which are held with their group.

Threads: any thread may submit (sends are serialised per worker); futures are
resolved on the reader thread, so their callbacks must not block. `_lock` guards
which worker is serving; a worker's `pending_lock` guards its unanswered calls.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from diffbatch.cpus import parse_cpu_list
from diffbatch.crash_reruns import failed_again, rerun_groups
from diffbatch.errors import ConfigError, EngineClosedError, EngineDeadError, WorkerDiedError
from diffbatch.executor.abstract import Executor
from diffbatch.executor.forkserver import ForkedProcess, fork_allowed
from diffbatch.executor.worker_process import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    PendingCall,
    WorkerProcess,
    describe_exit,
)
from diffbatch.ipc import shm
from diffbatch.ipc.messages import (
    UNREADABLE_CALL_ID,
    StepJoin,
    WorkerCall,
    WorkerCancel,
    WorkerError,
    WorkerHeartbeat,
    WorkerJoined,
    WorkerMethod,
    WorkerPartialImage,
    WorkerReady,
    WorkerReply,
    heartbeat_interval_s,
    recv_message,
)
from diffbatch.outputs import BatchRunnerOutput
from diffbatch.worker.threads import (
    choose_threads,
    cpu_contention,
    shares_cpus_with_this_process,
    usable_cpu_count,
)

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0  # imports (~6 s) plus loading a real model from disk
# A replacement worker that fails to start (killed while loading, out of memory for a
# moment) is started again after these pauses; after the last attempt the executor is
# dead for good. A load that fails for good (the model folder is gone) costs the two
# pauses and two more starts before the engine says so.
RESTART_PAUSES_S = (1.0, 5.0)


def _worker_env(config: EngineConfig) -> dict[str, str]:
    """The worker's environment: ours, with our import path and its thread settings.

    The worker imports what this process can import (a custom pipeline class or
    runner next to the user's script included), so it gets our `sys.path`. Threads
    and OpenMP's wait policy are chosen here, before the worker imports torch
    (`diffbatch.worker.threads`).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    pinned = parse_cpu_list(config.worker_cpus) if config.worker_cpus else None
    usable = usable_cpu_count(pinned)
    choice = choose_threads(usable_cpus=usable, env=env,
                            torch_num_threads=config.torch_num_threads,
                            shares_front_end=shares_cpus_with_this_process(pinned))
    choice.apply(env)
    logger.info("worker threads: %s", choice.reason)
    if config.torch_num_threads is not None and config.torch_num_threads > usable:
        logger.warning(
            "torch_num_threads=%d is more than the %d CPU(s) the worker may use%s: the "
            "threads beyond them only take turns, and every forward waits for the slowest",
            config.torch_num_threads, usable,
            f" (worker_cpus={config.worker_cpus})" if config.worker_cpus else "")
    return env


def _check_pipeline_class_importable(config: EngineConfig) -> None:
    """A pipeline class defined in the user's `__main__` cannot be imported by the
    worker, which never runs the user's script; say so before starting it."""
    cls = config.pipeline_class
    if isinstance(cls, type) and cls.__module__ == "__main__":
        raise ConfigError(
            f"pipeline_class {cls.__qualname__} is defined in the script being run "
            "(__main__), which the worker process cannot import: move it to a module of "
            "its own (or pass its dotted name), or use executor='inproc'"
        )


class MultiprocExecutor(Executor):
    """Runs the `ModelRunner` in a worker process; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        restart_on_death: bool = True,
    ) -> None:
        super().__init__(config)
        _check_pipeline_class_importable(config)
        self._env = _worker_env(config)
        self._fork = fork_allowed(config.device)  # forked from a fork server, or spawned
        self._startup_timeout_s = startup_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._restart_on_death = restart_on_death  # False after `stop_restarting`
        self.max_concurrent_waves = config.max_waves_in_flight
        self._lock = threading.Lock()
        self._health = threading.Condition(self._lock)  # notified when serving changes
        self._call_ids = itertools.count(1)
        self._worker: WorkerProcess | None = None  # the serving worker; None while dead
        self._starting: WorkerProcess | None = None  # a replacement being started
        self._restart_thread: threading.Thread | None = None
        self._dead_reason = "no worker process is running"  # why `_worker` is None
        self._closed = False
        self._stall_timeout_s = config.worker_stall_timeout_s  # 0: never declared frozen
        self.num_restarts = 0  # replacement workers started after a death
        self.num_deaths = 0  # serving workers that died (killed as frozen included)
        self.num_frozen = 0  # workers killed as stalled (silent heartbeat or stuck wave)
        self.num_stuck_waves = 0  # of those, killed because a wave ran past its bound
        self.num_batch_reruns = 0  # step mode: halves of running batches re-run
        # step mode: groups of requests a worker died under, to re-run on the
        # replacement in this order (see the module docstring); guarded by `_lock`
        self._held: list[list[PendingCall]] = []

        worker, ready = self._start_worker()
        assert ready.info is not None
        self.info = ready.info
        self._worker = worker
        _live_executors.add(self)

    @property
    def worker_pid(self) -> int | None:
        """The serving worker's process id; None while it is dead or restarting."""
        with self._lock:
            return self._worker.pid if self._worker is not None else None

    @property
    def is_healthy(self) -> bool:
        """Whether a live worker is serving (never blocks on a running call)."""
        with self._lock:
            worker = None if self._closed else self._worker
        return worker is not None and not worker.exited() and worker.stalled is None

    @property
    def is_restarting(self) -> bool:
        """Whether the worker died and a replacement is starting (work can wait for it)."""
        with self._lock:
            return not self._closed and self._worker is None and self._restart_thread is not None

    def health_stats(self) -> dict[str, float]:
        with self._lock:
            worker = None if self._closed else self._worker
        up = worker is not None and not worker.exited() and worker.stalled is None
        return {
            "up": float(up),
            "heartbeat_age_s": time.monotonic() - worker.last_heard if worker else 0.0,
            "deaths": float(self.num_deaths),
            "frozen": float(self.num_frozen),
            "stuck_waves": float(self.num_stuck_waves),
            "restarts": float(self.num_restarts),
            "batch_reruns": float(self.num_batch_reruns),
            "torch_threads": float(worker.torch_threads if worker else 0),
        }

    def compile_stats(self) -> dict[str, float]:
        with self._lock:
            worker = None if self._closed else self._worker
        return dict(worker.compile_stats) if worker is not None else {}

    def cancel(self, future: Future[BatchRunnerOutput]) -> None:
        with self._lock:
            worker = self._worker
            held = self._take_held(lambda call: call.future is future)
        _answer_aborted(held)
        call_id = worker.call_id_of(future) if worker is not None else None
        if worker is None or call_id is None:  # answered already, or its worker is gone
            return
        with contextlib.suppress(Exception):  # a dead worker's reader fails the call anyway
            worker.send(WorkerCancel(call_id))

    def stop_restarting(self) -> None:
        with self._lock:
            self._restart_on_death = False

    def cancel_all(self) -> None:
        """Nobody waits for any call the worker has: stop them all (`cancel`)."""
        with self._lock:
            worker = self._worker
            held = self._take_held(lambda _call: True)
        _answer_aborted(held)
        if worker is None:
            return
        with worker.pending_lock:
            call_ids = list(worker.pending)
        for call_id in call_ids:
            with contextlib.suppress(Exception):
                worker.send(WorkerCancel(call_id))

    def has_started(self, future: Future[BatchRunnerOutput]) -> bool:
        """Whether the worker started the call behind `future`: a wave queued behind
        the running one has not, nor (step mode) a request not yet in the running
        batch; an answered one has."""
        with self._lock:
            worker = self._worker
        return worker is None or worker.has_started(future)

    def submit_batch(
        self, scheduler_output: SchedulerOutput, *, stall_after_s: float | None = None,
    ) -> Future[BatchRunnerOutput]:
        n = scheduler_output.num_requests
        what = f"wave {scheduler_output.wave_id} ({n} request{'s' if n != 1 else ''})"

        def convert(reply: WorkerReply) -> BatchRunnerOutput:
            if reply.error is None:
                return reply.result
            return BatchRunnerOutput.failed(scheduler_output.req_ids, reply.error.error)

        return self._submit("execute_batch", scheduler_output, what, convert, stall_after_s)

    def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        return self.submit_batch(scheduler_output).result()

    def load_lora(self, key: str) -> str:
        # (request mode: after the waves sent before it; step mode: between two ticks)
        return self._submit("load_lora", key, "a LoRA adapter load", _raise_error).result()

    def unload_lora(self, key: str) -> None:
        self._submit("unload_lora", key, "a LoRA adapter unload", _raise_error)

    def check_health(self) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the executor is shut down")
            worker = self._worker
            if worker is None:
                raise EngineDeadError(self._dead_message())
        if worker.stalled is not None:
            raise EngineDeadError(f"worker process {worker.pid} stopped making progress "
                                  f"({worker.stalled}) and is being replaced")
        if worker.exited():
            # Its reader notices the exit, fails what was pending and starts the
            # replacement; wait for that, so the reason below is the real one.
            worker.join_reader(self._shutdown_timeout_s)
            with self._lock:
                handled = self._worker is not worker
                reason = self._dead_message() if handled else f"worker process {worker.pid} died"
            raise EngineDeadError(reason)

    def wait_healthy(self, timeout_s: float) -> bool:
        """Wait until a worker serves (e.g. a replacement), the executor closes, or a
        restart fails; True if healthy. For tests and callers that can wait."""
        with contextlib.suppress(EngineDeadError):
            self.check_health()  # waits for the reader to handle a worker that just died
        with self._health:
            self._health.wait_for(
                lambda: self._closed or self._worker is not None or self._restart_thread is None,
                timeout=timeout_s,
            )
        return self.is_healthy

    def shutdown(self, timeout_s: float | None = None) -> None:
        stage_s = self._shutdown_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker, starting = self._worker, self._starting
            thread = self._restart_thread
            held = self._take_held(lambda _call: True)
            self._worker = None
            self._dead_reason = "the executor is shut down"
            self._health.notify_all()
        _live_executors.discard(self)
        for call in held:
            call.future.set_exception(
                EngineClosedError(f"the executor was shut down before it re-ran {call.what}"))
        if starting is not None:
            with contextlib.suppress(ProcessLookupError):  # the restart thread cleans up
                starting.process.terminate()
        if worker is not None:
            worker.stop(graceful=True, timeout_s=stage_s)
            # Its reader now reads the last replies and the exit, fails what is still
            # pending (EngineClosedError) and cleans up.
            if not worker.join_reader(stage_s):
                shm.sweep(shm.segment_prefix(worker.pid))
        if thread is not None:
            thread.join(stage_s)
        logger.info("multiproc executor shut down")

    def _start_worker(self, *, replacement: bool = False) -> tuple[WorkerProcess, WorkerReady]:
        start = time.monotonic()
        worker = WorkerProcess(self.config, self._env, fork=self._fork)
        with self._lock:
            closed = self._closed
            if replacement and not closed:
                self._starting = worker
        if closed:
            worker.stop(graceful=False, timeout_s=self._shutdown_timeout_s)
            worker.cleanup()
            raise EngineClosedError("the executor was shut down while a worker was starting")
        logger.info("started worker process %d (%s); waiting for it to load the pipeline",
                    worker.pid, "forked" if isinstance(worker.process, ForkedProcess)
                    else "its own program")
        try:
            ready = worker.wait_ready(self._startup_timeout_s)
        finally:
            with self._lock:
                if self._starting is worker:
                    self._starting = None
        logger.info("worker process %d ready in %.1f s", worker.pid, time.monotonic() - start)
        worker.start_reader(self._read_replies)
        return worker, ready

    def submit_join(self, wave: SchedulerOutput, capacity: int, *,
                    stall_after_s: float | None = None) -> list[Future[BatchRunnerOutput]]:
        """Step mode: add the wave's requests to the worker's running batch; one future
        per request, done when that request leaves the batch. While any is in it, the
        batch finishing no step for `stall_after_s` counts as a stuck worker."""
        def converter(request_id: str) -> Callable[[WorkerReply], BatchRunnerOutput]:
            def convert(reply: WorkerReply) -> BatchRunnerOutput:
                if reply.error is None:
                    return reply.result
                return BatchRunnerOutput.failed([request_id], reply.error.error)
            return convert

        pendings = [PendingCall(f"request {r.request_id}", converter(r.request_id), Future(),
                                stall_after_s, in_batch=True,
                                rejoin=replace(wave, requests=[r]), capacity=capacity)
                    for r in wave.requests]
        self._submit_calls("join", lambda ids: StepJoin(wave, ids, capacity), pendings)
        return [p.future for p in pendings]

    def _submit(
        self, method: WorkerMethod, arg: Any, what: str, convert: Callable[[WorkerReply], Any],
        stall_after_s: float | None = None,
    ) -> Future[Any]:
        """Send one call; its future gets `convert(reply)`, or the error that stopped it."""
        pending = PendingCall(what, convert, Future(), stall_after_s)
        self._submit_calls(method, lambda _ids: arg, [pending])
        return pending.future

    def _submit_calls(
        self, method: WorkerMethod, make_arg: Callable[[list[int]], Any],
        pendings: list[PendingCall],
    ) -> None:
        """Send one call answered by one reply per pending (each with a call id of its
        own; the call carries the first); each future gets its converted reply, or the
        error that stopped it."""
        what = pendings[0].what if len(pendings) == 1 else f"{len(pendings)} requests"
        with self._lock:
            closed, worker = self._closed, self._worker
            dead_message = self._dead_message() if worker is None else ""
            restarting = self._restart_thread is not None
        if closed:
            for p in pendings:
                p.future.set_exception(
                    EngineClosedError(f"the executor is shut down; cannot run {p.what}"))
            return
        call_ids = [next(self._call_ids) for _ in pendings]
        if worker is None and not restarting:  # dead for good
            for p in pendings:
                p.future.set_exception(EngineDeadError(f"cannot run {p.what}: {dead_message}"))
            return
        registered = []
        for call_id, pending in zip(call_ids, pendings, strict=True):
            if worker is None or not worker.add_pending(call_id, pending):
                reason = dead_message if worker is None else f"worker process {worker.pid} died"
                pending.future.set_exception(
                    WorkerDiedError(f"cannot run {pending.what}: {reason}", started=False))
            else:
                registered.append((call_id, pending))
        if worker is None or not registered:
            return
        try:
            worker.send(WorkerCall(call_ids[0], method, make_arg(call_ids)))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the worker is gone; its reader fails these calls with the reason
        except Exception as exc:  # the argument does not pickle; nothing was sent
            logger.error("could not send %s to the worker: %s", what, exc)
            for call_id, pending in registered:
                if worker.pop_pending(call_id) is pending:
                    pending.resolve(WorkerReply(call_id, error=WorkerError.from_exception(exc)))

    def _read_replies(self, worker: WorkerProcess) -> None:
        """A worker's reader thread: answer pending calls until the worker is gone, and
        kill it once it stalls: its heartbeat silent for the stall timeout, or its
        running wave past its stall bound."""
        check_s = heartbeat_interval_s(self._stall_timeout_s) if self._stall_timeout_s else None
        worker.last_heard = last_wake = time.monotonic()
        while True:
            ready = wait(worker.waitables, timeout=check_s)
            now = time.monotonic()
            if check_s is not None and now - last_wake > 3 * check_s:
                # NOTE: this process itself was not running (suspended, e.g. a
                # laptop's sleep): the silence, or the wave's time, says nothing about
                # the worker.
                worker.last_heard = worker.resumed = now
            elif not ready and now - worker.last_heard > self._stall_timeout_s:
                self._kill_stalled(worker, f"frozen: no heartbeat for "
                                           f"{now - worker.last_heard:.1f} s "
                                           f"(--worker-stall-timeout {self._stall_timeout_s:g} s)")
            last_wake = now
            if not ready:  # nothing for a heartbeat interval
                self._check_running_call(worker, now)
                continue
            if worker.conn not in ready:
                break
            try:
                reply = recv_message(worker.conn)
            except (EOFError, OSError):
                break
            except Exception as exc:  # a reply that does not unpickle here
                reply = WorkerReply(UNREADABLE_CALL_ID, error=WorkerError.from_exception(exc))
            worker.last_heard = now
            if isinstance(reply, WorkerHeartbeat):
                if reply.ticks != worker.last_ticks:  # the running batch moved on
                    worker.last_ticks, worker.last_progress = reply.ticks, now
                worker.torch_threads = reply.torch_threads
                worker.compile_stats = reply.compile_stats
                self._check_running_call(worker, now)
                continue
            if isinstance(reply, WorkerJoined):  # step mode: these calls have started
                worker.mark_joined(reply.call_ids)
                continue
            if isinstance(reply, WorkerPartialImage):  # its call runs on
                self._partial_image(reply)
                continue
            worker.last_reply = now
            call_id = getattr(reply, "call_id", None)
            pending = worker.pop_pending(call_id)
            if pending is None:
                logger.warning("dropping a worker reply nobody waits for (%r)", call_id)
                shm.release(getattr(reply, "result", None))
                continue
            try:
                reply.result = shm.unpack(reply.result)
            except Exception as exc:  # e.g. a segment that is gone
                reply = WorkerReply(reply.call_id, error=WorkerError.from_exception(exc))
            if reply.error is not None:  # (a refused input, e.g. a bad adapter: no failure)
                logger.log(logging.INFO if reply.error.error.status_code < 500
                           else logging.ERROR, "worker failed while running %s: %s",
                           pending.what, reply.error.exc_type)
                logger.debug("worker traceback:\n%s", reply.error.traceback)
            pending.resolve(reply)
        self._on_death(worker)

    def _partial_image(self, message: WorkerPartialImage) -> None:
        """(Reader thread.) Unpack a partial image and hand it to the listener."""
        try:
            partial = shm.unpack(message.partial)
        except Exception as exc:  # e.g. a segment that is gone: only a preview is lost
            logger.warning("dropping a partial image of call %d: %s", message.call_id, exc)
            return
        try:
            self._notify_partial_image(partial)
        except Exception:  # a listener's bug must not stop the reader
            logger.exception("the partial-image listener failed")

    def _check_running_call(self, worker: WorkerProcess, now: float) -> None:
        """(Reader thread.) Kill the worker if the call it runs is past its stall bound."""
        running = worker.running_call()
        if running is None:
            return
        call, since = running
        if call.stall_after_s is None or now - since <= call.stall_after_s:
            return
        # On a machine busier than it has CPUs, every wave runs slower: the bound
        # stretches with the load (up to 4x) so a slow but working worker is not killed,
        # its work lost and a model load added to the overload.
        contention = cpu_contention()
        bound_s = call.stall_after_s * contention
        if now - since <= bound_s:
            return
        what, expected = (("the running batch finished no step for", "expected step time")
                          if call.in_batch else (f"{call.what} ran", "expected time"))
        load = f" x {contention:.1f} for the machine's load" if contention > 1.0 else ""
        self._kill_stalled(
            worker, f"stuck: {what} {now - since:.1f} s, past its bound of "
            f"{bound_s:.1f} s (--wave-stall-factor x its {expected}, at least "
            f"--worker-stall-timeout{load}) while its heartbeat lived", stuck_wave=True)

    def _kill_stalled(self, worker: WorkerProcess, reason: str, *,
                      stuck_wave: bool = False) -> None:
        """(Reader thread.) The worker stopped making progress (`reason`): kill it, once;
        its death is then handled like any other (pending calls fail, a replacement
        starts)."""
        if worker.stalled is not None:
            return
        self.num_frozen += 1  # counted before `stalled` makes it visible (health)
        self.num_stuck_waves += stuck_wave
        worker.stalled = reason
        logger.error("worker process %d stalled, %s; killing it", worker.pid, reason)
        with worker._proc_lock, contextlib.suppress(ProcessLookupError):
            worker.process.kill()

    def _on_death(self, worker: WorkerProcess) -> None:
        """Handle a worker that exited (on its reader thread): clean up, fail its
        pending calls, and, for the serving worker, start a replacement."""
        if not worker.exited():  # EOF but still running: make sure it is gone
            worker.stop(graceful=False, timeout_s=self._shutdown_timeout_s)
        exit_text = describe_exit(worker.exitcode())
        if worker.stalled is not None:
            exit_text = f"{worker.stalled}, killed"
        worker.cleanup()
        pending = worker.close_pending()
        running = [c.what for c in pending if c.in_batch and c.joined] or \
            [c.what for c in pending[:1] if not c.in_batch]
        thread = None
        repeat: list[PendingCall] = []  # step mode: killed a worker again when re-run alone
        with self._lock:
            closed = self._closed
            first = self._worker is worker
            if first:
                self._worker = None
                self.num_deaths += 1
                self._dead_reason = f"worker process {worker.pid} died ({exit_text})"
                if self._restart_on_death and not closed:
                    groups, num_halves, repeat, pending = _split_for_rerun(pending)
                    self._held.extend(groups)
                    self.num_batch_reruns += num_halves
                    thread = threading.Thread(
                        target=self._restart, name="diffbatch-worker-restart", daemon=True
                    )
                    # started under the lock: whoever sees it (shutdown) may join it
                    self._restart_thread = thread
                    thread.start()
                self._health.notify_all()
        if first and not closed:
            during = f"while running {', '.join(running)}" if running else "while idle"
            logger.error("worker process %d died (%s) %s%s", worker.pid, exit_text, during,
                         "; starting a replacement" if thread is not None else "")
            if self._held and thread is not None:
                logger.warning("re-running %d request(s) of its running batch in %d "
                               "group(s) on the replacement",
                               sum(len(group) for group in self._held), len(self._held))
        for call in repeat:  # as request mode answers a wave of one that crashes again
            assert call.rejoin is not None
            call.future.set_result(BatchRunnerOutput.failed(call.rejoin.req_ids, failed_again(
                f"worker process died ({exit_text}) while running {call.what}")))
        # The worker runs calls in order: the oldest was running, the others waited. In
        # step mode the requests the worker said joined its batch were running; the
        # others waited in its queue.
        for i, call in enumerate(pending):
            started = call.joined if call.in_batch else i == 0
            call.future.set_exception(
                EngineClosedError(f"the executor was shut down while running {call.what}")
                if closed else
                WorkerDiedError(f"worker process died ({exit_text}) while running {call.what}",
                                started=True)
                if started else
                WorkerDiedError(f"worker process died ({exit_text}) before it started "
                                f"{call.what}", started=False)
            )

    def _restart(self) -> None:
        """Background thread: start a replacement worker and make it the serving one;
        a start that fails is tried again after a pause (`RESTART_PAUSES_S`), and when
        every attempt failed the executor is dead for good."""
        for attempt, pause_s in enumerate((*RESTART_PAUSES_S, None), start=1):
            try:
                worker, ready = self._start_worker(replacement=True)
                break
            except Exception as exc:
                with self._lock:
                    closed = self._closed
                    if not closed:
                        logger.error("could not start a replacement worker (attempt %d of "
                                     "%d): %s%s", attempt, len(RESTART_PAUSES_S) + 1, exc,
                                     "" if pause_s is None else
                                     f"; trying again in {pause_s:g} s")
                    if pause_s is not None and not closed:
                        # held work keeps waiting; shutdown() ends the pause at once
                        self._health.wait_for(lambda: self._closed, timeout=pause_s)
                        if not self._closed:
                            continue
                    if not self._closed:
                        self._dead_reason += f"; starting a replacement failed: {exc}"
                    self._restart_thread = None
                    held = self._take_held(lambda _call: True)
                    reason = self._dead_reason
                    self._health.notify_all()
                for call in held:
                    call.future.set_exception(WorkerDiedError(
                        f"{reason}; {call.what} could not be re-run", started=True))
                self._notify_ready()  # dead for good: held work fails now
                return
        with self._lock:
            closed = self._closed
            if not closed:
                # the held groups go first: nothing the engine sends can pass them
                groups, self._held = self._held, []
                self._rejoin(worker, groups)
                self._worker = worker
                self.num_restarts += 1
                if ready.info != self.info:
                    logger.warning("replacement worker reports different pipeline info")
            self._restart_thread = None
            self._health.notify_all()
        if closed:
            worker.stop(graceful=True, timeout_s=self._shutdown_timeout_s)
            worker.join_reader(self._shutdown_timeout_s)
        else:
            self._notify_ready()

    def _take_held(self, which: Callable[[PendingCall], bool]) -> list[PendingCall]:
        """(Holding `_lock`.) Take the held calls `which` selects out of their groups."""
        taken = [call for group in self._held for call in group if which(call)]
        if taken:
            self._held = [kept for group in self._held
                          if (kept := [call for call in group if not which(call)])]
        return taken

    def _rejoin(self, worker: WorkerProcess, groups: list[list[PendingCall]]) -> None:
        """(Holding `_lock`.) Send each held group to `worker` as an isolated join; a
        request finished meanwhile (aborted) is answered as aborted instead."""
        for group in groups:
            finished = [c for c in group if c.rejoin is None or c.rejoin.requests[0].is_finished]
            _answer_aborted(finished)
            group = [c for c in group if c not in finished]
            if not group:
                continue
            call_ids = [next(self._call_ids) for _ in group]
            now = time.monotonic()
            for call_id, call in zip(call_ids, group, strict=True):
                call.joined, call.sent, call.group = False, now, call_ids[0]
                worker.add_pending(call_id, call)
            first = group[0].rejoin
            assert first is not None
            wave = replace(first, requests=[c.rejoin.requests[0] for c in group if c.rejoin])
            join = StepJoin(wave, call_ids, max(c.capacity for c in group), isolated=True)
            try:
                worker.send(WorkerCall(call_ids[0], "join", join))
            except (BrokenPipeError, EOFError, OSError):
                pass  # the replacement is gone too: its reader handles these calls
            except Exception as exc:  # nothing was sent (it went once, so unlikely)
                logger.error("could not re-send %d request(s) to the worker: %s",
                             len(group), exc)
                for call_id, call in zip(call_ids, group, strict=True):
                    if worker.pop_pending(call_id) is call:
                        call.resolve(WorkerReply(call_id,
                                                 error=WorkerError.from_exception(exc)))

    def _dead_message(self) -> str:
        if self._restart_thread is not None:
            return f"{self._dead_reason}; a replacement worker is starting"
        return self._dead_reason


def _split_for_rerun(
    pending: list[PendingCall],
) -> tuple[list[list[PendingCall]], int, list[PendingCall], list[PendingCall]]:
    """Step mode, a dead worker's unanswered calls: (the groups to re-run on the
    replacement, in order; how many of them are new halves; the calls that killed a
    worker again when re-run alone; the rest, failed as before).

    The requests in the running batch split as request mode splits a crashed wave
    (`crash_reruns.rerun_groups`): in halves, and a request that was the only one
    left of its re-run group fails. Isolated groups that had not joined yet keep
    their group.
    """
    crashed = [c for c in pending if c.in_batch and c.joined and c.rejoin is not None]
    waiting: dict[int, list[PendingCall]] = {}
    for call in pending:
        if call.in_batch and not call.joined and call.group and call.rejoin is not None:
            waiting.setdefault(call.group, []).append(call)
    held = {id(c) for c in crashed} | {id(c) for g in waiting.values() for c in g}
    rest = [c for c in pending if id(c) not in held]
    halves = rerun_groups(crashed, any(c.crashes > 0 for c in crashed))
    if halves is None:
        return list(waiting.values()), 0, crashed, rest
    for call in crashed:
        call.crashes += 1
    return [*halves, *waiting.values()], len(halves), [], rest


def _raise_error(reply: WorkerReply) -> Any:
    """A plain call's result, or its error rebuilt here (a 400 stays a 400)."""
    if reply.error is not None:
        raise reply.error.to_exception("the worker")
    return reply.result


def _answer_aborted(calls: list[PendingCall]) -> None:
    """Answer held calls whose requests nobody waits for any more as aborted."""
    for call in calls:
        if call.rejoin is not None:
            call.future.set_result(BatchRunnerOutput.aborted(call.rejoin.req_ids))


# Executors that were never shut down are shut down at interpreter exit, so their
# workers get the graceful shutdown call instead of waking to a closed lifeline.
_live_executors: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_live_executors() -> None:
    for executor in list(_live_executors):
        # The interpreter is exiting (the script ended, or Ctrl-C ended it): nobody
        # waits for what the worker still runs, so it stops at its next denoising step
        # instead of running to the end of the shutdown timeout.
        executor.cancel_all()
        executor.shutdown()
