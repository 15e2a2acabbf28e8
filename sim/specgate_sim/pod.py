"""A simulated engine pod: an `EngineCore` driven in (scaled) real time.

The pod owns one background task, started by `start()` and cancelled by `stop()`; it sleeps on
an event while idle, so hundreds of idle pods cost no CPU. Time inside the pod is simulated
seconds: `time_scale` > 1 runs the engine faster than real time (tests, large simulations).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specgate_sim.engine import EngineCore, HostSpells, SimRequest
from specgate_sim.profile import Profile

THROUGHPUT_WINDOW_S = 5.0


@dataclass(frozen=True)
class PodSettings:
    name: str = "sim-0"
    model: str = "sim-model"
    api_key: str | None = None
    threshold: int | None = 8
    time_scale: float = 1.0
    seed: int | None = None
    max_running_requests: int | None = None
    tp_size: int = 8
    off_step_tokens: int = 1
    """Tokens a request per off step (SGLang with the patch: --speculative-off-step-tokens)."""
    host_spells: HostSpells | None = None
    """Slow spells of a shared host (none: every step at the profile's time)."""
    model_inputs: bool = True
    """Report the step profile and acceptance counters the router's prediction reads
    (contract.STEP_PROFILE); False serves what the patched SGLang engine reports today, and
    the router learns from samples and probes alone."""


class SharedGpu:
    """One GPU that several pods of a process share, as two SGLang servers with split memory
    fractions share one: their CUDA contexts time-slice the GPU, so one pod's step waits
    for the step another has in flight. Modelled at step granularity, in arrival order."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()


class SimPod:
    def __init__(
        self, profile: Profile, settings: PodSettings, gpu: SharedGpu | None = None
    ) -> None:
        self.profile = profile
        self.settings = settings
        self.gpu = gpu
        self.core = EngineCore(
            profile,
            threshold=settings.threshold,
            seed=settings.seed,
            max_running_requests=settings.max_running_requests,
            off_step_tokens=settings.off_step_tokens,
            host_spells=settings.host_spells,
        )
        # The start-up step profile a patched engine measures after capturing its CUDA graphs;
        # the simulator knows its own step times (in wall-clock seconds, as a client sees them).
        simulated = profile.step_profile(settings.off_step_tokens, self.core.max_running)
        self.step_profile = {
            mode: [[b, s / settings.time_scale] for b, s in points]
            for mode, points in simulated.items()
        }
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        self._ids = itertools.count(1)
        self._recent: deque[tuple[float, int]] = deque()
        self.started_at = time.time()

    # ---- lifecycle ----

    def now(self) -> float:
        """Simulated seconds since the pod started."""
        return (time.monotonic() - self._t0) * self.settings.time_scale

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._drive(), name=f"engine:{self.settings.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _drive(self) -> None:
        while True:
            step = self.core.plan()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.gpu is None:
                await asyncio.sleep(step.duration / self.settings.time_scale)
            else:
                async with self.gpu.lock:
                    await asyncio.sleep(step.duration / self.settings.time_scale)
            end = self.now()
            self.core.finish(step, end)
            produced = sum(n for _, n in step.tokens)
            self._recent.append((end, produced))
            while self._recent and self._recent[0][0] < end - THROUGHPUT_WINDOW_S:
                self._recent.popleft()

    # ---- requests ----

    async def generate(self, prompt_tokens: int, max_new_tokens: int) -> AsyncIterator[int]:
        """Yield the number of new tokens at the end of every step that produced some; the
        request is aborted in the engine if the consumer stops early (client went away)."""
        queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        req = SimRequest(
            rid=f"{self.settings.name}-{next(self._ids)}",
            prompt_tokens=max(1, prompt_tokens),
            max_new_tokens=max(1, max_new_tokens),
            arrival=self.now(),
            sink=lambda n, done: queue.put_nowait((n, done)),
        )
        self.core.add(req)
        self._wake.set()
        try:
            while True:
                n, done = await queue.get()
                yield n
                if done:
                    return
        finally:
            if req.finished_at is None:
                self.core.abort(req)

    def gen_throughput(self) -> float:
        """Output tokens per simulated second over the last few seconds."""
        if not self._recent:
            return 0.0
        now = self.now()
        recent = [n for t, n in self._recent if t >= now - THROUGHPUT_WINDOW_S]
        return sum(recent) / THROUGHPUT_WINDOW_S
