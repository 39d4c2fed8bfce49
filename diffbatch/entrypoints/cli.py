"""The `diffbatch` command line: `diffbatch serve [MODEL] ...` (more subcommands later).

Each subcommand registers itself in `_SUBCOMMANDS` with a function that adds its
parser and sets `func`; `main` parses, configures logging and calls `func(args)`.
Flag values are checked while parsing ("--max-num-seqs must be 'auto' or an integer
>= 1, got 0"), so a bad flag fails before any model is loaded.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence

from diffbatch.arg_types import (
    float_at_least,
    http_url,
    int_at_least,
    int_between,
    port,
)
from diffbatch.config import add_cli_args

logger = logging.getLogger(__name__)

API_KEY_ENV = "DIFFBATCH_API_KEY"
RUNTIME_LORA_ENV = "DIFFBATCH_ALLOW_RUNTIME_LORA_UPDATING"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help already states its
    default or the default is None (which says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action)


def _non_empty(text: str) -> str:
    """An argparse type: the string given, refused when empty (or only spaces); argparse
    names the flag in its error ("argument --api-key: must not be empty")."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _add_seconds(
    group: argparse._ArgumentGroup, flag: str, default: float | None, help: str,
) -> None:
    """Add `flag`, a duration in seconds that must be > 0."""
    group.add_argument(flag, type=float_at_least(0.0, strict=True), default=default,
                       metavar="SECONDS", help=help)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `diffbatch serve [MODEL]` and its flags (vLLM's names where they exist)."""
    from diffbatch.entrypoints.openai.api_server import (
        DEFAULT_BODY_TIMEOUT_S,
        DEFAULT_HEADER_TIMEOUT_S,
        DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        DEFAULT_LIMIT_CONCURRENCY,
        DEFAULT_MAX_UPLOAD_MB,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
    )
    from diffbatch.entrypoints.openai.image_store import (
        DEFAULT_MAX_MB as DEFAULT_IMAGE_STORE_MB,
    )
    from diffbatch.entrypoints.openai.image_store import (
        DEFAULT_TTL_S as DEFAULT_IMAGE_URL_TTL_S,
    )
    from diffbatch.entrypoints.openai.serving_images import (
        DEFAULT_MAX_IMAGE_PIXELS,
        DEFAULT_PNG_COMPRESS_LEVEL,
    )
    from diffbatch.entrypoints.openai.video_store import (
        DEFAULT_MAX_MB as DEFAULT_VIDEO_STORE_MB,
    )
    from diffbatch.entrypoints.openai.video_store import (
        DEFAULT_TTL_S as DEFAULT_VIDEO_TTL_S,
    )

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL at POST /v1/images/generations and /v1/images/edits "
        "(OpenAI-compatible), with a playground at GET /. Concurrent HTTP requests are "
        "batched by the engine.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="local diffusers folder, hub id or built-in model name: `shapes` (a small "
        "trained model shipped with diffbatch) or a tiny random-weight one (tiny-sd, "
        "tiny-sd3, tiny-flux, tiny-pixart) (default: shapes)",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=port, default=8000, help="port to listen on")
    server.add_argument(
        "--served-model-name", default=None, type=_non_empty,
        help="model name clients pass and /v1/models lists (default: MODEL)",
    )
    server.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None, type=_non_empty,
        help=f"require `Authorization: Bearer <key>` on /v1 routes (default: ${API_KEY_ENV})",
    )
    _add_seconds(server, "--request-timeout", None,
                 "abort requests not finished after this long (504)")
    server.add_argument(
        "--shutdown-timeout", type=float_at_least(0.0, strict=False),
        default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
        help="on SIGTERM or Ctrl-C: refuse new requests and answer waiting ones 503 at once, "
        "let running waves finish for this long, then interrupt them (503), stop the "
        "worker and exit. With --ray it is each replica's graceful shutdown timeout in Ray "
        "Serve: a stopping replica gets no new requests, finishes those it holds (queued "
        "ones too) until then, then is killed and the rest are answered 503 "
        "(docs/scaling.md)",
    )
    server.add_argument(
        "--max-image-pixels", type=int_at_least(1), default=DEFAULT_MAX_IMAGE_PIXELS,
        help="largest width*height of one image, whatever the model (400 above it); a "
        "model may cap lower on its own (`model_max_pixels`), which the engine checks",
    )
    server.add_argument(
        "--max-upload-mb", type=int_at_least(1), default=DEFAULT_MAX_UPLOAD_MB, metavar="MB",
        help="largest body of POST /v1/images/edits, image and mask together, in MiB "
        "(413 above it)",
    )
    server.add_argument(
        "--public-url", type=http_url, default=None, metavar="URL",
        help='base of the links `response_format: "url"` answers with, e.g. '
        "https://img.example.com behind a proxy (default: the URL each request was sent to)",
    )
    server.add_argument(
        "--image-store-mb", type=int_at_least(0), default=None, metavar="MB",
        help='memory for images answered as links (`response_format: "url"`), oldest '
        f"dropped first; 0 refuses url with a 400 (default: {DEFAULT_IMAGE_STORE_MB}; 0 with "
        "several --ray replicas, whose links could reach another replica)",
    )
    _add_seconds(server, "--image-url-ttl", DEFAULT_IMAGE_URL_TTL_S,
                 'how long a link of `response_format: "url"` works')
    server.add_argument(
        "--video-store-mb", type=int_at_least(1), default=DEFAULT_VIDEO_STORE_MB,
        metavar="MB", help="memory for the finished clips of /v1/videos jobs (a video "
        "model only), oldest dropped first (default: %(default)s)")
    _add_seconds(server, "--video-ttl", DEFAULT_VIDEO_TTL_S,
                 "how long a finished /v1/videos job and its clip stay reachable")
    server.add_argument(
        "--png-compress-level", type=int_between(0, 9), default=DEFAULT_PNG_COMPRESS_LEVEL,
        metavar="LEVEL",
        # `%(default)s`, not a literal: the formatter would add a second "(default: 1)".
        help="zlib level of PNG responses, 0-9: 1 encodes fastest, 9 smallest "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
        default=os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "routes: add or remove LoRA adapters by name and server path while serving; "
        f"under --api-key like every /v1 route) (default: off, or ${RUNTIME_LORA_ENV})",
    )
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info", type=str.lower,
                        help="log level; debug adds one line per HTTP request")
    # Connection limits (uvicorn's side; see openai/http_protocol.py).
    _add_seconds(server, "--header-timeout", DEFAULT_HEADER_TIMEOUT_S,
                 "close a connection whose request headers are not complete after this "
                 "long (408)")
    _add_seconds(server, "--body-timeout", DEFAULT_BODY_TIMEOUT_S,
                 "close a connection whose request body pauses (no bytes) this long (408)")
    _add_seconds(server, "--keep-alive-timeout", DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                 "close an idle keep-alive connection after this long")
    server.add_argument(
        "--limit-concurrency", type=int_at_least(1), default=DEFAULT_LIMIT_CONCURRENCY,
        metavar="N", help="most open connections and requests in progress; more get 503",
    )

    add_cli_args(parser)  # the engine flags, one per EngineConfig field
    from diffbatch.entrypoints.ray.server import add_ray_args  # imports Ray only when run

    add_ray_args(parser)
    parser.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from diffbatch.entrypoints.ray.server import ray_flags_given

    ignored = ray_flags_given(args)
    if ignored and not args.ray:
        print(f"diffbatch serve: error: {', '.join(ignored)} appl"
              f"{'ies' if len(ignored) == 1 else 'y'} only with --ray", file=sys.stderr)
        return 2
    if args.ray and getattr(args, "allow_runtime_lora_updating", False):
        # each replica keeps its own adapter names: a load would reach one of them
        print("diffbatch serve: error: --allow-runtime-lora-updating applies only "
              "without --ray (serve adapters with --lora-modules there)", file=sys.stderr)
        return 2
    if args.ray:
        from diffbatch.entrypoints.ray.server import run_ray_server

        run_ray_server(args)
        return 0
    from diffbatch.entrypoints.openai.api_server import run_server

    run_server(args)
    return 0


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from diffbatch.bench.serve import add_bench_parser

    add_bench_parser(subparsers)


def _add_check_model_parser(subparsers: argparse._SubParsersAction) -> None:
    from diffbatch.entrypoints.check_model import add_check_model_parser

    add_check_model_parser(subparsers)


# (name, adds the subparser)
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_serve_parser, _add_bench_parser, _add_check_model_parser,
]


def make_arg_parser() -> argparse.ArgumentParser:
    """The `diffbatch` parser with every subcommand."""
    from diffbatch import __version__

    parser = argparse.ArgumentParser(
        prog="diffbatch",
        description="A serving engine for diffusion models built around request-level batching.",
    )
    parser.add_argument("--version", action="version", version=f"diffbatch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def _command_parser(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` ran, e.g. `diffbatch bench serve`'s."""
    while True:
        action = next((a for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction)), None)
        chosen = None if action is None else getattr(args, action.dest, None)
        if action is None or chosen is None:
            return parser
        parser = action.choices[chosen]


def configure_logging(level: str) -> None:
    """Log `level` and above to stderr, in one line per record."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("diffbatch").setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `diffbatch` command line; returns the process exit code.

    Args:
        argv: Arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        0 on a clean exit, 1 when the command failed to start (the reason is logged).
    """
    from diffbatch.errors import DiffbatchError

    parser = make_arg_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's, says what it takes
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(getattr(args, "log_level", "info"))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 0
    except DiffbatchError as exc:
        logger.error("diffbatch %s failed to start: %s", args.command, exc.message)
        return 1


def run() -> None:
    """The `diffbatch` program (and `python -m diffbatch`): `main`, then the exit.

    Once a command returned, a server has closed its engine, swept its shared memory
    and stopped its threads; what an ordinary exit still does is tear down the
    interpreter's modules, which with torch loaded takes a second or more of CPU on
    every server stop. So the process ends without it (`os._exit`), after the exit
    handlers ran and the logs and streams were flushed; if a thread that an ordinary
    exit would wait for is still running, it exits the ordinary way.
    """
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
