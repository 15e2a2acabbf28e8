"""The HTTP client for engine pods: everything the router sends to them (forwarded requests,
scrapes, threshold pushes) and the simulator's contract tests go through one aiohttp session.

Why not httpx: its connection pool (httpcore 1.0) walks every pooled connection on each request
it starts and each response it closes, and for each idle connection walks them all again. With
many connections to one pod that turns into a spiral: the more connections sit idle, the more
each pass costs, and the router's CPU, not the engine, sets the pace. aiohttp's connector takes
an idle connection off a per-host queue; `lab/bench/client_pool.py` measures both side by side
(BENCHMARKS.md, "Router overhead").

`EngineHttp` owns one `aiohttp.ClientSession`, opened in the running loop on first use and
closed by `close()`; tests put a subclass in its place to inject failures.
"""

from __future__ import annotations

import aiohttp

RETRYABLE: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError)
"""What a failing pod raises: refused or dropped connections, a body cut short, silence past
the read timeout (aiohttp's ServerTimeoutError is a TimeoutError too)."""

UNREACHABLE: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)
"""A connection that could not be opened at all (refused, no route): the pod is not there."""

IDLE_SECONDS = 4.0
"""How long an idle connection is kept for reuse: under SGLang's own 5 s keep-alive
(SGLANG_TIMEOUT_KEEP_ALIVE), so the router does not send on a connection the engine is closing
(aiohttp's default is 15 s)."""


class EngineHttp:
    def __init__(self, connect_timeout: float = 2.0, read_timeout: float = 120.0) -> None:
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_read=read_timeout
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No cap on connections: the router's placement decides each pod's load.
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=IDLE_SECONDS
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> aiohttp.ClientResponse:
        """Send; return once the status line and headers have arrived (the body is the
        caller's to read, and `release()` hands the connection back). `timeout` bounds the
        whole exchange instead of the session's connect and read timeouts."""
        return await self.session.request(
            method,
            url,
            data=body,
            headers=headers,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout) if timeout is not None else self.timeout,
        )

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        return await self.request("POST", url, body=body, headers=headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
