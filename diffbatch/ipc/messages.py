"""What crosses the pipe between the executor (engine process) and its worker process.

Eight messages, one plain dataclass each (and `StepJoin`, the argument of a step-mode
"join" call):

- `WorkerStart` engine -> worker, once: what to load (the engine's config);
- `WorkerCall`  engine -> worker: run one method of the runner;
- `WorkerCancel` engine -> worker: nobody waits for a call any more; stop it at the
  next denoising step, or drop it before it starts;
- `WorkerReady` worker -> engine, once: the pipeline is loaded (its `PipelineInfo`),
  or why it could not be;
- `WorkerPartialImage` worker -> engine, while a call runs: one preview a request
  asked for (`SamplingParams.partial_images`), packed like results, sent before the
  call's reply;
- `WorkerJoined` worker -> engine, step mode: requests that entered the running
  batch (sent before any of their code runs);
- `WorkerReply` worker -> engine, one per call: the packed result or the error;
- `WorkerHeartbeat` worker -> engine, every `heartbeat_interval_s(config)` once
  ready: the worker's process is alive and scheduled (a frozen one stops sending).

Results are packed with `diffbatch.ipc.shm.pack` before they are sent, so a reply
carries shared-memory handles instead of large tensors; the receiver unpacks (or
releases) them. Errors cross as `WorkerError` (plain strings and a `RequestError`)
rather than as pickled exceptions, which may not unpickle on the other side.
Messages go through `send_message` / `recv_message`, never `Connection.send`.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from diffbatch import errors
from diffbatch.outputs import RequestError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from diffbatch.config import EngineConfig
    from diffbatch.pipelines.interface import PipelineInfo
    from diffbatch.sched.output import SchedulerOutput

WorkerMethod = Literal["execute_batch", "join", "load_lora", "unload_lora", "shutdown"]
WORKER_METHODS: tuple[str, ...] = ("execute_batch", "join", "load_lora", "unload_lora",
                                  "shutdown")
# The call id of a reply to a call the worker could not unpickle (so it cannot know
# the id). The worker answers calls in the order they were sent, so the executor
# takes it as the answer to its oldest unanswered call.
UNREADABLE_CALL_ID = -1


@dataclass
class WorkerError:
    """An exception raised in the worker, in a form that always unpickles."""

    exc_type: str  # "module.QualName" of the worker-side exception class
    error: RequestError  # message, HTTP status, OpenAI type and param, for outputs
    traceback: str = ""  # formatted worker traceback; may quote user input: DEBUG logs only

    @classmethod
    def from_exception(cls, exc: BaseException) -> WorkerError:
        exc_cls = type(exc)
        return cls(
            exc_type=f"{exc_cls.__module__}.{exc_cls.__qualname__}",
            error=RequestError.from_exception(exc),
            traceback="".join(traceback.format_exception(exc)),
        )

    @property
    def message(self) -> str:
        return self.error.message

    def to_exception(self, context: str) -> Exception:
        """Rebuild the error in this process: the same diffbatch error class where there
        is one (ModelNotFoundError stays a 404), otherwise a RuntimeError that names
        `context` and the worker's exception type and message."""
        module, _, name = self.exc_type.rpartition(".")
        if module == errors.__name__:
            exc_cls = getattr(errors, name, None)
            if isinstance(exc_cls, type) and issubclass(exc_cls, errors.DiffbatchError):
                return exc_cls(self.error.message, param=self.error.param)
        return RuntimeError(f"{context}: {self.error.message}")


@dataclass
class WorkerStart:
    """Engine -> worker, the first message on the pipe: what to load and how to log."""

    config: EngineConfig  # the engine's config (model, pipeline class, threads, ...)
    log_level: int | None = None  # the engine process's diffbatch log level


@dataclass
class WorkerCall:
    """Engine -> worker: run `method(arg)` on the worker's runner."""

    call_id: int  # increasing per executor; the reply echoes it
    method: WorkerMethod  # one of WORKER_METHODS
    # a SchedulerOutput for "execute_batch"; a `StepJoin` for "join" (step mode: each
    # joining request has a call id of its own, answered when it finishes); a
    # `LoraRef.key` for "load_lora" (its reply: the key of the version read) and
    # "unload_lora"; None for "shutdown"
    arg: Any = None


@dataclass
class StepJoin:
    """The argument of a "join" call: requests to add to the running batch.

    Each request has a call id of its own: its reply comes when it finishes, not when
    its batch mates do. An `isolated` join re-runs requests a worker died under (one
    half of that batch, as request mode re-runs a crashed wave): they run as a batch
    of their own, entering only an empty batch, and nothing else joins them until they
    have all left.
    """

    wave: SchedulerOutput  # the joining requests, all of one key
    call_ids: list[int]  # one per request, in order
    capacity: int  # most requests in the running batch for this key
    isolated: bool = False  # a batch of their own (see above)


@dataclass
class WorkerJoined:
    """Worker -> engine, step mode: these calls' requests entered the running batch.

    Sent before any of their code runs, so a request that crashes the worker counts
    as started (the executor re-runs it, in halves of the batch); one still waiting in
    the worker's queue has not started, and is queued again if the worker dies, or
    answered at once on shutdown."""

    call_ids: list[int]


@dataclass
class WorkerCancel:
    """Engine -> worker: stop call `call_id` (running: at its next denoising step;
    queued: before it starts). Its reply still comes, with aborted outputs."""

    call_id: int  # the `call_id` of the call to stop; unknown or finished ids are ignored


@dataclass
class WorkerHeartbeat:
    """Worker -> engine, sent by a thread of its own while the worker serves."""

    sent: float  # the worker's time.monotonic() when it was sent (for logs)
    # progress of the work in hand, whose calls may run for long without a reply:
    # step mode, ticks the running batch has finished so far; request mode, the
    # denoising steps the waves have finished (their pipelines' between-step asks)
    ticks: int = 0
    torch_threads: int = 0  # torch's thread count in the worker now (0: not known)
    # `CompileStats.as_dict()` of the worker's compiled forwards (empty: not compiling)
    compile_stats: dict[str, float] = field(default_factory=dict)


def heartbeat_interval_s(stall_timeout_s: float) -> float:
    """How often a worker sends `WorkerHeartbeat`: often enough that a stall timeout
    sees several missed beats (at most every second)."""
    return min(1.0, stall_timeout_s / 5.0) if stall_timeout_s > 0 else 1.0


@dataclass
class WorkerReady:
    """Worker -> engine, sent once after start-up: loaded, or failed to load."""

    pid: int  # the worker's process id (its shm segment names carry it)
    info: PipelineInfo | None = None  # the loaded pipeline's info; None on failure
    error: WorkerError | None = None  # why loading failed; None on success

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class WorkerPartialImage:
    """Worker -> engine, from the forward's thread while call `call_id` runs."""

    call_id: int  # the call whose wave made it
    partial: Any  # a shm-packed `PartialImage` (a large image travels in shared memory)


@dataclass
class WorkerReply:
    """Worker -> engine, one per `WorkerCall`."""

    call_id: int  # the `call_id` of the call this answers
    result: Any = None  # a shm-packed BatchRunnerOutput, or None
    error: WorkerError | None = None  # an unexpected error while handling the call

    @property
    def ok(self) -> bool:
        return self.error is None


# NOTE: `Connection.send` pickles with multiprocessing's ForkingPickler, for which
# `import torch` registers a tensor reducer that moves every tensor, however small,
# into a fresh shared-memory file and passes its descriptor through a background
# "resource sharer" thread. Plain pickle keeps small tensors inline as the design
# says; large ones were already moved to shm by `shm.pack`.


class ByteSink(Protocol):
    """What `send_message` writes to: a `Connection`, or anything with its `send_bytes`."""

    def send_bytes(self, buf: bytes, /) -> None: ...


def send_message(conn: ByteSink, message: Any) -> None:
    """Pickle `message` with plain pickle and send it. Pickling errors raise before
    anything is written; a closed pipe raises OSError (BrokenPipeError)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv_message(conn: Connection) -> Any:
    """Receive one message; EOFError/OSError if the pipe closed, another exception if
    the bytes do not unpickle here (the stream stays in sync either way)."""
    return pickle.loads(conn.recv_bytes())
