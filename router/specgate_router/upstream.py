"""The data plane's client: the requests the router forwards to engine pods go through aiohttp.

Why not httpx, which the control plane keeps for its scrapes and threshold pushes: httpx's
connection pool (httpcore 1.0) walks every pooled connection on each request it starts and each
response it closes, and for each idle connection walks them all again. At c = 128 on one H200
that became a spiral: when a hiccup left many of one pod's 128 connections idle, each pass cost
more, the router's thread ran at 100% CPU holding 120 requests while its engine ran a batch of
8, which left more connections idle (BENCHMARKS.md job 37). aiohttp's connector takes an idle
connection off a per-host queue. `bench/client_pool.py` measures both side by side.

`Upstream` owns one `aiohttp.ClientSession`, opened in the running loop by `start()` and closed
by `close()`; tests put a subclass in its place to inject failures.
"""

from __future__ import annotations

import aiohttp

from specgate_router.settings import ResilienceSettings

RETRYABLE: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError)
"""What a failing pod raises: refused or dropped connections, a body cut short, silence past
the read timeout (aiohttp's ServerTimeoutError is a TimeoutError too)."""


class Upstream:
    def __init__(self, resilience: ResilienceSettings) -> None:
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            connect=resilience.connect_timeout_seconds,
            sock_read=resilience.read_timeout_seconds,
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No cap on connections (the router's placement decides load), none on DNS caching
        # either: pod URLs are addresses, and a restarted pod keeps its Service name.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send; return once the status line and headers have arrived (the body is the
        caller's to read, and `release()` hands the connection back)."""
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return await self._session.post(url, data=body, headers=headers, allow_redirects=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
