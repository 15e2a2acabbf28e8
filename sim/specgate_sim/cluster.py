"""Many simulated pods in one process, each an HTTP server on its own loopback port."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import uvicorn

from specgate_router.http_limits import BoundedHttpToolsProtocol
from specgate_router.settings import ResilienceSettings
from specgate_sim.pod import PodSettings, SharedGpu, SimPod
from specgate_sim.profile import Profile
from specgate_sim.server import create_app


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bounded_http() -> type[BoundedHttpToolsProtocol]:
    """The router's header bounds, for a simulated pod too."""
    limits = ResilienceSettings()
    return BoundedHttpToolsProtocol.with_limits(limits.max_header_bytes, limits.max_headers)


class SimCluster:
    """`count` pods on consecutive ports from `base_port` (or free ports when it is 0), each
    on a GPU of its own or, with `gpus`, sharing that many (`SharedGpu`; pod i on GPU i mod
    `gpus`).

    Owns one uvicorn server task per pod; `stop()` ends them all, `kill(i)` ends one abruptly
    (its engine stops and its port closes, as when a pod dies).
    """

    def __init__(
        self,
        profile: Profile,
        count: int,
        *,
        base_port: int = 0,
        host: str = "127.0.0.1",
        settings: PodSettings | None = None,
        thresholds: list[int | None] | None = None,
        gpus: int | None = None,
    ) -> None:
        template = settings or PodSettings()
        ports = (
            free_ports(count, host) if base_port == 0 else list(range(base_port, base_port + count))
        )
        self.host = host
        self.pods: list[SimPod] = []
        self.servers: list[uvicorn.Server] = []
        self.ports = ports
        shared = [SharedGpu() for _ in range(gpus or 0)]
        for i, port in enumerate(ports):
            pod_settings = dataclasses.replace(
                template,
                name=f"{template.name.rsplit('-', 1)[0]}-{i}",
                seed=None if template.seed is None else template.seed + i,
                threshold=thresholds[i] if thresholds else template.threshold,
            )
            pod = SimPod(profile, pod_settings, shared[i % len(shared)] if shared else None)
            config = uvicorn.Config(
                create_app(pod),
                host=host,
                port=port,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=5,
                http=_bounded_http(),
            )
            self.pods.append(pod)
            self.servers.append(uvicorn.Server(config))
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    async def start(self) -> None:
        for server in self.servers:
            self._tasks.append(asyncio.create_task(server.serve()))
        while not all(s.started for s in self.servers):
            if any(t.done() for t in self._tasks):
                failed = next(t for t in self._tasks if t.done())
                failed.result()  # raises the start-up error (e.g. port in use)
                raise RuntimeError("a simulated pod stopped during start-up")
            await asyncio.sleep(0.01)

    async def kill(self, index: int) -> None:
        server = self.servers[index]
        server.force_exit = True
        server.should_exit = True
        await asyncio.gather(self._tasks[index], return_exceptions=True)

    async def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
