"""Benchmark tools shipped with diffbatch: `diffbatch bench serve`, a load generator.

`diffbatch.bench.serve` drives any server that speaks diffbatch's
`POST /v1/images/generations` (diffbatch itself, or the peer servers under
`benchmarks/peers_servers/`) with a Poisson or bursty load, and reports throughput,
end-to-end latency and, when the target exposes diffbatch's Prometheus metrics,
the mean wave size and the queue wait. The scripts under `benchmarks/` build on it.
"""

from __future__ import annotations
