"""What every benchmark script shares: servers on free loopback ports, always torn down.

`running(specs)` starts each server as its own process group (so its worker
processes go with it), waits until every one answers its health route, yields
their base URLs and, whatever happens, stops them: SIGINT first (each server shuts
down cleanly on it), then SIGTERM and SIGKILL to the whole group. Servers bind
127.0.0.1 only. Their logs go to files whose tail is shown if one fails to start.

A benchmark killed outright (SIGKILL: `kill -9`, a test's `subprocess.run` timeout)
runs no `finally`, so every process it starts is also tied to it by the kernel
(`die_with_this_process`): Linux's parent-death signal (`PR_SET_PDEATHSIG`) kills
the server when the benchmark dies, and the server's worker follows through its own
lifeline (`diffbatch/worker/lifeline.py`). Ray's local cluster ties its processes to their
driver the same way. The signal follows the thread that started the process, so
servers are started from the benchmark's main thread.

Smoke mode (`SMOKE_ENV=1`, what the smoke tests in `tests/bench/` set) proves a
script runs, in seconds; its figures mean nothing. Every `diffbatch serve` server a
benchmark asks for is one shared server (per model), started by the first `running`
that asks and stopped when the benchmark exits, without the start-up calibration
(`--calibration-budget-s 0`: it learns from the traffic). Each name still gets its
own entry (its own `spec`, the shared server's URL), so the script runs every step
and writes every field of its report in the time of one server's start-up. Peer
servers start as usual. And `user_env` keeps the caller's thread settings: a test
run's processes share the cores, where torch's default threads would spin-wait for
each other.

Threads: every server gets `OMP_NUM_THREADS` / `MKL_NUM_THREADS` = `threads` (the
diffbatch worker inherits them; torch reads them at start) and the peers also call
`torch.set_num_threads(threads)` themselves (Ray would otherwise impose its own).
`OMP_WAIT_POLICY=PASSIVE` is set for every process: with the default active wait,
two torch threads on a busy shared 2-core machine slowed a 64x64 tiny-sd call from
~0.15 s to 4-11 s (see docs/benchmarks.md). A spec with `threads=None` gets none of
these three settings, not even inherited ones (`user_env()`): the server runs with
the thread choices of torch and diffbatch themselves, as under a user's shell.

`CoTenant` is other CPU work beside a server: one busy-loop process per CPU, for the
scenarios that ask how a server fares on a machine it does not have to itself.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = BENCH_DIR.parent
PEER_MODULES = {
    "fastapi": "peers_servers.fastapi_serial",
    "ray": "peers_servers.ray_serve_batch",
    "litserve": "peers_servers.litserve_batch",
}
DEFAULT_STARTUP_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 30.0
SMOKE_ENV = "DIFFBATCH_BENCH_SMOKE"


def smoke_mode() -> bool:
    """Whether this run only proves the script runs (see the module docstring)."""
    return os.environ.get(SMOKE_ENV) == "1"


_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent dies


def _load_prctl() -> Callable[..., int] | None:
    """libc's `prctl` on Linux, looked up once here: the child between fork and exec
    must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def die_with_this_process() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`/`run` of a process that must not outlive
    this one: on Linux it gets SIGKILL when this process dies, however it dies (None
    elsewhere: only the `finally` paths stop it)."""
    if _prctl is None:
        return None
    parent = os.getpid()
    prctl = _prctl

    def arm() -> None:  # runs in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def set_thread_env(threads: int | None) -> None:
    """Thread settings for this process (`threads=None`: none, torch's defaults); call
    before torch is imported."""
    os.environ.update(server_env_overrides(threads))


def threads_arg(text: str) -> int | None:
    """A `--threads` value: a positive count, or "none" for no thread settings at all
    (torch's defaults in every process; diffbatch's worker chooses its own)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive thread count or 'none', got {text!r}")
    return value


def server_env_overrides(threads: int | None) -> dict[str, str]:
    """What the harness sets for a server; `threads=None`: no thread settings."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if threads is not None:
        env.update({
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "OMP_WAIT_POLICY": "PASSIVE",
        })
    return env


# What `set_thread_env` sets and `user_env` takes away.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")


def user_env() -> dict[str, str]:
    """This process' environment without thread settings: what a user's script or
    `diffbatch serve` gets from a plain shell (torch and diffbatch choose themselves).
    In smoke mode, the environment as it is (see the module docstring)."""
    if smoke_mode():
        return dict(os.environ)
    return {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerSpec:
    """How to start one server and how to tell it is up."""

    name: str  # label in reports, e.g. "diffbatch" or "ray"
    cmd: list[str]
    port: int
    threads: int | None  # None: no thread settings (see `user_env`)
    health_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)  # on top of the thread settings
    # the checkout whose `diffbatch` it runs (working directory and first on the path):
    # None, this one; another commit's worktree for an A/B of two versions
    source_tree: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def diffbatch_spec(
    model: str,
    *,
    threads: int | None,
    max_num_seqs: int,
    wait_ms: float,
    executor: str = "mp",
    name: str = "diffbatch",
    extra_args: Sequence[str] = (),
) -> ServerSpec:
    """`diffbatch serve` with the given batching flags (access log off, like the peers),
    then `extra_args`."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "diffbatch.entrypoints.cli", "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
        "--request-batch-max-wait-ms", str(wait_ms), "--executor", executor,
        "--log-level", "warning", *extra_args,
    ]
    return ServerSpec(name, cmd, port, threads)


def diffbatch_defaults_spec(
    model: str,
    *,
    name: str = "auto",
    threads: int | None = None,
    log_level: str | None = None,
    extra_args: Sequence[str] = (),
    source_tree: str | Path | None = None,
) -> ServerSpec:
    """`diffbatch serve MODEL --port P` with no tuning flag: batch size, admission wait
    and (with `threads=None`) torch threads are the server's own choice.

    `log_level` adds `--log-level` (e.g. "warning" to match `diffbatch_spec`'s
    servers); None leaves the command exactly as a user would type it.
    `source_tree`: another checkout to run it from (an A/B of two versions).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "diffbatch.entrypoints.cli", "serve", model,
           "--port", str(port)]
    if log_level is not None:
        cmd += ["--log-level", log_level]
    return ServerSpec(name, [*cmd, *extra_args], port, threads,
                      source_tree=None if source_tree is None else Path(source_tree).resolve())


def peer_spec(
    kind: str, model: str, *, threads: int | None, max_batch_size: int | None = 8,
    wait_ms: float | None = 20.0,
) -> ServerSpec:
    """One of the peer servers ("fastapi", "ray" or "litserve"). None for `threads`,
    `max_batch_size` or `wait_ms`: not set, the library's own default (torch's threads;
    Ray Serve's `@serve.batch` and LitServe's `LitAPI` batching defaults)."""
    if kind not in PEER_MODULES:
        raise ValueError(f"peer must be one of {sorted(PEER_MODULES)}, got {kind!r}")
    port = free_port()
    cmd = [sys.executable, "-m", PEER_MODULES[kind], "--model", model, "--port", str(port)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    flags = {"ray": ("--max-batch-size", "--batch-wait-ms"),
             "litserve": ("--max-batch-size", "--batch-timeout-ms")}.get(kind)
    if flags is not None:
        for flag, value in zip(flags, (max_batch_size, wait_ms), strict=True):
            if value is not None:
                cmd += [flag, str(value)]
    return ServerSpec(kind, cmd, port, threads)


class Server:
    """A started server process (its own session and process group)."""

    def __init__(self, spec: ServerSpec, log_dir: str) -> None:
        self.spec = spec
        self.log_path = os.path.join(log_dir, f"{spec.name}-{spec.port}.log")
        env = dict(os.environ) if spec.threads is not None else user_env()
        env.update(server_env_overrides(spec.threads))
        env.update(spec.env)
        root = spec.source_tree or REPO_ROOT
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(BENCH_DIR), str(root), env.get("PYTHONPATH")) if p
        )
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            spec.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(root), start_new_session=True,
            preexec_fn=die_with_this_process(),
        )

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by every live process of its session."""
        return session_cpu_seconds(self.process.pid)

    def log_tail(self, num_chars: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            data = f.read()
        return data[-num_chars:].decode("utf-8", "replace")

    def is_healthy(self, client: httpx.Client) -> bool:
        try:
            return client.get(self.spec.base_url + self.spec.health_path).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGINT, then SIGTERM and SIGKILL to the process group; never raises."""
        process = self.process
        try:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(_STOP_TIMEOUT_S)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, sig)  # stragglers of its group (workers)
                if process.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(10.0)
        finally:
            self.log.close()


@contextlib.contextmanager
def running(
    specs: Sequence[ServerSpec],
    *,
    log_dir: str | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    one_at_a_time: bool = False,
) -> Iterator[dict[str, Server]]:
    """Start every server, wait until all are healthy, yield name -> Server.

    In parallel by default; `one_at_a_time` starts each once the one before is healthy,
    so a diffbatch server picks its threads and calibrates `auto` on an otherwise idle
    machine (started together, each sees the others' start-up as load). Raises
    RuntimeError with the log tail if a server exits or is not healthy in time; every
    server started is stopped on the way out, in any case. In smoke mode the diffbatch
    servers are the one shared server (see the module docstring).
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must be unique, got {names}")
    log_dir = log_dir or tempfile.mkdtemp(prefix="diffbatch-bench-logs-")
    shared = [s for s in specs if _uses_shared_server(s)]
    servers: list[Server] = []
    try:
        with _exit_on_sigterm():
            by_name: dict[str, Server] = {}
            if shared:
                server = _shared_server(shared[0], log_dir, startup_timeout_s)
                by_name.update({s.name: _SharedServerView(s, server) for s in shared})
            own = [s for s in specs if s not in shared]
            groups = [[spec] for spec in own] if one_at_a_time else [own]
            for group in groups:
                started = [Server(spec, log_dir) for spec in group]
                servers.extend(started)
                _wait_healthy(started, startup_timeout_s)
            by_name.update({s.spec.name: s for s in servers})
            yield {name: by_name[name] for name in names}
    finally:
        for server in reversed(servers):
            server.stop()


_shared: dict[str, Server] = {}  # model -> its shared server (smoke mode)


def _uses_shared_server(spec: ServerSpec) -> bool:
    return smoke_mode() and "diffbatch.entrypoints.cli" in spec.cmd and "serve" in spec.cmd


def _shared_server(spec: ServerSpec, log_dir: str, startup_timeout_s: float) -> Server:
    """The benchmark's one diffbatch server of `spec`'s model, started from `spec` at
    the first call."""
    model = spec.cmd[spec.cmd.index("serve") + 1]
    if model not in _shared:
        if "--calibration-budget-s" not in spec.cmd:
            spec = replace(spec, cmd=[*spec.cmd, "--calibration-budget-s", "0"])
        server = Server(spec, log_dir)
        atexit.register(server.stop)
        _wait_healthy([server], startup_timeout_s)
        _shared[model] = server
    return _shared[model]


class _SharedServerView(Server):
    """A name's entry for the shared server: its own spec, the shared server's process
    and URL (see the module docstring)."""

    def __init__(self, spec: ServerSpec, server: Server) -> None:  # no process of its own
        self.spec = replace(spec, port=server.spec.port)
        self.log_path, self.log, self.process = server.log_path, server.log, server.process

    def stop(self) -> None:
        """Nothing: the shared server stops when the benchmark exits."""


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM (e.g. from `timeout`) ends the benchmark through `SystemExit`, so the
    servers it started are stopped on the way out instead of left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_healthy(servers: list[Server], startup_timeout_s: float) -> None:
    """Poll until every server answers its health check; RuntimeError (with the log
    tail) if one exits or is not healthy after `startup_timeout_s`."""
    deadline = time.monotonic() + startup_timeout_s
    pending = list(servers)
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while pending:
            for server in list(pending):
                if server.process.poll() is not None:
                    raise RuntimeError(
                        f"server {server.spec.name!r} exited with code "
                        f"{server.process.returncode} during start-up; log "
                        f"{server.log_path}:\n{server.log_tail()}"
                    )
                if server.is_healthy(client):
                    pending.remove(server)
            if pending and time.monotonic() > deadline:
                server = pending[0]
                raise RuntimeError(
                    f"server {server.spec.name!r} not healthy after {startup_timeout_s:.0f}"
                    f" s; log {server.log_path}:\n{server.log_tail()}"
                )
            if pending:
                time.sleep(0.25)  # polling another process' readiness


def session_cpu_seconds(session_id: int) -> float:
    """CPU seconds (user + system) of the live processes whose session id is `session_id`.

    A server's processes (uvicorn, its workers, a Ray cluster) share the session the
    harness gave it, so this is what the server costs, whichever process did the work.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        if int(fields[3]) == session_id:  # field 6: session
            total += (int(fields[11]) + int(fields[12])) / ticks  # fields 14-15: utime, stime
    return total


# -- reports -----------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """Where a result was measured (load average included: the machine is shared)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_1_5_15": list(os.getloadavg()),
    }


def report_header(benchmark: str, args: Any) -> dict[str, Any]:
    """The common head of every benchmark JSON: what, when, where, how."""
    return {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": " ".join([os.path.relpath(sys.executable, REPO_ROOT), *sys.argv]),
        "args": {key: _jsonable(value) for key, value in vars(args).items()},
    }


def _jsonable(value: Any) -> Any:
    """An argument as the report's JSON holds it: a dataclass (a parsed option, e.g. a
    benchmark's fixed setting) as its fields, lists item by item."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


def write_report(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    report["machine"]["loadavg_at_end"] = list(os.getloadavg())
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}", flush=True)


def plot_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


def add_batch_grid_args(parser: Any) -> None:
    """The grid both batch-gain benchmarks measure (offline and served), so their
    figures compare: every model x size x batch size, at `--steps`."""
    parser.add_argument("--models", nargs="+", default=["tiny-sd", "tiny-sd3"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=4)


def add_request_args(parser: Any) -> None:
    """The one request shape of the latency benchmarks: `--model`, `--size`, `--steps`."""
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)


def finish_report(
    report: dict[str, Any], args: Any, plot: Callable[[dict[str, Any], str], None],
    *, start_s: float | None = None,
) -> None:
    """The tail of a benchmark: its `elapsed_s` since `start_s` (`time.perf_counter()`;
    None: the report has it already), the JSON at `args.out`, and `plot`'s figure beside
    it unless `--no-plot`."""
    if start_s is not None:
        report["elapsed_s"] = time.perf_counter() - start_s
    write_report(report, args.out)
    if args.no_plot:
        return
    if importlib.util.find_spec("matplotlib") is None:  # the [bench] extra: `make bench`
        print("matplotlib missing (install the [bench] extra): no plot", flush=True)
        return
    plot(report, plot_path(args.out))


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _busy_loop(stop: Any) -> None:
    """A plain Python loop that keeps one CPU busy until `stop` is set."""
    while not stop.is_set():
        for _ in range(20_000):
            pass


class CoTenant:
    """Other CPU work on this machine: one busy-loop process per CPU, at the benchmark's
    own priority, as a neighbour's job would run. `stop()` ends them (idempotent);
    use it as a context manager so they never outlive the benchmark."""

    def __init__(self, num_processes: int | None = None) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        count = num_processes or os.cpu_count() or 1
        self.processes = [context.Process(target=_busy_loop, args=(self._stop,), daemon=True)
                          for _ in range(count)]
        for process in self.processes:
            process.start()

    def stop(self) -> None:
        self._stop.set()
        for process in self.processes:
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> CoTenant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
