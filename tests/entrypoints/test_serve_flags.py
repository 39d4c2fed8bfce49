"""Every `diffbatch serve` flag and every `Engine` option reaches the code that uses it.

One table per kind, derived checks over both:

- `SERVER_FLAGS`: each flag of `diffbatch serve` that is not an engine option, with a
  check that runs the real start-up path (`run_server` on the parsed command line, an
  in-process engine of `tests.fake_pipelines`) and asserts what the flag changes:
  an answer of the app, a setting of uvicorn, the shutdown bound.
- `ENGINE_OPTIONS`: each `EngineConfig` field, with the value that must arrive in the
  config `run_server` hands to `Engine.from_config` (through its flag) or that
  `Engine(**options)` keeps, and the test that proves the engine behaves differently
  with it (`proven_by`, checked to exist).

`test_every_flag_and_option_has_an_entry` derives the lists from the parser and the
config, so a flag or option added without an entry fails the suite, naming it and
where its one-line entry goes.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import socket
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import pytest

from diffbatch.config import EngineConfig
from diffbatch.entrypoints import cli
from diffbatch.entrypoints.openai import api_server
from diffbatch.entrypoints.openai.image_store import FILES_ROUTE, max_file_bytes
from tests.fake_pipelines import GatedPipeline

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/v1/images/generations"
# Bounds each wait of a broken test: an in-process client has no network timeouts, so
# every request and gate wait here is given this deadline and a red test fails fast.
DEADLINE_S = 5.0
# Every served case starts from this: an in-process engine of the fake pipeline, fixed
# settings (no calibration), no warm-up, the port the system picks. A case's own flags
# come after these, so they win.
BASE_ARGV = ("--executor", "inproc", "--pipeline-class", "tests.fake_pipelines:FakeBatchPipeline",
             "--max-num-seqs", "2", "--request-batch-max-wait-ms", "0", "--no-warmup",
             "--port", "0")


class TimeoutGate(GatedPipeline):
    """This module's own gate (events apart from other tests'): a forward blocks until
    `release` is set."""

    entered = threading.Event()
    release = threading.Event()

    def forward(self, batch: Any) -> Any:
        if batch.prompts != ["warm-up"]:
            type(self).entered.set()
            type(self).release.wait(DEADLINE_S)
        return self.make_outputs(batch)


@dataclass
class Served:
    """What `run_server` built from a command line, seen where uvicorn would run it."""

    app: Any
    engine: Any
    config: Any  # uvicorn.Config
    shutdown_timeout_s: float

    def client(self) -> httpx.AsyncClient:
        """An in-process client of the app whose every request fails after DEADLINE_S."""
        return httpx.AsyncClient(transport=_DeadlineTransport(app=self.app),
                                 base_url="http://app")


class _DeadlineTransport(httpx.ASGITransport):
    """httpx's ASGI transport, which has no timeouts, with a deadline per request."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await asyncio.wait_for(super().handle_async_request(request), DEADLINE_S)


def serve(argv: list[str], check: Callable[[Served], Any],
          monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `diffbatch serve BASE_ARGV argv` through `run_server`, with `check` (sync or
    async) run where the server would serve; the engine is closed afterwards as
    `run_server` closes it."""
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    args = cli.make_arg_parser().parse_args(["serve", *BASE_ARGV, *argv])
    failures: list[BaseException] = []

    class CheckingServer:
        def __init__(self, config: Any, *, engine: Any, shutdown_timeout_s: float) -> None:
            self.served = Served(config.app, engine, config, shutdown_timeout_s)
            self.started = True

        def run(self) -> None:
            try:
                result = check(self.served)
                if asyncio.iscoroutine(result):
                    asyncio.run(result)
            except BaseException as exc:  # re-raised after run_server closed the engine
                failures.append(exc)

    monkeypatch.setattr(api_server, "DrainingServer", CheckingServer)
    api_server.run_server(args)
    if failures:
        raise failures[0]


async def within(awaitable: Any) -> Any:
    """`awaitable`, failing the test after `DEADLINE_S`."""
    return await asyncio.wait_for(awaitable, DEADLINE_S)


async def generate(served: Served, **body: Any) -> httpx.Response:
    async with served.client() as client:
        return await client.post(ROUTE, json={"prompt": "a red circle", **body})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- checks of the server flags -----------------------------------------------------

def listens_at(host: str | None = None, port: int | None = None) -> Callable[[Served], None]:
    def check(served: Served) -> None:
        if host is not None:
            assert served.config.host == host
        if port is not None:
            assert served.config.port == port
    return check


async def check_served_model_name(served: Served) -> None:
    async with served.client() as client:
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "renamed"
        assert (await client.post(ROUTE, json={"prompt": "p", "model": "renamed"})
                ).status_code == 200


async def check_runtime_lora_updating(served: Served) -> None:
    """The unload route answers (without the flag it does not exist: a bare 404)."""
    async with served.client() as client:
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "none"})
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "lora_name", response.text


async def check_api_key(served: Served) -> None:
    async with served.client() as client:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer k1"})
                ).status_code == 200


async def check_request_timeout(served: Served) -> None:
    """A request held at the gate past the timeout is answered 504 and aborted."""
    try:
        response = await generate(served)
        assert response.status_code == 504, response.text
        assert "request timeout of 0.2 s" in response.json()["error"]["message"]
    finally:
        TimeoutGate.release.set()


def check_shutdown_timeout(served: Served) -> None:
    assert served.shutdown_timeout_s == 4.0
    assert served.config.timeout_graceful_shutdown > 4.0  # uvicorn waits for the engine


async def check_max_image_pixels(served: Served) -> None:
    assert (await generate(served, size="16x16")).status_code == 200
    response = await generate(served, size="32x32")  # 1024 pixels > 256
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "size"


async def check_max_upload_mb(served: Served) -> None:
    async with served.client() as client:
        response = await client.post("/v1/images/edits", data={"prompt": "p"}, files={
            "image": ("big.png", b"\0" * (3 << 19), "image/png")})  # 1.5 MiB > 1 MiB
    assert response.status_code == 413, response.text


async def check_public_url(served: Served) -> None:
    response = await generate(served, response_format="url")
    assert response.status_code == 200, response.text
    assert response.json()["data"][0]["url"].startswith(
        f"https://img.example.com/api{FILES_ROUTE}/")


async def check_image_store_mb(served: Served) -> None:
    """1 MiB keeps a 16x16 image but refuses, before any compute, links to images the
    store could not hold (a size over 1 MiB but under the default store's 256 MiB)."""
    assert (await generate(served, response_format="url")).status_code == 200
    side = 8 * (int(((1 << 20) / 3.3) ** 0.5) // 8 + 8)
    assert max_file_bytes(side, side) > 1 << 20
    response = await generate(served, response_format="url", size=f"{side}x{side}")
    assert response.status_code == 400, response.text
    assert "(1048576 bytes)" in response.json()["error"]["message"]


async def check_no_image_store(served: Served) -> None:
    response = await generate(served, response_format="url")
    assert response.status_code == 400, response.text
    assert "--image-store-mb 0" in response.json()["error"]["message"]


async def check_image_url_ttl(served: Served) -> None:
    response = await generate(served, response_format="url")
    path = response.json()["data"][0]["url"].removeprefix("http://app")
    async with served.client() as client:
        image = await client.get(path)
    assert image.status_code == 200
    max_age = int(image.headers["cache-control"].rsplit("=", 1)[1])
    assert 7000 < max_age <= 7200  # the default is an hour


VIDEO = ("tiny-wan", "--pipeline-class",
         "diffbatch.pipelines.diffusers_video:DiffusersVideoPipeline")


async def check_video_store_mb(served: Served) -> None:
    assert served.app.state.serving_videos.store.max_bytes == 3 << 20


async def check_video_ttl(served: Served) -> None:
    """A finished job expires the flag's seconds after it finished."""
    async with served.client() as client:
        job = (await client.post("/v1/videos", json={
            "prompt": "a cat", "num_frames": 1, "num_inference_steps": 1})).json()
        while job["status"] in ("queued", "in_progress"):
            await asyncio.sleep(0.02)  # (a busy poll would hold the GIL from the engine)
            job = (await client.get(f"/v1/videos/{job['id']}")).json()
    assert job["status"] == "completed", job
    assert job["expires_at"] - job["completed_at"] == 120


def png_zlib_header(png: bytes) -> bytes:
    """The first two bytes of the PNG's zlib stream (its FLEVEL tells the level)."""
    offset = 8
    while offset < len(png):
        length, kind = struct.unpack(">I4s", png[offset:offset + 8])
        if kind == b"IDAT":
            return png[offset + 8:offset + 10]
        offset += 12 + length
    raise AssertionError("no IDAT chunk")


async def check_png_compress_level(served: Served) -> None:
    response = await generate(served)
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    assert png_zlib_header(png) == b"\x78\xda"  # level 9; levels 0-1 write 78 01
    zlib.decompress(png[png.index(b"IDAT") + 4:])  # sanity: it is the zlib stream


def check_log_level(served: Served) -> None:
    assert served.config.log_level == "debug"


def check_connection_limits(served: Served) -> None:
    config = served.config
    assert config.timeout_keep_alive == 7
    assert (config.http.header_timeout_s, config.http.max_connections) == (3, 9)


async def check_body_timeout(served: Served) -> None:
    """A body that stops arriving is answered 408 after the flag's pause."""
    sent: list[dict[str, Any]] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"prompt"', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": ROUTE, "raw_path": ROUTE.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("app", 80), "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", b"100")]}
    await within(served.app(scope, receive, send))
    assert sent[0]["status"] == 408, sent


@dataclass(frozen=True)
class FlagCase:
    argv: tuple[str, ...]  # the flag and its value
    check: Callable[[Served], Any] | None  # asserts what the flag changed (sync or async)
    proven_by: str | None = None  # or "path::test", the test that shows it (Ray flags)


def case(*argv: str, check: Callable[[Served], Any]) -> FlagCase:
    return FlagCase(tuple(argv), check)


def ray(proven_by: str) -> FlagCase:
    """A Ray flag: refused without --ray (`test_ray_flags_are_refused_without_ray`),
    shown at work on Ray Serve by the test `proven_by` names."""
    return FlagCase((), None, proven_by)


GATE = f"{__name__}:TimeoutGate"
RAY = "tests/entrypoints/ray/test_ray_serve.py::"
# One entry per `diffbatch serve` flag that is not an engine option. A new flag: add a
# line `"--flag": case("--flag", "VALUE", check=a_check_of_what_it_changes),` (a Ray
# flag: `"--flag": ray(RAY + "test_that_shows_it_on_ray"),`).
SERVER_FLAGS: dict[str, FlagCase] = {
    "--host": case("--host", "0.0.0.0", check=listens_at(host="0.0.0.0")),
    "--port": case("--port", str(PORT := free_port()), check=listens_at(port=PORT)),
    "--served-model-name": case("--served-model-name", "renamed",
                                check=check_served_model_name),
    "--api-key": case("--api-key", "k1", check=check_api_key),
    "--request-timeout": case("--request-timeout", "0.2", "--pipeline-class", GATE,
                              check=check_request_timeout),
    "--shutdown-timeout": case("--shutdown-timeout", "4", check=check_shutdown_timeout),
    "--max-image-pixels": case("--max-image-pixels", "256", check=check_max_image_pixels),
    "--max-upload-mb": case("--max-upload-mb", "1", check=check_max_upload_mb),
    "--public-url": case("--public-url", "https://img.example.com/api",
                         check=check_public_url),
    "--image-store-mb": case("--image-store-mb", "1", check=check_image_store_mb),
    "--image-url-ttl": case("--image-url-ttl", "7200", check=check_image_url_ttl),
    "--png-compress-level": case("--png-compress-level", "9", check=check_png_compress_level),
    "--video-store-mb": case(*VIDEO, "--video-store-mb", "3", check=check_video_store_mb),
    "--video-ttl": case(*VIDEO, "--video-ttl", "120", check=check_video_ttl),
    "--log-level": case("--log-level", "debug", check=check_log_level),
    "--header-timeout": case("--header-timeout", "3", "--limit-concurrency", "9",
                             "--keep-alive-timeout", "7", check=check_connection_limits),
    "--body-timeout": case("--body-timeout", "0.1", check=check_body_timeout),
    "--keep-alive-timeout": case("--keep-alive-timeout", "7", "--header-timeout", "3",
                                 "--limit-concurrency", "9", check=check_connection_limits),
    "--limit-concurrency": case("--limit-concurrency", "9", "--header-timeout", "3",
                                "--keep-alive-timeout", "7", check=check_connection_limits),
    "--ray": ray(RAY + "test_cli_on_ray_batches_in_the_replicas_worker_and_bounds_its_shutdown"),
    "--ray-address": ray(
        RAY + "test_an_address_where_nothing_listens_fails_at_once_naming_the_flag"),
    "--num-replicas": ray(RAY + "test_serve_flags_become_args"),
    "--min-replicas": ray(RAY + "test_args_autoscaling_bounds"),
    "--max-replicas": ray(RAY + "test_args_autoscaling_bounds"),
    "--target-ongoing-requests": ray(RAY + "test_args_autoscaling_bounds"),
    "--max-ongoing-requests": ray(RAY + "test_serve_flags_become_args"),
    "--num-cpus-per-replica": ray(RAY + "test_serve_flags_become_args"),
    "--num-gpus-per-replica": ray(RAY + "test_serve_flags_become_args"),
    "--allow-runtime-lora-updating": case("--allow-runtime-lora-updating",
                                          check=check_runtime_lora_updating),
    "--ray-router": ray("tests/entrypoints/ray/test_routing.py::"
                        "test_ray_router_flag_reaches_the_deployment"),
}
# A second value of a flag whose first one leaves a path untried (0 turns the store off).
EXTRA_SERVER_CASES: list[FlagCase] = [
    case("--image-store-mb", "0", check=check_no_image_store),
]


@dataclass(frozen=True)
class OptionCase:
    value: Any  # a value other than the default, as the config holds it
    proven_by: str  # "path::test": the test that shows the engine behaving differently
    text: str | None = None  # the flag's text for `value` (default: str(value); "" for
    # a boolean flag, given as --flag or --no-flag)
    with_flags: tuple[str, ...] = ()  # other flags the value needs (e.g. --executor mp)


def option(value: Any, proven_by: str, text: str | None = None,
           with_flags: tuple[str, ...] = ()) -> OptionCase:
    return OptionCase(value, proven_by, text, with_flags)


E2E = "tests/test_e2e_engine.py::"
ENGINE = "tests/engine/test_engine.py::"
MULTIPROC = "tests/executor/test_multiproc.py::"
# One entry per `EngineConfig` field. A new option: add a line
# `"name": option(VALUE, "tests/...py::test_that_shows_what_it_changes"),` (`text=` when
# the flag's text is not str(VALUE), `with_flags=` for flags VALUE needs beside it).
ENGINE_OPTIONS: dict[str, OptionCase] = {
    "mixed_resolution": option(True, "tests/test_e2e_mixed_resolution.py::"
                               "test_the_flag_lets_transformer_waves_mix_sizes_and_unets_split_"
                               "by_size", text=""),
    "lora_modules": option({"style": str(ROOT / "tests")},
                           "tests/entrypoints/openai/test_lora_adapters.py::"
                           "test_model_and_lora_select_adapters_through_the_openai_client",
                           text=f"style={ROOT / 'tests'}"),
    "lora_allow_pickle": option(True, "tests/entrypoints/openai/test_lora_loading.py::"
                                "test_pickle_adapters_load_only_with_the_opt_in"),
    "max_lora_file_mb": option(1, "tests/entrypoints/openai/test_lora_loading.py::"
                               "test_an_adapter_file_over_the_size_cap_is_refused_at_load"),
    "max_loras": option(2, "tests/test_e2e_lora.py::"
                        "test_four_adapters_under_max_loras_two_lose_no_request"),
    "model": option("tiny-sd", E2E + "test_batch_invariance_each_image_equals_its_solo_run"),
    "pipeline_class": option("tests.fake_pipelines:FakeSinglePipeline",
                             ENGINE + "test_non_batch_pipeline_takes_the_per_request_path"),
    "max_num_seqs": option(3, ENGINE + "test_waves_fill_while_a_wave_runs"),
    "max_num_seqs_limit": option(
        3, "tests/engine/test_calibration.py::test_the_limit_and_memory_bound_the_sizes",
        with_flags=("--max-num-seqs", "auto")),
    "max_waves_in_flight": option(
        1, "tests/engine/test_waves_in_flight.py::test_one_wave_in_flight_never_queues_a_second"),
    "request_batch_max_wait_ms": option(
        50.0, "tests/engine/test_batch_policy.py::test_fixed_settings_pass_through"),
    "calibration_budget_s": option(
        3.0, "tests/engine/test_calibration.py::"
        "test_a_slow_model_is_measured_at_fewer_steps_within_the_budget"),
    "executor": option("inproc", "tests/engine/test_waves_in_flight.py::"
                       "test_the_inproc_executor_holds_one_wave_whatever_the_config_says"),
    "device": option("cpu", "tests/pipelines/test_diffusers_t2i.py::"
                     "test_a_device_this_torch_cannot_use_is_a_config_error_naming_it"),
    "dtype": option("bfloat16", "tests/pipelines/test_diffusers_t2i.py::test_resolve_dtype"),
    "seed": option(7, "tests/entrypoints/test_cli_serve.py::"
                   "test_seed_flag_seeds_the_requests_that_give_none"),
    "max_request_work": option(
        1000, "tests/entrypoints/openai/test_worker_faults.py::"
        "test_a_request_over_the_work_limit_is_refused_with_400"),
    "worker_stall_timeout_s": option(2.5, MULTIPROC + "test_a_frozen_worker_is_killed_and_"
                                     "replaced_and_its_wave_fails_as_started"),
    "wave_stall_factor": option(
        3.0, MULTIPROC + "test_a_wave_past_its_stall_bound_is_stuck_and_its_worker_replaced"),
    "max_queue_size": option(
        1, "tests/entrypoints/test_serve_flags.py::test_max_queue_size_refuses_beyond_the_queue"),
    "lora_dir": option(str(ROOT / "tests"), "tests/test_e2e_lora.py::"
                       "test_a_mixed_wave_equals_each_request_alone"),
    "warmup": option(False, ENGINE + "test_warmup_failure_fails_start_up", text=""),
    "scheduling_policy": option(
        "fifo", "tests/test_e2e_grouped_policy.py::"
        "test_fifo_runs_an_alternating_size_queue_one_request_per_wave"),
    "compile": option("denoiser", "tests/test_e2e_compile.py::"
                      "test_start_up_compiles_each_bucket_before_ready",
                      with_flags=("--compile-backend", "eager")),
    "compile_buckets": option("2,4", "tests/test_e2e_compile.py::"
                              "test_start_up_compiles_each_bucket_before_ready"),
    "compile_backend": option("eager", "tests/test_e2e_compile.py::"
                              "test_a_module_whose_compile_fails_serves_eagerly"),
    "step_cache": option("first_block:0.3", "tests/test_e2e_step_cache.py::"
                         "test_server_default_and_per_request_settings_are_counted_in_"
                         "response_and_metrics"),
    "step_execution": option(True, "tests/test_e2e_step_execution.py::"
                             "test_mixed_step_counts_share_the_batch_and_the_short_request_"
                             "leaves_first", text=""),
    "max_head_wait_ms": option(
        100.0, "tests/engine/test_core.py::"
        "test_max_head_wait_ms_reaches_the_grouped_scheduler_from_the_config"),
    "max_wave_pixels": option(4096, "tests/sched/test_scheduler.py::"
                              "test_the_pixel_cap_bounds_fifo_waves_too",
                              with_flags=("--no-step-execution",)),
    "batch_error_isolation": option(
        "none", "tests/engine/test_engine.py::"
        "test_a_failing_wave_fails_only_its_requests_and_the_engine_keeps_serving"),
    "shm_threshold_bytes": option(
        4096, "tests/ipc/test_shm.py::test_at_threshold_stays_inline_above_goes_to_shm"),
    "torch_num_threads": option(1, "tests/worker/test_threads.py::test_the_users_settings_win"),
    "worker_cpus": option("0", MULTIPROC + "test_worker_cpus_pins_the_worker_process",
                          with_flags=("--executor", "mp")),
    "pipeline_kwargs": option(
        {"variant": "fp16"}, ENGINE + "test_pipeline_load_arguments_go_through_pipeline_kwargs"),
}


def serve_flags() -> dict[str, str]:
    """Every `diffbatch serve` flag (its `--no-` twin left out) -> its argparse dest."""
    parser = cli._command_parser(cli.make_arg_parser(),
                                 cli.make_arg_parser().parse_args(["serve"]))
    return {option: action.dest for action in parser._actions
            for option in action.option_strings
            if option.startswith("--") and option != "--help" and not option.startswith("--no-")}


def engine_flag(name: str) -> str | None:
    """The flag of `EngineConfig` field `name` (None: it has none, Python only)."""
    opt = next(f for f in fields(EngineConfig) if f.name == name).metadata["option"]
    if opt.flag == "":
        return None
    return opt.flag or "--" + name.replace("_", "-")


def test_every_flag_and_option_has_an_entry() -> None:
    """The tables below follow the parser and the config: a flag or option added (or
    removed) without its entry fails here, saying where the line goes."""
    options = {f.name for f in fields(EngineConfig)}
    engine_flags = {engine_flag(name) for name in options} - {None}
    server_flags = set(serve_flags()) - engine_flags
    here = "tests/entrypoints/test_serve_flags.py"
    missing = sorted(server_flags - set(SERVER_FLAGS))
    assert not missing, (
        f"`diffbatch serve` flag(s) {missing} have no test: add a one-line entry "
        f"`\"--flag\": case(\"--flag\", \"VALUE\", check=...)` to SERVER_FLAGS in {here}, "
        "with a check of what the flag changes")
    gone = sorted(set(SERVER_FLAGS) - server_flags)
    assert not gone, f"SERVER_FLAGS in {here} lists flag(s) {gone} that `diffbatch serve` " \
        "no longer has (or that are engine options now): remove their entries"
    missing = sorted(options - set(ENGINE_OPTIONS))
    assert not missing, (
        f"Engine option(s) {missing} have no test: add a one-line entry "
        f"`\"name\": option(VALUE, \"tests/...py::test_name\")` to ENGINE_OPTIONS in {here}, "
        "naming the test that shows what the option changes (its flag, if it has one, "
        "is then checked to hand VALUE to the engine)")
    gone = sorted(set(ENGINE_OPTIONS) - options)
    assert not gone, f"ENGINE_OPTIONS in {here} lists {gone}, which EngineConfig no " \
        "longer has: remove their entries"


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
               for node in ast.walk(tree))


@pytest.mark.parametrize("reference", sorted(
    {c.proven_by for c in ENGINE_OPTIONS.values()}
    | {c.proven_by for c in SERVER_FLAGS.values() if c.proven_by}))
def test_each_named_proof_exists(reference: str) -> None:
    assert _test_exists(reference), f"{reference} is no test: fix the entry that names it"


@pytest.mark.parametrize("case", [
    pytest.param(c, id=flag) for flag, c in SERVER_FLAGS.items() if c.argv
] + [pytest.param(c, id=" ".join(c.argv)) for c in EXTRA_SERVER_CASES])
def test_server_flag_reaches_its_consumer(case: FlagCase,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    TimeoutGate.release.clear()
    serve(list(case.argv), case.check, monkeypatch)


def test_ray_flags_are_refused_without_ray(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The Ray flags (whose entries name Ray tests) do nothing without --ray but fail."""
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    assert cli.main(["serve", "--num-replicas", "2"]) == 2
    assert "--num-replicas applies only with --ray" in capsys.readouterr().err


class _Stop(Exception):
    """Ends `run_server` once the engine's config is seen."""


@pytest.mark.parametrize("name", [n for n in ENGINE_OPTIONS if engine_flag(n)])
def test_engine_flag_reaches_the_engine_config(name: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`diffbatch serve --flag VALUE` hands the engine a config holding VALUE (not the
    default), through the real parse and `run_server`."""
    import diffbatch

    entry = ENGINE_OPTIONS[name]
    default = next(f for f in fields(EngineConfig) if f.name == name).default
    assert entry.value != default, f"{name}: the entry's value must differ from the default"
    flag = engine_flag(name)
    if name == "model":  # the positional MODEL
        argv = [entry.value]
    elif entry.text == "":  # a boolean flag: --flag or --no-flag
        argv = [flag if entry.value else "--no-" + flag.removeprefix("--")]
    else:
        argv = [flag, entry.text or str(entry.value)]
    argv += entry.with_flags
    seen: list[EngineConfig] = []

    def from_config(config: EngineConfig) -> None:
        seen.append(config)
        raise _Stop

    monkeypatch.setattr(diffbatch.Engine, "from_config", from_config)
    args = cli.make_arg_parser().parse_args(["serve", *argv])
    with pytest.raises(_Stop):
        api_server.run_server(args)
    value = getattr(seen[0], name)
    assert value == entry.value, f"{flag}: the engine got {value!r}, not {entry.value!r}"


@pytest.mark.parametrize("name", [n for n in ENGINE_OPTIONS if not engine_flag(n)])
def test_python_only_option_reaches_the_engine_config(name: str) -> None:
    entry = ENGINE_OPTIONS[name]
    config = EngineConfig.from_options(**{name: entry.value})
    assert getattr(config, name) == entry.value


def test_max_queue_size_refuses_beyond_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max-queue-size 1` with one request running and one waiting: a third is 503."""

    async def check(served: Served) -> None:
        engine = served.engine
        async with served.client() as client:
            body = {"prompt": "p"}
            running = asyncio.create_task(client.post(ROUTE, json=body))
            try:
                assert await asyncio.to_thread(TimeoutGate.entered.wait, DEADLINE_S)
                waiting = asyncio.create_task(client.post(ROUTE, json=body))
                for _ in range(1000):  # bounded: the request reaches the queue at once
                    if engine.num_waiting == 1:
                        break
                    await asyncio.sleep(0.01)
                assert engine.num_waiting == 1
                refused = await client.post(ROUTE, json=body)
                assert refused.status_code == 503, refused.text
                assert "full" in refused.json()["error"]["message"]
            finally:
                TimeoutGate.release.set()
            assert (await running).status_code == 200
            assert (await waiting).status_code == 200

    TimeoutGate.release.clear()
    TimeoutGate.entered.clear()
    serve(["--max-queue-size", "1", "--max-num-seqs", "1", "--pipeline-class", GATE],
          check, monkeypatch)


def test_the_default_is_what_a_served_flag_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the flags, each served check above would fail: the defaults differ."""
    async def check(served: Served) -> None:
        response = await generate(served)
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        assert png_zlib_header(png) == b"\x78\x01"  # the default level, 1
        assert served.config.host == "127.0.0.1"
        assert served.engine.config.max_queue_size is None
        async with served.client() as client:
            assert (await client.get("/v1/models")).status_code == 200  # no key needed

    serve([], check, monkeypatch)
