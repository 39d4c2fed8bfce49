"""Connection-level behaviour over a real uvicorn server: timeouts, limits, keep-alive.

The server is configured as `diffbatch serve` configures it (`uvicorn_config`), with
short timeouts so that a test waits little; each wait on the socket is bounded by
`SOCKET_TIMEOUT_S`, which only ends a broken test (a server that never answers).
The limits are checked over both of uvicorn's HTTP implementations.
"""

from __future__ import annotations

import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tests.entrypoints.openai.conftest import gated_server
from tests.process_utils import wait_until

pytestmark = pytest.mark.slow

ROUTE = "/v1/images/generations"
SOCKET_TIMEOUT_S = 30.0
HEADER_TIMEOUT_S = 1.0  # the requests served in time share the GIL with the server


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(SOCKET_TIMEOUT_S)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def http_base(request: pytest.FixtureRequest) -> type:
    return request.param


def test_slow_request_headers_get_408_and_the_connection_is_closed(http_base: type) -> None:
    config = {"header_timeout_s": HEADER_TIMEOUT_S, "http_base": http_base}
    with gated_server(config=config) as (server, gate):
        gate.release.set()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty".encode())
            answer = read_until_closed(sock)  # a slow client would send the rest later
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout")
        assert set(error) == {"message", "type", "param", "code"}
        # A connection that never sends a request is closed without an answer.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            assert read_until_closed(sock) == b""
        # One whose headers arrive in time is served as usual.
        response = httpx.post(f"{server.url}{ROUTE}", json={"prompt": "p"}, timeout=60)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("garbage", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon in this header\r\n\r\n",
    b"GET /he alth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
], ids=["request-line", "header", "space-in-target"])
def test_malformed_http_gets_400_in_the_openai_shape_and_the_server_goes_on(
    http_base: type, garbage: bytes
) -> None:
    with gated_server(config={"http_base": http_base}) as (server, gate):
        gate.release.set()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(garbage)
            answer = read_until_closed(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), answer
        assert b"content-type: application/json" in head.lower()
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("invalid_request_error",
                                                  "invalid_http_request")
        response = httpx.post(f"{server.url}{ROUTE}", json={"prompt": "p"}, timeout=60)
        assert response.status_code == 200, response.text


def test_the_header_timeout_starts_again_for_each_request_on_a_keep_alive_connection(
    http_base: type,
) -> None:
    config = {"header_timeout_s": HEADER_TIMEOUT_S, "http_base": http_base}
    with gated_server(config=config) as (server, gate):
        gate.release.set()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=SOCKET_TIMEOUT_S)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            sock = conn.sock
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            answer = read_until_closed(sock)
        finally:
            conn.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer


@pytest.mark.parametrize("route", [ROUTE, "/v1/images/edits"])
def test_a_body_that_stops_arriving_gets_408_and_the_connection_is_closed(
    http_base: type, route: str,
) -> None:
    config = {"http_base": http_base}
    with gated_server(config=config, body_timeout_s=HEADER_TIMEOUT_S) as (server, gate):
        gate.release.set()
        content_type = "application/json" if route == ROUTE else \
            "multipart/form-data; boundary=b"
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}"
                         "\r\nContent-Length: 50\r\n\r\n{\"prompt\": \"a".encode())
            answer = read_until_closed(sock)  # the other 36 bytes never come
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout")
        assert set(error) == {"message", "type", "param", "code"}
        assert server.engine.num_unfinished == 0
        # a body that arrives in time is served as usual
        response = httpx.post(f"{server.url}{ROUTE}", json={"prompt": "p"}, timeout=60)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/"])
def test_head_answers_as_get_without_the_body(http_base: type, path: str) -> None:
    with gated_server(config={"http_base": http_base}) as (server, gate):
        gate.release.set()
        got = httpx.get(f"{server.url}{path}", timeout=60)
        head = httpx.head(f"{server.url}{path}", timeout=60)
    assert (got.status_code, head.status_code) == (200, 200)
    assert got.content and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the metrics change between the two requests
        assert head.headers["content-length"] == got.headers["content-length"]


def test_a_keep_alive_connection_survives_a_refused_lora(tmp_path) -> None:
    with gated_server(lora_dir=str(tmp_path)) as (server, gate):
        gate.release.set()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=SOCKET_TIMEOUT_S)
        try:
            headers = {"Content-Type": "application/json"}
            conn.request("POST", ROUTE, json.dumps({"prompt": "p", "lora": "a\x00b"}), headers)
            refused = conn.getresponse()
            error = json.loads(refused.read())["error"]
            sock = conn.sock
            conn.request("POST", ROUTE, json.dumps({"prompt": "p"}), headers)
            served = conn.getresponse()
            served.read()
            assert conn.sock is sock  # the same connection carried both requests
        finally:
            conn.close()
        assert (refused.status, error["param"]) == (400, "lora")
        assert str(tmp_path) not in error["message"]
        assert served.status == 200


def test_over_the_connection_limit_a_request_gets_503_in_the_openai_shape(
    http_base: type,
) -> None:
    config = {"limit_concurrency": 2, "http_base": http_base}
    with gated_server(config=config) as (server, gate), \
            ThreadPoolExecutor(max_workers=2) as pool:
        try:
            held = [pool.submit(httpx.post, f"{server.url}{ROUTE}", json={"prompt": f"p{i}"},
                                timeout=120) for i in range(2)]
            wait_until(lambda: server.engine.num_running + server.engine.num_waiting == 2,
                       what="two requests in progress")
            response = httpx.get(f"{server.url}/v1/models", timeout=60)
        finally:
            gate.release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.headers["connection"] == "close"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_overloaded", "server_busy")


def raw_post(sock: socket.socket, body: bytes, route: str = ROUTE,
             content_type: str = "application/json") -> None:
    sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """One answer's status and body (the server closes or the body is complete)."""
    sock.settimeout(SOCKET_TIMEOUT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def test_a_burst_over_the_connection_limit_refuses_only_the_connections_over_it(
    http_base: type,
) -> None:
    """Three connections open at once against a limit of 2: the two oldest are served,
    whatever order their requests come in; the youngest gets the 503."""
    config = {"limit_concurrency": 2, "http_base": http_base}
    with gated_server(config=config, max_num_seqs=2) as (server, gate):
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        try:
            for i in (1, 0):  # the two oldest ask while the third is open too
                raw_post(socks[i], json.dumps({"prompt": f"p{i}"}).encode())
            wait_until(lambda: server.engine.num_running + server.engine.num_waiting == 2,
                       what="the two oldest connections' requests in progress")
            raw_post(socks[2], json.dumps({"prompt": "p2"}).encode())
            status, body = read_answer(socks[2])
            assert status == 503, body
            assert json.loads(body)["error"]["code"] == "server_busy"
            gate.release.set()
            assert [read_answer(socks[i])[0] for i in (0, 1)] == [200, 200]
        finally:
            for sock in socks:
                sock.close()
        registry = server.app.state.http_metrics.registry
        assert registry.get_sample_value(
            "diffbatch_http_requests_total", {"route": ROUTE, "method": "POST", "status": "503"},
        ) == 1
        assert server.engine.metrics.count("rejected") == 1


def test_an_upload_over_the_connection_limit_gets_its_503_and_may_finish_sending() -> None:
    """The 503 comes at once, and the server reads the rest of the refused upload before
    it closes: a close with the upload unread would reset the connection, and a client
    still sending (as `httpx` does before it reads) would get no answer."""
    declared, first = 8 << 20, 64 << 10
    with gated_server(config={"limit_concurrency": 1}) as (server, gate), \
            socket.create_connection(("127.0.0.1", server.port)) as held, \
            socket.create_connection(("127.0.0.1", server.port)) as upload:
        raw_post(held, json.dumps({"prompt": "p"}).encode())
        wait_until(lambda: server.engine.num_running == 1, what="the request in progress")
        upload.sendall(f"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       f"multipart/form-data; boundary=b\r\nContent-Length: {declared}\r\n"
                       "\r\n".encode() + b"\0" * first)
        status, body = read_answer(upload)
        assert status == 503 and json.loads(body)["error"]["code"] == "server_busy"
        upload.sendall(b"\0" * (declared - first))  # a reset connection raises here
        assert upload.recv(1) == b""  # then a clean close
        gate.release.set()
        assert read_answer(held)[0] == 200


def test_a_client_gone_mid_upload_counts_as_a_disconnect() -> None:
    with gated_server() as (server, gate):
        gate.release.set()
        registry = server.app.state.http_metrics.registry

        def disconnects() -> float:
            return registry.get_sample_value("diffbatch_http_client_disconnects_total") or 0.0

        rejected, before = server.engine.metrics.count("rejected"), disconnects()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         "\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"a".encode())
        wait_until(lambda: disconnects() == before + 1, what="the disconnect to be counted")
        assert server.engine.metrics.count("rejected") == rejected
        assert registry.get_sample_value(
            "diffbatch_http_requests_total",
            {"route": ROUTE, "method": "POST", "status": "400"},
        ) is None


def test_a_slow_upload_does_not_hold_other_requests_waves() -> None:
    """A client still sending its body holds nobody's wave: the next request's wave
    closes as stable, not after the whole 2 s wait."""
    from diffbatch import Engine
    from diffbatch.entrypoints.openai.api_server import build_app
    from tests.entrypoints.openai.conftest import serve_in_thread
    from tests.fake_pipelines import FakeBatchPipeline

    with Engine(pipeline_class=FakeBatchPipeline, executor="inproc", max_num_seqs=4,
                request_batch_max_wait_ms=2000, warmup=False) as engine:
        app = build_app(engine, served_model_name="fake")
        with serve_in_thread(app) as url, socket.create_connection(
            ("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=SOCKET_TIMEOUT_S,
        ) as slow:
            slow.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         "\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"a".encode())
            response = httpx.post(f"{url}{ROUTE}", json={"prompt": "quick"}, timeout=60)
            assert response.status_code == 200, response.text
            registry = engine.metrics.registry
            by_admission = {
                sample.labels["admission"]: sample.value
                for metric in registry.collect() if metric.name == "diffbatch_waves"
                for sample in metric.samples if sample.name == "diffbatch_waves_total"
            }
            assert by_admission == {"stable": 1.0}
