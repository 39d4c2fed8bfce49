"""Start workers by forking them from a process that has imported the worker already.

`start_forked(env, conn_fd, life_fd)` hands a new worker's pipe and lifeline to the
fork server of `env` (`python -m diffbatch.worker.forkserver`, started on first use,
one per distinct worker environment in this process) and returns the forked child
as a `ForkedProcess`. The child skips the seconds of imports a fresh
`python -m diffbatch.worker` spends, so a replacement after a crash, and every
engine after the first in one process, loads its model sooner. The first worker of
an environment costs what a fresh program does: its fork server imports first.

Each fork request carries the worker's whole environment, which the child takes
before it runs the worker. What the libraries read while they load (OpenMP's and
malloc's settings, the hub's cache paths, `PYTHONPATH`) was read in the fork server,
so fork servers are keyed by the variables that can matter then
(`read_at_import`): a worker whose settings differ there gets a fork server of its
own. A fork server with no workers left closes after `IDLE_CLOSE_S`, and every fork
server exits with this process (its lifeline).

Workers that use CUDA are spawned: CUDA cannot be used in a child forked from a
process where it was initialised, and a library imported in the fork server could
initialise it. `DIFFBATCH_WORKER_START` overrides the choice: `spawn` starts every
worker as its own program, `forkserver` forks workers on any device. Any failure of
the fork server (it could not start, died, or did not answer) is logged and the
worker is spawned instead.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

logger = logging.getLogger(__name__)

START_METHOD_ENV = "DIFFBATCH_WORKER_START"  # unset (by device), "forkserver" or "spawn"
IDLE_CLOSE_S = 60.0  # a fork server with no live worker closes after this long
FORK_TIMEOUT_S = 120.0  # its imports, on a busy machine, before the first fork
# A worker whose fork server died before reporting its exit: its code is unknowable.
UNKNOWN_EXIT_CODE = 255
# Environment variables the interpreter, the C libraries (OpenMP, BLAS, malloc, the
# loader) and the preloaded Python libraries may read as they load, by prefix.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
    "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
    "DIFFUSERS_", "TOKENIZERS_", "XDG_", "DIFFBATCH_",
)
IMPORT_TIME_NAMES = frozenset({"HOME", "TMPDIR", "LANG", "LC_ALL"})


def read_at_import(name: str) -> bool:
    """Whether a variable may be read while the worker's libraries load (then the
    fork server's value is the one they have)."""
    return name in IMPORT_TIME_NAMES or name.startswith(IMPORT_TIME_PREFIXES)


class ForkServerError(RuntimeError):
    """The fork server could not start a worker (the caller spawns one instead)."""


class ForkedProcess:
    """A worker forked by a fork server: the part of `subprocess.Popen` the executor
    uses (`pid`, `poll`, `wait`, `returncode`, `terminate`, `kill`). Its exit code
    comes from the fork server, its parent."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)  # signals never reach a reused pid

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def _lost_parent(self) -> None:
        """The fork server is gone: the exit code, once the process exits, is unknown."""
        threading.Thread(target=self._wait_without_parent, daemon=True,
                         name=f"diffbatch-forked-{self.pid}").start()

    def _wait_without_parent(self) -> None:
        pidfd = self._pidfd
        if pidfd is not None:
            with contextlib.suppress(OSError, ValueError):
                select.select([pidfd], [], [])
        else:
            while _pid_alive(self.pid):
                time.sleep(0.1)
        if self.returncode is None:
            self._set_exit(UNKNOWN_EXIT_CODE)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker process {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        pidfd = self._pidfd
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, sig)
                return
            except OSError as exc:  # closed meanwhile, or already exited
                if self.returncode is not None:
                    return
                if isinstance(exc, ProcessLookupError):
                    raise
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ForkServer:
    """The engine's handle on one fork server process and the workers it forked."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        life_read, self._lifeline = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "diffbatch.worker.forkserver",
                 "--control-fd", str(theirs.fileno()), "--lifeline-fd", str(life_read)],
                pass_fds=(theirs.fileno(), life_read), env=env)
        except BaseException:
            ours.close()
            os.close(self._lifeline)
            raise
        finally:
            theirs.close()
            os.close(life_read)
        self._control = ours
        self._lock = threading.Lock()  # a fork request and its place in `_waiting`
        self._waiting: collections.deque[Future[ForkedProcess]] = collections.deque()
        self._children: dict[int, ForkedProcess] = {}
        self.alive = True
        self._idle_since: float | None = None
        threading.Thread(target=self._read, daemon=True,
                         name=f"diffbatch-forkserver-{self.process.pid}").start()

    def fork(self, env: dict[str, str], conn_fd: int, life_fd: int) -> ForkedProcess:
        """Fork a worker with environment `env` on these descriptors (both stay open
        here: the caller's)."""
        future: Future[ForkedProcess] = Future()
        with self._lock:
            if not self.alive:
                raise ForkServerError("the fork server has exited")
            self._waiting.append(future)
            try:
                socket.send_fds(self._control, [b"fork " + json.dumps(env).encode()],
                                [conn_fd, life_fd])
            except OSError as exc:
                self._waiting.remove(future)
                raise ForkServerError(f"the fork server is gone: {exc}") from exc
            self._idle_since = None
        try:
            return future.result(FORK_TIMEOUT_S)
        except TimeoutError as exc:
            self.close()
            raise ForkServerError(
                f"the fork server did not fork within {FORK_TIMEOUT_S:.0f} s") from exc

    def idle_for(self, now: float) -> float:
        """How long it has had no live worker (0 while it has one)."""
        with self._lock:
            if self._children or self._waiting or self._idle_since is None:
                return 0.0
            return now - self._idle_since

    def close(self) -> None:
        """Close the control socket and lifeline: the fork server exits; its live
        workers go on (their exit codes are then unknown)."""
        with self._lock:
            self.alive = False
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)
        self._close_lifeline()

    def _close_lifeline(self) -> None:
        """Close our end of its lifeline, once: a second close could hit a number
        reused meanwhile (another fork server's or worker's pipe)."""
        with self._lock:
            fd, self._lifeline = self._lifeline, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read(self) -> None:
        while True:
            try:
                message = self._control.recv(64)
            except OSError:
                message = b""
            if not message:
                break
            kind, _, rest = message.decode("ascii", "replace").partition(" ")
            if kind == "pid":
                child = ForkedProcess(int(rest))
                with self._lock:
                    self._children[child.pid] = child
                    future = self._waiting.popleft() if self._waiting else None
                if future is not None:
                    future.set_result(child)
            elif kind == "exit":
                pid_text, _, code_text = rest.partition(" ")
                with self._lock:
                    child_or_none = self._children.pop(int(pid_text), None)
                    idle = not self._children and not self._waiting
                    if idle:
                        self._idle_since = time.monotonic()
                if child_or_none is not None:
                    child_or_none._set_exit(int(code_text))
                if idle:
                    timer = threading.Timer(IDLE_CLOSE_S, _close_idle_servers)
                    timer.daemon = True
                    timer.start()
        with self._lock:
            self.alive = False
            waiting, self._waiting = list(self._waiting), collections.deque()
            orphans, self._children = list(self._children.values()), {}
        for future in waiting:
            future.set_exception(ForkServerError("the fork server exited"))
        for child in orphans:
            child._lost_parent()
        self._control.close()
        self._close_lifeline()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}  # by `read_at_import` values
_servers_lock = threading.Lock()


def fork_allowed(device: str | None) -> bool:
    """Whether workers that run on `device` (None: CUDA when available) are forked
    (see the module docstring): on Linux, on the CPU, unless `DIFFBATCH_WORKER_START`
    says otherwise."""
    method = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if method == "spawn" or not sys.platform.startswith("linux"):
        return False
    if method == "forkserver":
        return True
    if device is not None:
        return device.strip().lower().startswith("cpu")
    import torch

    return not torch.cuda.is_available()


def start_forked(env: dict[str, str], conn_fd: int, life_fd: int) -> ForkedProcess | None:
    """A worker forked on (`conn_fd`, `life_fd`) with environment `env`; None when the
    fork server failed (logged: the caller spawns the worker instead)."""
    key = tuple(sorted((name, value) for name, value in env.items() if read_at_import(name)))
    try:
        with _servers_lock:
            _close_idle(time.monotonic())
            server = _servers.get(key)
            if server is None or not server.alive:
                server = _servers[key] = ForkServer(env)
        return server.fork(env, conn_fd, life_fd)
    except (ForkServerError, OSError) as exc:
        logger.warning("could not fork the worker (%s); starting it as its own program", exc)
        return None


def _close_idle(now: float) -> None:
    """(Holding `_servers_lock`.) Close the fork servers idle for `IDLE_CLOSE_S`."""
    for key, server in list(_servers.items()):
        if not server.alive or server.idle_for(now) >= IDLE_CLOSE_S:
            server.close()
            del _servers[key]


def _close_idle_servers() -> None:
    with _servers_lock:
        _close_idle(time.monotonic())


def close_all() -> None:
    """Close every fork server of this process (their live workers go on)."""
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()
