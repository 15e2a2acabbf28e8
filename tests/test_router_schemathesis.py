"""Property-based API testing of the router with schemathesis: whatever the schema allows a
client to send, the router answers without a 5xx.

The router and two simulated pods (time scale 500, so long generations finish quickly) run in
a background thread's event loop for the whole module; schemathesis calls them over HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import schemathesis

from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster
from specgate_sim.pod import PodSettings

from .router_harness import run_router

pytestmark = pytest.mark.integration


CLIENT_KEY, ADMIN_KEY = "sg-schemathesis-client", "sg-schemathesis-admin"


def _client_auth() -> dict[str, Any]:
    from specgate_router.client_auth import hash_key

    return {
        "keys": [
            # A key that may send only throughput traffic: the class header meets refusals too.
            {"name": "client", "sha256": hash_key(CLIENT_KEY), "classes": ["throughput"]},
            {"name": "admin", "sha256": hash_key(ADMIN_KEY), "admin": True},
        ]
    }


@pytest.fixture(scope="module", params=[False, True], ids=["open", "client-keys"])
def live_router(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    with_keys: bool = request.param
    started: dict[str, Any] = {}
    ready = threading.Event()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        settings = PodSettings(api_key="k", time_scale=500.0, model="m", seed=1)
        async with SimCluster(profiles.load("rtx-pro-6000-x8"), 2, settings=settings) as pods:
            config: dict[str, Any] = {"model": "m", "backends": pods.urls, "engineApiKey": "k"}
            if with_keys:
                config["clientAuth"] = _client_auth()
            async with run_router(config) as router:
                started["url"] = router.url
                started["loop"] = asyncio.get_running_loop()
                ready.set()
                await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(30), "router did not start"
    yield str(started["url"]), with_keys
    started["loop"].call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
    thread.join(30)


def test_router_never_answers_5xx(live_router: tuple[str, bool]) -> None:
    """Without client keys, and with them (every call carries a key limited to throughput
    traffic; the schema is read with an admin key)."""
    url, with_keys = live_router
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"} if with_keys else {}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"} if with_keys else {}
    # schemathesis' pytest plugin does not run under pytest 9 (it reads Function._nodeid), so
    # its per-operation strategies are driven with hypothesis directly.
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=admin)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/generate",
        "/v1/models",
        "/readyz",
    }
    seen: list[int] = []
    for operation in operations:

        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: Any) -> None:
            response = case.call(base_url=url, headers=headers, timeout=60)
            seen.append(response.status_code)
            assert response.status_code < 500, (
                case.method,
                case.path,
                case.body,
                response.status_code,
                response.text[:300],
            )

        check()
    # The generator reached the engines (2xx) and the validation (4xx) both.
    assert any(200 <= code < 300 for code in seen) and any(400 <= code < 500 for code in seen)
