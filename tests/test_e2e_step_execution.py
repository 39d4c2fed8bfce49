"""Step mode end to end: a real worker process running the batch, a real tiny model.

Arrivals are ordered by events (the engine reports the request running), never by
sleeping; outputs are compared with request mode's solo runs of the same requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.errors import ConfigError
from tests.fake_pipelines import HANG, FakeBatchPipeline

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


def pt(seed: int, steps: int) -> SamplingParams:
    return SamplingParams(num_inference_steps=steps, seed=seed, output_type="pt")


def wait_until(condition, timeout_s: float = 120.0) -> None:
    """Wait for a condition the engine reports (re-checked every 10 ms)."""
    pause = threading.Event()
    for _ in range(int(timeout_s * 100)):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture(scope="module")
def step_engine():
    """Step mode in a worker process, on the real tiny-sd adapter whose call for a
    `HANG` prompt never returns (the stuck-batch test's), with a 3 s stall timeout."""
    with Engine("tiny-sd", pipeline_class="tests.fake_tiny_sd.HangingTinySD",
                step_execution=True, max_num_seqs=4, executor="mp", worker_stall_timeout_s=3.0,
                max_request_work=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def request_engine():
    """Request mode, in process: the reference outputs (grouped: a queue of mixed step
    counts runs in waves of one step count, not a wave per change of count)."""
    with Engine("tiny-sd", max_num_seqs=8, request_batch_max_wait_ms=0, executor="inproc",
                scheduling_policy="grouped", warmup=False) as engine:
        yield engine


def ticks(engine: Engine) -> float:
    return engine.metrics.registry.get_sample_value(
        "diffbatch_step_batch_size_requests_count") or 0.0


def test_mixed_step_counts_share_the_batch_and_the_short_request_leaves_first(
        step_engine, request_engine):
    steps = [200, 4, 120, 24]
    finished: list[int] = []

    async def run():
        tasks = []
        for i, n in enumerate(steps):
            tasks.append(asyncio.ensure_future(
                step_engine.generate_async(f"prompt {i}", pt(i, n))))
            tasks[-1].add_done_callback(lambda _t, i=i: finished.append(i))
            # the next one arrives once this one has joined the running batch (one
            # that finished had joined it)
            while step_engine.num_running + len(finished) < i + 1 and not tasks[-1].done():
                await asyncio.sleep(0.005)
        return await asyncio.gather(*tasks)

    outputs = asyncio.run(run())
    # Each joined while the ones before it were running, and a tick advances every
    # running request by one step: the fewest steps left finishes first.
    assert finished[0] == 1, f"completion order {finished}: the 4-step request should lead"
    assert finished[-1] == 0
    references = request_engine.generate([f"prompt {i}" for i in range(4)],
                                         [pt(i, n) for i, n in enumerate(steps)])
    for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        assert out.ok, out.error
        assert (out.images - ref.images).abs().max().item() <= TOLERANCE, f"request {i}"
    # 200, 120 and 24 steps shared a step (the 4-step one too, unless it left before
    # the last joined: a loaded machine decides that)
    assert outputs[0].batch_size in (3, 4) and outputs[3].batch_size in (3, 4)
    assert outputs[1].batch_size >= 2  # it joined the 200-step request's batch


def test_many_concurrent_requests_each_get_their_own_image(step_engine, request_engine):
    """64 requests of five step counts at once: the running batch of 4 takes joiners
    at every step boundary, and each request's image is its own."""
    prompts = [f"a shape number {i}" for i in range(64)]
    params = [pt(1000 + i, 2 + i % 5) for i in range(64)]
    outputs = step_engine.generate(prompts, params, use_tqdm=False)
    references = request_engine.generate(prompts, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        assert out.ok, out.error
        assert (out.images - ref.images).abs().max().item() <= TOLERANCE, f"request {i}"
    assert max(o.batch_size for o in outputs) == 4


def counted(engine: Engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


def test_an_abort_stops_the_requests_compute_and_frees_its_slot(step_engine):
    before = ticks(step_engine)
    joins = counted(step_engine, "diffbatch_step_joins_total")
    leaves = counted(step_engine, "diffbatch_step_leaves_total")

    async def run():
        long_task = asyncio.ensure_future(step_engine.generate_async("long", pt(1, 999)))
        while step_engine.num_running < 1:
            await asyncio.sleep(0.005)
        long_task.cancel()  # the caller went away: the request is aborted
        short = await step_engine.generate_async("short", pt(2, 4))
        with pytest.raises(asyncio.CancelledError):
            await long_task
        return short

    short = asyncio.run(run())
    assert short.ok, short.error
    # both joined the batch and both left it: the cancelled one counts as a leave (its
    # tick statistics arrive with the worker's answer to the cancel, in either order
    # with the short one's)
    wait_until(lambda: counted(step_engine, "diffbatch_step_leaves_total") - leaves == 2)
    assert counted(step_engine, "diffbatch_step_joins_total") - joins == 2
    assert step_engine.num_running == 0
    assert ticks(step_engine) - before < 500  # the 1000-step request stopped early
    assert counted(step_engine, "diffbatch_waves_cancelled_total") == 0  # no waves here


def test_a_streamed_request_gets_its_partial_images_through_the_worker(step_engine,
                                                                      request_engine):
    async def stream(engine):
        params = pt(7, 4).clone(partial_images=3)
        return [item async for item in engine.generate_stream("a streamed cat", params)]

    *partials, output = asyncio.run(stream(step_engine))
    *expected, reference = asyncio.run(stream(request_engine))
    assert [p.step for p in partials] == [p.step for p in expected] == [1, 2, 3]
    for got, want in zip([*partials, output], [*expected, reference], strict=True):
        image = got.image if hasattr(got, "image") else got.images
        wanted = want.image if hasattr(want, "image") else want.images
        assert (image - wanted).abs().max().item() <= TOLERANCE


def test_start_up_refuses_a_pipeline_without_the_step_contract():
    with pytest.raises(ConfigError, match="FakeBatchPipeline"):
        Engine(pipeline_class=FakeBatchPipeline, step_execution=True, executor="inproc")


def test_a_batch_that_stops_stepping_while_the_heartbeat_lives_is_stuck_and_replaced(
        step_engine):
    """The worker's main thread hangs in a request's pipeline call (its heartbeat
    thread beats on): once the running batch has finished no step for its stall bound
    (here the 3 s stall timeout: 10 x a tiny tick is less), the worker is killed as
    stuck; the request is re-run alone on the replacement, hangs again, and fails
    naming why, as request mode's wave of one would; the next replacement serves the
    next request. (3 s, not less: the replacement's first ticks must stay inside it on
    a machine that runs another test beside this one.) It replaces the module engine's
    worker, so it runs after the other tests of `step_engine`."""
    engine = step_engine
    keys = ("stuck_waves", "frozen", "batch_reruns")
    before = engine.executor.health_stats()
    assert engine.generate(["before"], [pt(1, 3)], use_tqdm=False)[0].ok  # ticks seen
    stuck = engine.generate([f"it {HANG}"], [pt(2, 3)], use_tqdm=False)[0]
    assert stuck.error is not None
    assert "again when it was re-run on its own" in stuck.error.message
    assert "stuck: the running batch finished no step" in stuck.error.message
    stats = engine.executor.health_stats()
    assert tuple(stats[k] - before[k] for k in keys) == (2, 2, 1)
    assert engine.executor.wait_healthy(120)
    after = engine.generate(["after"], [pt(3, 3)], use_tqdm=False)[0]
    assert after.ok, after.error


def started_and_queued(engine: Engine) -> tuple[set[str], set[str]]:
    """The requests handed to the worker: in its running batch, and in its queue."""
    records = [r for r in list(engine.core.in_flight) if not r.future.done()]
    started = {r.wave.requests[0].request_id for r in records
               if engine.executor.has_started(r.future)}
    return started, {r.wave.requests[0].request_id for r in records} - started


@pytest.fixture(scope="module")
def capacity_one():
    """One engine for the two tests below (the shutdown one ends it, so it runs last)."""
    with Engine("tiny-sd", step_execution=True, max_num_seqs=1, executor="mp",
                max_request_work=0) as engine:
        yield engine


def test_a_request_still_in_the_workers_queue_is_run_again_when_the_worker_dies(
        capacity_one):
    """Capacity 1: "waits" sits in the worker's queue behind "runs". The worker dies:
    "runs" is re-run on its own on the replacement (it may have caused the crash),
    "waits" never started, so it is queued again and served after it."""
    engine = capacity_one

    async def run():
        runs = asyncio.ensure_future(engine.generate_async("runs", pt(1, 300)))
        waits = asyncio.ensure_future(engine.generate_async("waits", pt(2, 6)))
        while len(started_and_queued(engine)[0]) < 1 or len(started_and_queued(engine)[1]) < 1:
            await asyncio.sleep(0.005)
        # the one in the batch runs; the one in the worker's queue waits (and counts
        # against --max-queue-size, with the metrics' waiting gauges)
        assert engine.num_running == 1 and engine.num_waiting == 1
        assert sum(engine.core.num_waiting_by_key().values()) == 1
        os.kill(engine.executor.worker_pid, signal.SIGKILL)
        return await asyncio.gather(runs, waits)

    reruns = engine.executor.health_stats()["batch_reruns"]
    runs, waits = asyncio.run(run())
    assert runs.ok, runs.error
    assert waits.ok, waits.error
    assert engine.executor.health_stats()["batch_reruns"] - reruns == 1  # "runs" alone
    references = engine.generate(["runs", "waits"], [pt(1, 300), pt(2, 6)], use_tqdm=False)
    for got, want in zip((runs, waits), references, strict=True):
        assert (got.images - want.images).abs().max().item() <= TOLERANCE


def test_shutdown_answers_a_request_in_the_workers_queue_at_once(capacity_one):
    """On shutdown, a request that had not entered the running batch is answered
    "had not started" at once; the running one may finish."""
    engine = capacity_one
    answered: list[str] = []

    async def run():
        runs = asyncio.ensure_future(engine.generate_async("runs", pt(1, 300)))
        waits = asyncio.ensure_future(engine.generate_async("waits", pt(2, 6)))
        runs.add_done_callback(lambda _t: answered.append("runs"))
        waits.add_done_callback(lambda _t: answered.append("waits"))
        while len(started_and_queued(engine)[0]) < 1 or len(started_and_queued(engine)[1]) < 1:
            await asyncio.sleep(0.005)
        stopping = asyncio.get_running_loop().run_in_executor(None, engine.shutdown, 120.0)
        outputs = await asyncio.gather(runs, waits)
        await stopping
        return outputs

    runs, waits = asyncio.run(run())
    assert waits.error is not None and "had not started" in waits.error.message
    assert runs.ok, runs.error
    assert answered == ["waits", "runs"]


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_diffbatch_serve_step_execution_shares_steps_across_step_counts(tmp_path):
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.entrypoints.test_cli_serve import wait_ready

    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffbatch.entrypoints.cli", "serve", "tiny-sd", "--port",
         "0", "--log-level", "info", "--step-execution", "--max-num-seqs", "4",
         "--max-request-work", "0"],
        stdout=log, stderr=subprocess.STDOUT)
    # NOTE: the pool is shut down after the server stops (`finally`), so a failed check
    # does not wait for the 600-step request to finish.
    pool = ThreadPoolExecutor(2)
    try:
        url = wait_ready(proc, log.name)
        joins_before = metric(url, "diffbatch_step_joins_total")

        def generate(steps: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/images/generations", timeout=300, json={
                "prompt": f"a circle in {steps} steps", "num_inference_steps": steps,
                "seed": steps})

        long = pool.submit(generate, 600)  # outlasts a stalled round trip or two
        wait_until(lambda: metric(url, "diffbatch_num_requests_running") == 1)
        short = pool.submit(generate, 4)
        # the short request joins the running batch at the next step boundary, or the
        # test fails now (a request that only queued would wait out the 600 steps)
        wait_until(lambda: long.done()
                   or metric(url, "diffbatch_step_joins_total") - joins_before == 2,
                   timeout_s=15)
        assert not long.done(), "the 4-step request did not join the running batch"
        assert short.result().status_code == 200, short.result().text
        assert short.result().headers["x-diffbatch-batch-size"] == "2"
        assert not long.done()  # the 4-step request left while the 600-step one ran
        assert long.result().status_code == 200
        assert long.result().headers["x-diffbatch-batch-size"] == "2"
        assert metric(url, "diffbatch_step_joins_total") - joins_before == 2
        assert metric(url, "diffbatch_step_leaves_total") - joins_before == 2
        assert metric(url, "diffbatch_step_batch_size_requests_count") >= 600
    finally:  # killed: its shutdown would let a failed test's 600-step request finish
        proc.kill()
        proc.wait(60)
        pool.shutdown(cancel_futures=True)
        log.close()
