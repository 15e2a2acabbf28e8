"""The embedded local stack: engine pods (simulated, or real SGLang processes) and the router on
localhost, in one process, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import uvicorn

from specgate_router.app import create_app
from specgate_router.http_limits import BoundedHttpToolsProtocol
from specgate_router.settings import RouterSettings
from specgate_router.state import RouterState
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster, free_ports
from specgate_sim.pod import PodSettings


@dataclass(frozen=True)
class StackConfig:
    pods: int = 4
    engine: Literal["sim", "sglang"] = "sim"
    port: int = 8000
    host: str = "127.0.0.1"
    profile: str = "rtx-pro-6000-x8"
    model: str = "sim-model"
    threshold: int = 8
    time_scale: float = 1.0
    off_step_tokens: int = 1  # tokens a request per off step (--speculative-off-step-tokens)
    control: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, Any] = field(default_factory=dict)
    # Real SGLang only:
    model_path: str | None = None
    draft_model_path: str | None = None
    sglang_args: tuple[str, ...] = ()


@dataclass
class Stack:
    router_url: str
    engine_urls: list[str]
    router: RouterState
    sims: SimCluster | None


NUM_DRAFT_TOKENS = 4
"""`--speculative-num-draft-tokens` of the local stack's SGLang engines (three draft steps)."""


def sglang_command(cfg: StackConfig, port: int) -> list[str]:
    """A patched SGLang engine for `specgate up --engine sglang` (the worker image's flags;
    the API key goes in its environment, `sglang_env`, never on its command line)."""
    if not cfg.model_path or not cfg.draft_model_path:
        raise SystemExit("--engine sglang needs --model-path and --draft-model-path")
    if cfg.off_step_tokens > NUM_DRAFT_TOKENS:
        # The CRD's rule too: an off step's tokens take the KV slots kept for the drafts.
        raise SystemExit(
            f"--off-step-tokens {cfg.off_step_tokens}: at most {NUM_DRAFT_TOKENS} "
            f"with --engine sglang (its --speculative-num-draft-tokens)"
        )
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model_path,
        "--served-model-name",
        cfg.model,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--enable-metrics",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        cfg.draft_model_path,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(NUM_DRAFT_TOKENS),
        "--speculative-disable-batch-threshold",
        str(cfg.threshold),
        # As the operator renders it: the flag only where it differs from SGLang's default.
        *(
            ["--speculative-off-step-tokens", str(cfg.off_step_tokens)]
            if cfg.off_step_tokens != 1
            else []
        ),
        *cfg.sglang_args,
    ]


def sglang_env(api_key: str, gpu: int) -> dict[str, str]:
    """The engine's environment: its GPU, and its API key where the patched server reads it
    (SGLANG_API_KEY), which `ps` does not show."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "SGLANG_API_KEY": api_key}


async def _wait_healthy(urls: list[str], timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        pending = set(urls)
        while pending:
            for url in list(pending):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url + "/health")).status_code == 200:
                        pending.discard(url)
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"engines not healthy after {timeout:.0f}s: {sorted(pending)}")
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def running_stack(cfg: StackConfig) -> AsyncIterator[Stack]:
    """Start everything; on exit stop the router first (it drains), then the engines."""
    api_key = secrets.token_urlsafe(16)
    sims: SimCluster | None = None
    procs: list[subprocess.Popen[bytes]] = []
    if cfg.engine == "sim":
        settings = PodSettings(
            api_key=api_key,
            threshold=cfg.threshold,
            model=cfg.model,
            time_scale=cfg.time_scale,
            seed=1,
            off_step_tokens=cfg.off_step_tokens,
        )
        sims = SimCluster(profiles.load(cfg.profile), cfg.pods, settings=settings, host=cfg.host)
        await sims.start()
        engine_urls = sims.urls
    else:
        if importlib.util.find_spec("sglang") is None:
            raise SystemExit("--engine sglang: SGLang is not installed here (see worker-image/)")
        ports = free_ports(cfg.pods, cfg.host)
        for i, port in enumerate(ports):
            procs.append(subprocess.Popen(sglang_command(cfg, port), env=sglang_env(api_key, i)))
        engine_urls = [f"http://{cfg.host}:{port}" for port in ports]
        await _wait_healthy(engine_urls, timeout=900)
    settings_obj = RouterSettings.model_validate(
        {
            "model": cfg.model,
            "backends": engine_urls,
            "engineApiKey": api_key,
            "control": {"threshold": cfg.threshold, **cfg.control},
            "pools": cfg.pools,
        }
    )
    app = create_app(settings_obj, identity="local")
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            timeout_graceful_shutdown=10,
            # The bounds `specgate router` serves with: a local stack is a router like it.
            http=BoundedHttpToolsProtocol.with_limits(
                settings_obj.resilience.max_header_bytes, settings_obj.resilience.max_headers
            ),
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("router stopped during start-up")
            await asyncio.sleep(0.01)
        yield Stack(f"http://{cfg.host}:{cfg.port}", engine_urls, app.state.router, sims)
    finally:
        # Open streams end now with an error event and [DONE], not after the server's
        # graceful timeout with a cut connection.
        app.state.router.end_streams("the router is stopping; retry against a running one")
        server.should_exit = True
        await task
        if sims is not None:
            await sims.stop()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def serve_until_interrupted(cfg: StackConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with running_stack(cfg) as stack:
        print(f"router (OpenAI API) at {stack.router_url}/v1  model={cfg.model}", flush=True)
        for url in stack.engine_urls:
            print(f"  engine pod ({cfg.engine}) at {url}", flush=True)
        print(f"  live pod view: {stack.router_url}/specgate/pods   Ctrl-C stops", flush=True)
        await stop.wait()
        print("stopping: draining the router, then the engines", flush=True)
