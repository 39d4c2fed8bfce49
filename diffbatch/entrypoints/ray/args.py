"""The arguments of a diffbatch Ray Serve application, validated in one place.

`RayServeArgs` is what both ways of starting take: `diffbatch serve --ray` builds it
from the CLI namespace, and the application builder (`serve run
diffbatch.entrypoints.ray.server:build_app model=tiny-sd num_replicas=2`, or a Serve
config file's `args:`) builds it from a dict whose values may be strings. Names are
the `diffbatch serve` flags' destinations (`--max-num-seqs 4` is `max_num_seqs=4`).
Three groups:

- engine: any `EngineConfig` field (`model`, `max_num_seqs`, `executor`, ...), given
  to every replica's engine (`engine_config()`). They are not repeated here: each is
  converted to its `EngineConfig` type and checked by `EngineConfig` itself, so a new
  engine option works on Ray the day it is added;
- server: the FastAPI app's options (`app_kwargs()`);
- deployment: replicas, their resources, health checks, shutdown and the request
  router (`deployment_options()`, Ray Serve's `Deployment.options()` keywords).

`shutdown_timeout` (`--shutdown-timeout`) is a deployment option on Ray: Ray Serve, not
the replica, decides when a replica stops, so the bound becomes each replica's
graceful shutdown timeout (see `deployment_options`).

Everything is checked in the process that builds the application, before any
replica starts; a bad or unknown argument fails with its name and value.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from diffbatch.config import EngineConfig
from diffbatch.errors import ConfigError
from diffbatch.options import Rule

logger = logging.getLogger(__name__)

DEFAULT_DEPLOYMENT_NAME = "diffbatch"
# Ray Serve's own default of `max_ongoing_requests`.
RAY_DEFAULT_MAX_ONGOING_REQUESTS = 5
# The request routers `ray_router` names: diffbatch's (by batch key and adapters), or
# Ray Serve's default (the less busy of two random replicas).
RAY_ROUTERS = ("diffbatch", "random")
DIFFBATCH_ROUTER_CLASS = "diffbatch.entrypoints.ray.router.DiffbatchRequestRouter"
# How often each replica reports its batch keys and adapters to the routers (s).
ROUTING_STATS_PERIOD_S = 1.0
# How often a stopping replica checks whether its requests are done (Ray's default: 2 s,
# which an idle replica would wait out before stopping).
DRAIN_CHECK_S = 0.25


def _engine_rules() -> dict[str, Rule]:
    """`EngineConfig` field name -> its rule (what parses builder strings)."""
    return {f.name: f.metadata["option"].rule for f in dataclasses.fields(EngineConfig)}


class RayServeArgs(BaseModel):
    """Engine, server and deployment arguments of a diffbatch Ray Serve application.

    Values given as strings (`serve run ... max_num_seqs=4`) are converted; unknown
    names are refused, so a typo fails before any replica starts. Engine arguments
    (any `EngineConfig` field) are kept in `model_extra`.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    # -- server (the same FastAPI app in every replica) ------------------------------
    served_model_name: str | None = None  # None: `model`, else the default model
    api_key: str | None = None
    request_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds
    max_image_pixels: int | None = Field(None, ge=1)  # None: the server's default
    png_compress_level: int | None = Field(None, ge=0, le=9)  # None: the server's default
    max_body_bytes: int | None = Field(None, ge=1)  # None: the server's default
    max_upload_mb: int | None = Field(None, ge=1)  # edits' body limit; None: the default
    image_store_mb: int | None = Field(None, ge=0)  # per replica; None: the default
    image_url_ttl: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds
    public_url: str | None = None  # None: the URL each request was sent to
    # seconds a stopping replica may finish its requests before Ray kills it; None: the
    # server's default (`--shutdown-timeout`)
    shutdown_timeout: float | None = Field(None, ge=0, allow_inf_nan=False)

    # -- deployment (Ray Serve) ------------------------------------------------------
    name: str = DEFAULT_DEPLOYMENT_NAME  # the deployment's name
    num_replicas: int = Field(1, ge=1)  # fixed count; the initial count when autoscaling
    min_replicas: int | None = Field(None, ge=0)  # autoscaling lower bound
    max_replicas: int | None = Field(None, ge=1)  # set to turn autoscaling on
    target_ongoing_requests: float | None = Field(None, gt=0)  # autoscaling target
    # None: max(5, 3 * max_num_seqs), where "auto" counts as its limit
    max_ongoing_requests: int | None = Field(None, ge=1)
    num_cpus_per_replica: float = Field(1.0, ge=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # how Ray Serve picks a replica per request (see RAY_ROUTERS)
    ray_router: Literal["diffbatch", "random"] = "diffbatch"

    @model_validator(mode="after")
    def _check(self) -> RayServeArgs:
        # 1. Engine arguments: known `EngineConfig` fields, converted by their rules.
        extra = self.model_extra if self.model_extra is not None else {}
        rules = _engine_rules()
        for name in list(extra):
            if name not in rules:
                raise ValueError(
                    f"unknown argument `{name}` (got {extra[name]!r}); engine arguments "
                    f"are EngineConfig fields: {', '.join(rules)}"
                )
            try:
                extra[name] = rules[name].convert(extra[name])
            except ValueError as exc:
                raise ValueError(f"`{name}` {exc}") from None
        # 2. Autoscaling bounds.
        if self.max_replicas is None:
            for name in ("min_replicas", "target_ongoing_requests"):
                if getattr(self, name) is not None:
                    raise ValueError(f"`{name}` needs autoscaling: also set `max_replicas`")
        else:
            low = 1 if self.min_replicas is None else self.min_replicas
            if not low <= self.num_replicas <= self.max_replicas:
                raise ValueError(
                    "autoscaling bounds must satisfy min_replicas <= num_replicas <= "
                    f"max_replicas, got {low} <= {self.num_replicas} <= {self.max_replicas}"
                )
        return self

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> RayServeArgs:
        """Validate builder arguments; raise `ConfigError` naming the bad ones.

        Also builds the `EngineConfig` once, so its own checks run here too.
        """
        try:
            validated = cls.model_validate(args)
        except ValidationError as exc:
            problems = "; ".join(_describe(error) for error in exc.errors())
            raise ConfigError(f"invalid diffbatch Ray Serve arguments: {problems}") from None
        validated.engine_config()  # raises ConfigError for a bad engine option
        return validated

    # -- the three groups ------------------------------------------------------------
    @property
    def model(self) -> str | None:
        return self.engine_config().model

    @property
    def max_num_seqs(self) -> int:
        """The most requests one replica's wave may hold (the auto limit for "auto")."""
        return self.engine_config().capacity_limit

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine arguments given (`EngineConfig` fields)."""
        return dict(self.model_extra or {})

    def engine_config(self) -> EngineConfig:
        """Each replica's `EngineConfig` (validated by `EngineConfig` itself)."""
        return EngineConfig.from_options(**self.engine_kwargs())

    def app_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of each replica's `build_app(engine, ...)`, but the model name."""
        kwargs: dict[str, Any] = {
            "api_key": self.api_key, "request_timeout_s": self.request_timeout,
        }
        if self.max_image_pixels is not None:
            kwargs["max_image_pixels"] = self.max_image_pixels
        if self.png_compress_level is not None:
            kwargs["png_compress_level"] = self.png_compress_level
        if self.max_body_bytes is not None:
            kwargs["max_body_bytes"] = self.max_body_bytes
        if self.max_upload_mb is not None:
            kwargs["max_upload_bytes"] = self.max_upload_mb << 20
        if self.image_store_mb is not None:
            kwargs["image_store_bytes"] = self.image_store_mb << 20
        elif self.num_replicas > 1 or (self.max_replicas or 1) > 1:
            # NOTE: each replica keeps its own images, and the proxy may route a link to
            # another replica; several replicas answer "url" with a 400 unless told.
            kwargs["image_store_bytes"] = 0
        if self.num_replicas > 1 or (self.max_replicas or 1) > 1:
            # each replica would keep its own video jobs, and the proxy may route a
            # job's poll to another replica: /v1/videos is refused with a 400
            kwargs["video_store_bytes"] = 0
        if self.image_url_ttl is not None:
            kwargs["image_url_ttl_s"] = self.image_url_ttl
        if self.public_url is not None:
            kwargs["public_url"] = self.public_url
        return kwargs

    def effective_max_ongoing_requests(self) -> int:
        """Requests Ray routes to one replica at once.

        NOTE: Ray Serve never gives a replica more than `max_ongoing_requests`
        requests, so no wave can be larger, and the engine can batch only what it
        holds. The default holds three full waves (3 * max_num_seqs), never less than
        Ray's own default of 5: one running, and room for the next wave of each key
        behind it. With two, the requests that come back while a wave runs wait in
        Ray's queue until it ends and then miss the wave that starts at once (the
        diffbatch router keeps a key's requests waiting for its replica).
        """
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return max(RAY_DEFAULT_MAX_ONGOING_REQUESTS, 3 * self.max_num_seqs)

    @property
    def effective_shutdown_timeout(self) -> float:
        """`shutdown_timeout`, or the server's default."""
        from diffbatch.entrypoints.openai.api_server import DEFAULT_SHUTDOWN_TIMEOUT_S

        return (DEFAULT_SHUTDOWN_TIMEOUT_S if self.shutdown_timeout is None
                else self.shutdown_timeout)

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of `Deployment.options(...)`.

        NOTE: `--shutdown-timeout` becomes Ray Serve's `graceful_shutdown_timeout_s`.
        When the application is deleted (SIGTERM to `diffbatch serve --ray`) or a
        replica is scaled down, Ray stops routing to the replica and waits for the
        requests it holds, running or queued in its engine, to finish; at the timeout
        it kills the replica (its worker process follows), and the proxy answers what
        was left with an OpenAI-shaped 503 (`replica_failed`, proxy.py). Ray calls no
        code of the replica when the stop begins, only once its requests are done, so
        the engine's own shutdown (waiting requests refused at once, running waves
        interrupted at a step) does not run there.
        """
        actor_options: dict[str, Any] = {"num_cpus": self.num_cpus_per_replica}
        if self.num_gpus_per_replica:
            actor_options["num_gpus"] = self.num_gpus_per_replica
        options: dict[str, Any] = {
            "name": self.name,
            "ray_actor_options": actor_options,
            "max_ongoing_requests": self.effective_max_ongoing_requests(),
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.effective_shutdown_timeout,
            "graceful_shutdown_wait_loop_s": DRAIN_CHECK_S,
        }
        if self.ray_router == "diffbatch":
            options["request_router_config"] = self.request_router_config()
        if self.max_replicas is None:
            options["num_replicas"] = self.num_replicas
        else:
            autoscaling: dict[str, Any] = {
                "min_replicas": 1 if self.min_replicas is None else self.min_replicas,
                "initial_replicas": self.num_replicas,
                "max_replicas": self.max_replicas,
            }
            if self.target_ongoing_requests is not None:
                autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
            options["autoscaling_config"] = autoscaling
        return options

    def request_router_config(self) -> dict[str, Any]:
        """Ray Serve's `request_router_config` of the diffbatch router: a wave is the
        engine's largest (`max_num_seqs`, or the auto limit)."""
        return {
            "request_router_class": DIFFBATCH_ROUTER_CLASS,
            "request_router_kwargs": {"wave_size": self.max_num_seqs},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        }


def _describe(error: Any) -> str:
    """One pydantic error as "`field`: rule (got value)"; our own checks as they are."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:
        return message
    field = ".".join(map(str, error["loc"]))
    return f"`{field}`: {message} (got {error['input']!r})"
