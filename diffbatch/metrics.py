"""Prometheus metrics of one engine, in a registry of its own.

Each engine owns a `CollectorRegistry`, so several engines (tests, replicas) can
live in one process; the HTTP server exposes it at `/metrics`. Names carry their
unit: `diffbatch_<thing>_<unit>`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from diffbatch.engine.batch_policy import BatchPolicy
    from diffbatch.outputs import TickStats

OUTCOMES = ("completed", "error", "aborted", "rejected")
_WAVE_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0
)


class _WaitingByKey(Collector):
    """`diffbatch_num_requests_waiting_by_key{key=...}`, read from the scheduler on scrape."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self.read = read

    def collect(self):
        family = GaugeMetricFamily(
            "diffbatch_num_requests_waiting_by_key",
            "Waiting requests per batch key (short form: WxH/steps/guidance/n[/lora]).",
            labels=["key"],
        )
        for key, count in sorted(self.read().items()):
            family.add_metric([key], count)
        yield family


def learned_batching(policy: BatchPolicy) -> dict[str, dict[str, Any]]:
    """Per curve label of the policy's cost model: per-image ms by wave size, capacity
    and the longest wait; empty with fixed settings."""
    if not policy.learns:
        return {}
    return {shape.label(steps): {
        "per_image_ms": {size: ms / size for size, ms in table.items()},
        "capacity": policy.curve_capacity(shape, steps),
        "wait_ms": policy.wait_bound_ms(shape, steps),
    } for (shape, steps), table in policy.cost.tables().items()}


class _LearnedBatching(Collector):
    """The batch policy's learned curve, capacity and wait per shape, read on scrape."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy

    def collect(self):
        cost = GaugeMetricFamily(
            "diffbatch_learned_cost_per_image_ms",
            "Learned forward time per image (ms) of a wave of `wave_size` requests, per shape "
            "and step count (WxH/sSTEPS/nN[/cfg]).",
            labels=["shape", "wave_size"],
        )
        capacity = GaugeMetricFamily(
            "diffbatch_capacity_requests", "Current wave capacity per shape and step count.",
            labels=["shape"])
        wait = GaugeMetricFamily(
            "diffbatch_admission_wait_ms",
            "Longest admission wait per shape and step count (ms): the auto wait's bound "
            "(one request's wave time, at most 1 s) or the fixed wait.",
            labels=["shape"])
        for shape, entry in sorted(learned_batching(self.policy).items()):
            for size, ms in entry["per_image_ms"].items():
                cost.add_metric([shape, str(size)], ms)
            capacity.add_metric([shape], entry["capacity"])
            wait.add_metric([shape], entry["wait_ms"])
        yield cost
        yield capacity
        yield wait


class _StatsOnScrape(Collector):
    """Metric families made from the numbers `read()` returns at each scrape; none while
    it returns nothing (no worker yet, or the feature is off)."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def collect(self):
        stats = self.read()
        if stats:
            yield from self.families(stats)

    def families(self, stats: dict[str, float]):
        raise NotImplementedError


def _counters(stats: dict[str, float], rows: tuple[tuple[str, str, str], ...]):
    """One counter per (metric name, key in `stats`, help text)."""
    for name, key, text in rows:
        yield CounterMetricFamily(name, text, value=stats.get(key, 0.0))


class _WorkerHealth(_StatsOnScrape):
    """The executor's worker health (`Executor.health_stats`), read on scrape."""

    def families(self, stats: dict[str, float]):
        yield GaugeMetricFamily(
            "diffbatch_worker_up", "1 while a live, responsive worker process serves; 0 while "
            "it is dead, frozen or being replaced.", value=stats.get("up", 0.0))
        yield GaugeMetricFamily(
            "diffbatch_worker_heartbeat_age_seconds", "Seconds since the serving worker was "
            "last heard from (a heartbeat about every second); it grows while the worker is "
            "frozen.", value=stats.get("heartbeat_age_s", 0.0))
        yield GaugeMetricFamily(
            "diffbatch_worker_torch_threads", "Torch's CPU threads in the worker (chosen at "
            "start-up from the CPUs it may use, unless set); 0 until its first "
            "heartbeat.", value=stats.get("torch_threads", 0.0))
        yield from _counters(stats, (
            ("diffbatch_worker_deaths", "deaths", "Worker processes that died while serving "
             "(killed as frozen included)."),
            ("diffbatch_worker_frozen", "frozen", "Worker processes killed because they "
             "stopped making progress: heartbeat silent for --worker-stall-timeout, or a wave "
             "running past its stall bound (--wave-stall-factor)."),
            ("diffbatch_worker_stuck_waves", "stuck_waves", "Of those, workers killed because "
             "a wave ran past its stall bound while the heartbeat lived (a hung forward)."),
            ("diffbatch_worker_restarts", "restarts", "Replacement worker processes started."),
            ("diffbatch_worker_batch_reruns", "batch_reruns", "Step mode: groups of a "
             "running batch re-run on a replacement worker after the worker died under it "
             "(a crashed batch is re-run in halves)."),
        ))


class _Compiled(_StatsOnScrape):
    """The worker's compile counts (`Executor.compile_stats`), read on scrape."""

    def families(self, stats: dict[str, float]):
        yield from _counters(stats, (
            ("diffbatch_compile_graphs", "graphs", "Graphs torch.compile made (a graph "
             "break makes several per bucket)."),
            ("diffbatch_compile_compiles", "compiles", "Compiled buckets warmed at start-up "
             "(--compile)."),
            ("diffbatch_compile_recompiles", "recompiles", "Compiled calls that had to "
             "compile again after start-up (e.g. a new image size)."),
            ("diffbatch_compile_failures", "failures", "Compiles or compiled calls that "
             "failed; the module then runs eagerly."),
            ("diffbatch_compile_compiled_forwards", "compiled_forwards", "Module forwards "
             "run by a compiled graph."),
            ("diffbatch_compile_cache_hits", "cache_hits", "Inductor FX graphs read from "
             "the on-disk cache at start-up."),
        ))
        yield GaugeMetricFamily("diffbatch_compile_buckets", "Compiled wave-size buckets "
                                "(row counts), over the compiled modules.",
                                value=stats.get("buckets", 0.0))
        yield GaugeMetricFamily("diffbatch_compile_seconds", "Seconds spent compiling.",
                                value=stats.get("compile_s", 0.0))
        eager = CounterMetricFamily(
            "diffbatch_compile_eager_forwards", "Forwards of a compiled module run eagerly, "
            "by reason (lora, step_cache, packed, above_buckets, off).", labels=["reason"])
        for key, value in stats.items():
            if key.startswith("eager_forwards:"):
                eager.add_metric([key.partition(":")[2]], value)
        yield eager


class EngineMetrics:
    """The engine's gauges, histograms and counters."""

    def __init__(
        self,
        num_waiting: Callable[[], int],
        num_running: Callable[[], int],
        waiting_by_key: Callable[[], dict[str, int]] | None = None,
        policy: BatchPolicy | None = None,
        worker_health: Callable[[], dict[str, float]] | None = None,
        compile_stats: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge(
            "diffbatch_num_requests_waiting", "Requests in the waiting queue.", registry=r
        )
        self.waiting.set_function(num_waiting)
        self.running = Gauge(
            "diffbatch_num_requests_running", "Requests in waves the executor works on "
            "(aborted ones included until their wave has stopped).", registry=r
        )
        self.running.set_function(num_running)
        self.wave_size = Histogram(
            "diffbatch_wave_size_requests", "Requests per scheduler wave.",
            buckets=_WAVE_SIZE_BUCKETS, registry=r,
        )
        self.waves = Counter(
            "diffbatch_waves",
            "Scheduler waves run, by why the wave stopped growing (close_reason: capacity, "
            "key, queue_empty, group_empty, pixel_cap, starvation) and why the admission "
            "wait before it ended (admission: capacity, stable, deadline, stopped, none).",
            ["close_reason", "admission"], registry=r,
        )
        self.step_batch_size = Histogram(
            "diffbatch_step_batch_size_requests", "Step mode: requests in one tick's fused "
            "denoiser call.", buckets=_WAVE_SIZE_BUCKETS, registry=r,
        )
        self.step_time = Histogram(
            "diffbatch_step_time_seconds", "Step mode: wall time of one tick (the fused "
            "denoiser call, and the joiners' encoding and leavers' decoding around it).",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.step_joins = Counter(
            "diffbatch_step_joins", "Step mode: requests that joined the running batch.",
            registry=r)
        self.step_leaves = Counter(
            "diffbatch_step_leaves", "Step mode: requests that left the running batch "
            "(finished, failed or cancelled).", registry=r)
        self.lora_adapters_per_wave = Histogram(
            "diffbatch_lora_adapters_per_wave", "Distinct LoRA adapters in one wave (step "
            "mode: in one fused denoiser call); 0 = the base model alone.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.lora_loads = Counter(
            "diffbatch_lora_adapter_loads", "LoRA adapters loaded into the model.", registry=r)
        self.lora_evictions = Counter(
            "diffbatch_lora_adapter_evictions", "LoRA adapters unloaded to make room "
            "(least recently used; --max-loras).", registry=r)
        self.queue_time = Histogram(
            "diffbatch_request_queue_time_seconds", "Arrival to start of the request's wave.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.forward_time = Histogram(
            "diffbatch_wave_forward_time_seconds", "Pipeline forward time of one wave.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.e2e_time = Histogram(
            "diffbatch_request_e2e_time_seconds", "Arrival to delivery of a request.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.requests = Counter(
            "diffbatch_requests", "Finished requests by outcome.", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.waves_cancelled = Counter(
            "diffbatch_waves_cancelled", "Waves in flight stopped early because none of "
            "their requests was wanted any more (aborted, timed out, disconnected).", registry=r,
        )
        self.waves_rerun = Counter(
            "diffbatch_waves_rerun", "Waves re-run on a replacement worker after the worker "
            "died under them (a crashed wave is re-run in halves).", registry=r,
        )
        self.step_cache_steps = Counter(
            "diffbatch_step_cache_steps", "Denoising steps of requests with a step cache, "
            "per model: computed (the transformer's remaining blocks ran for the request) "
            "or cached (its cached residual was reused).", ["model", "outcome"], registry=r)
        if worker_health is not None:
            r.register(_WorkerHealth(worker_health))
        if compile_stats is not None:
            r.register(_Compiled(compile_stats))
        if waiting_by_key is not None:
            r.register(_WaitingByKey(waiting_by_key))
        if policy is not None:
            r.register(_LearnedBatching(policy))

    def observe_wave(
        self, size: int, close_reason: str, admission: str, forward_s: float
    ) -> None:
        self.wave_size.observe(size)
        self.waves.labels(close_reason=close_reason or "unknown",
                          admission=admission or "none").inc()
        self.forward_time.observe(forward_s)

    def observe_loras(self, num_adapters: int, loads: int, evictions: int) -> None:
        """LoRA of one wave (or step-mode tick): distinct adapters, loads, evictions."""
        self.lora_adapters_per_wave.observe(num_adapters)
        self.lora_loads.inc(loads)
        self.lora_evictions.inc(evictions)

    def observe_tick(self, tick: TickStats) -> None:
        """Step mode: one tick of the worker's running batch (or, with batch size 0, a
        cancelled request that left between ticks: counted, no step observed)."""
        if tick.batch_size > 0:
            self.step_batch_size.observe(tick.batch_size)
            self.step_time.observe(tick.step_ms / 1000.0)
        if tick.batch_size > 0:
            self.lora_adapters_per_wave.observe(tick.num_lora_adapters)
        self.lora_loads.inc(tick.num_lora_loads)
        self.lora_evictions.inc(tick.num_lora_evictions)
        self.step_joins.inc(tick.joins)
        self.step_leaves.inc(tick.leaves)

    def observe_finished(self, outcome: str, queue_s: float | None, e2e_s: float) -> None:
        self.requests.labels(outcome=outcome).inc()
        if queue_s is not None:
            self.queue_time.observe(queue_s)
        self.e2e_time.observe(e2e_s)

    def observe_step_cache(self, model: str, computed_steps: int, cached_steps: int) -> None:
        """One finished request's step-cache counts."""
        self.step_cache_steps.labels(model=model, outcome="computed").inc(computed_steps)
        self.step_cache_steps.labels(model=model, outcome="cached").inc(cached_steps)

    def count(self, outcome: str) -> float:
        """The number of requests finished with `outcome` so far."""
        value = self.registry.get_sample_value("diffbatch_requests_total", {"outcome": outcome})
        return value or 0.0

    def wave_sizes_sum_count(self) -> tuple[float, float]:
        """(sum of wave sizes, number of waves) so far."""
        total = self.registry.get_sample_value("diffbatch_wave_size_requests_sum") or 0.0
        count = self.registry.get_sample_value("diffbatch_wave_size_requests_count") or 0.0
        return total, count
