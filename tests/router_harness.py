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

from specgate.engine_http import EngineHttp
from specgate_router.app import create_app
from specgate_router.http_limits import BoundedHttpToolsProtocol
from specgate_router.settings import RouterSettings
from specgate_router.state import RouterState
from specgate_sim.cluster import free_ports


class RouterServer:
    def __init__(
        self, server: uvicorn.Server, port: int, app: Any, host: str = "127.0.0.1"
    ) -> None:
        self.server, self.port, self.app = server, port, app
        self.url = f"http://{host}:{port}"

    @property
    def state(self) -> RouterState:
        state: RouterState = self.app.state.router
        return state


@asynccontextmanager
async def serving(config: uvicorn.Config) -> AsyncIterator[uvicorn.Server]:
    """A uvicorn server in the test's event loop: started (or its start-up error raised),
    and stopped after the block."""
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def run_router(
    settings: dict[str, Any] | RouterSettings,
    *,
    engine_http: EngineHttp | None = None,
    config_path: str | None = None,
    ready: bool = True,
    port: int | None = None,
    host: str = "127.0.0.1",
) -> AsyncIterator[RouterServer]:
    if isinstance(settings, dict):
        settings = RouterSettings.model_validate(settings)
    app = create_app(settings, engine_http=engine_http, config_path=config_path, identity="test")
    port = port or free_ports(1, host)[0]
    limits = settings.resilience
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=30,
        # As `specgate router` serves (main.run).
        http=BoundedHttpToolsProtocol.with_limits(limits.max_header_bytes, limits.max_headers),
    )
    async with serving(config) as server:
        handle = RouterServer(server, port, app, host)
        if ready:
            async with httpx.AsyncClient() as client:
                for _ in range(200):
                    if (await client.get(handle.url + "/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
        yield handle


class FaultyEngineHttp(EngineHttp):
    """Real HTTP to the engine pods, except requests for which `fail(method, url)` holds, which
    raise `error` (a dropped connection by default; TimeoutError for a pod that is silent)."""

    def __init__(
        self,
        fail: Callable[[str, str], bool],
        error: type[Exception] = aiohttp.ClientConnectionError,
    ) -> None:
        super().__init__()
        self.fail, self.error = fail, error

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> aiohttp.ClientResponse:
        if self.fail(method, url):
            raise self.error("injected failure")
        return await super().request(method, url, body=body, headers=headers, timeout=timeout)


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
