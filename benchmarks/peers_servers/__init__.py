"""Peer servers and the harness the benchmark scripts share.

Each peer serves the same diffusers pipeline (`pipeline.py`) with diffbatch's
request and response shape (`POST /v1/images/generations`, `b64_json` PNGs, a
`/health` route), so one client, `diffbatch bench serve`, drives them all:

- `fastapi_serial.py`: plain FastAPI + diffusers, one request at a time;
- `ray_serve_batch.py`: Ray Serve with `@serve.batch`;
- `litserve_batch.py`: LitServe with `max_batch_size` and `batch_timeout`.

`plain_loop.py` is no server: it times the plain diffusers loop a user would write
(one process, torch's defaults), for `defaults.py`.

`harness.py` starts diffbatch and these servers on free loopback ports, waits for
them to be healthy and always tears them down. Run a peer on its own with e.g.
`PYTHONPATH=benchmarks .venv/bin/python -m peers_servers.fastapi_serial --port 8001`.
"""

from __future__ import annotations
