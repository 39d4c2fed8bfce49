"""The arguments of a diffbatch Ray Serve application, validated in one place.

`RayServeArgs` is what both ways of starting take: `diffbatch serve --ray` builds it
from the CLI namespace, and the application builder (`serve run
diffbatch.entrypoints.ray_serve:build_app model=tiny-sd num_replicas=2`, or a Serve
config file's `args:`) builds it from a dict whose values may be strings. The names
are the `diffbatch serve` flags' destinations, so `--max-num-seqs 4` on the CLI is
`max_num_seqs=4` in the builder. Three groups, split by the methods below:

- engine: what every replica's `Engine` gets (`engine_kwargs`);
- server: what every replica's FastAPI app gets (`app_kwargs`);
- deployment: how many replicas, their resources and health checks
  (`deployment_options`, Ray Serve's `Deployment.options()` keywords).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from diffbatch.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_DEPLOYMENT_NAME = "diffbatch"
# Ray Serve's own default of `max_ongoing_requests`.
RAY_DEFAULT_MAX_ONGOING_REQUESTS = 5

_ENGINE_FIELDS = (
    "model", "pipeline_class", "max_num_seqs", "request_batch_max_wait_ms", "executor",
    "max_queue_size", "lora_dir", "seed", "device", "dtype", "torch_num_threads",
    "pipeline_kwargs",
)


class RayServeArgs(BaseModel):
    """Engine, server and deployment arguments of a diffbatch Ray Serve application.

    Values given as strings (`serve run ... max_num_seqs=4`) are converted; unknown
    names are refused, so a typo fails before any replica starts.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- engine (one per replica) ----------------------------------------------------
    model: str | None = None  # folder, hub id or built-in name (None = the default)
    pipeline_class: str | None = None  # dotted name of a custom pipeline class
    max_num_seqs: int = Field(1, ge=1)  # most requests per wave, per replica
    request_batch_max_wait_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    executor: Literal["mp", "inproc"] = "mp"  # "inproc": the pipeline runs in the replica
    max_queue_size: int | None = Field(None, ge=1)  # per replica
    lora_dir: str | None = None  # must exist on every node that runs a replica
    seed: int | None = Field(None, ge=0)  # seeds each replica's random source alike
    device: str | None = None
    dtype: str | None = None
    torch_num_threads: int | None = Field(None, ge=1)  # None: Ray's OMP_NUM_THREADS
    pipeline_kwargs: dict[str, Any] = Field(default_factory=dict)  # to `from_pretrained`

    # -- server (the same FastAPI app in every replica) ------------------------------
    served_model_name: str | None = None  # None: `model`, else the default model
    api_key: str | None = None
    request_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds
    max_image_pixels: int | None = Field(None, ge=1)  # None: the server's default
    max_body_bytes: int | None = Field(None, ge=1)  # None: the server's default

    # -- deployment (Ray Serve) ------------------------------------------------------
    name: str = DEFAULT_DEPLOYMENT_NAME  # the deployment's name
    num_replicas: int = Field(1, ge=1)  # fixed count; the initial count when autoscaling
    min_replicas: int | None = Field(None, ge=0)  # autoscaling lower bound
    max_replicas: int | None = Field(None, ge=1)  # set to turn autoscaling on
    target_ongoing_requests: float | None = Field(None, gt=0)  # autoscaling target
    max_ongoing_requests: int | None = Field(None, ge=1)  # None: max(5, 2 * max_num_seqs)
    num_cpus_per_replica: float = Field(1.0, ge=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> RayServeArgs:
        autoscaling_only = ("min_replicas", "target_ongoing_requests")
        if self.max_replicas is None:
            given = [n for n in autoscaling_only if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"`{given[0]}` needs autoscaling: also set `max_replicas`"
                )
            return self
        low = 1 if self.min_replicas is None else self.min_replicas
        if not low <= self.num_replicas <= self.max_replicas:
            raise ValueError(
                "autoscaling bounds must satisfy min_replicas <= num_replicas <= "
                f"max_replicas, got {low} <= {self.num_replicas} <= {self.max_replicas}"
            )
        return self

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> RayServeArgs:
        """Validate builder arguments; raise `ConfigError` naming every bad one."""
        try:
            return cls.model_validate(args)
        except ValidationError as exc:
            problems = "; ".join(_describe(error) for error in exc.errors())
            raise ConfigError(f"invalid diffbatch Ray Serve arguments: {problems}") from None

    # -- the three groups ------------------------------------------------------------
    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of each replica's `Engine(...)`."""
        return {name: getattr(self, name) for name in _ENGINE_FIELDS}

    def app_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of each replica's `build_app(engine, ...)`, but the model name."""
        kwargs: dict[str, Any] = {
            "api_key": self.api_key, "request_timeout_s": self.request_timeout,
        }
        if self.max_image_pixels is not None:
            kwargs["max_image_pixels"] = self.max_image_pixels
        if self.max_body_bytes is not None:
            kwargs["max_body_bytes"] = self.max_body_bytes
        return kwargs

    def effective_max_ongoing_requests(self) -> int:
        """Requests Ray routes to one replica at once.

        NOTE: Ray Serve never gives a replica more than `max_ongoing_requests`
        requests, so a wave can never be larger than it. The default holds one full
        wave running plus one full wave waiting (2 * max_num_seqs), and never less
        than Ray's own default.
        """
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return max(RAY_DEFAULT_MAX_ONGOING_REQUESTS, 2 * self.max_num_seqs)

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of `Deployment.options(...)`."""
        actor_options: dict[str, Any] = {"num_cpus": self.num_cpus_per_replica}
        if self.num_gpus_per_replica:
            actor_options["num_gpus"] = self.num_gpus_per_replica
        options: dict[str, Any] = {
            "name": self.name,
            "ray_actor_options": actor_options,
            "max_ongoing_requests": self.effective_max_ongoing_requests(),
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
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


def _describe(error: Any) -> str:
    """One pydantic error as "`field`: rule (got value)"; cross-field errors as is."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:
        return message
    field = ".".join(map(str, error["loc"]))
    return f"`{field}`: {message} (got {error['input']!r})"
