"""A closed-loop load generator for the OpenAI API: concurrent streaming clients that follow a
schedule of phases, each client sending its next request when the last one ends."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from specgate_router.settings import TrafficClass


@dataclass(frozen=True)
class Phase:
    """`latency_clients` and `throughput_clients` streams for `seconds`; with `ramp_from`, the
    counts grow linearly from those values to them over the phase."""

    name: str
    seconds: float
    latency_clients: int
    throughput_clients: int
    ramp_from: tuple[int, int] | None = None

    def clients(self, cls: TrafficClass, elapsed: float) -> int:
        end = self.latency_clients if cls == "latency" else self.throughput_clients
        if self.ramp_from is None:
            return end
        start = self.ramp_from[0] if cls == "latency" else self.ramp_from[1]
        share = min(1.0, max(0.0, elapsed / self.seconds))
        return round(start + (end - start) * share)


@dataclass(frozen=True)
class Result:
    traffic_class: TrafficClass
    phase: str
    started: float
    ttft: float | None
    ended: float
    tokens: int
    ok: bool
    pod: str | None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.ended - self.started - self.ttft) / (self.tokens - 1)


@dataclass
class LoadGenerator:
    url: str
    model: str
    phases: list[Phase]
    latency_max_tokens: int = 96
    throughput_max_tokens: int = 256
    seed: int = 0
    results: list[Result] = field(default_factory=list)
    phase_name: str = ""
    started_at: float = 0.0

    def current_phase(self, now: float) -> tuple[Phase, float] | None:
        """The phase at `now` and the seconds spent in it so far."""
        elapsed = now - self.started_at
        for phase in self.phases:
            if elapsed < phase.seconds:
                return phase, elapsed
            elapsed -= phase.seconds
        return None

    @property
    def duration(self) -> float:
        return sum(p.seconds for p in self.phases)

    async def run(self) -> list[Result]:
        self.started_at = time.monotonic()
        rng = random.Random(self.seed)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5)) as client:
            most_l = max(p.latency_clients for p in self.phases)
            most_t = max(p.throughput_clients for p in self.phases)
            clients = [self._client(client, "latency", i, rng.random()) for i in range(most_l)]
            clients += [self._client(client, "throughput", i, rng.random()) for i in range(most_t)]
            await asyncio.gather(*clients)
        return self.results

    async def _client(
        self, http: httpx.AsyncClient, cls: TrafficClass, index: int, jitter: float
    ) -> None:
        await asyncio.sleep(jitter * 0.2)
        while True:
            now = time.monotonic()
            current = self.current_phase(now)
            if current is None:
                return
            phase, into = current
            self.phase_name = phase.name
            if index >= phase.clients(cls, into):
                await asyncio.sleep(0.1)
                continue
            max_tokens = self.latency_max_tokens if cls == "latency" else self.throughput_max_tokens
            self.results.append(await self._one(http, cls, phase.name, max_tokens))

    async def _one(
        self, http: httpx.AsyncClient, cls: TrafficClass, phase: str, max_tokens: int
    ) -> Result:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Tell me about speculative decoding."}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.monotonic()
        ttft, tokens, ok, pod = None, 0, False, None
        try:
            async with http.stream(
                "POST",
                self.url + "/v1/chat/completions",
                json=body,
                headers={"x-specgate-class": cls},
            ) as resp:
                pod = resp.headers.get("x-specgate-pod")
                if resp.status_code != 200:
                    await resp.aread()
                    await asyncio.sleep(0.2)  # a 503 asks for patience
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            break
                        if ttft is None and event.get("choices"):
                            ttft = time.monotonic() - started
                        if event.get("usage"):
                            tokens = int(event["usage"]["completion_tokens"])
                            ok = True
        except httpx.HTTPError:
            ok = False
        return Result(
            cls,
            phase,
            started - self.started_at,
            ttft,
            time.monotonic() - self.started_at,
            tokens,
            ok,
            pod,
        )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, int(q) - 1))]
