"""The operator process's liveness endpoint, served whatever its role: a standby replica is
alive while it waits for the Lease, and the kubelet must not restart it for waiting."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 8192
READ_SECONDS = 5.0


def parse_endpoint(url: str) -> tuple[str, int, str]:
    """`http://HOST:PORT/PATH` -> (host, port, path); ValueError naming the flag otherwise."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"--liveness: expected http://HOST:PORT/PATH, got {url!r}")
    return parts.hostname, port, parts.path or "/"


async def serve(url: str, state: Callable[[], tuple[bool, dict[str, str]]]) -> asyncio.Server:
    """Answer GET on the endpoint's path with 200 (503 when `state` says not alive) and the
    state as JSON; 404 elsewhere. Each connection gets one answer, bounded in size and time."""
    host, port, path = parse_endpoint(url)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), READ_SECONDS)
            parts = head[:MAX_HEAD_BYTES].split()
            target = parts[1].decode(errors="replace").split("?")[0] if len(parts) > 1 else ""
            alive, body = state()
            status = ("200 OK" if alive else "503 Service Unavailable") if target == path else (
                "404 Not Found")  # fmt: skip
            data = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await asyncio.wait_for(writer.drain(), READ_SECONDS)
        writer.close()

    return await asyncio.start_server(answer, host, port, limit=MAX_HEAD_BYTES)
