"""Fixtures of the Ray Serve tests: one local Ray cluster on loopback for these tests.

`ray_cluster` starts Ray once (`ray.init(num_cpus=2, include_dashboard=False)`) and
Serve's proxy on a free loopback port, and stops both after this package's tests (left
up, its controller and proxy keep polling and take CPU from every later test); each
test application is deployed on it under
its own route prefix and deleted afterwards. Teardown always runs `serve.shutdown()`
and `ray.shutdown()`. Replica logs stay in Ray's session folder
(/tmp/ray/session_*/logs/serve/), not in the test output.

`FileGatedPipeline` is the Ray twin of the in-process `GatedPipeline`: replicas are
other processes, so the gate is a folder. Each closing of the gate is a new
generation, a subfolder named in the file `current`: a real wave writes
`<generation>/entered-<replica id>-<n>`, then waits until `<generation>/release`
exists, so a test can act while a replica holds requests mid-wave (kill it,
disconnect a client). A wave still waiting on an earlier generation (it had not seen
that gate open before the next test closed a new one) is let through by the earlier
`release`, which stays.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from diffbatch.entrypoints.ray.proxy import serve_start_options
from diffbatch.pipelines.interface import DiffusionRequestBatch
from tests.fake_pipelines import FakeBatchPipeline
from tests.process_utils import wait_until as poll_until

RAY_NUM_CPUS = 2
GATE_WAIT_S = 60.0  # a forward never waits longer than this for `release`
_REPO_ROOT = str(Path(__file__).resolve().parents[3])


class FileGatedPipeline(FakeBatchPipeline):
    """Blocks each real wave until `<gate_dir>/release` exists; see the module doc.

    Loaded by name in replicas: `pipeline_kwargs={"gate_dir": ...}` names the folder.
    """

    _waves = itertools.count()

    def forward(self, batch: DiffusionRequestBatch) -> list[Any]:
        gate_dir = self.kwargs.get("gate_dir")
        current = Path(gate_dir, "current") if gate_dir else None
        if current is not None and current.exists() and batch.prompts != ["warm-up"]:
            from ray import serve

            generation = Path(gate_dir, current.read_text())
            replica_id = serve.get_replica_context().replica_tag
            marker = generation / f"entered-{replica_id}-{next(self._waves)}"
            marker.write_text(str(len(batch)))
            release = generation / "release"
            idle = threading.Event()
            deadline = time.monotonic() + GATE_WAIT_S
            while not release.exists() and time.monotonic() < deadline:
                idle.wait(0.01)  # the replica's stand-in for a long forward
        return super().forward(batch)


@dataclass
class RayCluster:
    """The session's Ray cluster: where Serve's proxy listens."""

    url: str  # http://127.0.0.1:<port>


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="package")
def ray_cluster(cache_dir: str) -> Iterator[RayCluster]:
    """A local Ray cluster and Serve proxy on loopback, shared by all Ray tests."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    # Replicas are Ray workers: they inherit this environment (offline hub, the
    # session's model cache) and need the repository on their path for test pipelines.
    python_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, python_path) if p)
    try:
        # "local": always a new cluster of our own, never one `ray start`ed here.
        ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
    finally:
        _restore_env("PYTHONPATH", python_path)  # the cluster's processes have it now
    try:
        port = _free_port()
        serve.start(**serve_start_options("127.0.0.1", port))
        yield RayCluster(url=f"http://127.0.0.1:{port}")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 60.0,
               what: str = "condition") -> None:
    """`tests.process_utils.wait_until` for state that changes in other processes
    (replicas, Serve's controller): a longer deadline, a slower poll."""
    poll_until(predicate, timeout_s=timeout_s, what=what, poll_s=0.05)
