"""The diffbatch request router and autoscaling on a local Ray cluster (`ray_cluster`).

- `/routed`: two replicas of `FakeBatchPipeline` behind the diffbatch router (the
  default), with Serve's proxy running diffbatch's middleware (conftest.py): requests
  of two batch keys sent together are answered each key by one replica, in waves of
  several;
- `/scaled`: one replica with autoscaling between 1 and 2 (`max_replicas`), Ray
  Serve's own `autoscaling_config`: it starts and serves.

The flag tests need no cluster.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from diffbatch.entrypoints.ray.args import DIFFBATCH_ROUTER_CLASS, RayServeArgs
from diffbatch.entrypoints.ray.server import REPLICA_HEADER, args_from_namespace, build_app
from tests.entrypoints.ray.conftest import RayCluster, wait_until

FAKE = "tests.fake_pipelines.FakeBatchPipeline"
REPLICA_CPUS = 0.25
PER_KEY = 6  # requests of each key sent at once: one full wave (max_num_seqs)


# -- the flag (no cluster) ---------------------------------------------------------------
@pytest.mark.parametrize(("flags", "router_class"), [
    ([], DIFFBATCH_ROUTER_CLASS),
    (["--ray-router", "diffbatch"], DIFFBATCH_ROUTER_CLASS),
    (["--ray-router", "random"], None),  # Ray Serve's default router
])
def test_ray_router_flag_reaches_the_deployment(flags: list[str], router_class: str | None
                                                ) -> None:
    from diffbatch.entrypoints.cli import make_arg_parser

    namespace = make_arg_parser().parse_args(
        ["serve", "tiny-sd", "--ray", "--max-num-seqs", "3", *flags])
    options = args_from_namespace(namespace).deployment_options()
    config = options.get("request_router_config")
    if router_class is None:
        assert config is None
    else:
        assert config["request_router_class"] == router_class
        assert config["request_router_kwargs"] == {"wave_size": 3}  # a wave: max_num_seqs


def test_ray_router_refuses_unknown_names() -> None:
    from diffbatch.entrypoints.cli import make_arg_parser
    from diffbatch.errors import ConfigError

    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["serve", "--ray", "--ray-router", "pow2"])
    with pytest.raises(ConfigError, match="`ray_router`: Input should be 'diffbatch' or "
                                          "'random' \\(got 'pow2'\\)"):
        RayServeArgs.from_dict({"ray_router": "pow2"})


def test_ray_router_is_a_builder_argument() -> None:
    """`serve run ... ray_router=random`, or the config file's `args:`."""
    assert "request_router_config" not in RayServeArgs.from_dict(
        {"ray_router": "random"}).deployment_options()
    auto = RayServeArgs.from_dict({}).deployment_options()["request_router_config"]
    assert auto["request_router_kwargs"] == {"wave_size": RayServeArgs.from_dict({}).max_num_seqs}


# -- on a Ray cluster --------------------------------------------------------------------
def _deploy(name: str, args: dict[str, Any]) -> None:
    from ray import serve

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")


def _deployment_details(app: str) -> dict[str, Any]:
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()["applications"][app]["deployments"][
        "diffbatch"]


@pytest.fixture(scope="module")
def routed_url(ray_cluster: RayCluster) -> Iterator[str]:
    """Two replicas behind the diffbatch router; an idle engine may wait up to 5 s for
    more requests of a wave."""
    from ray import serve

    _deploy("routed", {
        "pipeline_class": FAKE, "served_model_name": "fake", "num_replicas": 2,
        "executor": "inproc", "max_num_seqs": PER_KEY, "request_batch_max_wait_ms": 5000,
        "calibration_budget_s": 0, "num_cpus_per_replica": REPLICA_CPUS,
    })
    try:
        yield f"{ray_cluster.url}/routed"
    finally:
        serve.delete("routed")


@pytest.mark.slow
def test_each_key_is_answered_by_one_replica_in_full_waves(routed_url: str) -> None:
    config = _deployment_details("routed")["deployment_config"]["request_router_config"]
    assert config["request_router_class"] == DIFFBATCH_ROUTER_CLASS
    sizes = {"a": "16x16", "b": "32x32"}  # two batch keys

    def post(key_seed: tuple[str, int]) -> tuple[str, httpx.Response]:
        key, seed = key_seed
        return key, httpx.post(f"{routed_url}/v1/images/generations", timeout=60, json={
            "prompt": f"request {seed}", "size": sizes[key], "seed": seed})

    homes: dict[str, str] = {}
    for round_ in range(2):  # the second round finds the keys' replicas already known
        work = [(key, 100 * round_ + i) for i in range(PER_KEY) for key in sizes]
        with ThreadPoolExecutor(len(work)) as pool:
            answers = list(pool.map(post, work))
        assert all(r.status_code == 200 for _, r in answers), [r.text for _, r in answers]
        replicas = {key: collections.Counter(r.headers[REPLICA_HEADER]
                                             for k, r in answers if k == key)
                    for key in sizes}
        waves = {key: sorted(int(r.headers["x-diffbatch-batch-size"])
                             for k, r in answers if k == key) for key in sizes}
        for key in sizes:
            if round_ == 0:
                # 1. One replica answers all of a key's requests ...
                assert len(replicas[key]) == 1, (round_, replicas, waves)
                homes[key] = next(iter(replicas[key]))
            else:
                # ... and keeps most of them later (the router may spill to an idle
                # replica while the key's own looks a wave longer in Ray's queue
                # lengths, which lag behind completions).
                assert replicas[key][homes[key]] > PER_KEY / 2, (round_, replicas, homes)
            # 2. ... in waves of several: on average a request shares its wave with
            # half the key's requests or more (Ray's default router: 1-2 per wave).
            assert sum(waves[key]) / PER_KEY >= PER_KEY / 2, (round_, waves)
        # 3. The two keys go to different replicas: each replica batches one.
        assert homes["a"] != homes["b"], homes


@pytest.mark.slow
def test_autoscaling_between_one_and_two_replicas_starts_and_serves(
        ray_cluster: RayCluster) -> None:
    from ray import serve

    _deploy("scaled", {
        "pipeline_class": FAKE, "served_model_name": "fake", "executor": "inproc",
        "max_num_seqs": 2, "num_replicas": 1, "min_replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": 2, "calibration_budget_s": 0,
        "num_cpus_per_replica": REPLICA_CPUS,
    })
    try:
        autoscaling = _deployment_details("scaled")["deployment_config"]["autoscaling_config"]
        assert (autoscaling["min_replicas"], autoscaling["max_replicas"],
                autoscaling["target_ongoing_requests"]) == (1, 2, 2)
        wait_until(lambda: serve.status().applications["scaled"].status == "RUNNING",
                   what="the autoscaling application")
        url = f"{ray_cluster.url}/scaled/v1/images/generations"
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: httpx.post(url, timeout=60, json={
                "prompt": f"request {i}", "seed": i}), range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert all(a.headers[REPLICA_HEADER] for a in answers)
    finally:
        serve.delete("scaled")
