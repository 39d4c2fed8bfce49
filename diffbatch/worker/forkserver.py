"""`python -m diffbatch.worker.forkserver`: imports the worker once, forks one per start.

A worker started as its own program spends seconds importing torch, diffusers and
transformers before it reads its first byte of weights, and a replacement after a
crash pays them again. The engine process instead starts this program once per
worker environment (`diffbatch.executor.forkserver`); it imports what every worker
needs (`PRELOAD`), then serves fork requests on its control socket: each carries a
new worker's pipe and lifeline, and the forked child runs the worker's `main` on
them, exactly as `python -m diffbatch.worker` would, without the imports.

The control protocol is one datagram per message on a `SOCK_SEQPACKET` pair:

- engine -> here: `b"fork <environment as JSON>"` with two file descriptors (the
  worker's pipe end and the read end of its lifeline);
- here -> engine: `b"pid <pid>"` for each fork, in order, and `b"exit <pid>
  <code>"` when a child exits (`code` as `subprocess` writes it: negative for a
  signal).

It exits when its own lifeline or control socket closes (the engine is gone); its
workers have lifelines of their own. Nothing here may start CUDA or a torch thread
pool: a forked child inherits neither in a usable state.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import traceback

from diffbatch.worker import lifeline

# What every worker imports before it loads a model; the child inherits it loaded.
PRELOAD = (
    "torch",
    "diffbatch.worker.worker",
    "diffbatch.pipelines.diffusers_t2i",
    "diffusers",
    "diffusers.pipelines.pipeline_utils",
    "diffusers.models.modeling_utils",
    "transformers.modeling_utils",
)
MAX_MESSAGE = 1 << 20  # a fork request: the worker's environment, as JSON
WORKER_TITLE = "diffbatch.worker"  # the forked workers' process title (see `_run_worker`)


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # the worker will import it itself, and report what fails
            logging.getLogger(__name__).debug("preload of %s failed", name, exc_info=True)


def _run_worker(env: dict[str, str], fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: become a worker with environment `env` on `fds` (pipe,
    lifeline); never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep_closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn_fd, life_fd = fds
        argv = ["--conn-fd", str(conn_fd), "--lifeline-fd", str(life_fd)]
        with contextlib.suppress(ImportError):
            import setproctitle  # so `ps` shows a worker, not another fork server

            setproctitle.setproctitle(" ".join(
                [sys.executable, "-m", WORKER_TITLE, *argv]))
        # (after the title: setproctitle finds the process's memory by its environment)
        os.environ.clear()
        os.environ.update(env)
        from diffbatch.worker.worker import main

        code = main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(control: socket.socket, own_fds: list[int]) -> None:
    """Answer fork requests on `control` and report each child's exit, until it closes."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector via the pipe
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    children: set[int] = set()
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                with contextlib.suppress(OSError):
                    while os.read(wake_read, 512):
                        pass
                continue  # reaped below
            try:
                message, fds, _flags, _addr = socket.recv_fds(control, MAX_MESSAGE, 2)
            except OSError:
                message, fds = b"", []
            if not message:  # the engine is gone
                return
            kind, _, body = message.partition(b" ")
            if kind != b"fork" or len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                continue
            env = json.loads(body)
            pid = os.fork()
            if pid == 0:
                _run_worker(env, fds, [control.fileno(), wake_read, wake_write, *own_fds])
            for fd in fds:
                os.close(fd)
            children.add(pid)
            control.send(f"pid {pid}".encode())
        _reap(control, children)


def _reap(control: socket.socket, children: set[int]) -> None:
    """Wait for every exited child and tell the engine its exit code."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        with contextlib.suppress(OSError):
            control.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    control_fd = int(args[args.index("--control-fd") + 1])
    life_fd = int(args[args.index("--lifeline-fd") + 1])
    lifeline.watch(life_fd)  # before the imports: they take seconds
    # Should torch be asked whether CUDA is there (DIFFBATCH_WORKER_START=forkserver on
    # a GPU machine), it asks NVML, which leaves the forked workers able to use CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # Ctrl-C in a terminal reaches the whole process group; the engine decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload()
    control = socket.socket(fileno=control_fd)
    control.send(b"ready")
    serve(control, [life_fd])
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)
