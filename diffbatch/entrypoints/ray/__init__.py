"""Ray Serve integration: many replicas, each with its own engine, behind one API.

`deployment.py` holds the Ray Serve deployment (imports Ray); the public entry
points (`build_app`, `add_ray_args`, `run_ray_server`) live in
`diffbatch.entrypoints.ray_serve`, which imports Ray only when called.
"""

from __future__ import annotations

# The response header that names the replica that served a request.
REPLICA_HEADER = "x-diffbatch-replica"
