"""diffbatch on Ray Serve: arguments, the builder, and replicas on a local Ray cluster.

The fast tests check argument handling, the application builder's contract with Ray
Serve and the proxy middleware without a cluster. The slow ones share one local Ray
cluster (`ray_cluster` in conftest.py) and deploy four applications on it:

- `/tiny`: two replicas of `tiny-sd` (executor "inproc" inside the replicas, to save
  processes on a 2-core machine), driven by the official `openai` client;
- `/gated`: two replicas of `FileGatedPipeline`, whose waves block until the test
  opens the gate, for the client-disconnect and replica-kill tests;
- `/cfg`: deployed from a Serve config file by Ray's own `serve run` command;
- `/`: `diffbatch serve --ray` itself, a subprocess with the default `mp` executor
  (batching in the replica's worker process, the shutdown timeout on SIGTERM).
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from diffbatch.entrypoints.ray.args import RayServeArgs
from diffbatch.entrypoints.ray.proxy import REPLICA_FAILED_MESSAGE, ReplicaFailureMiddleware
from diffbatch.entrypoints.ray.server import REPLICA_HEADER, args_from_namespace, build_app
from diffbatch.errors import ConfigError
from tests.entrypoints.openai.conftest import disconnect, open_raw_request
from tests.entrypoints.ray.conftest import RayCluster, wait_until

# Ray is imported inside the tests that need it: without the `[ray]` extra the
# argument and middleware tests still run, and the others skip.

MODEL = "tiny-sd"
GATED = "tests.entrypoints.ray.conftest.FileGatedPipeline"
REPLICA_CPUS = 0.25  # five replicas at most at once fit the 2-CPU cluster
STEPS = 2
# Batch invariance across replicas: every replica loads the same cached weights, and a
# request's image in a wave equals its image alone up to float reordering.
MAX_PIXEL_DIFF = 3  # out of 255, per channel


# -- arguments (no cluster) --------------------------------------------------------------
def test_args_convert_strings_like_serve_run() -> None:
    args = RayServeArgs.from_dict({
        "model": MODEL, "num_replicas": "2", "max_num_seqs": "4",
        "request_batch_max_wait_ms": "20", "num_cpus_per_replica": "0.5",
        "scheduling_policy": "grouped", "warmup": "false",
    })
    config = args.engine_config()  # every EngineConfig field is an engine argument
    assert (config.model, config.max_num_seqs, config.request_batch_max_wait_ms) == (MODEL, 4, 20.0)
    assert (config.scheduling_policy, config.warmup) == ("grouped", False)
    assert config.executor == "mp"  # the usual default, also inside replicas
    options = args.deployment_options()
    assert options["num_replicas"] == 2
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    assert options["max_ongoing_requests"] == 12  # three waves: one running, two more
    assert "autoscaling_config" not in options


def test_args_autoscaling_bounds() -> None:
    args = RayServeArgs.from_dict({"num_replicas": 2, "min_replicas": 1, "max_replicas": 4,
                                   "target_ongoing_requests": 3, "num_gpus_per_replica": 1})
    options = args.deployment_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 3,
    }
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert options["max_ongoing_requests"] == 96  # 3 * the auto limit (32): three waves
    fixed = RayServeArgs.from_dict({"max_num_seqs": 1}).deployment_options()
    assert fixed["max_ongoing_requests"] == 5  # Ray's default, above 3 * max_num_seqs


@pytest.mark.parametrize(("given", "expected"), [
    ({"num_replica": 2}, "unknown argument `num_replica` (got 2); engine arguments are "
                         "EngineConfig fields: model,"),
    ({"num_replicas": 0}, "`num_replicas`: Input should be greater than or equal to 1 (got 0)"),
    ({"executor": "thread"}, "`executor` must be one of 'mp', 'inproc', got 'thread'"),
    ({"max_num_seqs": "many"}, "`max_num_seqs` must be 'auto' or an integer >= 1, got 'many'"),
    ({"max_num_seqs": 0}, "`max_num_seqs` must be 'auto' or an integer >= 1, got 0"),
    ({"png_compress_level": 10}, "`png_compress_level`: Input should be less than or equal "
                                 "to 9 (got 10)"),
    ({"min_replicas": 1}, "`min_replicas` needs autoscaling: also set `max_replicas`"),
    ({"num_replicas": 5, "max_replicas": 4}, "min_replicas <= num_replicas <= max_replicas, "
                                              "got 1 <= 5 <= 4"),
])
def test_args_refuse_bad_values(given: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        RayServeArgs.from_dict(given)
    assert expected in str(info.value)


def test_server_args_reach_the_app() -> None:
    assert "png_compress_level" not in RayServeArgs.from_dict({}).app_kwargs()  # app's default
    kwargs = RayServeArgs.from_dict({"png_compress_level": "9", "max_image_pixels": "4096"}
                                    ).app_kwargs()
    assert (kwargs["png_compress_level"], kwargs["max_image_pixels"]) == (9, 4096)


def test_several_replicas_keep_no_image_links_unless_told() -> None:
    one, several = (RayServeArgs.from_dict({"num_replicas": n}).app_kwargs() for n in (1, 2))
    assert "image_store_bytes" not in one  # the server's default store
    assert several["image_store_bytes"] == 0  # a link could reach another replica
    told = RayServeArgs.from_dict({"num_replicas": 2, "image_store_mb": "8",
                                   "max_upload_mb": "4", "public_url": "https://x"})
    assert (told.app_kwargs()["image_store_bytes"], told.app_kwargs()["max_upload_bytes"],
            told.app_kwargs()["public_url"]) == (8 << 20, 4 << 20, "https://x")


def test_serve_flags_become_args() -> None:
    from diffbatch.entrypoints.cli import make_arg_parser

    namespace = make_arg_parser().parse_args([
        "serve", MODEL, "--ray", "--num-replicas", "3", "--max-num-seqs", "4",
        "--scheduling-policy", "grouped", "--served-model-name", "sd", "--port", "9000",
        "--num-cpus-per-replica", "2", "--max-replicas", "4", "--png-compress-level", "0",
        "--shutdown-timeout", "3",
    ])
    assert namespace.ray and namespace.ray_address is None
    args = args_from_namespace(namespace)
    config = args.engine_config()
    assert (config.model, config.max_num_seqs, config.scheduling_policy) == (MODEL, 4, "grouped")
    assert (args.served_model_name, args.num_replicas, args.num_cpus_per_replica) == ("sd", 3, 2)
    options = args.deployment_options()
    assert options["autoscaling_config"]["max_replicas"] == 4
    assert options["graceful_shutdown_timeout_s"] == 3.0  # Ray kills a replica after it
    assert args.app_kwargs()["png_compress_level"] == 0


def test_the_shutdown_timeout_defaults_to_the_servers() -> None:
    from diffbatch.entrypoints.cli import make_arg_parser
    from diffbatch.entrypoints.openai.api_server import DEFAULT_SHUTDOWN_TIMEOUT_S

    by_builder = RayServeArgs.from_dict({}).deployment_options()
    by_cli = args_from_namespace(make_arg_parser().parse_args(["serve", "--ray"])
                                 ).deployment_options()
    assert by_builder["graceful_shutdown_timeout_s"] == DEFAULT_SHUTDOWN_TIMEOUT_S
    assert by_cli["graceful_shutdown_timeout_s"] == DEFAULT_SHUTDOWN_TIMEOUT_S
    assert RayServeArgs.from_dict({"shutdown_timeout": "0.5"}
                                  ).deployment_options()["graceful_shutdown_timeout_s"] == 0.5


def test_a_misspelt_model_name_fails_before_ray_is_touched(caplog) -> None:
    """In the builder (a Serve config file) and in `diffbatch serve --ray`, with the
    name's hint, as without Ray: not as replicas that fail to load, retried."""
    from diffbatch.entrypoints.cli import main
    from diffbatch.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="did you mean `tiny-sd`"):
        build_app({"model": "tiny-sdd"})
    assert main(["serve", "tiny-sdd", "--ray", "--port", "0"]) == 1
    assert "failed to start: model 'tiny-sdd'" in caplog.text


def test_an_address_where_nothing_listens_fails_at_once_naming_the_flag(
        caplog, monkeypatch) -> None:
    """Ray would retry such an address for a long while; the CLI refuses it first."""
    import socket

    from diffbatch.entrypoints.cli import main
    from diffbatch.entrypoints.ray.server import check_ray_address

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_ray_address(f"127.0.0.1:{port}")  # something answers: Ray's to judge
        check_ray_address(f"ray://127.0.0.1:{port}")
    # the port is closed now: connections to it are refused
    with pytest.raises(ConfigError, match=f"--ray-address 'ray://127.0.0.1:{port}'"):
        check_ray_address(f"ray://127.0.0.1:{port}")
    for address in (None, "", "auto", "local"):
        check_ray_address(address)
    assert main(["serve", MODEL, "--ray", "--ray-address", f"127.0.0.1:{port}"]) == 1
    assert f"cannot reach a Ray cluster at --ray-address '127.0.0.1:{port}'" in caplog.text
    # the address Ray would take from its variable is checked, and named, the same way
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert main(["serve", MODEL, "--ray"]) == 1
    assert f"cannot reach a Ray cluster at $RAY_ADDRESS '127.0.0.1:{port}'" in caplog.text


def test_builder_follows_ray_app_builder_convention() -> None:
    """`serve run module:build_app k=v` calls the builder with a dict of strings."""
    serve = pytest.importorskip("ray.serve")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(
        build_app, {"model": MODEL, "num_replicas": "3", "max_num_seqs": "2"}
    )
    assert isinstance(app, serve.Application)
    with pytest.raises(ConfigError, match="`max_num_seqs`"):  # before touching Ray
        build_app({"max_num_seqs": "many"})


# -- proxy middleware (no cluster) -------------------------------------------------------
async def _run_asgi(app: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    scope = {"type": "http", "method": "POST", "path": "/v1/images/generations",
             "headers": [], "query_string": b""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ReplicaFailureMiddleware(app)(scope, receive, send)
    return sent


async def test_proxy_middleware_turns_an_empty_answer_into_a_clear_503() -> None:
    async def replica_died(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the body; then the replica dies and Ray sends nothing

    sent = await _run_asgi(replica_died, [{"type": "http.request", "body": b"{}"}])
    assert sent[0]["status"] == 503
    body = sent[1]["body"].decode()
    assert REPLICA_FAILED_MESSAGE in body and '"code":"replica_failed"' in body


async def test_proxy_middleware_leaves_answers_and_disconnects_alone() -> None:
    async def answers(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = await _run_asgi(answers, [])
    assert [m.get("status") for m in sent] == [200, None]

    async def client_left(scope: Any, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    assert await _run_asgi(client_left, [{"type": "http.request", "body": b"{}"}]) == []


# -- on a Ray cluster --------------------------------------------------------------------
def _deploy(name: str, args: dict[str, Any]) -> None:
    from ray import serve

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")


def _delete(name: str) -> None:
    from ray import serve

    serve.delete(name)


def _decode(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def _deployment_status(app: str) -> Any:
    from ray import serve

    application = serve.status().applications.get(app)
    return None if application is None else application.deployments.get("diffbatch")


def _has_healthy_replicas(app: str, count: int) -> bool:
    status = _deployment_status(app)
    return (status is not None and status.status == "HEALTHY"
            and status.replica_states == {"RUNNING": count})


@pytest.fixture(scope="module")
def tiny_url(ray_cluster: RayCluster) -> Iterator[str]:
    """Two `tiny-sd` replicas at `/tiny`, batching up to 4 requests each."""
    from diffbatch.pipelines.tiny import ensure_tiny_model

    ensure_tiny_model(MODEL)  # build once here, not in both replicas at once
    _deploy("tiny", {
        "model": MODEL, "num_replicas": 2, "executor": "inproc", "max_num_seqs": 4,
        "request_batch_max_wait_ms": 20, "num_cpus_per_replica": REPLICA_CPUS,
    })
    try:
        yield f"{ray_cluster.url}/tiny"
    finally:
        _delete("tiny")


@pytest.mark.slow
def test_two_replicas_serve_the_openai_client(tiny_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    prompts = [(f"shape number {i}", 100 + i) for i in range(16)]

    def generate(prompt_seed: tuple[str, int]) -> tuple[np.ndarray, str]:
        prompt, seed = prompt_seed
        raw = client.images.with_raw_response.generate(
            model=MODEL, prompt=prompt, size="64x64", response_format="b64_json",
            extra_body={"seed": seed, "num_inference_steps": STEPS},
        )
        return _decode(raw.parse().data[0].b64_json), raw.headers[REPLICA_HEADER]

    # 1. Sixteen at once: all succeed, and both replicas serve some.
    with ThreadPoolExecutor(max_workers=16) as pool:
        concurrent = list(pool.map(generate, prompts))
    replicas = {replica for _, replica in concurrent}
    assert len(replicas) == 2, f"one replica served all 16 requests: {replicas}"
    # 2. Each image equals the same prompt and seed served alone (on whichever replica).
    for prompt_seed, (image, _) in zip(prompts, concurrent, strict=True):
        alone, _ = generate(prompt_seed)
        diff = np.abs(image - alone).max()
        assert diff <= MAX_PIXEL_DIFF, f"{prompt_seed}: max pixel diff {diff}"


@pytest.mark.slow
def test_metrics_and_health_name_their_replica(tiny_url: str) -> None:
    metrics = httpx.get(f"{tiny_url}/metrics", timeout=30)
    assert metrics.status_code == 200
    assert 'diffbatch_requests_total{outcome="completed"}' in metrics.text
    health = httpx.get(f"{tiny_url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert metrics.headers[REPLICA_HEADER] and health.headers[REPLICA_HEADER]
    # one x-request-id per answer: the client's, else Ray's own (the proxy puts it on)
    for sent in ({"x-request-id": "client-id-7"}, {}):
        ids = httpx.get(f"{tiny_url}/v1/models", headers=sent, timeout=30
                        ).headers.get_list("x-request-id")
        assert len(ids) == 1 and ids[0], ids
        assert ids == ["client-id-7"] or not sent


# -- gated replicas: disconnect and kill -------------------------------------------------
class Gate:
    """The folder `FileGatedPipeline` replicas wait on; see conftest.py.

    Open until first closed; each `close()` starts a new generation, so a wave that
    still waits on an earlier one is released by that one's `open()`.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._generations = itertools.count()
        self.generation: Path | None = None

    def close(self) -> None:
        self.generation = self.folder / f"g{next(self._generations)}"
        self.generation.mkdir()
        current = self.folder / "current.tmp"
        current.write_text(self.generation.name)
        current.replace(self.folder / "current")  # replicas never read half a name

    def open(self) -> None:
        if self.generation is not None:
            (self.generation / "release").touch()

    def entered_replicas(self) -> set[str]:
        """Ids of the replicas with a wave waiting at the gate since it last closed."""
        if self.generation is None:
            return set()
        return {m.name.split("-")[1] for m in self.generation.glob("entered-*")}


@pytest.fixture(scope="module")
def gated(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, Gate]]:
    """Two gated replicas at `/gated`: waves of up to 4, at most 4 requests each."""
    gate = Gate(tmp_path_factory.mktemp("gate"))
    _deploy("gated", {
        "pipeline_class": GATED, "pipeline_kwargs": {"gate_dir": str(gate.folder)},
        "served_model_name": "gated", "num_replicas": 2, "executor": "inproc",
        "max_num_seqs": 4, "request_batch_max_wait_ms": 0,  # fixed: the test holds waves
        "max_ongoing_requests": 4, "num_cpus_per_replica": REPLICA_CPUS,
        "health_check_period_s": 1, "health_check_timeout_s": 10,
    })
    try:
        yield f"{ray_cluster.url}/gated", gate
    finally:
        gate.open()
        _delete("gated")


GATED_BODY = {"prompt": "a gated request", "size": "16x16", "response_format": "b64_json"}


def _replica_counts(url: str, replica: str) -> dict[str, float]:
    """Request outcomes of one replica, read from `/metrics` answers it served."""
    found: dict[str, float] = {}

    def served_by_replica() -> bool:
        response = httpx.get(f"{url}/metrics", timeout=30)
        if response.headers[REPLICA_HEADER] != replica:
            return False
        for line in response.text.splitlines():
            if line.startswith("diffbatch_requests_total{"):
                name, value = line.rsplit(" ", 1)
                found[name.split('"')[1]] = float(value)
        return True

    wait_until(served_by_replica, what=f"a /metrics answer from replica {replica}")
    return found


@pytest.mark.slow
def test_client_disconnect_aborts_on_its_replica(gated: tuple[str, Gate]) -> None:
    url, gate = gated
    gate.close()

    async def disconnect_mid_wave() -> str:
        async with httpx.AsyncClient(timeout=60) as client:
            request = asyncio.ensure_future(
                client.post(f"{url}/v1/images/generations", json=GATED_BODY)
            )
            while not gate.entered_replicas():  # bounded by the request's own timeout
                await asyncio.wait({request}, timeout=0.01)
                assert not request.done(), request.result().text
            request.cancel()  # closes the connection: the client is gone
            await asyncio.gather(request, return_exceptions=True)
        return next(iter(gate.entered_replicas()))

    try:
        replica = asyncio.run(disconnect_mid_wave())
        # The replica that held the request aborted it in its engine.
        wait_until(lambda: _replica_counts(url, replica)["aborted"] >= 1,
                   what=f"the abort to reach replica {replica}")
        assert _replica_counts(url, replica)["completed"] == 0
    finally:
        gate.open()


@pytest.mark.slow
def test_killed_replica_answers_every_request_and_recovers(gated: tuple[str, Gate]) -> None:
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    url, gate = gated
    wait_until(lambda: _has_healthy_replicas("gated", 2), what="two healthy replicas")
    gate.close()

    async def load_then_kill() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as client:
            requests = [
                asyncio.ensure_future(client.post(
                    f"{url}/v1/images/generations", json={**GATED_BODY, "seed": i}))
                for i in range(8)
            ]
            # 8 requests, at most 4 per replica: both replicas hold a wave at the gate.
            while len(gate.entered_replicas()) < 2:
                done, _ = await asyncio.wait(requests, timeout=0.01)
                assert not done, [r.result().text for r in done]
            victim = sorted(gate.entered_replicas())[0]
            actor_name = ReplicaID(victim, DeploymentID("diffbatch", "gated")).to_full_id_str()
            ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)
            # The gate stays shut until the victim is gone: with it shut, only the dead
            # replica's requests can end (`ray.kill` returns before the process exits).
            await asyncio.wait(requests, return_when=asyncio.FIRST_COMPLETED)
            gate.open()
            return victim, list(await asyncio.gather(*requests))

    victim, answers = asyncio.run(load_then_kill())
    # 1. Exactly one answer each: an image from the survivor, or a clear error.
    assert len(answers) == 8
    ok = [a for a in answers if a.status_code == 200]
    failed = [a for a in answers if a.status_code != 200]
    assert ok and failed, [a.status_code for a in answers]
    for answer in ok:
        assert answer.headers[REPLICA_HEADER] != victim
        assert answer.json()["data"][0]["b64_json"]
    for answer in failed:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"] == {
            "message": REPLICA_FAILED_MESSAGE, "type": "engine_unavailable",
            "param": None, "code": "replica_failed",
        }
    # 2. Ray Serve replaces the replica; new requests reach two healthy replicas.
    survivor = ok[0].headers[REPLICA_HEADER]
    wait_until(lambda: _has_healthy_replicas("gated", 2), what="a replacement replica")
    seen: set[str] = set()
    scales = (1.0 + n / 100 for n in itertools.count())

    def new_replica_serves() -> bool:
        # The diffbatch router keeps a batch key on the replica it went to last (the
        # survivor), so new keys (guidance scales) show the replacement taking its share.
        response = httpx.post(f"{url}/v1/images/generations", timeout=60,
                              json={**GATED_BODY, "guidance_scale": next(scales)})
        assert response.status_code == 200, response.text
        seen.add(response.headers[REPLICA_HEADER])
        return bool(seen - {survivor})

    wait_until(new_replica_serves, what="a request served by the replacement replica")
    assert victim not in seen


# -- a Serve config file, deployed by Ray's own CLI --------------------------------------
@pytest.mark.slow
def test_serve_config_file(ray_cluster: RayCluster, tmp_path: Path) -> None:
    import ray

    config = tmp_path / "serve.yaml"
    config.write_text(
        "applications:\n"
        "  - name: cfg\n"
        "    route_prefix: /cfg\n"
        "    import_path: diffbatch.entrypoints.ray.server:build_app\n"
        "    args:\n"
        f"      pipeline_class: {GATED}\n"
        "      served_model_name: from-config\n"
        "      executor: inproc\n"
        "      max_num_seqs: '2'\n"
        f"      num_cpus_per_replica: {REPLICA_CPUS}\n"
    )
    serve_cli = str(Path(sys.executable).with_name("serve"))
    address = ray.get_runtime_context().gcs_address
    try:
        done = subprocess.run(
            [serve_cli, "run", "--non-blocking", "--address", address, str(config)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        wait_until(lambda: _has_healthy_replicas("cfg", 1), what="the config's application")
        url = f"{ray_cluster.url}/cfg"
        models = httpx.get(f"{url}/v1/models", timeout=30)
        assert [m["id"] for m in models.json()["data"]] == ["from-config"]
        response = httpx.post(f"{url}/v1/images/generations", json=GATED_BODY, timeout=60)
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER]
    finally:
        _delete("cfg")


# -- `diffbatch serve --ray`, joining the running cluster --------------------------------
def _running_requests(url: str) -> float:
    """`diffbatch_num_requests_running` of the replica that answers `url`/metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("diffbatch_num_requests_running "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.slow
def test_cli_on_ray_batches_in_the_replicas_worker_and_bounds_its_shutdown(
    ray_cluster: RayCluster,
) -> None:
    """`diffbatch serve --ray` as a user starts it, with the default `mp` executor: two
    requests queued behind a long wave share one wave of 2 in the replica's worker
    process once the long wave's client leaves; --shutdown-timeout becomes the
    replica's graceful shutdown timeout, so SIGTERM with a long wave in flight kills
    the replica then and its client is answered 503; the command exits 0 and the
    application is gone."""
    import ray
    from ray.serve.context import _get_global_client

    from diffbatch.entrypoints.ray.server import DEFAULT_APP_NAME
    from diffbatch.pipelines.tiny import ensure_tiny_model

    ensure_tiny_model(MODEL)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffbatch", "serve", MODEL, "--ray", "--ray-address", address,
         "--num-replicas", "1", "--max-num-seqs", "2", "--request-batch-max-wait-ms", "0",
         "--torch-threads", "1", "--shutdown-timeout", "0.5", "--max-request-work", "0",
         "--num-cpus-per-replica", str(REPLICA_CPUS), "--served-model-name", "from-cli",
         "--log-level", "warning"],
    )
    url = ray_cluster.url  # route prefix "/": the other applications' longer prefixes win
    signalled = False

    def post(**body: Any) -> httpx.Response:
        return httpx.post(f"{url}/v1/images/generations", timeout=120,
                          json={"prompt": "a blue square", "num_inference_steps": STEPS, **body})

    try:
        wait_until(lambda: _has_healthy_replicas(DEFAULT_APP_NAME, 1) or proc.poll() is not None,
                   timeout_s=180, what="the CLI's application")
        assert proc.poll() is None, f"diffbatch serve --ray exited with {proc.returncode}"
        models = httpx.get(f"{url}/v1/models", timeout=30)
        assert [m["id"] for m in models.json()["data"]] == ["from-cli"]
        config = _get_global_client().get_serve_details()["applications"][DEFAULT_APP_NAME][
            "deployments"]["diffbatch"]["deployment_config"]
        assert config["graceful_shutdown_timeout_s"] == 0.5
        with ThreadPoolExecutor(3) as pool:
            # 1. Behind a long wave (long enough to outlast a few stalled round trips
            # through the proxy), a full wave of two waits at the worker; the long
            # wave's client then leaves, which stops that wave at its next step.
            holder = open_raw_request(int(url.rsplit(":", 1)[1]), {
                "prompt": "holds the worker", "num_inference_steps": 600})
            try:
                wait_until(lambda: _running_requests(url) == 1, what="the long wave")
                pair = [pool.submit(post, seed=seed) for seed in (1, 2)]
                wait_until(lambda: _running_requests(url) == 3, what="the pair behind it")
            finally:
                disconnect(holder)
            answers = [f.result() for f in pair]
            assert [a.status_code for a in answers] == [200] * 2, [a.text for a in answers]
            assert [a.headers["x-diffbatch-batch-size"] for a in answers] == ["2", "2"]
            # 2. SIGTERM with a long wave in flight: cut after the shutdown timeout.
            cut = pool.submit(post, num_inference_steps=400, n=10)  # a minute on a CPU
            wait_until(lambda: _running_requests(url) == 1, what="the wave to cut")
            proc.terminate()  # SIGTERM: delete the application, disconnect, exit 0
            signalled = True
            response = cut.result()
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "replica_failed"
    finally:
        if not signalled:  # a second SIGTERM would cut the application's deletion short
            proc.terminate()
        assert proc.wait(timeout=120) == 0
    # deleted; the cluster lives on (the controller may list it a moment longer)
    wait_until(lambda: _deployment_status(DEFAULT_APP_NAME) is None,
               what="the application deleted")
