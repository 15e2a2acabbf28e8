"""The router's live state and its background loops.

`RouterState` owns the pod table, the engine HTTP client (`EngineHttp`: forwarded requests,
scrapes and threshold pushes), the metrics and every background task
(scraper, controller, config watcher, discovery, leader election, status publisher); `start()`
launches them and `stop()` cancels and awaits every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specgate.engine_client import EngineClient, EngineError
from specgate.engine_http import EngineHttp
from specgate_router import control, replay
from specgate_router import settings as settings_mod
from specgate_router.control import pools
from specgate_router.errors import PodNotFound
from specgate_router.metrics import RouterMetrics
from specgate_router.pods import PodState, Scrape
from specgate_router.settings import RouterSettings, TrafficClass

log = logging.getLogger("specgate.router")

Clock = Callable[[], float]


class RouterState:
    def __init__(
        self,
        settings: RouterSettings,
        *,
        engine_http: EngineHttp | None = None,
        config_path: str | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        identity: str = "router",
    ) -> None:
        self.settings = settings
        self.config_path = config_path
        self.clock = clock
        self.rng = rng or random.Random()
        self.identity = identity
        res = settings.resilience
        self.engine_http = engine_http or EngineHttp(
            res.connect_timeout_seconds, res.read_timeout_seconds
        )
        self.pods: dict[str, PodState] = {}
        self.metrics = RouterMetrics()
        self.metrics.attach_pods(lambda: list(self.pods.values()), lambda: self.settings, clock)
        self.is_leader = not settings.leader_election
        self.metrics.leader.set(1 if self.is_leader else 0)
        self.in_flight_by_class: dict[TrafficClass, int] = {"latency": 0, "throughput": 0}
        self.class_load: dict[TrafficClass, float] = {"latency": 0.0, "throughput": 0.0}
        self._class_load_at = clock()
        self.latency_pool: set[str] = set()
        self.latency_batch: int | None = None
        """The batch that meets the latency TPOT target (None: no target, or unknown yet)."""
        self.draining = False
        self.in_flight = 0
        # Open streams' engine answers, for end_streams; and why they are being ended.
        self.streams: set[Any] = set()
        self.ending_streams: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_push_at = -math.inf
        self.kube: Any = None  # specgate.kube.KubeClient when running in a cluster
        if settings.backends:
            self.sync_backends(_static_endpoints(settings.backends))

    # ---- pod table ----

    def engine(self, url: str) -> EngineClient:
        return EngineClient(url, self.engine_http, api_key=self.settings.engine_api_key)

    def sync_backends(self, endpoints: dict[str, str]) -> None:
        """Make the pod table match `endpoints` (name -> URL): add new pods, drop removed ones
        (a pod with requests in flight is drained first)."""
        for name, url in endpoints.items():
            pod = self.pods.get(name)
            if pod is None or pod.url != url:
                self.pods[name] = PodState(
                    name=name,
                    url=url,
                    client=self.engine(url),
                    decision=control.initial_decision(self.settings.control, self.clock()),
                )
            else:
                pod.draining = False
        for name in list(self.pods):
            if name not in endpoints:
                if self.pods[name].in_flight == 0:
                    del self.pods[name]
                else:
                    self.pods[name].draining = True

    def live_pods(self) -> list[PodState]:
        return list(self.pods.values())

    # ---- lifecycle ----

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))  # type: ignore[arg-type]

    async def start(self) -> None:
        self.spawn(
            self._every(lambda: self.settings.control.scrape_interval_seconds, self.scrape_all),
            "scraper",
        )
        self.spawn(
            self._every(lambda: self.settings.control.scrape_interval_seconds, self.control_step),
            "controller",
        )
        if self.config_path:
            self.spawn(self._watch_config(), "config-watcher")
        k8s = self.settings.discovery.kubernetes
        if k8s is not None or self.settings.leader_election or self.settings.status_target:
            from specgate_router import cluster

            self.kube = await cluster.connect()
            if k8s is not None:
                self.spawn(cluster.watch_endpoints(self, k8s), "discovery")
            if self.settings.leader_election:
                self.spawn(cluster.lead(self, self.settings.leader_election), "leader-election")
            if self.settings.status_target:
                self.spawn(cluster.publish_status(self, self.settings.status_target), "status")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.engine_http.close()
        if self.kube is not None:
            await self.kube.aclose()

    def end_streams(self, reason: str) -> int:
        """End every open stream now: each client gets an error event saying `reason`, then
        `data: [DONE]` (proxy._relay). For a local stack stopped with Ctrl-C; a router in a
        cluster drains instead (`drain`). Returns how many streams it ended."""
        self.ending_streams = reason
        streams = list(self.streams)
        for resp in streams:
            resp.close()
        return len(streams)

    async def drain(self, timeout: float) -> None:
        """Refuse new work (readiness fails) and wait for in-flight requests."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _every(
        self, interval: Callable[[], float], step: Callable[[], Awaitable[None]]
    ) -> None:
        while True:
            started = time.monotonic()
            try:
                await step()
            except Exception:  # a loop that dies silently is worse than one that logs and goes on
                log.exception("background step %s failed", getattr(step, "__name__", step))
            await asyncio.sleep(max(0.0, interval() - (time.monotonic() - started)))

    # ---- scraping ----

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(pod) for pod in self.live_pods()))

    async def scrape(self, pod: PodState) -> None:
        timeout = self.settings.control.scrape_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                load = await pod.client.loads(timeout)
        except TimeoutError:
            pod.scrape_failed(f"no answer within {timeout}s", unreachable=False)
            return
        except EngineError as error:
            pod.scrape_failed(str(error), unreachable=error.unreachable)
            if error.message.startswith("bad "):
                # Malformed or out-of-range numbers: dropped, counted, logged once a minute.
                self.metrics.rejected_metrics.labels(pod.name).inc()
                if self.clock() - pod.rejected_logged_at >= 60:
                    pod.rejected_logged_at = self.clock()
                    log.warning("metrics of %s rejected: %s", pod.name, error.message[:300])
            return
        first = pod.last is None
        pod.record(Scrape(self.clock(), load, own_in_flight=pod.in_flight))
        params = self.settings.control
        if first and load.threshold_known and params.mode == "dynamic":
            # A new leader or a restarted router continues from what the pod runs with, when
            # that lies within the resource's bounds; otherwise from the resource's threshold.
            initial = control.initial_decision(params, self.clock())
            value = load.threshold
            if value is not None and params.min_threshold <= value <= params.max_threshold:
                pod.decision = replace(initial, threshold=value, detail="adopted from the pod")
            else:
                pod.decision = replace(
                    initial,
                    detail=f"the pod reported threshold {value}, outside the resource's bounds"
                    f" [{params.min_threshold}, {params.max_threshold}]: not adopted",
                )

    # ---- control ----

    def update_class_load(self, now: float) -> None:
        """Smoothed in-flight requests per class across the router replicas (the class mix
        the pools are sized from; pools.fleet_class_load)."""
        tau = self.settings.pools.class_mix_window_seconds
        alpha = min(1.0, max(0.0, now - self._class_load_at) / tau)
        self._class_load_at = now
        others = [
            max(0, p.last.load.running + p.last.load.waiting - p.last.own_in_flight)
            for p in self.live_pods()
            if p.last is not None and p.fresh(now, self.settings.control)
        ]
        fleet = pools.fleet_class_load(self.in_flight_by_class, float(sum(others)))
        for cls, current in fleet.items():
            self.class_load[cls] += alpha * (current - self.class_load[cls])

    def update_pools(self, now: float, samples: Sequence[control.Sample]) -> None:
        self.update_class_load(now)
        live = [p for p in self.live_pods() if not p.draining]
        settings = self.settings.pools
        thresholds = [p.threshold for p in live if p.threshold is not None]
        models = [
            (p.decision.model, between)
            for p in live
            if p.decision.model is not None
            and (between := between_steps_per_token(p.samples, now)) is not None
        ]
        latency_batch = pools.latency_batch_for_target(
            samples,
            thresholds,
            target_ms=settings.latency_tpot_target_ms,
            now=now,
            min_samples=self.settings.control.min_samples,
            models=models,
        )
        self.latency_batch = latency_batch
        pool = pools.plan_latency_pool(
            [p.name for p in live],
            thresholds,
            latency_load=self.class_load["latency"],
            throughput_load=self.class_load["throughput"],
            previous=self.latency_pool,
            default_threshold=self.settings.control.threshold,
            min_fraction=settings.min_latency_fraction,
            max_fraction=settings.max_latency_fraction,
            throughput_batch_per_pod=settings.throughput_batch_per_pod,
            latency_batch=latency_batch,
        )
        if pool is None:
            for pod in self.live_pods():
                pod.pool, pod.throughput_room, pod.pool_batch = "mixed", 0, 0
            self.latency_pool = set()
            self.metrics.latency_pool_size.set(len(live) if len(live) <= 1 else 0)
            return
        self.latency_pool = pool
        pool_batch = pools.latency_pool_batch(
            thresholds,
            default_threshold=self.settings.control.threshold,
            latency_batch=latency_batch,
        )
        room = pools.throughput_room(
            pool_batch, latency_load=self.class_load["latency"], pool_size=len(pool)
        )
        for pod in self.live_pods():
            latency = pod.name in pool
            pod.pool = "latency" if latency else "throughput"
            pod.throughput_room = room if latency else 0
            pod.pool_batch = pool_batch if latency else 0
        self.metrics.latency_pool_size.set(len(pool))

    async def control_step(self) -> None:
        now = self.clock()
        params = self.settings.control
        live = self.live_pods()
        self.update_pools(now, control.pool_samples([pod.samples for pod in live]))
        inputs = [pod.control_input(now, params) for pod in live]
        for i, decision in control.each_decision(inputs, now=now, params=params):
            pod = live[i]
            if self.is_leader and (event := control.trial_event(pod.decision, decision)):
                self.metrics.trials.labels(pod.name, *event).inc()
                if event[1] != "started":
                    # The reading, also where it leaves the threshold as it was (no push,
                    # so no change to log): what the pod measured is worth a line either way.
                    log.info("trial on %s %s: %s", pod.name, event[1], decision.reason)
            pod.decision = decision
            # One pod's decision at a time: requests and scrapes run between them, so the
            # loop never waits on the whole fleet's step (about 10 ms at 64 pods).
            await asyncio.sleep(0)
        if not self.is_leader:
            return
        for pod in self.live_pods():
            if not pod.fresh(now, params) or not pod.threshold_known:
                continue  # never act on stale data; unpatched engines cannot be driven
            if pod.confirmed_threshold == pod.decision.threshold or now < pod.next_push_at:
                continue
            if now - self._last_push_at < params.stagger_seconds:
                break  # one change at a time across pods
            self._last_push_at = now
            await self.push(pod, now)

    def _push_failed(self, pod: PodState, now: float, what: str) -> None:
        """Back off exponentially (0.5 s doubling to 30 s, jittered) whatever the failure, and
        log once per backoff step up to the longest, then once a minute at most."""
        pod.push_failures += 1
        self.metrics.push_failures.labels(pod.name).inc()
        backoff = min(30.0, 0.5 * 2 ** min(pod.push_failures, 6))
        pod.next_push_at = now + backoff * (0.5 + self.rng.random())
        if pod.push_failures <= 7 or now - pod.push_logged_at >= 60:
            pod.push_logged_at = now
            log.warning(
                "threshold push of %s to %s %s; retry in %.1fs",
                pod.decision.threshold, pod.name, what, backoff,
            )  # fmt: skip

    async def push(self, pod: PodState, now: float) -> None:
        target = pod.decision.threshold
        previous = pod.confirmed_threshold
        try:
            await pod.client.set_threshold(
                target, timeout=self.settings.control.scrape_timeout_seconds
            )
            confirmed = await pod.client.threshold()
        except EngineError as exc:
            self._push_failed(pod, now, f"failed ({exc.message[:200]})")
            return
        if confirmed != target:
            # An engine that accepts a push and never applies it is a failure like any other.
            self._push_failed(pod, now, f"not applied (the pod reports {confirmed})")
            return
        pod.push_failures = 0
        pod.confirmed_threshold, pod.threshold_known = confirmed, True
        direction = _direction(previous, target)
        rule = str(pod.decision.rule)
        self.metrics.threshold_changes.labels(pod.name, direction, rule).inc()
        log.info(
            "threshold of %s: %s -> %s (%s)",
            pod.name, previous, target, pod.decision.reason,
            extra={"rule": rule, "pod": pod.name},
        )  # fmt: skip

    # ---- configuration ----

    async def _watch_config(self) -> None:
        assert self.config_path is not None
        path = Path(self.config_path)
        seen = _mtime(path)
        while True:
            await asyncio.sleep(1.0)
            current = _mtime(path)
            if current == seen:
                continue
            seen = current
            try:
                new = settings_mod.load(path)
            except settings_mod.SettingsError as exc:
                log.error("configuration not reloaded, keeping the previous one: %s", exc)
                continue
            self.reload(new)

    def reload(self, new: RouterSettings) -> None:
        """Swap in new settings; requests in flight keep the settings they started with."""
        old, self.settings = self.settings, new
        if new.backends != old.backends and new.backends:
            self.sync_backends(_static_endpoints(new.backends))
        if new.engine_api_key != old.engine_api_key:
            for pod in self.pods.values():
                pod.client = self.engine(pod.url)
        log.info("configuration reloaded")

    def sample_export(self, pod: str | None = None) -> dict[str, Any]:
        """What the controller decides from, for `replay` offline: every pod's learning samples
        (rows of replay.SAMPLE_FIELDS, times on this router's clock), or `pod`'s alone (a fleet
        of 64 keeps 77k), and the settings."""
        pods = sorted(self.pods.values(), key=lambda p: p.name)
        if pod is not None:
            pods = [p for p in pods if p.name == pod]
            if not pods:
                known = ", ".join(sorted(self.pods)) or "none"
                raise PodNotFound(f"no pod {pod!r}; the router knows {known}", param="pod")
        return {
            "now": round(self.clock(), 3),
            "fields": list(replay.SAMPLE_FIELDS),
            "control": self.settings.control.model_dump(by_alias=True),
            "pods": [
                {"name": p.name, "threshold": p.threshold, "samples": replay.sample_rows(p.samples)}
                for p in pods
            ],
        }

    def views(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            pod.view(now, self.settings.control, self.settings.resilience)
            for pod in sorted(self.pods.values(), key=lambda p: p.name)
        ]


def between_steps_per_token(samples: Sequence[control.Sample], now: float) -> float | None:
    """The seconds a pod spends between decode steps (prefills, mostly) per token it
    generates, over its recent speculating samples (None: none): a speculating batch of b
    requests waits for its successors' prefills, so a latency target reads it times b."""
    values = sorted(
        s.outside_steps / s.tokens_per_second
        for s in control.samples.newest_within(samples, now=now, seconds=30.0)
        if s.speculating and s.outside_steps is not None and s.tokens_per_second > 0
    )
    return values[len(values) // 2] if values else None


def _static_endpoints(backends: list[str]) -> dict[str, str]:
    """Configured backend URLs as pods, named by host:port."""
    return {url.split("://", 1)[-1].rstrip("/"): url for url in backends}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns / 1e9
    except OSError:
        return -1.0


def _direction(previous: int | None, target: int | None) -> str:
    if previous == target:
        return "same"
    if target is None or (previous is not None and target > previous):
        return "raise"
    return "lower"
