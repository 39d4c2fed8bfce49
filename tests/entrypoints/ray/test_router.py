"""The diffbatch request router without a cluster: routing keys, the proxy middleware
that adds them, and the router's choice on synthetic replica states.

The router is Ray Serve's `RequestRouter` subclass itself, fed the way Ray Serve
feeds it (replicas through `update_replicas`, requests as the proxy sends them: a
pickled `StreamingHTTPRequest` whose scope carries the key header); the replicas
are `SyntheticReplica`s, stand-ins for Ray's replica handles that hold the state
the test sets (queue length, routing stats).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any

import pytest

from diffbatch.entrypoints.ray.route_key import (
    ROUTE_KEY_HEADER,
    RouteKey,
    route_key_of_body,
    route_key_of_generation,
)
from diffbatch.sampling_params import SamplingParamsKey

ROUTE = "/app/v1/images/generations"


def _key(**body: Any) -> RouteKey | None:
    return route_key_of_generation(json.dumps({"prompt": "a cat", **body}).encode())


# -- routing keys ------------------------------------------------------------------------
def test_requests_that_could_share_a_wave_have_one_key() -> None:
    a = _key(size="64x64", num_inference_steps=2, seed=1)
    assert a is not None and a.adapters == ()
    assert _key(prompt="a dog", size="64x64", num_inference_steps=2, seed=9,
                negative_prompt="blur") == a  # prompt, seed: not in the batch key
    for other in ({"size": "32x32"}, {"num_inference_steps": 3}, {"n": 2},
                  {"guidance_scale": 3.0}):
        assert _key(**{"size": "64x64", "num_inference_steps": 2, **other}) != a, other
    styled = _key(size="64x64", num_inference_steps=2, lora="style")
    assert styled is not None and styled.adapters == ("style",)
    # adapters split the batch part exactly while the engine's batch key holds them
    in_engine_key = "lora" in {f.name for f in dataclasses.fields(SamplingParamsKey)}
    assert (styled.batch != a.batch) == in_engine_key
    assert RouteKey.decode(styled.encode()) == styled
    assert RouteKey.decode("not json") is None and RouteKey.decode('[1, ["x"]]') is None


def test_only_valid_json_generations_get_a_key() -> None:
    body = json.dumps({"prompt": "a cat", "size": "64x64"}).encode()
    assert route_key_of_body("POST", ROUTE, "application/json", body) is not None
    assert route_key_of_body("GET", ROUTE, "application/json", body) is None
    assert route_key_of_body("POST", "/app/v1/images/edits", "application/json", body) is None
    assert route_key_of_body("POST", ROUTE, "multipart/form-data", body) is None
    assert route_key_of_body("POST", ROUTE, "application/json", b'{"prompt": ""}') is None
    assert route_key_of_body("POST", ROUTE, "application/json", b"{not json") is None
    assert _key(size="64x64", num_inference_steps=0) is None  # the server's 400


# -- the proxy middleware ----------------------------------------------------------------
async def _through_proxy_middleware(headers: list[tuple[bytes, bytes]], chunks: list[bytes],
                                    method: str = "POST") -> tuple[dict[str, Any], bytes]:
    from diffbatch.entrypoints.ray.proxy import RouteKeyMiddleware

    seen: dict[str, Any] = {}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["scope"] = scope
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = body

    scope = {"type": "http", "method": method, "path": ROUTE, "headers": headers}
    await RouteKeyMiddleware(app)(scope, receive, None)
    return seen["scope"], seen["body"]


async def test_proxy_middleware_adds_the_key_and_replays_the_body() -> None:
    body = json.dumps({"prompt": "a cat", "size": "64x64", "lora": "style"}).encode()
    scope, replayed = await _through_proxy_middleware(
        [(b"content-type", b"application/json"), (ROUTE_KEY_HEADER.encode(), b"forged")],
        [body[:10], body[10:]])
    assert replayed == body
    keys = [v for k, v in scope["headers"] if k == ROUTE_KEY_HEADER.encode()]
    assert keys == [_key(size="64x64", lora="style").encode().encode()]  # the forged one gone
    # no key for a body that does not validate, nor for other content types
    for headers, chunks in (([(b"content-type", b"application/json")], [b"{}"]),
                            ([(b"content-type", b"text/plain")], [body])):
        scope, replayed = await _through_proxy_middleware(headers, chunks)
        assert replayed == chunks[0]
        assert all(k != ROUTE_KEY_HEADER.encode() for k, _ in scope["headers"])


# -- the router's choice -----------------------------------------------------------------
class SyntheticReplica:
    """The part of Ray Serve's `RunningReplica` the router reads, with set state."""

    def __init__(self, name: str, *, queue_len: int = 0, capacity: int = 8,
                 node_id: str = "node-1") -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(name, DeploymentID("diffbatch", "app"))
        self.queue_len = queue_len
        self.max_ongoing_requests = capacity
        self.node_id = node_id
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, Any] = {}
        self.dead = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        if self.dead:
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()
        return self.queue_len


WAVE = 4


@pytest.fixture
def router():
    pytest.importorskip("ray.serve")
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from diffbatch.entrypoints.ray.router import DiffbatchRequestRouter

    made = DiffbatchRequestRouter(
        deployment_id=DeploymentID("diffbatch", "app"),
        handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-1",
        use_replica_queue_len_cache=True)
    made.initialize_state(wave_size=WAVE)
    return made


_ids = iter(range(10**6))


def _request(key: RouteKey | None):
    """A pending request as Ray Serve's proxy makes it (the ASGI scope, pickled)."""
    from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest
    from ray.serve.request_router import PendingRequest

    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((ROUTE_KEY_HEADER.encode(), key.encode().encode()))
    scope = {"type": "http", "method": "POST", "path": ROUTE, "headers": headers}
    request_id = f"r{next(_ids)}"
    return PendingRequest(args=[pickle.dumps(StreamingHTTPRequest(scope, proxy_actor_name="p"))],
                          kwargs={}, metadata=RequestMetadata(request_id, request_id))


async def _route(router, key: RouteKey | None, replicas: list[SyntheticReplica],
                 pending=None) -> str | None:
    """Route one request as Ray Serve would: the replica it sends it to (the shortest
    queue of the first rank with room), recorded as routed and its queue grown; None
    when no rank has room (Ray would ask again later, as `_route(..., pending)`)."""
    for replica in replicas:
        router.on_new_queue_len_info(replica.replica_id, replica.queue_len)
    pending = _request(key) if pending is None else pending
    ranks = await router.choose_replicas(list(router.curr_replicas.values()), pending)
    for rank in ranks:
        open_ = [r for r in rank if r.queue_len < r.max_ongoing_requests]
        if open_:
            chosen = min(open_, key=lambda r: r.queue_len)
            chosen.queue_len += 1
            router.on_request_routed(pending, chosen.replica_id, None)
            return chosen.replica_id.unique_id
    return None


KEY_A = RouteKey('{"height":64,"num_inference_steps":2}')
KEY_B = RouteKey('{"height":32,"num_inference_steps":2}')


async def test_one_key_goes_to_one_replica_and_keys_spread(router) -> None:
    replicas = [SyntheticReplica("r1"), SyntheticReplica("r2")]
    router.update_replicas(replicas)
    a = [await _route(router, KEY_A, replicas) for _ in range(3)]
    b = [await _route(router, KEY_B, replicas) for _ in range(3)]
    assert len(set(a)) == 1 and len(set(b)) == 1, (a, b)
    assert a[0] != b[0]  # a new key goes to the replica batching fewer keys
    # ... even when the other replica is shorter by less than a wave
    a += [await _route(router, KEY_A, replicas) for _ in range(WAVE)]
    assert set(a) == {a[0]}, a


async def test_an_idle_replica_takes_a_backlog_more_than_a_wave_long(router) -> None:
    replicas = [SyntheticReplica("r1"), SyntheticReplica("r2")]
    router.update_replicas(replicas)
    routed = [await _route(router, KEY_A, replicas) for _ in range(WAVE + 3)]
    home = routed[0]
    other = next(r for r in replicas if r.replica_id.unique_id != home)
    # a wave on the key's replica; the next would make it more than a wave longer
    # than the idle replica's queue, so the idle one takes it
    assert routed[:WAVE] == [home] * WAVE
    assert routed[WAVE] == other.replica_id.unique_id, routed
    # a busy replica's own stats count too: keys it runs for another proxy
    fresh = [SyntheticReplica("r3"), SyntheticReplica("r4")]
    fresh[1].routing_stats = {"batch_keys": {KEY_B.batch: 2}, "adapters": ["style"]}
    router.update_replicas(fresh)
    assert await _route(router, KEY_B, fresh) == "r4"
    styled = RouteKey('{"height":16}', ("style",))
    assert await _route(router, styled, fresh) == "r4"  # where its adapter is loaded


async def test_a_busy_replica_gets_no_stray_key_until_a_whole_replica_behind(router) -> None:
    """A replica running another key gets a request of this key only when the key's
    replica is longer by more than a replica holds (a stray request would cost it a
    wave of its own); until then the key's requests wait for their replica."""
    capacity = 2 * WAVE
    replicas = [SyntheticReplica("r1", capacity=capacity),
                SyntheticReplica("r2", capacity=capacity)]
    router.update_replicas(replicas)
    busy = await _route(router, KEY_B, replicas)  # one request of another key
    routed = [await _route(router, KEY_A, replicas) for _ in range(capacity)]
    home = routed[0]
    assert home != busy and routed == [home] * capacity, routed  # full, not spilt
    held = _request(KEY_A)
    assert await _route(router, KEY_A, replicas, held) is None  # waits for its replica
    # the waiting one counts in its queue: now more than a replica longer
    assert await _route(router, KEY_A, replicas) == busy


async def test_a_key_with_a_full_wave_is_shared_with_its_other_replicas(router) -> None:
    """A key on several replicas whose preferred one already holds a wave of it goes
    to the least loaded of them (one key too busy for one replica is shared evenly);
    with less than a wave there it stays on the replica that has the most."""
    replicas = [SyntheticReplica("r1", capacity=4 * WAVE),
                SyntheticReplica("r2", capacity=4 * WAVE)]
    replicas[0].routing_stats = {"batch_keys": {KEY_A.batch: WAVE - 1}}
    replicas[0].queue_len = WAVE - 1
    replicas[1].routing_stats = {"batch_keys": {KEY_A.batch: 1}}
    replicas[1].queue_len = 1
    router.update_replicas(replicas)
    assert await _route(router, KEY_A, replicas) == "r1"  # less than a wave there
    replicas[0].routing_stats = {"batch_keys": {KEY_A.batch: WAVE}}
    assert await _route(router, KEY_A, replicas) == "r2"  # a wave: shared, r2 is shorter
    replicas[1].queue_len = 3 * WAVE
    assert await _route(router, KEY_A, replicas) == "r1"  # r1 is the shorter now


async def test_requests_waiting_for_a_full_replica_are_routed_when_it_has_room(router) -> None:
    replicas = [SyntheticReplica("r1", capacity=WAVE), SyntheticReplica("r2", capacity=WAVE)]
    router.update_replicas(replicas)
    busy = await _route(router, KEY_B, replicas)
    routed = [await _route(router, KEY_A, replicas) for _ in range(WAVE)]
    home = next(r for r in replicas if r.replica_id.unique_id == routed[0])
    assert routed[0] != busy and routed == [routed[0]] * WAVE  # full now
    first = _request(KEY_A)
    assert await _route(router, KEY_A, replicas, first) is None
    home.queue_len = WAVE - 1  # a request done
    assert await _route(router, KEY_A, replicas, first) == routed[0]


async def test_a_dead_replica_is_skipped(router) -> None:
    replicas = [SyntheticReplica("r1"), SyntheticReplica("r2")]
    router.update_replicas(replicas)
    home = await _route(router, KEY_A, replicas)
    victim = next(r for r in replicas if r.replica_id.unique_id == home)
    survivor = next(r for r in replicas if r is not victim)
    victim.dead = True
    router.on_replica_actor_died(victim.replica_id)  # what Ray does on ActorDiedError
    assert victim.replica_id not in router.curr_replicas
    assert [await _route(router, KEY_A, replicas) for _ in range(3)] \
        == [survivor.replica_id.unique_id] * 3
    # and when the controller's update drops it, its memory goes too
    router.update_replicas([survivor])
    assert await _route(router, KEY_B, [survivor]) == survivor.replica_id.unique_id


async def test_requests_without_a_key_go_to_the_least_loaded(router) -> None:
    replicas = [SyntheticReplica("r1", queue_len=3), SyntheticReplica("r2", queue_len=1)]
    router.update_replicas(replicas)
    assert await _route(router, None, replicas) == "r2"


def test_rank_replicas_policy() -> None:
    from diffbatch.entrypoints.ray.router import ReplicaLoad, rank_replicas

    busy = ReplicaLoad("r1", queue_len=6, capacity=8, batch_keys={KEY_A.batch: 6})
    working = ReplicaLoad("r2", queue_len=1, capacity=8)
    idle = ReplicaLoad("r2", queue_len=0, capacity=8)
    assert rank_replicas(KEY_A, [busy, working], wave_size=8) == [["r1"]]
    # more than a wave longer: only an idle replica takes the spill ...
    assert rank_replicas(KEY_A, [busy, working], wave_size=4) == [["r1"]]
    assert rank_replicas(KEY_A, [busy, idle], wave_size=4) == [["r2"], ["r1"]]
    # ... or any, once longer by more than a replica holds
    small = dataclasses.replace(busy, capacity=4)
    assert rank_replicas(KEY_A, [small, working], wave_size=4) == [["r2"], ["r1"]]
    assert rank_replicas(KEY_B, [busy, working], wave_size=8) == [["r2"]]
    assert rank_replicas(None, [busy, working], wave_size=8) == [["r2", "r1"]]
    assert rank_replicas(KEY_A, [], wave_size=8) == []
