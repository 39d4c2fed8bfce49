"""The engine's handle on one worker process: its pipe, its lifeline, the calls it owes.

`WorkerProcess` starts a worker with one end of a socket pair and the read end of a
lifeline pipe (forked from the fork server of its environment,
`diffbatch.executor.forkserver`, or as the program `python -m diffbatch.worker`),
sends it `WorkerStart`, and keeps what the
executor needs to talk to it and to bury it: the pipe (sends serialised by a
lock), the process's pidfd (readable once it exited), the unanswered calls in the
order they were sent (`PendingCall`, each with the future it resolves), when it
was last heard from, and an escalating `stop()` (a shutdown call, SIGTERM,
SIGKILL). `cleanup()` drops unread replies and sweeps its shared-memory segments.
What to do with it (reading replies, stalls, restarts) is the executor's
(`diffbatch.executor.multiproc`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from diffbatch.executor.forkserver import ForkedProcess, start_forked
from diffbatch.ipc import shm
from diffbatch.ipc.messages import (
    UNREADABLE_CALL_ID,
    WorkerCall,
    WorkerCancel,
    WorkerReady,
    WorkerReply,
    WorkerStart,
    recv_message,
    send_message,
)

if TYPE_CHECKING:
    from diffbatch.config import EngineConfig
    from diffbatch.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0  # per stage: graceful exit, then terminate, then kill
SIGTERM_GRACE_S = 0.5  # after SIGTERM, before SIGKILL (see `WorkerProcess.stop`)


def describe_exit(code: int | None) -> str:
    """ "exit code 3", or "exit code -9 (SIGKILL)" for a signal."""
    names = {-sig.value: sig.name for sig in signal.Signals}
    return f"exit code {code}" + (f" ({names[code]})" if code in names else "")


@dataclass
class PendingCall:
    """A call sent to the worker and not answered yet."""

    what: str  # "wave 3 (8 requests)", for errors and logs
    convert: Callable[[WorkerReply], Any]  # the unpacked reply -> the future's result
    future: Future[Any]
    stall_after_s: float | None = None  # running longer than this: the worker is stuck
    sent: float = field(default_factory=time.monotonic)  # when it was sent
    # a request in step mode's running batch: its stall bound is on the batch's progress
    # (no tick finished for that long), not on its own run time
    in_batch: bool = False
    joined: bool = False  # step mode: the worker said it entered the running batch
    # step mode: what re-running the request on a replacement worker needs
    rejoin: SchedulerOutput | None = None  # a wave of this one request, to join again
    capacity: int = 1  # the capacity it joined with
    crashes: int = 0  # running batches of a worker that died under it
    group: int = 0  # the isolated join it was re-sent in (its first call id); 0: none

    def resolve(self, reply: WorkerReply) -> None:
        try:
            result = self.convert(reply)
        except Exception as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class WorkerProcess:
    """One worker process, the engine's end of its pipe and the calls it owes."""

    def __init__(self, config: EngineConfig, env: dict[str, str], *, fork: bool = False) -> None:
        parent_sock, child_sock = socket.socketpair()
        life_read, self._lifeline = os.pipe()  # both ends non-inheritable (PEP 446)
        child_fd = child_sock.detach()
        try:
            self.process: subprocess.Popen[bytes] | ForkedProcess = \
                (start_forked(env, child_fd, life_read) if fork else None) or subprocess.Popen(
                    [sys.executable, "-m", "diffbatch.worker", "--conn-fd", str(child_fd),
                     "--lifeline-fd", str(life_read)],
                    pass_fds=(child_fd, life_read), env=env,
                )
        except BaseException:
            parent_sock.close()
            os.close(self._lifeline)
            raise
        finally:
            os.close(child_fd)  # the child has its own copies; EOF here means it died
            os.close(life_read)
        self.conn = Connection(parent_sock.detach())
        self.pid: int = self.process.pid
        # Readable once the process has exited (Linux >= 5.3); elsewhere the pipe's
        # EOF is the only death signal the reader waits on.
        self.sentinel: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.sentinel = os.pidfd_open(self.pid)
        self.send_lock = threading.Lock()  # a call and shutdown() may send concurrently
        self._proc_lock = threading.Lock()  # serialises wait/terminate/kill
        # `exited()` polls the pidfd while the reader may be closing it (`cleanup`): a
        # closed number can be reused at once (the replacement's pipes) and would then
        # read as "still running".
        self._sentinel_lock = threading.Lock()
        self._cleaned = False
        self.pending_lock = threading.Lock()
        self.pending: OrderedDict[int, PendingCall] = OrderedDict()  # in the order sent
        self.accepting = True  # False once the reader has failed what was pending
        self.reader: threading.Thread | None = None
        self.last_heard = time.monotonic()  # the last message from it (reader thread)
        self.last_reply = 0.0  # when the last reply came: the next call started then
        # the progress count the last heartbeat carried (step mode: the running batch's
        # ticks; request mode: denoising steps), and when it last changed
        self.last_ticks = 0
        self.torch_threads = 0  # as the last heartbeat said
        self.compile_stats: dict[str, float] = {}  # as the last heartbeat said
        self.last_progress = 0.0
        self.resumed = 0.0  # when this process last woke from a suspension of its own
        self.stalled: str | None = None  # why it was killed as stalled ("frozen: ...")
        log_level = logging.getLogger("diffbatch").getEffectiveLevel()
        with contextlib.suppress(OSError):  # it died already: wait_ready reports why
            self.send(WorkerStart(config, log_level))

    @property
    def waitables(self) -> list[Any]:
        """What signals a reply or the worker's exit, for `multiprocessing.connection.wait`."""
        return [self.conn] if self.sentinel is None else [self.conn, self.sentinel]

    def add_pending(self, call_id: int, pending: PendingCall) -> bool:
        """Register a call before it is sent; False if the worker is already written off."""
        with self.pending_lock:
            if self.accepting:
                self.pending[call_id] = pending
            return self.accepting

    def pop_pending(self, call_id: int | None) -> PendingCall | None:
        """The call a reply answers. The worker answers in order, so a reply it could
        not address (to a call it could not unpickle) answers the oldest one."""
        with self.pending_lock:
            if call_id == UNREADABLE_CALL_ID and self.pending:
                return self.pending.popitem(last=False)[1]
            return self.pending.pop(call_id, None)  # type: ignore[arg-type]

    def mark_joined(self, call_ids: list[int]) -> None:
        """Step mode: these calls' requests entered the running batch."""
        with self.pending_lock:
            for call_id in call_ids:
                call = self.pending.get(call_id)
                if call is not None:
                    call.joined = True

    def has_started(self, future: Future[Any]) -> bool:
        """Whether the call behind `future` has started: in step mode, its request
        entered the running batch; otherwise it is the oldest unanswered call (the
        worker runs them in order, so a later one waits behind it). An answered or
        unknown call counts as started."""
        with self.pending_lock:
            for position, call in enumerate(self.pending.values()):
                if call.future is future:
                    return call.joined if call.in_batch else position == 0
        return True

    def call_id_of(self, future: Future[Any]) -> int | None:
        """The id of the unanswered call whose future is `future`, if any."""
        with self.pending_lock:
            return next((cid for cid, p in self.pending.items() if p.future is future), None)

    def running_call(self) -> tuple[PendingCall, float] | None:
        """The call the worker runs now (the oldest unanswered: it runs them in order)
        and since when: its sending, the previous reply, a resume of this process, or
        the last progress the heartbeat reported (step mode: the running batch's last
        tick; request mode: the wave's last denoising step), whichever came last."""
        with self.pending_lock:
            call = next(iter(self.pending.values()), None)
        if call is None:
            return None
        return call, max(call.sent, self.last_reply, self.resumed, self.last_progress)

    def close_pending(self) -> list[PendingCall]:
        """Stop accepting calls; return the unanswered ones (for the caller to fail)."""
        with self.pending_lock:
            self.accepting = False
            pending = list(self.pending.values())
            self.pending.clear()
        return pending

    def start_reader(self, read: Callable[[WorkerProcess], None]) -> None:
        self.reader = threading.Thread(target=read, args=(self,), daemon=True,
                                       name=f"diffbatch-worker-{self.pid}-reader")
        self.reader.start()

    def join_reader(self, timeout_s: float) -> bool:
        """Wait until the reader has handled the worker's exit; True if it has."""
        reader = self.reader
        if reader is None or reader is threading.current_thread():
            return reader is None
        reader.join(timeout_s)
        return not reader.is_alive()

    def exited(self) -> bool:
        """Whether the process has exited (non-blocking)."""
        with self._sentinel_lock:
            if self._cleaned:  # cleaned up only after it exited
                return True
            if self.sentinel is not None:
                return bool(wait([self.sentinel], timeout=0))
        with self._proc_lock:
            return self.process.poll() is not None

    def wait_ready(self, timeout_s: float) -> WorkerReady:
        """Wait for `WorkerReady`; on a load error, exit or timeout, stop and raise."""
        ready = wait(self.waitables, timeout=timeout_s)
        message: Any = None
        if self.conn in ready:
            with contextlib.suppress(Exception):  # EOF (it died first) or an unpickling error
                message = recv_message(self.conn)
        if isinstance(message, WorkerReady) and message.ok:
            return message
        self.stop(graceful=False, timeout_s=DEFAULT_SHUTDOWN_TIMEOUT_S)
        self.cleanup()
        if isinstance(message, WorkerReady) and message.error is not None:
            logger.debug("worker %d load traceback:\n%s", self.pid, message.error.traceback)
            raise message.error.to_exception("worker failed to load the pipeline")
        if not ready:
            raise RuntimeError(f"worker process {self.pid} did not become ready within "
                               f"{timeout_s:.0f} s")
        raise RuntimeError(f"worker process {self.pid} exited during start-up "
                           f"({describe_exit(self.exitcode())}); see its log above")

    def send(self, call: WorkerStart | WorkerCall | WorkerCancel) -> None:
        with self.send_lock:
            send_message(self.conn, call)

    def exitcode(self) -> int | None:
        """The exit code (negative: the signal), waiting up to the shutdown timeout."""
        return self._wait(DEFAULT_SHUTDOWN_TIMEOUT_S)

    def _wait(self, timeout_s: float) -> int | None:
        with self._proc_lock, contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)
        return self.process.returncode

    def stop(self, *, graceful: bool, timeout_s: float) -> None:
        """Ask the worker to exit (if `graceful`), escalate to SIGTERM then SIGKILL."""
        if graceful and not self.exited():
            with contextlib.suppress(OSError, EOFError, ValueError):  # already gone
                self.send(WorkerCall(0, "shutdown"))
        if self._wait(timeout_s if graceful else 0) is None:
            with self._proc_lock, contextlib.suppress(ProcessLookupError):
                self.process.terminate()
        # The worker keeps SIGTERM's default action, which ends it at once; one that is
        # still there is stopped (SIGSTOP) or stuck in the kernel, and only SIGKILL ends it.
        if self._wait(min(timeout_s, SIGTERM_GRACE_S)) is None:
            logger.warning("worker process %d ignored SIGTERM; killing it", self.pid)
            with self._proc_lock, contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self._wait(timeout_s)

    def cleanup(self) -> None:
        """After exit: drop unread replies (and their segments), close, sweep. Idempotent.

        Only the pipe's reader calls it (its reader thread, or start-up before that).
        """
        if self._cleaned:
            return
        self._cleaned = True
        with contextlib.suppress(Exception):  # EOF ends the drain; sweep() catches the rest
            while self.conn.poll(0):
                shm.release(getattr(recv_message(self.conn), "result", None))
        with self.send_lock:  # not under a send: its number could go to another pipe
            self.conn.close()  # a send after this raises OSError (its callers' "gone")
        with contextlib.suppress(OSError):
            os.close(self._lifeline)
        with self._sentinel_lock:
            if self.sentinel is not None:
                with contextlib.suppress(OSError):
                    os.close(self.sentinel)
                self.sentinel = None
        shm.sweep(shm.segment_prefix(self.pid))
