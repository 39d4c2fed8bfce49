"""The wave log: a bounded ring of the waves the engine ran, read by `GET /v1/waves`."""

from __future__ import annotations

import httpx
import pytest

from diffbatch import Engine, SamplingParams
from diffbatch.engine.wave_log import WaveLog
from diffbatch.entrypoints.openai.api_server import build_app
from tests.fake_pipelines import FakeBatchPipeline


def record(log: WaveLog, size: int, **changes) -> None:
    fields = dict(wave_id=1, num_requests=size, key="16x16/s2/g5/n1", close_reason="capacity",
                  admission="", max_queue_wait_ms=1.23456, forward_ms=7.0)
    log.record(**{**fields, **changes})


def test_ids_increase_and_a_poller_sees_each_wave_once() -> None:
    log = WaveLog(capacity=8)
    assert (log.last_id, log.since(0)) == (0, [])
    for size in (1, 2, 3):
        record(log, size)
    first = log.since(0)
    assert [(e.id, e.num_requests) for e in first] == [(1, 1), (2, 2), (3, 3)]
    assert first[0].admission == "none" and first[0].max_queue_wait_ms == 1.235
    record(log, 4)
    assert [e.id for e in log.since(log.since(0)[-2].id)] == [4]
    assert [e.id for e in log.since(0, limit=2)] == [3, 4]


def test_the_ring_keeps_only_the_newest() -> None:
    log = WaveLog(capacity=3)
    for size in range(1, 6):
        record(log, size)
    assert [e.id for e in log.since(0)] == [3, 4, 5]  # a poller can tell 1 and 2 are gone
    assert log.last_id == 5
    with pytest.raises(ValueError, match="capacity"):
        WaveLog(capacity=0)


async def test_the_engine_logs_each_wave_and_the_server_serves_them() -> None:
    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=0) as engine:
        assert engine.wave_log.last_id == 0  # start-up's warm-up wave is not served
        outs = engine.generate(["a", "b", "c", "poison"], SamplingParams(seed=1))
        events = engine.wave_log.since(0)
        assert sum(e.num_requests for e in events) == 4
        assert {e.key for e in events} == {"16x16/s2/g5/n1"}
        assert sum(e.num_errors for e in events) == sum(o.error is not None for o in outs) > 0
        app = build_app(engine, served_model_name="fake", api_key="k",
                        close_engine_on_shutdown=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://app") as client:
            assert (await client.get("/v1/waves")).status_code == 401
            key = {"Authorization": "Bearer k"}
            body = (await client.get("/v1/waves", headers=key)).json()
            assert body["object"] == "list" and body["last_id"] == events[-1].id
            assert [w["id"] for w in body["data"]] == [e.id for e in events]
            later = await client.get(f"/v1/waves?after={body['last_id']}", headers=key)
            assert later.json()["data"] == []
            bad = await client.get("/v1/waves?after=-1", headers=key)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def test_an_aborted_request_counts_as_aborted_not_as_a_failure(gate) -> None:
    from tests.engine.test_engine import gated_engine, submit

    with gated_engine(max_num_seqs=2) as engine:
        first = submit(engine, "first", "a")
        assert gate.entered.wait(30)
        engine.abort("a")  # its caller went away while the wave ran
        assert first.result(30).aborted
        gate.release.set()
        assert engine.generate(["poison"])[0].error is not None
        events = engine.wave_log.since(0)
    assert [(e.num_requests, e.num_errors, e.num_aborted) for e in events] == [(1, 0, 1),
                                                                              (1, 1, 0)]
