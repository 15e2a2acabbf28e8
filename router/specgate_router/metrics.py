"""The router's Prometheus metrics, in a registry owned by one app (no global registry)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from specgate import contract
from specgate_router.pods import PodState
from specgate_router.settings import RouterSettings

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


POD_GAUGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "batch": ("specgate_pod_batch", "Running requests.", ()),
    "queue": ("specgate_pod_queue", "Queued requests.", ()),
    "threshold": (
        "specgate_pod_threshold",
        "Speculation-disable batch threshold (-1: always speculate).",
        (),
    ),
    "speculating": ("specgate_pod_speculating", "1 while the pod speculates.", ()),
    "accept": ("specgate_pod_accept_length", "Accepted tokens per speculating step.", ()),
    "age": ("specgate_pod_scrape_age_seconds", "Age of the pod's metrics.", ()),
    "healthy": ("specgate_pod_healthy", "1 when healthy.", ()),
    "pool": ("specgate_pod_pool", "1 for the pod's current pool.", ("pool",)),
    "circuit": ("specgate_pod_circuit_open", "1 while the pod's circuit is open.", ()),
    "in_flight": ("specgate_pod_in_flight", "Requests this router has in flight.", ()),
    "gen": (
        "specgate_pod_gen_throughput",
        "Output tokens/s the engine reports (its own recent average).",
        (),
    ),
    "rule": (
        "specgate_pod_control_rule",
        "1 for the control rule behind the pod's current decision (control.Rule).",
        ("rule",),
    ),
    "expected_accept": (
        "specgate_pod_expected_accept_length",
        "Accept length the control law uses: measured while speculating, estimated while off"
        " (0: none).",
        (),
    ),
    "correction": (
        "specgate_pod_correction",
        "The law's measured correction: speculating over off delivered-over-predicted (1: none).",
        (),
    ),
    "between_steps": (
        "specgate_pod_between_steps_seconds_per_token",
        "Time between decode steps (prefills) per generated token (0: no data).",
        (),
    ),
}
"""Per engine pod gauges: key -> (metric name, help, labels beyond engine_pod)."""


class PodCollector(Collector):
    """Per-pod gauges read from the router's live pod table at scrape time."""

    def __init__(
        self,
        pods: Callable[[], Iterable[PodState]],
        settings: Callable[[], RouterSettings],
        clock: Callable[[], float],
    ) -> None:
        self._pods, self._settings, self._clock = pods, settings, clock

    def collect(self) -> Any:
        now = self._clock()
        settings = self._settings()
        families = {
            key: GaugeMetricFamily(name, doc, labels=["engine_pod", *extra])
            for key, (name, doc, extra) in POD_GAUGES.items()
        }
        for pod in self._pods():
            load = pod.last.load if pod.last else None
            name = [pod.name]
            families["batch"].add_metric(name, load.running if load else 0)
            families["queue"].add_metric(name, load.waiting if load else 0)
            families["threshold"].add_metric(name, contract.threshold_gauge(pod.threshold))
            families["speculating"].add_metric(name, 1.0 if load and pod.speculating() else 0.0)
            families["accept"].add_metric(name, (load.accept_length or 0.0) if load else 0.0)
            age = pod.scrape_age(now)
            families["age"].add_metric(name, age if math.isfinite(age) else -1)
            families["healthy"].add_metric(name, 1.0 if pod.healthy else 0.0)
            families["pool"].add_metric([pod.name, pod.pool], 1.0)
            state = pod.breaker.state(now, settings.resilience)
            families["circuit"].add_metric(name, 0.0 if state == "closed" else 1.0)
            families["in_flight"].add_metric(name, pod.in_flight)
            families["gen"].add_metric(name, load.gen_throughput if load else 0.0)
            families["rule"].add_metric([pod.name, str(pod.decision.rule)], 1.0)
            model = pod.decision.model
            tau = model.tau if model is not None and not model.profile.fitted else 0.0
            families["expected_accept"].add_metric(name, tau)
            families["correction"].add_metric(name, model.correction if model else 1.0)
            families["between_steps"].add_metric(name, model.between if model else 0.0)
        yield from families.values()


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "specgate_router_requests",
            "Requests by class, pod and HTTP status.",
            ["traffic_class", "engine_pod", "code"],
            registry=r,
        )
        self.ttft = Histogram(
            "specgate_router_ttft_seconds",
            "Time to first token, as clients see it.",
            ["traffic_class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specgate_router_tpot_seconds",
            "Time per output token after the first.",
            ["traffic_class"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            "specgate_router_output_tokens",
            "Output tokens delivered.",
            ["traffic_class"],
            registry=r,
        )
        self.retries = Counter(
            "specgate_router_retries",
            "Requests retried on another pod, by reason.",
            ["reason"],
            registry=r,
        )
        self.saturated = Counter(
            "specgate_router_saturated",
            "Requests refused with 503: no pod could take them.",
            ["traffic_class"],
            registry=r,
        )
        self.stream_errors = Counter(
            "specgate_router_stream_errors",
            "Streams ended by an error after the first byte.",
            ["engine_pod"],
            registry=r,
        )
        self.rejected_metrics = Counter(
            "specgate_pod_rejected_metrics",
            "Scrapes dropped because the engine's numbers were malformed or out of range.",
            ["engine_pod"],
            registry=r,
        )
        self.threshold_changes = Counter(
            "specgate_threshold_changes",
            "Thresholds pushed to pods, by direction and the control rule that decided them"
            " (move, trial, trial-return, trial-ended, fixed).",
            ["engine_pod", "direction", "rule"],
            registry=r,
        )
        self.trials = Counter(
            "specgate_trials",
            "Trials of the other mode at a pod's batch, by the mode tried and how they ended"
            " (started, read, ended without a reading).",
            ["engine_pod", "mode", "outcome"],
            registry=r,
        )
        self.push_failures = Counter(
            "specgate_threshold_push_failures",
            "Failed threshold pushes.",
            ["engine_pod"],
            registry=r,
        )
        self.leader = Gauge(
            "specgate_router_leader", "1 while this replica controls thresholds.", registry=r
        )
        self.in_flight = Gauge("specgate_router_in_flight", "Requests in flight.", registry=r)
        self.latency_pool_size = Gauge(
            "specgate_latency_pool_pods", "Pods in the latency pool.", registry=r
        )

    def attach_pods(
        self,
        pods: Callable[[], Iterable[PodState]],
        settings: Callable[[], RouterSettings],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry.register(PodCollector(pods, settings, clock))
