"""diffbatch on Ray Serve: many replicas, each with its own engine, behind one API.

Two ways to start the same application (see docs/scaling.md):

- `diffbatch serve MODEL --ray --num-replicas N [--ray-address ADDR]` with every
  usual serve flag (`add_ray_args` adds the Ray flags, `run_ray_server` runs it);
- Ray Serve's application builder convention, `build_app(args) -> Application`:

      serve run diffbatch.entrypoints.ray.server:build_app model=tiny-sd num_replicas=2

  or in a Serve config file:

      applications:
        - name: diffbatch
          route_prefix: /
          import_path: diffbatch.entrypoints.ray.server:build_app
          args: {model: tiny-sd, num_replicas: 2, max_num_seqs: 4}

Ray Serve is the distributed part: it places replicas on the cluster's nodes,
routes each HTTP request to one replica, restarts replicas that die or fail their
health check, and scales between the autoscaling bounds. Each replica batches its
own share of the traffic. This module imports Ray only when called, so the plain
install (without the `[ray]` extra) can still import the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any

from diffbatch.config import EngineConfig
from diffbatch.entrypoints.ray import REPLICA_HEADER
from diffbatch.entrypoints.ray.args import RAY_ROUTERS, RayServeArgs
from diffbatch.errors import ConfigError
from diffbatch.pipelines.registry import check_model_spec

if TYPE_CHECKING:
    from ray.serve import Application

logger = logging.getLogger(__name__)

DEFAULT_APP_NAME = "diffbatch"
MIN_RAY_VERSION = (2, 60)  # see `_require_ray`
_INSTALL_HINT = "Ray Serve is not installed; install the extra: pip install 'diffbatch[ray]'"


def build_app(args: dict[str, Any] | RayServeArgs) -> Application:
    """Ray Serve application builder: validate `args` and bind the deployment.

    Args:
        args: `RayServeArgs`, or its fields by name (strings are converted), e.g.
            `{"model": "tiny-sd", "num_replicas": "2", "max_num_seqs": "4"}`.

    Returns:
        The bound application, for `serve.run`, `serve run` or a Serve config file.
    """
    validated = args if isinstance(args, RayServeArgs) else RayServeArgs.from_dict(dict(args))
    model = validated.model
    if model is not None and "/" not in model and os.sep not in model \
            and not model.startswith(("~", ".")):
        # A name (no path: a folder may exist on the replicas' nodes only) is checked
        # here, so a misspelt one fails with its hint before any replica starts.
        check_model_spec(model)
    _require_ray()
    from diffbatch.entrypoints.ray.deployment import build_deployment

    return build_deployment(validated)


def _require_ray() -> None:
    """Raise `ConfigError` unless a Ray Serve this module was built on is installed.

    NOTE: the deployment relies on Ray Serve's late-bound ingress
    (`__serve_build_asgi_app__`) and the proxy middleware on `controller_options`,
    both recent; 2.60 is the release this was tested with.
    """
    try:
        import ray
        import ray.serve
    except ImportError as exc:
        raise ConfigError(_INSTALL_HINT) from exc
    found = tuple(int(part) for part in ray.__version__.split(".")[:2] if part.isdigit())
    if found < MIN_RAY_VERSION:
        need = ".".join(map(str, MIN_RAY_VERSION))
        raise ConfigError(
            f"diffbatch on Ray Serve needs ray[serve]>={need}, got ray {ray.__version__}; "
            f"upgrade: pip install 'ray[serve]>={need}'"
        )


# -- CLI ---------------------------------------------------------------------------------
def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """Add the Ray Serve flags (`--ray`, `--num-replicas`, ...) to `diffbatch serve`."""
    from diffbatch.arg_types import float_at_least, int_at_least

    group = parser.add_argument_group(
        "ray", "scale out on Ray Serve (needs the `[ray]` extra); every replica runs "
        "its own engine with the engine flags above and batches its own share of traffic",
    )
    positive_int, non_negative_int = int_at_least(1), int_at_least(0)
    non_negative, positive = float_at_least(0.0, strict=False), float_at_least(0.0, strict=True)
    group.add_argument("--ray", action="store_true",
                       help="serve on Ray Serve: many replicas behind one API")
    group.add_argument(
        "--ray-address", default=None, metavar="ADDR",
        help="address of a running Ray cluster, e.g. 10.0.0.1:6379 or 'auto'; None: "
        "$RAY_ADDRESS, else the cluster last started here, else a new local one",
    )
    group.add_argument("--num-replicas", type=positive_int, default=1, metavar="N",
                       help="replicas (engines); the initial count when autoscaling")
    group.add_argument("--min-replicas", type=non_negative_int, default=None, metavar="N",
                       help="autoscaling lower bound (needs --max-replicas)")
    group.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                       help="autoscaling upper bound; setting it turns autoscaling on")
    group.add_argument("--target-ongoing-requests", type=positive, default=None, metavar="N",
                       help="autoscaling target of ongoing requests per replica")
    group.add_argument(
        "--max-ongoing-requests", type=positive_int, default=None, metavar="N",
        help="most requests Ray routes to one replica at once, which caps its wave size; "
        "None: max(5, 3 * --max-num-seqs)",
    )
    group.add_argument("--num-cpus-per-replica", type=non_negative, default=1.0, metavar="N",
                       help="CPUs Ray reserves for each replica")
    group.add_argument("--num-gpus-per-replica", type=non_negative, default=0.0, metavar="N",
                       help="GPUs Ray reserves for each replica (fractions allowed)")
    group.add_argument(
        "--ray-router", choices=RAY_ROUTERS, default="diffbatch",
        help="how Ray Serve picks a replica per request: 'diffbatch' sends requests of "
        "one batch key (and adapters) to the same replica unless it is a wave behind "
        "the least loaded; 'random' is Ray Serve's default (the less busy of two "
        "random replicas)",
    )
    parser.set_defaults(ray_only_flags={
        action.dest: (action.option_strings[0], action.default)
        for action in group._group_actions if action.dest != "ray"})


def ray_flags_given(args: argparse.Namespace) -> list[str]:
    """The Ray-only flags (`add_ray_args`) set to something but their default."""
    flags: dict[str, tuple[str, object]] = getattr(args, "ray_only_flags", {})
    return [flag for dest, (flag, default) in flags.items()
            if getattr(args, dest, default) != default]


def args_from_namespace(args: argparse.Namespace) -> RayServeArgs:
    """The `RayServeArgs` of a parsed `diffbatch serve --ray ...` command line.

    Every serve flag whose destination is an `EngineConfig` field or a `RayServeArgs`
    field is taken (unset ones are left to the defaults), so engine flags added to
    `diffbatch serve` reach the replicas without a change here.
    """
    names = [f.name for f in dataclasses.fields(EngineConfig)] + list(RayServeArgs.model_fields)
    values = {name: getattr(args, name) for name in names
              if getattr(args, name, None) is not None}
    return RayServeArgs.from_dict(values)


RAY_ADDRESS_TIMEOUT_S = 5.0  # how long a cluster's address may take to accept a connection


def check_ray_address(address: str | None, *, source: str = "--ray-address",
                      timeout_s: float = RAY_ADDRESS_TIMEOUT_S) -> None:
    """Refuse a cluster address (`host:port` or `ray://host:port`) where nothing accepts
    a TCP connection within `timeout_s`: Ray itself retries such an address for a
    long while before it gives up. Other forms ("auto", "local", none) are Ray's."""
    if not address or address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) \
            else exc.strerror or type(exc).__name__
        raise ConfigError(
            f"cannot reach a Ray cluster at {source} {address!r} ({reason}); start one "
            "there (`ray start --head`), or leave the address out to start a local one",
            param="ray_address") from None


def run_ray_server(args: argparse.Namespace) -> None:
    """Deploy on Ray Serve from CLI `args` and serve until interrupted.

    Connects to `--ray-address` (else `$RAY_ADDRESS`, else the cluster last started
    on this machine, else a new local cluster), starts the Serve proxy on
    `--host:--port`, deploys the replicas and waits until they are healthy, then
    blocks until SIGINT or SIGTERM. On exit it deletes the application (each replica
    finishes the requests it holds within `--shutdown-timeout`, or is killed then, and
    closes its engine) and disconnects; a local cluster it started goes away with it.
    """
    ray_args = args_from_namespace(args)  # 1. Validate before touching Ray.
    app = build_app(ray_args)  # (a misspelt model name fails here, with its hint)
    import ray
    from ray import serve

    from diffbatch.entrypoints.ray.proxy import serve_start_options

    # 2. Connect (or start a local cluster), start the proxy, deploy.
    if args.ray_address:
        check_ray_address(args.ray_address)
    else:
        check_ray_address(os.environ.get("RAY_ADDRESS"), source="$RAY_ADDRESS")
    try:
        ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    except ConnectionError as exc:
        raise ConfigError(f"cannot connect to the Ray cluster at --ray-address "
                          f"{args.ray_address!r}: {exc}", param="ray_address") from None
    # NOTE: right after `ray.init`, which installs handlers that exit (Python) or
    # abort (Ray's C++ failure handler) on SIGTERM: SIGTERM, at any point from here,
    # becomes a KeyboardInterrupt like Ctrl-C, so the cleanup below always runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.start(**serve_start_options(args.host, args.port))
        serve.run(app, name=DEFAULT_APP_NAME, route_prefix="/")
        logger.info(
            "listening on http://%s:%d: %d replica(s) of %r on Ray Serve (docs at /docs)",
            args.host, args.port, ray_args.num_replicas, ray_args.model,
        )
        # 3. Serve until SIGINT or SIGTERM.
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    finally:
        logger.info("shutting down: deleting the Ray Serve application %r", DEFAULT_APP_NAME)
        try:
            serve.delete(DEFAULT_APP_NAME)
        finally:
            ray.shutdown()


__all__ = [
    "DEFAULT_APP_NAME", "REPLICA_HEADER", "RayServeArgs", "add_ray_args", "build_app",
    "run_ray_server",
]
