"""The operator's own Prometheus metrics: how many reconciles ran and how they ended, and how
long they took. One registry an operator process (no global state); served on
--metrics-port by every replica, leader and standby alike."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "specgate_operator_reconciles",
            "Reconciles of SpecDecodeDeployments by outcome: ok, retry (a temporary error, kopf "
            "tries again), failed (a permanent error until the resource changes), error (a bug).",
            ["outcome"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "specgate_operator_reconcile_seconds",
            "How long a reconcile took, children applied and status written.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.leader = Gauge(
            "specgate_operator_leader",
            "1 in the replica that holds the operator's Lease and reconciles, 0 in a standby.",
            registry=self.registry,
        )
        self._server: Any = None

    async def timed(self, run: Callable[[], Awaitable[None]]) -> None:
        """Run one reconcile, counting its outcome and time (its exception passes through)."""
        started, outcome = time.perf_counter(), "error"
        try:
            await run()
            outcome = "ok"
        except kopf.TemporaryError:
            outcome = "retry"
            raise
        except kopf.PermanentError:
            outcome = "failed"
            raise
        finally:
            self.reconciles.labels(outcome).inc()
            self.seconds.observe(time.perf_counter() - started)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port and self._server is None:
            self._server, _ = start_http_server(port, host, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
