"""Running routers and simulated pods in the test's event loop, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import uvicorn

from specgate_router.app import create_app
from specgate_router.settings import ResilienceSettings, RouterSettings
from specgate_router.state import RouterState
from specgate_router.upstream import Upstream
from specgate_sim.cluster import free_ports


class RouterServer:
    def __init__(self, server: uvicorn.Server, port: int, app: Any) -> None:
        self.server, self.port, self.app = server, port, app
        self.url = f"http://127.0.0.1:{port}"

    @property
    def state(self) -> RouterState:
        state: RouterState = self.app.state.router
        return state


@asynccontextmanager
async def run_router(
    settings: dict[str, Any] | RouterSettings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    upstream: Upstream | None = None,
    config_path: str | None = None,
    ready: bool = True,
    port: int | None = None,
) -> AsyncIterator[RouterServer]:
    if isinstance(settings, dict):
        settings = RouterSettings.model_validate(settings)
    app = create_app(settings, transport=transport, upstream=upstream, config_path=config_path,
                     identity="test")  # fmt: skip
    port = port or free_ports(1)[0]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=30)  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    handle = RouterServer(server, port, app)
    if ready:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                if (await client.get(handle.url + "/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
    try:
        yield handle
    finally:
        server.should_exit = True
        await task


class FaultyUpstream(Upstream):
    """The router's forwarded requests over real HTTP, except those to a URL matching `fail`,
    which raise `error` (a refused connection by default)."""

    def __init__(
        self,
        fail: Callable[[str], bool],
        error: type[aiohttp.ClientError] = aiohttp.ClientConnectionError,
    ) -> None:
        super().__init__(ResilienceSettings())
        self.fail, self.error = fail, error

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        if self.fail(url):
            raise self.error("injected failure")
        return await super().post(url, body, headers)


class FaultyTransport(httpx.AsyncBaseTransport):
    """The router's scrapes and pushes over real HTTP, except requests matching `fail`, which
    raise `error` (a refused connection by default)."""

    def __init__(
        self,
        fail: Callable[[httpx.Request], bool],
        error: type[httpx.TransportError] = httpx.ConnectError,
    ) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.fail, self.error = fail, error

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.fail(request):
            raise self.error("injected failure", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def stream_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, list[tuple[float, str]]]:
    """(status, [(arrival time, data payload)]) of an SSE answer."""
    loop = asyncio.get_running_loop()
    events: list[tuple[float, str]] = []
    async with client.stream("POST", url, json=body, headers=headers or {}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, [(loop.time(), resp.text)]
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append((loop.time(), line[6:]))
    return 200, events


def is_error_event(payload: str) -> bool:
    if payload == "[DONE]":
        return False
    return "error" in json.loads(payload)
