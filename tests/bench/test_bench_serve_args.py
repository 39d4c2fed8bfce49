"""`diffbatch bench serve`'s arguments: what a user coming from the server or the
OpenAI client would pass."""

from __future__ import annotations

import argparse

import pytest

from diffbatch.bench.serve import API_KEY_ENV, BenchConfig, add_bench_parser, config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def test_an_output_path_that_is_a_directory_is_refused_before_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse("--output-json", str(tmp_path))
    assert info.value.code == 2
    assert "is a directory, expected a file path" in capsys.readouterr().err
    assert parse("--output-json", str(tmp_path / "out.json")).output_json


def test_the_base_url_an_openai_client_takes_works_as_well():
    for url in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/",
                "http://127.0.0.1:8000"):
        assert config_from_args(parse("--base-url", url)).base_url == "http://127.0.0.1:8000"
    # a custom endpoint outside /v1 keeps the URL as given
    assert BenchConfig("http://h/v1", endpoint="/generate").base_url == "http://h/v1"


def test_the_api_key_defaults_to_the_variable_the_server_reads(monkeypatch):
    from diffbatch.entrypoints.cli import API_KEY_ENV as SERVER_API_KEY_ENV

    assert API_KEY_ENV == SERVER_API_KEY_ENV
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert config_from_args(parse()).api_key == "sk-from-env"
    assert config_from_args(parse("--api-key", "given")).api_key == "given"
    monkeypatch.delenv(API_KEY_ENV)
    assert config_from_args(parse()).api_key is None


def test_the_help_never_prints_the_key(monkeypatch, capsys):
    monkeypatch.setenv(API_KEY_ENV, "sk-secret-in-env")
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    assert "--api-key" in out and "sk-secret-in-env" not in out
