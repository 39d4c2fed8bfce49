"""Engine configuration: one validated dataclass shared by the Python API, CLI and server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from diffbatch.cpus import existing_cpus, parse_cpu_list
from diffbatch.errors import ConfigError

ExecutorKind = Literal["mp", "inproc"]
SchedulingPolicy = Literal["fifo", "grouped"]
SCHEDULING_POLICIES: tuple[str, ...] = ("fifo", "grouped")
BatchErrorIsolation = Literal["bisect", "none"]
DEFAULT_SHM_THRESHOLD_BYTES = 1 << 20  # 1 MiB: larger tensors cross processes via shm


@dataclass
class EngineConfig:
    """Everything an engine needs to start; validated on construction.

    Attributes:
        model: local diffusers folder, hub id or built-in model name (None = default).
        pipeline_class: a pipeline class, or its dotted name; None picks diffbatch's
            batch-capable diffusers adapter.
        max_num_seqs: most requests in one wave (>= 1).
        max_waves_in_flight: most waves handed to the executor at once (>= 1). With 2
            (the default), a full wave is queued at the worker while the last one runs,
            so the worker starts it without waiting for the engine; an executor that
            runs waves in the caller's thread ("inproc") holds one regardless.
        request_batch_max_wait_ms: bounded admission wait before a wave (0 = off).
        executor: "mp" runs the pipeline in a worker process, "inproc" in this one.
        device / dtype: where and in which precision the pipeline runs (None = auto).
        seed: seed of the engine's random source for requests that give none.
        max_queue_size: most waiting requests; more are rejected (None = unbounded).
        lora_dir: folder that LoRA adapter names resolve in (None = only paths given
            through the Python API).
        warmup: run one small request through the whole path at start-up.
        scheduling_policy: "fifo" (conservative waves, the default: an incompatible head
            blocks) or "grouped" (waves from the best compatible group; see sched/grouped.py).
        max_head_wait_ms: "grouped" only: once the oldest request waited this long, its
            group goes next (no starvation).
        max_wave_pixels: "grouped" only: cap on a wave's output pixels B*n*H*W (None = none).
        batch_error_isolation: "bisect" re-runs a failing wave in halves so only the
            failing request(s) get an error; "none" fails the whole wave.
        shm_threshold_bytes: tensors above this cross processes in shared memory.
        torch_num_threads: torch threads in the worker (None = torch's default).
        worker_cpus: pin the worker process to these CPUs, a `taskset -c` list such
            as "1" or "2-7" (None = no pinning; "mp" executor, Linux); see
            diffbatch/cpus.py for what it was measured to do.
        pipeline_kwargs: extra keyword arguments for the pipeline's `from_pretrained`.
    """

    model: str | None = None
    pipeline_class: Any = None
    max_num_seqs: int = 1
    max_waves_in_flight: int = 2
    request_batch_max_wait_ms: float = 0.0
    executor: ExecutorKind = "mp"
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None
    max_queue_size: int | None = None
    lora_dir: str | None = None
    warmup: bool = True
    scheduling_policy: SchedulingPolicy = "fifo"
    max_head_wait_ms: float = 2000.0
    max_wave_pixels: int | None = None
    batch_error_isolation: BatchErrorIsolation = "bisect"
    shm_threshold_bytes: int = DEFAULT_SHM_THRESHOLD_BYTES
    torch_num_threads: int | None = None
    worker_cpus: str | None = None
    step_execution: bool = False  # step-wise continuous batching is not implemented
    pipeline_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int) \
                or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        depth = self.max_waves_in_flight
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"max_waves_in_flight must be an integer >= 1, got {depth!r}")
        wait = self.request_batch_max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not math.isfinite(wait) \
                or wait < 0:
            raise ConfigError(
                f"request_batch_max_wait_ms must be a finite number >= 0, got {wait!r}"
            )
        if self.executor not in ("mp", "inproc"):
            raise ConfigError(f"executor must be 'mp' or 'inproc', got {self.executor!r}")
        if self.max_queue_size is not None and (
            not isinstance(self.max_queue_size, int) or self.max_queue_size < 1
        ):
            raise ConfigError(
                f"max_queue_size must be an integer >= 1 or None, got {self.max_queue_size!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        head = self.max_head_wait_ms
        if isinstance(head, bool) or not isinstance(head, int | float) or not math.isfinite(head) \
                or head < 0:
            raise ConfigError(f"max_head_wait_ms must be a finite number >= 0, got {head!r}")
        if self.max_wave_pixels is not None and (
            isinstance(self.max_wave_pixels, bool) or not isinstance(self.max_wave_pixels, int)
            or self.max_wave_pixels < 1
        ):
            raise ConfigError(
                f"max_wave_pixels must be an integer >= 1 or None, got {self.max_wave_pixels!r}"
            )
        if self.batch_error_isolation not in ("bisect", "none"):
            raise ConfigError(
                "batch_error_isolation must be 'bisect' or 'none', "
                f"got {self.batch_error_isolation!r}"
            )
        if not isinstance(self.shm_threshold_bytes, int) or self.shm_threshold_bytes < 0:
            raise ConfigError(
                f"shm_threshold_bytes must be an integer >= 0, got {self.shm_threshold_bytes!r}"
            )
        if self.torch_num_threads is not None and (
            not isinstance(self.torch_num_threads, int) or self.torch_num_threads < 1
        ):
            raise ConfigError(
                f"torch_num_threads must be an integer >= 1, got {self.torch_num_threads!r}"
            )
        if self.worker_cpus is not None:
            self._check_worker_cpus()
        if self.step_execution:
            raise ConfigError(
                "step_execution=True (step-wise continuous batching) is not supported; "
                "request-level batching needs step_execution=False"
            )

    def _check_worker_cpus(self) -> None:
        try:
            cpus = parse_cpu_list(self.worker_cpus)
        except ValueError as exc:
            raise ConfigError(f"worker_cpus: {exc}") from None
        if self.executor != "mp":
            raise ConfigError(
                f"worker_cpus pins the worker process; it needs executor='mp', got "
                f"{self.executor!r}"
            )
        existing = existing_cpus()
        if existing is None:
            raise ConfigError("worker_cpus is not supported on this platform (no "
                              "sched_setaffinity)")
        if not cpus <= existing:
            raise ConfigError(
                f"worker_cpus {self.worker_cpus!r} names CPUs this machine does not have: "
                f"{sorted(cpus - existing)}; it has {min(existing)}-{max(existing)}"
            )
