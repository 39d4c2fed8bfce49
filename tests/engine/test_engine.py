"""The engine with fake pipelines in-process: capability, paths, abort, close, errors."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading

import pytest

from diffbatch import (
    ConfigError,
    Engine,
    EngineClosedError,
    InvalidRequestError,
    PipelineError,
    QueueFullError,
    SamplingParams,
)
from tests.fake_pipelines import (
    FakeBatchPipeline,
    FakeSinglePipeline,
    GatedPipeline,
    make_fake_adapter,
)

FAKE = "tests.fake_pipelines.FakeBatchPipeline"


def gated_engine(**kwargs) -> Engine:
    kwargs.setdefault("max_num_seqs", 4)
    kwargs.setdefault("request_batch_max_wait_ms", 0)  # fixed: these tests hold waves
    return Engine(pipeline_class=GatedPipeline, executor="inproc", **kwargs)


def submit(engine: Engine, prompt: str, request_id: str, **params):
    """Submit without waiting; returns the concurrent future of the output."""
    _, future = engine._submit(prompt, SamplingParams(**params), request_id, 0)
    return future


@pytest.mark.parametrize(
    "spec", [FakeBatchPipeline, FAKE, "tests.fake_pipelines:FakeBatchPipeline"]
)
def test_capability_from_class_object_or_dotted_name(spec):
    with Engine(pipeline_class=spec, executor="inproc", max_num_seqs=4) as engine:
        assert engine.supports_request_batch is True
        assert engine.pipeline_class is FakeBatchPipeline


def test_the_default_pipeline_is_known_to_batch_without_importing_it():
    """The engine's process takes the default class's capability on trust (it never
    imports diffusers); the class itself must agree."""
    from diffbatch.engine.async_engine import resolve_request_batch_support
    from diffbatch.pipelines.registry import resolve_pipeline_class

    assert resolve_request_batch_support(None) == (None, True)
    assert resolve_pipeline_class(None).supports_request_batch is True


@pytest.mark.parametrize("spec", ["tests.fake_pipelines.Missing", "no_such_module.Pipe",
                                  "tests.fake_pipelines.NotAPipeline"])
def test_bad_pipeline_class_is_a_clear_config_error(spec):
    with pytest.raises(ConfigError, match=spec.rsplit(".", 1)[-1]):
        Engine(pipeline_class=spec, executor="inproc")


def test_batching_with_a_non_batch_pipeline_is_a_start_up_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"supports_request_batch = True.*max_num_seqs=1"):
        Engine(pipeline_class=FakeSinglePipeline, executor="inproc", max_num_seqs=4)


def test_batching_a_diffusers_class_given_by_name_names_that_class_and_the_fix():
    with pytest.raises(ConfigError, match=r"pipeline_class StableDiffusionPipeline \(a "
                       r"diffusers class\) runs one request per forward; use max_num_seqs=1, "
                       r"or leave pipeline_class out") as info:
        Engine("tiny-sd", pipeline_class="diffusers.StableDiffusionPipeline",
               executor="inproc", max_num_seqs=4)
    assert "PerRequest" not in info.value.message


def test_non_batch_pipeline_takes_the_per_request_path():
    with Engine(pipeline_class=FakeSinglePipeline, executor="inproc") as engine:
        assert engine.supports_request_batch is False
        outs = engine.generate(["a", "b", "c"], SamplingParams(seed=1))
    assert [o.ok for o in outs] == [True] * 3 and {o.batch_size for o in outs} == {1}


def test_warmup_failure_fails_start_up(monkeypatch):
    monkeypatch.setenv("DIFFBATCH_FAKE_FAIL_WARMUP", "1")
    with pytest.raises(PipelineError, match="warm-up request failed: RuntimeError: warm-up"):
        Engine(pipeline_class=FAKE, executor="inproc")


def test_generate_returns_one_output_per_prompt_in_order_with_own_seed():
    with Engine(pipeline_class=FAKE, executor="inproc", max_num_seqs=4) as engine:
        params = [SamplingParams(seed=s, output_type="pt") for s in (1, 2, 3)]
        outs = engine.generate(["a", "b", "c"], params, request_ids=["x", "y", "z"])
        again = engine.generate(["b"], SamplingParams(seed=2, output_type="pt"))
        pil = engine.generate("a", SamplingParams(seed=1))[0]
    assert [o.request_id for o in outs] == ["x", "y", "z"]
    assert [o.seed for o in outs] == [1, 2, 3]
    assert (outs[1].images - again[0].images).abs().max() == 0
    assert pil.images[0].size == (16, 16) and pil.images[0].mode == "RGB"


def test_waves_fill_while_a_wave_runs(gate):
    with gated_engine(max_num_seqs=4) as engine:
        first = submit(engine, "first", "r0")
        assert gate.entered.wait(30)
        rest = [submit(engine, f"p{i}", f"r{i}") for i in range(1, 6)]
        assert engine.num_waiting == 5 and engine.num_running == 1
        registry = engine.metrics.registry
        depth = registry.get_sample_value("diffbatch_num_requests_waiting_by_key",
                                          {"key": "16x16/s2/g5/n1"})
        assert depth == 5
        gate.release.set()
        outs = [f.result(30) for f in [first, *rest]]
        assert registry.get_sample_value(
            "diffbatch_waves_total", {"close_reason": "capacity", "admission": "none"}) == 1
        assert registry.get_sample_value("diffbatch_wave_size_requests_count") == 3
        assert registry.get_sample_value("diffbatch_wave_size_requests_sum") == 6
        assert registry.get_sample_value("diffbatch_wave_size_requests_bucket",
                                         {"le": "1.0"}) == 2
    assert [o.batch_size for o in outs] == [1, 4, 4, 4, 4, 1]


def test_abort_waiting_and_running_requests(gate):
    with gated_engine() as engine:
        running = submit(engine, "runs", "a")
        assert gate.entered.wait(30)
        waiting = submit(engine, "waits", "b")
        assert engine.abort("b") and engine.abort("a")
        assert waiting.result(5).aborted and running.result(5).aborted
        assert not engine.abort("a")  # already finished
        gate.release.set()
        assert engine.generate(["after"])[0].ok
        assert engine.num_unfinished == 0 and engine.num_waiting == engine.num_running == 0
        assert engine.core.scheduler.request_ids() == []
        assert engine.metrics.count("aborted") == 2


def test_close_fails_every_open_request(gate):
    engine = gated_engine()
    running = submit(engine, "runs", "a")
    assert gate.entered.wait(30)
    waiting = submit(engine, "waits", "b")
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert running.result(30).error.message == "engine is closed"
    assert waiting.result(30).error.message == "engine is closed"
    gate.release.set()
    closer.join(30)
    with pytest.raises(EngineClosedError):
        engine.generate(["late"])
    assert not engine.is_healthy


def test_a_wave_cut_short_by_the_shutdown_is_logged_as_such_not_as_an_error(caplog):
    """Ctrl-C in a script closes the engine under its running waves: their requests
    fail "engine is closed", and the log says why without an ERROR line per wave; a
    worker that died is still an error."""
    from diffbatch.errors import WorkerDiedError
    from diffbatch.sched.output import SchedulerOutput

    caplog.set_level(logging.INFO, logger="diffbatch")
    with gated_engine() as engine:
        wave = SchedulerOutput(wave_id=7, requests=[], key=None)
        closed = engine.core._executor_error(
            wave, EngineClosedError("the executor was shut down while running wave 7"))
        assert closed.type == "engine_unavailable"
        assert [(r.levelno, r.getMessage()) for r in caplog.records
                if "wave 7" in r.getMessage()] == [
            (logging.INFO, "wave 7 ended by the shutdown: the executor was shut down while "
                           "running wave 7")]
        caplog.clear()
        engine.core._executor_error(wave, WorkerDiedError("the worker died", started=True))
        assert [r.levelno for r in caplog.records if "wave 7" in r.getMessage()] == [
            logging.ERROR]


def test_an_engine_dropped_without_close_fails_its_requests_and_stops_its_threads(gate):
    """No `close()`: once the last reference goes, the engine's finalizer does what
    `close` does (the core's threads hold it only weakly)."""
    engine = gated_engine()
    running = submit(engine, "runs", "a")
    assert gate.entered.wait(30)
    waiting = submit(engine, "waits", "b")
    threads = engine.core.threads()
    # the gated wave ends once both callers have their answer (the finalizer waits for it)
    threading.Thread(target=lambda: (running.result(30), waiting.result(30),
                                     gate.release.set()), daemon=True).start()
    del engine
    gc.collect()
    for future in (running, waiting):
        assert "garbage-collected without close()" in future.result(30).error.message
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), thread.name


def test_a_closed_engine_leaves_nothing_for_its_finalizer():
    engine = Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=2)
    assert engine._finalizer.alive
    engine.close()
    assert not engine._finalizer.alive


def test_a_second_shutdown_returns_once_the_first_has_closed_the_engine(gate):
    engine = gated_engine()
    running = submit(engine, "runs", "a")
    assert gate.entered.wait(30)
    first = threading.Thread(target=engine.shutdown, args=(60.0,))
    first.start()  # the running wave may finish for a minute
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (engine.shutdown(60.0), second_done.set()))
    second.start()
    assert not second_done.wait(0.2)  # not before the first is done
    gate.release.set()  # the wave ends, the first shutdown closes the engine
    second.join(60)
    assert second_done.is_set() and engine._close_done.is_set()
    assert running.result(5).ok
    first.join(60)


def test_a_failing_wave_fails_only_its_requests_and_the_engine_keeps_serving(gate):
    with gated_engine(batch_error_isolation="none") as engine:
        first = submit(engine, "first", "r0")
        assert gate.entered.wait(30)
        wave = [submit(engine, "poison", "p"), submit(engine, "fine", "f")]
        gate.release.set()
        assert first.result(30).ok
        outs = [f.result(30) for f in wave]
        assert [o.batch_size for o in outs] == [2, 2]
        assert all("poisoned prompt" in o.error.message for o in outs)
        assert engine.generate(["fine again"])[0].ok
        assert engine.metrics.count("error") == 2 and engine.is_healthy


def test_bisect_isolation_fails_only_the_poisoned_request(gate):
    with gated_engine() as engine:
        first = submit(engine, "first", "r0")
        assert gate.entered.wait(30)
        wave = [submit(engine, "poison", "p"), submit(engine, "fine", "f")]
        gate.release.set()
        assert first.result(30).ok
        poisoned, fine = (f.result(30) for f in wave)
        assert "poisoned prompt" in poisoned.error.message and fine.ok
        assert fine.batch_size == 2


def test_queue_full_is_rejected_at_once(gate):
    with gated_engine(max_queue_size=2) as engine:
        submit(engine, "runs", "a")
        assert gate.entered.wait(30)
        waiting = [submit(engine, "w", f"w{i}") for i in range(2)]
        with pytest.raises(QueueFullError, match="full"):
            submit(engine, "one too many", "x")
        assert engine.metrics.count("rejected") == 1
        gate.release.set()
        assert all(f.result(30).ok for f in waiting)


def test_bad_input_fails_at_the_call_and_leaves_the_engine_serving(tmp_path):
    make_fake_adapter(tmp_path / "good")
    with Engine(pipeline_class=FAKE, executor="inproc", max_num_seqs=4,
                lora_dir=str(tmp_path)) as engine:
        with pytest.raises(InvalidRequestError, match="multiple of 8"):
            engine.generate(["a"], SamplingParams(height=12))
        with pytest.raises(InvalidRequestError, match="single string"):
            engine.generate([["a", "b"]])
        with pytest.raises(InvalidRequestError, match="inside the LoRA directory"):
            engine.generate(["a"], SamplingParams(lora="../etc"))
        with pytest.raises(InvalidRequestError, match="not found"):
            engine.generate(["a"], SamplingParams(lora="missing"))
        with pytest.raises(InvalidRequestError, match="one per prompt"):
            engine.generate(["a", "b"], [SamplingParams()])
        with pytest.raises(InvalidRequestError, match=r"got dict \(build one"):
            engine.generate(["a", "b"], {"seed": 1})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="string or a list of strings, got NoneType"):
            engine.generate(None)  # type: ignore[arg-type]
        assert engine.generate(["a"], SamplingParams(lora="good"))[0].ok
        assert engine.generate(["a"])[0].ok


def test_ctrl_c_in_generate_aborts_its_requests(tmp_path, monkeypatch):
    """A KeyboardInterrupt while `generate` waits stops its wave at the next step (the
    script is going away, or the REPL wants the engine for the next call)."""
    monkeypatch.setenv("DIFFBATCH_FAKE_MARKER_DIR", str(tmp_path))
    # Python's own Ctrl-C handler, also where the suite was started with SIGINT ignored
    # (a background job, nohup): Python then leaves it ignored, and the SIGINT below
    # would do nothing while `generate` waits out its ten-minute wave.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Engine(pipeline_class="tests.fake_pipelines.FaultyPipeline", executor="inproc",
                    max_num_seqs=1, request_batch_max_wait_ms=0) as engine:
            def interrupt_once_running() -> None:
                while not (tmp_path / "ctrlc").exists():  # the wave's first step
                    threading.Event().wait(0.01)
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

            threading.Thread(target=interrupt_once_running, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                engine.generate(["steps ctrlc"])  # ten minutes of steps
            stopped = tmp_path / "ctrlc.interrupted"  # written when the wave stops at a step
            for _ in range(6000):  # (bounds a broken test only; the wave would run ten minutes)
                if stopped.exists():
                    break
                threading.Event().wait(0.01)
            assert stopped.exists()
            assert engine.generate(["next"])[0].ok
    finally:
        signal.signal(signal.SIGINT, previous)


def test_duplicate_active_request_id_is_rejected(gate):
    with gated_engine() as engine:
        submit(engine, "runs", "a")
        assert gate.entered.wait(30)
        with pytest.raises(InvalidRequestError, match="already active"):
            submit(engine, "again", "a")
        # the same id twice in one call is that call's mistake, whatever is active
        with pytest.raises(InvalidRequestError, match="'x' is given more than once"):
            engine.generate(["b", "c"], request_ids=["x", "x"])
        assert engine.num_unfinished == 1
        gate.release.set()


async def test_generate_async_and_cancellation_aborts(gate):
    with gated_engine() as engine:
        task = asyncio.ensure_future(engine.generate_async("runs", request_id="a"))
        assert await asyncio.to_thread(gate.entered.wait, 30)
        waiting = asyncio.ensure_future(engine.generate_async("waits", request_id="b"))
        while engine.num_waiting < 1:  # let the second submit reach the queue
            await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert engine.num_waiting == 0 and engine.metrics.count("aborted") == 1
        gate.release.set()
        out = await task
        assert out.ok and out.request_id == "a"


def test_default_model_is_named_in_the_config():
    from diffbatch.models import DEFAULT_MODEL

    with Engine(pipeline_class=FAKE, executor="inproc") as engine:
        assert engine.config.model == DEFAULT_MODEL


def test_sizes_above_the_models_own_limit_are_refused_naming_the_largest():
    """As OpenAI answers an unsupported size: 400 on `size`, naming a size that works."""
    with Engine(pipeline_class="tests.fake_pipelines.SmallModelPipeline",
                executor="inproc") as engine:
        with pytest.raises(InvalidRequestError, match=r"`size` 32x64 is larger than "
                           r"SmallModelPipeline generates: at most 1024 pixels .*; the "
                           r"largest square size is 32x32") as info:
            engine.generate(["a"], SamplingParams(height=64, width=32))
        assert info.value.status_code == 400 and info.value.param == "size"
        assert engine.generate(["a"], SamplingParams(height=32, width=32))[0].ok


@pytest.fixture(scope="module")
def tiny_sd3_engine():
    with Engine("tiny-sd3", executor="inproc", warmup=False) as engine:
        yield engine


@pytest.mark.parametrize(
    ("params", "param", "match"),
    [
        ({"height": 72}, "height", "multiple of 16"),
        ({"timesteps": (999, 500)}, "timesteps", "`timesteps` is not supported"),
        ({"extra": {"no_such_knob": 1}}, "extra", "'no_such_knob' is not accepted"),
        ({"extra": {"prompt_embeds": None}}, "extra", "'prompt_embeds' is not accepted"),
    ],
)
def test_model_dependent_checks_run_at_admission(tiny_sd3_engine, params, param, match):
    """Refused before queueing, with a 400 naming the parameter, never at wave time."""
    with pytest.raises(InvalidRequestError, match=match) as info:
        tiny_sd3_engine.generate(["a red cat"], SamplingParams(**params))
    assert info.value.status_code == 400 and info.value.param == param
    assert tiny_sd3_engine.num_unfinished == 0 and tiny_sd3_engine.num_waiting == 0


def test_unknown_engine_options_fail_naming_the_option():
    """A typo is not passed to the pipeline's from_pretrained; it fails with a hint."""
    with pytest.raises(ConfigError, match=r"unknown engine option `max_num_seq`; did you mean "
                                          r"`max_num_seqs`\?") as info:
        Engine("tiny-sd", max_num_seq=4)
    assert info.value.param == "max_num_seq"


def test_pipeline_load_arguments_go_through_pipeline_kwargs():
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", warmup=False,
                pipeline_kwargs={"variant": "fp16"}) as engine:
        assert engine.executor.runner.pipeline.kwargs == {"variant": "fp16"}


def test_every_refusal_at_admission_is_counted_once():
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", warmup=False,
                max_num_seqs=2, request_batch_max_wait_ms=0) as engine:
        with pytest.raises(InvalidRequestError):
            engine.generate(["a"], SamplingParams(height=12))  # not a multiple of 8
        with pytest.raises(InvalidRequestError):
            engine.generate(["a", ""], SamplingParams())  # one bad prompt refuses the call
        assert engine.metrics.count("rejected") == 3
        assert engine.generate(["fine"])[0].ok
        assert engine.metrics.count("rejected") == 3


@pytest.mark.parametrize("options", [
    {"max_num_seqs": 2},
    {"max_num_seqs": "auto", "max_num_seqs_limit": 2, "calibration_budget_s": 5.0},
], ids=["warm-up", "warm-up-and-calibration"])
def test_start_up_waves_are_not_counted_and_served_waves_are(options):
    before = len(FakeBatchPipeline.wave_sizes)
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", warmup=True,
                request_batch_max_wait_ms=0, **options) as engine:
        num_start_up = len(FakeBatchPipeline.wave_sizes) - before
        assert num_start_up >= (1 if options["max_num_seqs"] == 2 else 2)  # they ran
        assert engine.metrics.wave_sizes_sum_count() == (0, 0)
        assert engine.metrics.count("completed") == 0
        assert engine.wave_log.since() == []
        outputs = engine.generate(["a", "b"])
        assert all(o.ok for o in outputs)
        served = FakeBatchPipeline.wave_sizes[before + num_start_up:]
        assert engine.metrics.wave_sizes_sum_count() == (2, len(served))
        assert engine.metrics.count("completed") == 2
        assert [e.num_requests for e in engine.wave_log.since()] == served


def test_close_hands_out_outputs_that_finished_just_before_it():
    """A request whose wave finished is answered with its images, even when close()
    comes while its output is still on the way to its caller."""
    engine = Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=1,
                    request_batch_max_wait_ms=0, warmup=False)
    delivering, release, joining = threading.Event(), threading.Event(), threading.Event()
    deliver = engine.core.deliver

    def slow_deliver(request, output):
        delivering.set()
        release.wait(30)
        deliver(request, output)

    engine.core.deliver = slow_deliver
    join = engine.core.join

    def watched_join(*args, **kwargs):
        joining.set()
        return join(*args, **kwargs)

    engine.core.join = watched_join
    future = submit(engine, "done just in time", "r")
    assert delivering.wait(30)  # finished; its delivery is under way
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert joining.wait(30)
    assert not future.done()  # not failed as "engine is closed" meanwhile
    release.set()
    assert future.result(30).ok
    closer.join(30)


def test_generate_names_the_invalid_prompt_of_a_list_and_submits_none():
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=2) as engine:
        good = SamplingParams(height=16, width=16)
        with pytest.raises(InvalidRequestError, match=r"^prompt 1: `height` must be") as info:
            engine.generate(["good", "bad"], [good, good.clone(height=17)])
        assert info.value.param == "height"
        assert engine.num_unfinished == 0  # the good one was not submitted either


def test_a_list_longer_than_the_queue_says_so_instead_of_retry_later():
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=2,
                max_queue_size=2) as engine:
        with pytest.raises(QueueFullError, match="submit at most 2 at once"):
            engine.generate([f"p{i}" for i in range(5)])
        assert len(engine.generate(["a", "b"])) == 2


@pytest.mark.parametrize("broken", ["no-model-index", "bad-json", "no-vae"])
def test_a_broken_local_model_folder_fails_before_a_worker_starts(tmp_path, monkeypatch,
                                                                  broken):
    import shutil

    import diffbatch.executor.multiproc as multiproc
    from diffbatch import ModelLoadError, ModelNotFoundError
    from diffbatch.pipelines.tiny import ensure_tiny_model

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a folder that cannot load")

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", no_worker)
    folder = tmp_path / "my-model"
    shutil.copytree(ensure_tiny_model("tiny-sd"), folder)
    if broken == "no-model-index":
        (folder / "model_index.json").unlink()
    elif broken == "bad-json":
        (folder / "model_index.json").write_text("{not json")
    else:
        shutil.rmtree(folder / "vae")
    expected = ModelLoadError if broken == "no-vae" else ModelNotFoundError
    with pytest.raises(expected) as info:
        Engine(str(folder))
    message = info.value.message
    assert ("the folder has no vae subfolder" in message if broken == "no-vae"
            else "no readable model_index.json" in message), message


@pytest.mark.parametrize("policy", ["fifo", "grouped"])
def test_the_admission_wait_does_not_wait_for_requests_the_pixel_cap_would_leave_out(
        policy):
    """A cap of one 16x16 image per wave: a lone request's wave is already full, so
    the fixed wait is not waited (a wave of 2 would need a cap of 512 pixels)."""
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=2000, max_wave_pixels=16 * 16,
                scheduling_policy=policy) as engine:
        out = engine.generate(["alone"], SamplingParams(height=16, width=16))[0]
        assert out.ok and out.batch_size == 1
        admissions = {sample.labels["admission"]: sample.value
                      for metric in engine.metrics.registry.collect()
                      if metric.name == "diffbatch_waves" for sample in metric.samples
                      if sample.name == "diffbatch_waves_total" and sample.value}
        assert admissions == {"none": 1}, admissions
