"""With `--api-key`, every route under /v1 refuses a missing or wrong key.

The routes are read from the app's own route table, so a route added later is
covered without a new test; a route that is served without the key must be named
in `OPEN_V1_ROUTES` here (and routes outside /v1 in `OPEN_OTHER_ROUTES`), so a new
exception is a decision someone writes down, never an accident.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.routing import Mount, Route

from diffbatch import Engine
from diffbatch.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.conftest import asgi_client

API_KEY = "route-key"
# /v1 routes served without the key: image links, whose unguessable id is the
# credential (capability URLs, docs/serving.md).
OPEN_V1_ROUTES = {"/v1/images/files/{file_id}"}
# Routes outside /v1, all open: health checks, metrics scrapes, the docs and the
# playground (which asks for the key itself and sends it on its /v1 calls).
OPEN_OTHER_ROUTES = {"/", "/health", "/metrics", "/openapi.json", "/docs", "/redoc",
                     "/docs/oauth2-redirect", "/docs/assets", "/playground"}
KEYS = {"missing": {}, "wrong": {"Authorization": "Bearer not-the-key"},
        "not bearer": {"Authorization": f"Basic {API_KEY}"}}


@pytest.fixture(scope="module")
def app(engine: Engine):
    return build_app(engine, served_model_name="fake", api_key=API_KEY,
                     close_engine_on_shutdown=False)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app) as client:
        yield client


def app_routes(app) -> list[tuple[str, str]]:
    """(method, path template) of every route and mount of the app, those of included
    routers too."""
    return _routes(app.routes, "")


def _routes(table, prefix: str) -> list[tuple[str, str]]:
    routes = []
    for route in table:
        included = getattr(route, "original_router", None)  # FastAPI's included router
        if included is not None:
            routes += _routes(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Route):
            routes += [(method, prefix + route.path) for method in sorted(route.methods or {"GET"})
                       if method != "HEAD"]
        elif isinstance(route, Mount):
            routes.append(("GET", prefix + route.path))
        else:  # a websocket route or another kind: give it a decision of its own
            raise AssertionError(f"route {route!r} is of a kind this test does not know")
    return routes


def concrete(path: str) -> str:
    """A path template with each `{param}` filled."""
    return re.sub(r"\{[^}]+\}", "x", path)


def v1_routes(app) -> list[tuple[str, str]]:
    return [(m, p) for m, p in app_routes(app) if p.startswith("/v1")]


async def test_every_v1_route_refuses_a_missing_or_wrong_key(app, client) -> None:
    routes = [(m, p) for m, p in v1_routes(app) if p not in OPEN_V1_ROUTES]
    paths = {p for _, p in routes}
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/models", "/v1/waves",
            "/v1/models/{model:path}"} <= paths, paths
    for method, path in routes:
        for name, headers in KEYS.items():
            response = await client.request(method, concrete(path), headers=headers)
            assert response.status_code == 401, (
                f"{method} {path} with a {name} key answered {response.status_code}, not "
                f"401: protect it, or name it in OPEN_V1_ROUTES with the reason")
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["param"] is None
        right = await client.request(method, concrete(path),
                                     headers={"Authorization": f"Bearer {API_KEY}"})
        assert right.status_code != 401, f"{method} {path} refuses the right key"


async def test_only_the_named_routes_are_served_without_the_key(app, client) -> None:
    """Image links (capability URLs) answer without the key; each such exception, and
    each route outside /v1, is named here."""
    v1 = {p for _, p in v1_routes(app)}
    assert v1 >= OPEN_V1_ROUTES, "an exception names a route the app no longer has"
    for path in OPEN_V1_ROUTES:
        response = await client.get(concrete(path))  # no key: an unknown link is a 404
        assert response.status_code == 404, response.text
    other = {p for _, p in app_routes(app) if not p.startswith("/v1")}
    assert other <= OPEN_OTHER_ROUTES, (
        f"routes {sorted(other - OPEN_OTHER_ROUTES)} are outside /v1, where no key is "
        "asked: move them under /v1, or name them in OPEN_OTHER_ROUTES with the reason")
