"""Ray Serve integration: many replicas, each with its own engine, behind one API.

- `server.py`: the public entry points (`build_app`, `add_ray_args`,
  `run_ray_server`); it imports Ray only when called, so the CLI imports it on a
  plain install (without the `[ray]` extra);
- `args.py`: `RayServeArgs`, the application's arguments, validated in one place;
- `deployment.py`: the Ray Serve deployment, one engine per replica (imports Ray);
- `proxy.py`: the Serve proxy's middleware (a clear error when a replica fails
  mid-request) and its start options.
"""

from __future__ import annotations

# The response header that names the replica that served a request.
REPLICA_HEADER = "x-diffbatch-replica"
