"""The diffbatch request router for Ray Serve: keep each batch key's requests together.

Ray Serve's default router sends a request to the less busy of two random replicas,
blind to what it asks for, so N replicas split every batch key N ways and each
engine's waves shrink. `DiffbatchRequestRouter`, a Ray Serve `RequestRouter`, routes
by the request's routing key (`route_key.py`, put in a header by the proxy):

1. the preferred replica is the one with the most affinity to the key: requests of
   the same batch key in flight there (the most), else its adapters loaded there,
   else the key sent there last; a key new everywhere goes to the replica batching
   the fewest keys (then the shortest queue), so keys spread over the replicas;
2. a key with a full wave (`wave_size`, the engine's `max_num_seqs`) in flight on
   its preferred replica that is in flight on other replicas too goes to the least
   loaded of those: its next wave there has mates, and a key too busy for one
   replica is shared evenly instead of piling onto one;
3. the request spills to the least loaded replica when that one is idle and the
   preferred replica's queue (its requests, and those waiting in Ray's queue for
   it) is more than a wave longer, or when the preferred queue is longer by more
   than a whole replica holds (`max_ongoing_requests`). So no replica idles while
   another has a backlog, and no backlog grows unbounded; but a busy replica gets
   no stray request of another key, which would cost it a wave of its own;
4. otherwise it waits for the preferred replica while that one is full
   (`max_ongoing_requests`): its next wave will take it.

A request without a key (an edit, a handle call, no proxy middleware) goes to the
least loaded replica. Among replicas of equal rank, one on the router's own node
comes first (`LocalityMixin`).

Replica state comes from Ray Serve: queue lengths from the router's queue-length
cache (the replicas' own counts), keys in flight from the router's
`on_request_routed`/`on_request_completed` hooks, and each replica's keys in flight
and loaded adapters from its `record_routing_stats` (deployment.py), which also
covers requests routed by other proxies. `rank_replicas` is the policy alone, on
plain `ReplicaLoad` values.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import pickle
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from diffbatch.entrypoints.ray.route_key import RouteKey, route_key_of_headers

logger = logging.getLogger(__name__)

# How long a routing task waits for a full preferred replica to finish a request
# before it looks again (a completion wakes it sooner).
FULL_REPLICA_WAIT_S = 0.05
# How long a request counts as waiting for a replica after the router last chose it
# (a waiting request is chosen again every FULL_REPLICA_WAIT_S at most; a cancelled one
# stops counting after this).
WAITING_TTL_S = 1.0
# Keys whose last replica is remembered (the oldest are forgotten first).
MAX_REMEMBERED_KEYS = 4096
# Routing-stats fields (deployment.py's `record_routing_stats`).
STATS_KEYS = "batch_keys"  # {batch key: requests in flight}
STATS_ADAPTERS = "adapters"  # [adapter names loaded]


@dataclass(frozen=True)
class ReplicaLoad:
    """What the policy knows of one replica."""

    replica_id: str
    queue_len: int  # requests on it (ongoing or queued in its engine)
    capacity: int  # the most requests Ray gives it at once (max_ongoing_requests)
    waiting: int = 0  # requests waiting in Ray's queue for it
    batch_keys: Mapping[str, int] = field(default_factory=dict)  # in flight, by batch key
    adapters: frozenset[str] = frozenset()  # loaded there
    last_key_here: frozenset[str] = frozenset()  # batch keys last sent here
    local: bool = False  # on the router's own node

    @property
    def full(self) -> bool:
        return self.queue_len >= self.capacity

    @property
    def load(self) -> int:
        """Its queue: the requests on it and those waiting for it."""
        return self.queue_len + self.waiting


def _affinity(load: ReplicaLoad, key: RouteKey) -> tuple[bool, bool, int, bool]:
    """Higher is better: same batch key in flight, adapters loaded, how many of the key
    are in flight, key sent here last."""
    in_flight = load.batch_keys.get(key.batch, 0)
    return (in_flight > 0, set(key.adapters) <= load.adapters, in_flight,
            key.batch in load.last_key_here)


def _spread(key: RouteKey, replica_id: str) -> int:
    """A stable tie-break per (key, replica): equal replicas get different keys."""
    digest = hashlib.blake2b(f"{key.batch}|{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank_replicas(key: RouteKey | None, replicas: Sequence[ReplicaLoad],
                  wave_size: int) -> list[list[str]]:
    """Replica ids in ranks, best first: the policy of the module docstring.

    Ray Serve takes the first rank that has a replica with room (the shortest queue
    within a rank), and tries again later when none has. Replicas of equal load keep
    the order of `replicas`.
    """
    if not replicas:
        return []
    # (sorted() is stable: replicas of equal load keep the caller's order, a random one)
    by_load = sorted(replicas, key=lambda r: (r.load, not r.local))
    if key is None:
        return [[r.replica_id for r in by_load]]
    preferred = max(replicas, key=lambda r: (
        _affinity(r, key), -len(set(r.batch_keys) | r.last_key_here), -r.load, r.local,
        _spread(key, r.replica_id)))
    holders = [r for r in replicas if r.batch_keys.get(key.batch, 0) > 0]
    if preferred.batch_keys.get(key.batch, 0) >= wave_size and len(holders) > 1:
        preferred = min(holders, key=lambda r: (r.load, not r.local))
    least = by_load[0]
    longer_by = preferred.load + 1 - least.load  # + 1: this request
    if (least.load == 0 and longer_by > wave_size) or longer_by > preferred.capacity:
        # Spill: the least loaded replica (the preferred one last).
        return [[r.replica_id for r in by_load if r is not preferred], [preferred.replica_id]]
    return [[preferred.replica_id]]


class DiffbatchRequestRouter(LocalityMixin, RequestRouter):
    """Ray Serve request router by batch key and adapters; see the module docstring.

    `request_router_kwargs`: `wave_size`, the requests one replica's wave holds (the
    engine's `max_num_seqs`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wave_size = 1
        self._lock = threading.Lock()  # completions may come from another thread
        self._in_flight: dict[str, tuple[ReplicaID, str]] = {}  # request -> replica, key
        self._counts: dict[ReplicaID, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self._last_replica: collections.OrderedDict[str, ReplicaID] = collections.OrderedDict()
        self._keys: dict[str, RouteKey | None] = {}  # request -> its key, until routed
        self._freed: asyncio.Event | None = None
        # requests waiting in Ray's queue for a full preferred replica: id -> replica, when
        self._waiting: dict[str, tuple[ReplicaID, float]] = {}

    def initialize_state(self, wave_size: int = 1, **kwargs: Any) -> None:
        """Ray Serve passes `request_router_kwargs` here."""
        if kwargs:
            raise ValueError(f"unknown request_router_kwargs {sorted(kwargs)}; "
                             "DiffbatchRequestRouter takes wave_size")
        if isinstance(wave_size, bool) or not isinstance(wave_size, int) or wave_size < 1:
            raise ValueError(f"wave_size must be an integer >= 1, got {wave_size!r}")
        self.wave_size = wave_size

    @property
    def max_num_routing_tasks(self) -> int:
        """One routing task per request Ray may place, so a request waiting for its
        full replica does not hold back one for another replica (head-of-line)."""
        room = sum(r.max_ongoing_requests for r in self._replicas_list)
        return min(self.max_num_routing_tasks_cap, max(2 * len(self._replicas), room))

    # -- what the policy sees ----------------------------------------------------------
    def route_key(self, pending_request: PendingRequest | None) -> RouteKey | None:
        """The key the proxy put in the request's headers, or None."""
        if pending_request is None:
            return None
        request_id = pending_request.metadata.internal_request_id
        if request_id in self._keys:
            return self._keys[request_id]
        key = None
        arg = pending_request.args[0] if pending_request.args else None
        if isinstance(arg, bytes):  # the proxy's HTTP request, pickled (its scope)
            try:
                arg = pickle.loads(arg)
            except Exception:  # not the proxy's: no key
                arg = None
        scope = getattr(arg, "asgi_scope", None)
        if isinstance(scope, dict):
            key = route_key_of_headers(scope.get("headers"))
        if len(self._keys) >= MAX_REMEMBERED_KEYS:  # requests cancelled before routing
            self._keys.clear()
        self._keys[request_id] = key
        return key

    def replica_load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        reported = stats.get(STATS_KEYS) or {}
        with self._lock:
            local = self._counts.get(replica.replica_id, collections.Counter())
            keys = {k: max(n, int(reported.get(k, 0))) for k, n in local.items() if n > 0}
        for k, n in reported.items():
            keys.setdefault(k, int(n))
        queue_len = self._replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:  # not known yet: what this router has in flight there
            queue_len = sum(local.values())
        now = time.monotonic()
        waiting = sum(1 for r, since in self._waiting.values()
                      if r == replica.replica_id and now - since < WAITING_TTL_S)
        last = frozenset(k for k, r in self._last_replica.items() if r == replica.replica_id)
        return ReplicaLoad(
            replica_id=replica.replica_id.unique_id, queue_len=queue_len,
            capacity=replica.max_ongoing_requests, waiting=waiting, batch_keys=keys,
            adapters=frozenset(stats.get(STATS_ADAPTERS) or ()), last_key_here=last,
            local=self._self_node_id is not None and replica.node_id == self._self_node_id,
        )

    # -- Ray Serve's hooks -------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = self.route_key(pending_request)
        request_id = None if pending_request is None else \
            pending_request.metadata.internal_request_id
        if request_id is not None:
            self._waiting.pop(request_id, None)  # it is being chosen for again
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        # In random order: a request without a key goes to one of the least loaded at
        # random, as with Ray Serve's default router.
        loads = random.sample([self.replica_load(r) for r in candidate_replicas],
                              len(candidate_replicas))
        ranks = rank_replicas(key, loads, self.wave_size)
        waited = False
        if key is not None and len(ranks) == 1:
            preferred = by_id[ranks[0][0]]
            self._remember(key, preferred.replica_id)
            if next(load for load in loads if load.replica_id == ranks[0][0]).full:
                if request_id is not None:
                    self._hold(request_id, preferred.replica_id)
                await self._wait_for_room()  # then Ray asks again
                waited = True
        if pending_request is not None:  # Ray backs off unless this call waited
            pending_request.routing_context.should_backoff = not waited
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._waiting.pop(request_id, None)
        key = self._keys.pop(request_id, None)
        if key is None:
            return
        self._remember(key, replica_id)
        with self._lock:
            self._in_flight[request_id] = (replica_id, key.batch)
            self._counts[replica_id][key.batch] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._keys.pop(internal_request_id, None)
        self._waiting.pop(internal_request_id, None)
        with self._lock:
            routed = self._in_flight.pop(internal_request_id, None)
            if routed is not None:
                counts = self._counts[routed[0]]
                counts[routed[1]] -= 1
                if counts[routed[1]] <= 0:
                    del counts[routed[1]]
        freed = self._freed
        if freed is not None:
            loop = self._lazily_fetched_loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(freed.set)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_replicas({replica_id})

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        gone = {r for r in self._counts if r not in self._replica_id_set}
        gone |= {r for r in self._last_replica.values() if r not in self._replica_id_set}
        self._forget_replicas(gone)

    # -- helpers -----------------------------------------------------------------------
    def _remember(self, key: RouteKey, replica_id: ReplicaID) -> None:
        self._last_replica[key.batch] = replica_id
        self._last_replica.move_to_end(key.batch)
        while len(self._last_replica) > MAX_REMEMBERED_KEYS:
            self._last_replica.popitem(last=False)

    def _hold(self, request_id: str, replica_id: ReplicaID) -> None:
        """Count `request_id` as waiting for `replica_id` (for WAITING_TTL_S)."""
        now = time.monotonic()
        if len(self._waiting) >= MAX_REMEMBERED_KEYS:  # drop requests cancelled meanwhile
            self._waiting = {k: v for k, v in self._waiting.items()
                             if now - v[1] < WAITING_TTL_S}
        self._waiting[request_id] = (replica_id, now)

    def _forget_replicas(self, replica_ids: Iterable[ReplicaID]) -> None:
        gone = set(replica_ids)
        if not gone:
            return
        with self._lock:
            for replica_id in gone:
                self._counts.pop(replica_id, None)
            self._in_flight = {k: v for k, v in self._in_flight.items() if v[0] not in gone}
        for batch in [k for k, r in self._last_replica.items() if r in gone]:
            del self._last_replica[batch]
        self._waiting = {k: v for k, v in self._waiting.items() if v[0] not in gone}

    async def _wait_for_room(self) -> None:
        """Until a request completes anywhere, or `FULL_REPLICA_WAIT_S`."""
        if self._freed is None:
            self._freed = asyncio.Event()
        self._freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), FULL_REPLICA_WAIT_S)
