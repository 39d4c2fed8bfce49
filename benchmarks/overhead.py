"""How much time does diffbatch add to a request beyond the pipeline forward?

One request at a time (no batching, no queueing), `--max-num-seqs 1`, wait 0:

1. In-process: `Engine(model, executor="inproc")`, with the engine's diffusers
   pipeline wrapped so each call is timed. Per request, from the same request:
   e2e (around `Engine.generate`) minus the pipeline call = the engine's overhead,
   split into the model runner's share (its `execute_time_ms` minus the call:
   generators, output conversion) and the rest (submit, loop, delivery, PIL).
2. Worker process + HTTP: `diffbatch serve --executor mp`, one client request at a
   time. Per request: e2e at the client minus the worker's `x-diffbatch-execute-ms`
   minus `x-diffbatch-encode-ms`, plus the runner's share measured in step 1 (the
   same code runs in the worker) = overhead of the HTTP server, the engine and the
   worker pipe. PNG encoding is reported apart (`x-diffbatch-encode-ms`).
As a cross-check, rounds of bare pipeline calls alternate with the HTTP rounds.
P5 = median overhead excluding PNG encoding; bar: < 2 ms in-process, < 10 ms
through worker and HTTP. A pyinstrument profile of the engine thread (the hot
path: schedule, runner, delivery) over `--profile-requests` requests is saved
next to the JSON (`*_profile.txt`).

    .venv/bin/python benchmarks/overhead.py --out benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from peers_servers import harness

from diffbatch.bench.serve import BenchConfig, run_benchmark

PROMPT = "a red circle on a white background"


class TimedCall:
    """Wraps the diffusers pipeline object: times each call, forwards everything else."""

    def __init__(self, pipe: Any) -> None:
        self.__dict__["_pipe"] = pipe
        self.__dict__["times_ms"] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._pipe(*args, **kwargs)
        finally:
            self.times_ms.append((time.perf_counter() - start) * 1e3)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._pipe, name, value)


class EngineThreadProfile:
    """A pyinstrument profile of the engine loop thread, from inside that thread.

    pyinstrument samples the thread that starts it, so `EngineCore.step` is wrapped:
    the first step after `arm()` starts the profiler, the first step to end after
    `disarm()` stops it (send one more request after `disarm()` to get there).
    """

    def __init__(self, core: Any, interval_s: float) -> None:
        from pyinstrument import Profiler

        self.profiler = Profiler(interval=interval_s)
        self._core, self._step = core, core.step
        self._armed = self._running = False
        self.done = threading.Event()
        core.step = self._profiled_step

    def _profiled_step(self) -> bool:
        if self._armed and not self._running and not self.done.is_set():
            self.profiler.start()
            self._running = True
        try:
            return self._step()
        finally:
            if self._running and not self._armed:
                self.profiler.stop()
                self._running = False
                self.done.set()

    def arm(self) -> None:
        self._armed = True

    def disarm(self) -> None:
        self._armed = False


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "min": ordered[0]}


def in_process(engine: Any, args: argparse.Namespace, timed: TimedCall) -> dict[str, Any]:
    """Step 1: per-request overhead of the engine itself, and PNG encoding apart."""
    from diffbatch import SamplingParams
    from diffbatch.entrypoints.openai.serving_images import encode_images

    params = SamplingParams(height=args.size, width=args.size,
                            num_inference_steps=args.steps, seed=0)
    for _ in range(3):  # warm-up
        engine.generate(PROMPT, params, use_tqdm=False)
    rows = []
    for i in range(args.num_requests):
        timed.times_ms.clear()
        start = time.perf_counter()
        [out] = engine.generate(PROMPT, params.clone(seed=i), use_tqdm=False)
        e2e_ms = (time.perf_counter() - start) * 1e3
        if not out.ok or len(timed.times_ms) != 1:
            raise RuntimeError(f"request {i} failed or ran {len(timed.times_ms)} calls: "
                               f"{out.error}")
        encode_start = time.perf_counter()
        encode_images(out.images, "png", None)
        png_ms = (time.perf_counter() - encode_start) * 1e3
        pipe_ms = timed.times_ms[0]
        rows.append({"e2e_ms": e2e_ms, "pipe_ms": pipe_ms, "execute_ms": out.execute_time_ms,
                     "png_ms": png_ms})
    overhead = [r["e2e_ms"] - r["pipe_ms"] for r in rows]
    return {
        "pipe_ms": _stats([r["pipe_ms"] for r in rows]),
        "e2e_ms": _stats([r["e2e_ms"] for r in rows]),
        "overhead_ms": _stats(overhead),
        "runner_overhead_ms": _stats([r["execute_ms"] - r["pipe_ms"] for r in rows]),
        "engine_overhead_ms": _stats([r["e2e_ms"] - r["execute_ms"] for r in rows]),
        "png_encode_ms": _stats([r["png_ms"] for r in rows]),
        "requests": rows,
    }


def raw_round(pipe: Any, args: argparse.Namespace, seed: int) -> list[float]:
    """Bare pipeline calls (the same call the adapter makes), one request each."""
    from peers_servers.pipeline import ImageJob, pipeline_call

    times = []
    for i in range(args.num_requests):
        start = time.perf_counter()
        pipeline_call(pipe, [ImageJob(PROMPT, 1, args.size, args.size, args.steps, None,
                                      None, seed * 1000 + i)])
        times.append((time.perf_counter() - start) * 1e3)
    return times


def through_http(
    server: harness.Server, raw_pipe: Any, args: argparse.Namespace, runner_ms: float
) -> dict[str, Any]:
    """Step 2: the same through `diffbatch serve` (worker process), and raw rounds."""
    http_rows: list[dict[str, float]] = []
    raw_ms: list[float] = []
    for rep in range(args.repeats):
        if rep % 2 == 0:  # the order flips every round (see batch_gain.py's NOTE)
            raw_ms += raw_round(raw_pipe, args, seed=rep)
        report = run_benchmark(BenchConfig(
            base_url=server.base_url, num_prompts=args.num_requests, max_concurrency=1,
            width=args.size, height=args.size, steps=args.steps, seed=rep,
            warmup_requests=2 if rep == 0 else 0, disable_tqdm=True, keep_requests=True))
        if report["failed"]:
            raise RuntimeError(f"{report['failed']} requests failed: {report['errors']}")
        if rep % 2 == 1:
            raw_ms += raw_round(raw_pipe, args, seed=rep)
        for r in report["requests"]:
            timing = r["server"]
            http_rows.append({"e2e_ms": r["latency_s"] * 1e3, "execute_ms": timing["execute_ms"],
                              "encode_ms": timing["encode_ms"], "queue_ms": timing["queue_ms"]})
    beyond = [r["e2e_ms"] - r["execute_ms"] - r["encode_ms"] + runner_ms for r in http_rows]
    e2e = _stats([r["e2e_ms"] for r in http_rows])
    raw = _stats(raw_ms)
    return {
        "e2e_ms": e2e,
        "worker_execute_ms": _stats([r["execute_ms"] for r in http_rows]),
        "png_encode_ms": _stats([r["encode_ms"] for r in http_rows]),
        "queue_ms": _stats([r["queue_ms"] for r in http_rows]),
        "overhead_ms": _stats(beyond),
        "raw_pipe_ms": raw,
        "crosscheck_e2e_minus_raw_ms": e2e["median"] - raw["median"],
        "requests": http_rows,
    }


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    inproc, http = report["in_process"], report["http"]
    runner = inproc["runner_overhead_ms"]["median"]
    bars = {
        "in-process": [inproc["pipe_ms"]["median"], runner,
                       inproc["engine_overhead_ms"]["median"], 0.0,
                       inproc["png_encode_ms"]["median"]],
        "worker + HTTP": [http["worker_execute_ms"]["median"] - runner, runner, 0.0,
                          http["overhead_ms"]["median"] - runner,
                          http["png_encode_ms"]["median"]],
    }
    labels = ["pipeline forward", "model runner", "engine (submit, loop, deliver)",
              "HTTP + engine + worker pipe", "PNG encoding"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 3.8))
    for axis, skip_forward in ((ax, False), (bx, True)):
        for i, parts in enumerate(bars.values()):
            left = 0.0
            for k, (label, value) in enumerate(zip(labels, parts, strict=True)):
                if skip_forward and k == 0:
                    continue
                axis.barh(i, value, left=left, color=f"C{k}", label=label if i == 0 else None)
                left += value
        axis.set_yticks(range(len(bars)))
        axis.set_yticklabels(list(bars))
        axis.set_xlabel("ms per request (medians)")
    ax.set_title("Where a request's time goes")
    bx.set_title(f"Beyond the forward: P5 {report['P5_inproc_ms']:.2f} ms in-process, "
                 f"{report['P5_http_ms']:.2f} ms via worker+HTTP", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_request_args(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=30, help="per round")
    parser.add_argument("--repeats", type=int, default=3, help="HTTP and raw rounds")
    parser.add_argument("--profile-requests", type=int, default=30)
    parser.add_argument("--profile-interval-ms", type=float, default=0.2)
    parser.add_argument("--out", default="benchmarks/results/overhead.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv)
    harness.set_thread_env(args.threads)
    from diffbatch import Engine, SamplingParams

    report = harness.report_header("overhead", args)
    start = time.perf_counter()
    spec = harness.diffbatch_spec(args.model, threads=args.threads, max_num_seqs=1, wait_ms=0)
    with harness.running([spec]) as servers, Engine(
        args.model, executor="inproc", max_num_seqs=1, torch_num_threads=args.threads
    ) as engine:
        adapter = engine.executor.runner.pipeline
        raw_pipe = adapter.pipe
        timed = adapter.pipe = TimedCall(raw_pipe)
        report["in_process"] = in_process(engine, args, timed)
        runner_ms = report["in_process"]["runner_overhead_ms"]["median"]
        report["http"] = through_http(servers[spec.name], raw_pipe, args, runner_ms)
        if not args.no_profile:
            profile = EngineThreadProfile(engine.core, args.profile_interval_ms / 1000.0)
            params = SamplingParams(height=args.size, width=args.size,
                                    num_inference_steps=args.steps, seed=0)
            engine.generate(PROMPT, params, use_tqdm=False)  # enters the wrapped step
            profile.arm()
            for i in range(args.profile_requests):
                engine.generate(PROMPT, params.clone(seed=i), use_tqdm=False)
            profile.disarm()
            engine.generate(PROMPT, params, use_tqdm=False)  # ends the profiled step
            profile.done.wait(60)
            base = harness.plot_path(args.out)[:-len(".png")] + "_profile"
            os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
            with open(base + ".txt", "w", encoding="utf-8") as f:
                # Library frames (torch, diffusers) grouped; nodes down to 0.1% shown,
                # so the engine's own small costs are not filtered out.
                f.write(profile.profiler.output_text(
                    unicode=False, color=False,
                    processor_options={"filter_threshold": 0.001}))
            report["profile"] = [base + ".txt"]
    inproc, http = report["in_process"], report["http"]
    report["P5_inproc_ms"] = inproc["overhead_ms"]["median"]
    report["P5_http_ms"] = http["overhead_ms"]["median"]
    print(f"in-process: forward {inproc['pipe_ms']['median']:.1f} ms, overhead "
          f"{report['P5_inproc_ms']:.2f} ms (runner {inproc['runner_overhead_ms']['median']:.2f},"
          f" engine {inproc['engine_overhead_ms']['median']:.2f}), PNG "
          f"{inproc['png_encode_ms']['median']:.2f} ms")
    print(f"worker+HTTP: e2e {http['e2e_ms']['median']:.1f} ms, worker execute "
          f"{http['worker_execute_ms']['median']:.1f} ms, overhead {report['P5_http_ms']:.2f} ms,"
          f" PNG {http['png_encode_ms']['median']:.2f} ms; cross-check e2e - raw forward = "
          f"{http['crosscheck_e2e_minus_raw_ms']:.1f} ms")
    harness.finish_report(report, args, plot, start_s=start)


if __name__ == "__main__":
    sys.exit(main())
