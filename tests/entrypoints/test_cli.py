"""Tests of the `diffbatch` command line parser (no server is started)."""

from __future__ import annotations

import pytest

from diffbatch.entrypoints import cli
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
    assert args.max_num_seqs == 1
    assert args.request_batch_max_wait_ms == 0.0
    assert args.executor == "mp"
    assert args.api_key is None
    assert args.max_queue_size is None
    assert args.request_timeout is None
    assert args.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    assert args.png_compress_level == DEFAULT_PNG_COMPRESS_LEVEL == 1
    assert args.lora_dir is None
    assert args.log_level == "info"
    assert args.func is cli._cmd_serve


def test_serve_every_flag(tmp_path) -> None:
    args = parse(
        "serve", "tiny-sd", "--host", "0.0.0.0", "--port", "9001", "--max-num-seqs", "4",
        "--request-batch-max-wait-ms", "50", "--executor", "inproc",
        "--served-model-name", "sd", "--api-key", "k", "--max-queue-size", "8",
        "--request-timeout", "2.5", "--max-image-pixels", "4096", "--lora-dir", str(tmp_path),
        "--log-level", "DEBUG", "--seed", "3", "--device", "cpu", "--dtype", "float32",
    )
    assert args.model == "tiny-sd"
    assert (args.host, args.port, args.max_num_seqs) == ("0.0.0.0", 9001, 4)
    assert args.request_batch_max_wait_ms == 50.0
    assert (args.executor, args.served_model_name, args.api_key) == ("inproc", "sd", "k")
    assert (args.max_queue_size, args.request_timeout, args.max_image_pixels) == (8, 2.5, 4096)
    assert args.lora_dir == str(tmp_path)
    assert (args.log_level, args.seed, args.device, args.dtype) == ("debug", 3, "cpu", "float32")


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
        (["--max-num-seqs", "0"], "must be an integer >= 1, got 0"),
        (["--max-num-seqs", "two"], "must be an integer >= 1, got 'two'"),
        (["--request-batch-max-wait-ms", "-1"], "must be a finite number >= 0"),
        (["--request-batch-max-wait-ms", "nan"], "must be a finite number >= 0"),
        (["--request-timeout", "0"], "must be a finite number > 0"),
        (["--port", "70000"], "must be between 0 and 65535"),
        (["--executor", "ray"], "must be one of 'mp', 'inproc', got 'ray'"),
        (["--max-queue-size", "0"], "must be an integer >= 1"),
        (["--png-compress-level", "10"], "must be an integer between 0 and 9, got 10"),
        (["--png-compress-level", "-1"], "must be an integer between 0 and 9, got -1"),
        (["--png-compress-level", "max"], "must be an integer between 0 and 9, got 'max'"),
        (["--lora-dir", "/no/such/folder"], "must be an existing directory"),
        (["--log-level", "loud"], "invalid choice"),
    ],
)
def test_bad_flags_fail_while_parsing(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc_info:
        parse("serve", *argv)
    assert exc_info.value.code == 2
    assert message in capsys.readouterr().err


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


def test_scheduling_flags() -> None:
    args = parse("serve")
    assert (args.scheduling_policy, args.max_head_wait_ms, args.max_wave_pixels,
            args.batch_error_isolation) == ("fifo", 2000.0, None, "bisect")
    args = parse("serve", "--scheduling-policy", "grouped", "--max-head-wait-ms", "250",
                 "--max-wave-pixels", "65536", "--batch-error-isolation", "none")
    assert (args.scheduling_policy, args.max_head_wait_ms, args.max_wave_pixels,
            args.batch_error_isolation) == ("grouped", 250.0, 65536, "none")
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
