"""The worker process main: load the pipeline once, then serve calls over a pipe.

`MultiprocExecutor` starts `worker_main` in a spawned process. The worker

1. fixes glibc's malloc thresholds (`diffbatch.worker.malloc`), pins itself to
   `worker_cpus` (if configured), sets torch's thread count (if configured) and
   builds the runner, which loads the pipeline;
2. sends `WorkerReady` with the pipeline's info, or with the load error and exits;
3. loops: receive a `WorkerCall`, run it on the runner, pack the result's large
   tensors into shared memory (`diffbatch.ipc.shm`), send a `WorkerReply`.

An exception while handling one call becomes an error reply; it never ends the
loop. The loop ends on a "shutdown" call or when the pipe closes (the engine
process is gone).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from diffbatch.cpus import parse_cpu_list, pin_to_cpus
from diffbatch.errors import ConfigError
from diffbatch.ipc import shm
from diffbatch.ipc.messages import (
    UNREADABLE_CALL_ID,
    WORKER_METHODS,
    WorkerCall,
    WorkerError,
    WorkerReady,
    WorkerReply,
    recv_message,
    send_message,
)
from diffbatch.worker.malloc import tune_malloc

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_RUNNER_FACTORY = "diffbatch.worker.model_runner:ModelRunner"
_LOG_FORMAT = "%(asctime)s %(levelname)s [worker %(process)d] %(name)s: %(message)s"


def resolve_runner_factory(name: str) -> Any:
    """Import "package.module:attr" (or "package.module.attr") and return the attribute."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"runner factory must be a dotted name 'module:attr', got {name!r}")
    return getattr(importlib.import_module(module_name), attr)


def worker_main(
    config: EngineConfig,
    conn: Connection,
    runner_factory: str | None = None,
    log_level: int | None = None,
) -> None:
    """Run the worker: load, report ready, serve calls until shutdown or pipe close.

    `runner_factory` names a callable `factory(config)` returning a runner (default:
    `ModelRunner`); tests pass a fake here. `log_level` is the engine process's
    diffbatch log level; a spawned process starts with logging unconfigured.
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
        runner = _load_runner(config, runner_factory or DEFAULT_RUNNER_FACTORY)
        info = runner.info()
    except BaseException as exc:  # a load failure is reported, then the worker exits
        logger.error("worker %d failed to load the pipeline: %s", os.getpid(), exc)
        _send_quietly(conn, WorkerReady(os.getpid(), error=WorkerError.from_exception(exc)))
        conn.close()
        return
    load_time_s = time.monotonic() - start
    logger.info("worker %d ready (%s) in %.1f s%s", os.getpid(), info.name, load_time_s,
                "" if tuned else " (malloc thresholds left as they were)")
    if not _send_quietly(conn, WorkerReady(os.getpid(), info=info, load_time_s=load_time_s)):
        return
    _serve(runner, conn, config.shm_threshold_bytes)
    conn.close()
    logger.info("worker %d exiting", os.getpid())


def _pin(worker_cpus: str) -> None:
    try:
        pin_to_cpus(parse_cpu_list(worker_cpus))
    except OSError as exc:  # e.g. the CPUs are outside this container's cpuset
        raise ConfigError(f"could not pin the worker to CPUs {worker_cpus!r}: {exc}") from None
    logger.info("worker %d pinned to CPUs %s", os.getpid(), worker_cpus)


def _load_runner(config: EngineConfig, runner_factory: str) -> Any:
    """Set torch's threads, then build the runner (which loads the pipeline)."""
    import torch

    if config.torch_num_threads is not None:
        torch.set_num_threads(config.torch_num_threads)
    return resolve_runner_factory(runner_factory)(config)


def _serve(runner: Any, conn: Connection, threshold_bytes: int) -> None:
    """The call loop; returns on a shutdown call or a closed pipe."""
    while True:
        try:
            call = recv_message(conn)
        except (EOFError, OSError):
            logger.info("worker %d: pipe closed, the engine process is gone", os.getpid())
            return
        except Exception as exc:  # a call that does not unpickle here: answer with the error
            logger.error("worker %d: could not read a call: %s", os.getpid(), exc)
            if not _send_reply(conn, WorkerReply(UNREADABLE_CALL_ID,
                                                 error=WorkerError.from_exception(exc))):
                return
            continue
        if not isinstance(call, WorkerCall):
            logger.error("worker %d: ignoring unexpected message %r", os.getpid(), type(call))
            continue
        if call.method == "shutdown":
            return
        reply = _handle(runner, call, threshold_bytes)
        if not _send_reply(conn, reply):
            return


def _handle(runner: Any, call: WorkerCall, threshold_bytes: int) -> WorkerReply:
    """Run one call and pack its result; any exception becomes an error reply."""
    start = time.perf_counter()
    try:
        if call.method not in WORKER_METHODS:
            raise ValueError(f"unknown worker method {call.method!r}")
        if call.method == "check_health":
            # A runner may offer its own check; replying at all proves the loop is alive.
            check = getattr(runner, "check_health", None)
            result = check() if check is not None else None
        else:
            result = getattr(runner, call.method)(call.arg)
    except Exception as exc:
        logger.error("worker %d: %s raised %s", os.getpid(), call.method, type(exc).__name__)
        return WorkerReply(call.call_id, error=WorkerError.from_exception(exc),
                           execute_time_ms=(time.perf_counter() - start) * 1e3)
    executed = time.perf_counter()
    try:
        packed = shm.pack(result, threshold_bytes)
    except Exception as exc:  # e.g. /dev/shm is full; pack() already cleaned up
        logger.error("worker %d: packing the %s result failed: %s", os.getpid(), call.method, exc)
        return WorkerReply(call.call_id, error=WorkerError.from_exception(exc),
                           execute_time_ms=(executed - start) * 1e3)
    return WorkerReply(
        call.call_id,
        result=packed,
        execute_time_ms=(executed - start) * 1e3,
        pack_time_ms=(time.perf_counter() - executed) * 1e3,
    )


def _send_reply(conn: Connection, reply: WorkerReply) -> bool:
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
        error = WorkerReply(reply.call_id, error=WorkerError.from_exception(exc),
                            execute_time_ms=reply.execute_time_ms)
        return _send_quietly(conn, error)
    return True


def _send_quietly(conn: Connection, message: Any) -> bool:
    """Send `message`; False (instead of raising) if the engine process is gone."""
    try:
        send_message(conn, message)
    except (BrokenPipeError, EOFError, OSError):
        logger.info("worker %d: pipe closed while sending, the engine process is gone",
                    os.getpid())
        return False
    return True
