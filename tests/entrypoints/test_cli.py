"""Tests of the `diffbatch` command line parser (no server is started)."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any

import pytest

from diffbatch.entrypoints import cli
from diffbatch.entrypoints.openai.api_server import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
)
from diffbatch.entrypoints.openai.serving_images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_PNG_COMPRESS_LEVEL,
)


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """`main` configures process-wide logging; tests must not change it for others."""
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)


def parse(*argv: str):
    return cli.make_arg_parser().parse_args(list(argv))


def test_serve_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    args = parse("serve")
    assert args.command == "serve"
    assert args.model is None
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert args.max_num_seqs == "auto"
    assert args.request_batch_max_wait_ms == "auto"
    assert args.max_num_seqs_limit is None and args.torch_num_threads is None
    assert args.executor == "mp"
    assert args.api_key is None
    assert args.max_queue_size is None
    assert args.request_timeout is None
    assert args.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    assert args.png_compress_level == DEFAULT_PNG_COMPRESS_LEVEL == 1
    assert args.lora_dir is None
    assert args.log_level == "info"
    assert (args.header_timeout, args.keep_alive_timeout, args.limit_concurrency) == (
        DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_LIMIT_CONCURRENCY,
    ) == (10.0, 5.0, 1024)
    assert args.body_timeout == DEFAULT_BODY_TIMEOUT_S == 30.0
    assert args.func is cli._cmd_serve


def test_serve_every_flag(tmp_path) -> None:
    args = parse(
        "serve", "tiny-sd", "--host", "0.0.0.0", "--port", "9001", "--max-num-seqs", "4",
        "--request-batch-max-wait-ms", "50", "--executor", "inproc",
        "--served-model-name", "sd", "--api-key", "k", "--max-queue-size", "8",
        "--request-timeout", "2.5", "--max-image-pixels", "4096", "--lora-dir", str(tmp_path),
        "--log-level", "DEBUG", "--seed", "3", "--device", "cpu", "--dtype", "float32",
        "--header-timeout", "2.5", "--keep-alive-timeout", "30", "--limit-concurrency", "64",
        "--body-timeout", "7",
    )
    assert args.model == "tiny-sd"
    assert (args.host, args.port, args.max_num_seqs) == ("0.0.0.0", 9001, 4)
    assert args.request_batch_max_wait_ms == 50.0
    assert (args.executor, args.served_model_name, args.api_key) == ("inproc", "sd", "k")
    assert (args.max_queue_size, args.request_timeout, args.max_image_pixels) == (8, 2.5, 4096)
    assert args.lora_dir == str(tmp_path)
    assert (args.log_level, args.seed, args.device, args.dtype) == ("debug", 3, "cpu", "float32")
    assert (args.header_timeout, args.keep_alive_timeout, args.limit_concurrency) == (2.5, 30, 64)
    assert args.body_timeout == 7.0


@pytest.mark.parametrize("level", [0, 9])
def test_png_compress_level_bounds_are_accepted(level: int) -> None:
    assert parse("serve", "--png-compress-level", str(level)).png_compress_level == level


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert parse("serve").api_key == "from-env"
    assert parse("serve", "--api-key", "flag").api_key == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "must be 'auto' or an integer >= 1, got 0"),
        (["--max-num-seqs", "two"], "must be 'auto' or an integer >= 1, got 'two'"),
        (["--max-num-seqs", "autoo"], "must be 'auto' or an integer >= 1, got 'autoo'"),
        (["--max-num-seqs", "-1"], "must be 'auto' or an integer >= 1, got -1"),
        (["--request-batch-max-wait-ms", "-1"], "must be 'auto' or a finite number >= 0"),
        (["--request-batch-max-wait-ms", "nan"], "must be 'auto' or a finite number >= 0"),
        (["--max-num-seqs-limit", "0"], "must be an integer >= 1, got 0"),
        (["--torch-threads", "0"], "must be an integer >= 1, got 0"),
        (["--request-timeout", "0"], "must be a finite number > 0"),
        (["--port", "70000"], "must be an integer between 0 and 65535, got 70000"),
        (["--executor", "ray"], "must be one of 'mp', 'inproc', got 'ray'"),
        (["--device", "tpu"], "must be cpu, cuda, cuda:N, mps or xpu, got 'tpu'"),
        (["--dtype", "float99"], "must be one of float32, fp32, float, float16, fp16"),
        (["--max-queue-size", "0"], "must be an integer >= 1"),
        (["--png-compress-level", "10"], "must be an integer between 0 and 9, got 10"),
        (["--png-compress-level", "-1"], "must be an integer between 0 and 9, got -1"),
        (["--png-compress-level", "max"], "must be an integer between 0 and 9, got 'max'"),
        (["--lora-dir", "/no/such/folder"], "must be an existing directory"),
        (["--log-level", "loud"], "invalid choice"),
        (["--header-timeout", "0"], "must be a finite number > 0"),
        (["--keep-alive-timeout", "-1"], "must be a finite number > 0"),
        (["--limit-concurrency", "0"], "must be an integer >= 1"),
        (["--body-timeout", "0"], "must be a finite number > 0"),
        (["--api-key", ""], "argument --api-key: must not be empty"),
        (["--served-model-name", ""], "argument --served-model-name: must not be empty"),
        (["--served-model-name", "  "], "argument --served-model-name: must not be empty"),
    ],
)
def test_bad_flags_fail_while_parsing(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc_info:
        parse("serve", *argv)
    assert exc_info.value.code == 2
    assert message in capsys.readouterr().err


def test_ray_flags_without_ray_are_refused_before_anything_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "tiny-sd", "--num-replicas", "3", "--max-replicas", "1"]) == 2
    assert "--num-replicas, --max-replicas apply only with --ray" in capsys.readouterr().err


def test_serve_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert re.search(r"\(default: [^)]*\) \(default:", text) is None
    assert "tiny model name" not in text
    assert "built-in model name" in text
    assert "--header-timeout SECONDS close a connection whose request headers" in text


def test_run_server_hands_the_connection_flags_to_uvicorn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvicorn

    import diffbatch
    from diffbatch.entrypoints.openai import api_server
    from tests.fake_pipelines import FakeBatchPipeline

    engine = diffbatch.Engine(pipeline_class=FakeBatchPipeline, executor="inproc")
    monkeypatch.setattr(diffbatch, "Engine",
                        types.SimpleNamespace(from_config=lambda config: engine))
    configs: list[uvicorn.Config] = []
    shutdown_timeouts: list[float] = []

    class NoServer:
        def __init__(self, config: uvicorn.Config, *, engine: object,
                     shutdown_timeout_s: float) -> None:
            configs.append(config)
            shutdown_timeouts.append(shutdown_timeout_s)
            self.started = True

        def run(self) -> None:
            pass

    monkeypatch.setattr(api_server, "DrainingServer", NoServer)
    api_server.run_server(parse("serve", "--header-timeout", "3", "--keep-alive-timeout", "7",
                                "--limit-concurrency", "9", "--shutdown-timeout", "4"))
    (config,) = configs
    assert shutdown_timeouts == [4.0]
    # uvicorn waits longer than the engine takes to answer every open request
    assert config.timeout_graceful_shutdown > 4.0
    assert config.timeout_keep_alive == 7
    assert config.limit_concurrency is None  # enforced by the protocol, in the OpenAI shape
    assert (config.http.header_timeout_s, config.http.max_connections) == (3, 9)
    assert engine._closed


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from diffbatch import __version__

    with pytest.raises(SystemExit) as exc_info:
        cli.main(["--version"])
    assert exc_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"diffbatch {__version__}"


def test_a_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([])
    assert "COMMAND" in capsys.readouterr().err


def test_main_runs_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run_server(args) -> None:
        seen["model"] = args.model

    import diffbatch.entrypoints.openai.api_server as api_server

    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    assert cli.main(["serve", "tiny-sd", "--log-level", "warning"]) == 0
    assert seen == {"model": "tiny-sd"}


def test_main_reports_a_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffbatch.errors import ConfigError

    def failing_run_server(args) -> None:
        raise ConfigError("model 'nope' not found")

    import diffbatch.entrypoints.openai.api_server as api_server

    monkeypatch.setattr(api_server, "run_server", failing_run_server)
    assert cli.main(["serve", "nope", "--log-level", "critical"]) == 1


@pytest.mark.parametrize("broken", ["no-unet", "bad-model-index"])
def test_a_model_folder_that_does_not_load_is_one_error_line_not_a_traceback(
        tmp_path, caplog: pytest.LogCaptureFixture, broken: str) -> None:
    """A user's diffusers folder with a part missing or a bad model_index.json: `serve`
    exits 1 with one line naming the model and the loader's error."""
    import json
    import shutil

    from diffbatch.pipelines.tiny import ensure_tiny_model

    folder = tmp_path / "my-model"
    shutil.copytree(ensure_tiny_model("tiny-sd"), folder)
    if broken == "no-unet":
        shutil.rmtree(folder / "unet")
    else:
        index = json.loads((folder / "model_index.json").read_text())
        index["_class_name"] = "NoSuchPipeline"
        (folder / "model_index.json").write_text(json.dumps(index))
    code = cli.main(["serve", str(folder), "--executor", "inproc", "--port", "0",
                     "--log-level", "error"])
    assert code == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not [r for r in errors if r.exc_info], "a traceback was logged"
    message = errors[-1].getMessage()
    assert "failed to start: " in message and str(folder) in message
    if broken == "no-unet":  # the part that is missing, by name
        assert "names the component(s) unet, but the folder has no unet" in message
    else:
        assert "could not load the model" in message and "NoSuchPipeline" in message


def test_scheduling_flags() -> None:
    args = parse("serve")
    assert (args.scheduling_policy, args.max_head_wait_ms, args.max_wave_pixels,
            args.batch_error_isolation) == ("grouped", 2000.0, None, "bisect")
    args = parse("serve", "--scheduling-policy", "fifo", "--max-head-wait-ms", "250",
                 "--max-wave-pixels", "65536", "--batch-error-isolation", "none")
    assert (args.scheduling_policy, args.max_head_wait_ms, args.max_wave_pixels,
            args.batch_error_isolation) == ("fifo", 250.0, 65536, "none")
    for bad in (["--scheduling-policy", "lifo"], ["--max-wave-pixels", "0"],
                ["--max-head-wait-ms", "-1"], ["--batch-error-isolation", "maybe"]):
        with pytest.raises(SystemExit):
            parse("serve", *bad)


def test_max_waves_in_flight_flag() -> None:
    assert parse("serve").max_waves_in_flight == 2
    assert parse("serve", "--max-waves-in-flight", "1").max_waves_in_flight == 1
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse("serve", "--max-waves-in-flight", bad)


def test_worker_cpus_flag() -> None:
    assert parse("serve").worker_cpus is None
    assert parse("serve", "--worker-cpus", "0-1").worker_cpus == "0-1"
    with pytest.raises(SystemExit):
        parse("serve", "--worker-cpus", "1-")


def test_a_port_in_use_or_an_unknown_host_fails_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import socket

    from diffbatch import Engine

    def no_engine(cls, config):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(Engine, "from_config", classmethod(no_engine))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "tiny-sd", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
    assert cli.main(["serve", "tiny-sd", "--host", "no-such-host.invalid"]) == 1
    assert "cannot listen on no-such-host.invalid:8000" in caplog.text


def test_the_program_keeps_its_exit_code_exit_handlers_and_output() -> None:
    """`run` ends the process without the interpreter's teardown, but only after the
    exit handlers ran and what was printed and logged was flushed."""
    import subprocess
    import sys

    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "from diffbatch.entrypoints.cli import run\n"
              "sys.argv = ['diffbatch', 'serve', 'tiny-sdd']\n"
              "print('before', end='')\n"  # unflushed: a pipe buffers it
              "run()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1  # the start-up error's code
    assert done.stdout == "beforeexit handler ran\n"
    assert "did you mean `tiny-sd`" in done.stderr


@pytest.mark.parametrize(("argv", "prog", "unknown"), [
    (["serve", "tiny-sd", "extra"], "diffbatch serve", "extra"),
    (["bench", "serve", "--bogus", "1"], "diffbatch bench serve", "--bogus 1"),
])
def test_unknown_arguments_are_told_with_the_subcommands_own_usage(
    argv: list[str], prog: str, unknown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffbatch.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: unrecognized arguments: {unknown}" in err, err
    assert err.startswith(f"usage: {prog} ")


def test_every_serve_flag_is_in_the_docs_flag_tables() -> None:
    """docs/serving.md (and docs/scaling.md for the Ray flags) list every flag of
    `diffbatch serve`, so a new flag cannot ship undocumented."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    tables = "\n".join(line for name in ("serving.md", "scaling.md")
                       for line in (docs / name).read_text().splitlines()
                       if line.startswith("| `--"))
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", tables))
    serve = cli._command_parser(cli.make_arg_parser(), parse("serve"))
    flags = {option for action in serve._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"
             and not option.startswith("--no-")}
    assert flags - documented == set()


def _served_routes(monkeypatch: pytest.MonkeyPatch, *argv: str) -> set[str]:
    """The routes `run_server` serves for `diffbatch serve ARGV` (nothing listens)."""
    import diffbatch
    from diffbatch.engine.async_engine import Engine
    from diffbatch.entrypoints.openai import api_server
    from tests.fake_pipelines import FakeBatchPipeline

    engine = Engine(pipeline_class=FakeBatchPipeline, executor="inproc")
    monkeypatch.setattr(diffbatch, "Engine",
                        types.SimpleNamespace(from_config=lambda config: engine))
    apps: list[Any] = []

    class NoServer:
        def __init__(self, config: Any, **kwargs: Any) -> None:
            apps.append(config.app)
            self.started = True

        def run(self) -> None:
            pass

    monkeypatch.setattr(api_server, "DrainingServer", NoServer)
    api_server.run_server(parse("serve", *argv))
    from fastapi import FastAPI

    (app,) = apps
    while not isinstance(app, FastAPI):  # down through the middleware to the app
        app = app.app
    return set(app.openapi()["paths"])


def test_allow_runtime_lora_updating_adds_the_load_and_unload_routes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    routes = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    assert not set(routes) & _served_routes(monkeypatch)
    assert set(routes) <= _served_routes(monkeypatch, "--allow-runtime-lora-updating")
    monkeypatch.setenv(cli.RUNTIME_LORA_ENV, "true")
    assert set(routes) <= _served_routes(monkeypatch)


def test_lora_modules_and_max_loras_reach_the_engine_config(tmp_path: Path) -> None:
    from diffbatch.config import EngineConfig

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = parse("serve", "--lora-modules", f"ink={tmp_path / 'a'}", f"oil={tmp_path / 'b'}",
                 "--max-loras", "2")
    config = EngineConfig.from_cli_args(args)
    assert config.lora_modules == {"ink": str(tmp_path / "a"), "oil": str(tmp_path / "b")}
    assert config.max_loras == 2
    for bad in ("ink", f"a/b={tmp_path}", "ink=/no/such/path"):
        with pytest.raises(SystemExit):
            parse("serve", "--lora-modules", bad)


def test_lora_modules_take_vllms_json_form_beside_name_path(tmp_path: Path) -> None:
    from diffbatch.config import EngineConfig

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    entry = json.dumps({"name": "ink", "path": str(tmp_path / "a"),
                        "base_model_name": "tiny-sd"})
    args = parse("serve", "--lora-modules", entry, f"oil={tmp_path / 'b'}")
    config = EngineConfig.from_cli_args(args)
    assert config.lora_modules == {"ink": str(tmp_path / "a"), "oil": str(tmp_path / "b")}
    for bad in ({"name": "ink"}, {"name": "a/b", "path": str(tmp_path)},
                {"name": "ink", "path": "/no/such/path"}, {"name": "ink", "path": 3},
                {"name": "ink", "path": str(tmp_path), "rank": 4}, "{not json"):
        with pytest.raises(SystemExit):
            parse("serve", "--lora-modules", bad if isinstance(bad, str) else json.dumps(bad))


def test_runtime_lora_updating_is_refused_with_ray(capsys: pytest.CaptureFixture[str]) -> None:
    """Each Ray replica keeps its own adapter names: a load would reach only one."""
    assert cli._cmd_serve(parse("serve", "--ray", "--allow-runtime-lora-updating")) == 2
    assert "applies only without --ray" in capsys.readouterr().err
