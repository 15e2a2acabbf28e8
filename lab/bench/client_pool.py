"""The router's engine client, side by side: CPU per forwarded request through httpx's pool (what
the router used until job 37) and through `specgate.engine_http.EngineHttp` (aiohttp, what it
uses now), at the concurrencies a pod sees.

A stand-in engine (uvicorn in its own process, answering each POST after 50-150 ms, like a short
generation) and closed-loop clients in this process, one client library at a time, in phases:
c = 16, then 128, then 16 again with the pool still holding the connections c = 128 opened (the
state that tipped the router over in job 37: many idle connections, requests still arriving).
Figures: requests a second, and this process's CPU per request (what the router's one thread
pays). Both libraries run in the same invocation, so their ratio is measured side by side.

Then the control plane's pattern: rounds of one request to each of N pods every 0.5 s
(the router's default scrape interval), N = 8 and 64, the pods told apart by their loopback
address (127.0.0.1-127.0.0.64, Linux), and the share of a core each client spends on it.

    .venv/bin/python lab/bench/client_pool.py [--seconds 5] [--out lab/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from specgate.engine_http import EngineHttp

HERE = Path(__file__).resolve().parent
PHASES = (16, 128, 16)
SCRAPED_PODS = (8, 64)
SCRAPE_INTERVAL = 0.5
AIOHTTP = "aiohttp (EngineHttp)"
ENGINE = """
import asyncio, random
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(random.uniform(0.05, 0.15))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"output_ids": [1, 2, 3]}'})
"""

Post = Callable[[], Awaitable[None]]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def phase(post: Post, clients: int, seconds: float) -> dict[str, float]:
    """Closed loop: `clients` tasks posting until the time is up."""
    stop_at = time.monotonic() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await post()
            done += 1

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    return {
        "clients": clients,
        "requests_per_s": round(done / wall, 1),
        "cpu_us_per_request": round(1e6 * cpu / max(done, 1), 1),
        "cpu_share": round(cpu / wall, 3),
    }


async def run_httpx(url: str, seconds: float) -> list[dict[str, float]]:
    # As the router's control plane configures it (state.py), and its data plane did.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def post() -> None:
            resp = await client.post(url, content=b"{}")
            resp.raise_for_status()

        return [await phase(post, c, seconds) for c in PHASES]


async def run_engine_http(url: str, seconds: float) -> list[dict[str, float]]:
    engine_http = EngineHttp()
    try:

        async def post() -> None:
            resp = await engine_http.post(url, b"{}", {"Content-Type": "application/json"})
            try:
                await resp.read()
                resp.raise_for_status()
            finally:
                resp.release()

        return [await phase(post, c, seconds) for c in PHASES]
    finally:
        await engine_http.close()


async def scrape_share(
    get: Callable[[str], Awaitable[None]], urls: list[str], seconds: float
) -> float:
    """Scrape rounds (one request per pod, all at once) every SCRAPE_INTERVAL: CPU share."""
    cpu, began = time.process_time(), time.monotonic()
    while time.monotonic() - began < seconds:
        started = time.monotonic()
        await asyncio.gather(*(get(url) for url in urls))
        await asyncio.sleep(max(0.0, SCRAPE_INTERVAL - (time.monotonic() - started)))
    return round((time.process_time() - cpu) / (time.monotonic() - began), 4)


async def scrapes_httpx(urls: list[str], seconds: float) -> float:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def get(url: str) -> None:
            (await client.post(url, content=b"{}")).raise_for_status()

        return await scrape_share(get, urls, seconds)


async def scrapes_engine_http(urls: list[str], seconds: float) -> float:
    engine_http = EngineHttp()
    try:

        async def get(url: str) -> None:
            resp = await engine_http.post(url, b"{}", {"Content-Type": "application/json"})
            await resp.read()
            resp.release()

        return await scrape_share(get, urls, seconds)
    finally:
        await engine_http.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per phase")
    parser.add_argument("--out", type=Path, default=HERE.parent / "results")
    args = parser.parse_args(argv)
    port = free_port()
    engine = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import uvicorn\n{ENGINE}\nuvicorn.run(app, host='0.0.0.0', "
            f"port={port}, log_level='warning', access_log=False)",
        ],
    )
    url = f"http://127.0.0.1:{port}/generate"
    try:
        for _ in range(100):
            try:
                httpx.post(url, content=b"{}", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        results: dict[str, Any] = {}
        for name, run in (("httpx", run_httpx), (AIOHTTP, run_engine_http)):
            results[name] = asyncio.run(run(url, args.seconds))
            for row in results[name]:
                print(f"{name}: {row}", flush=True)
        scrapes: dict[str, dict[int, float]] = {"httpx": {}, AIOHTTP: {}}
        for pods in SCRAPED_PODS:
            # The stand-in answers scrapes after its 50-150 ms too: a slow pod, as under load.
            urls = [f"http://127.0.0.{i + 1}:{port}/v1/loads" for i in range(pods)]
            scrapes["httpx"][pods] = asyncio.run(scrapes_httpx(urls, args.seconds))
            scrapes[AIOHTTP][pods] = asyncio.run(scrapes_engine_http(urls, args.seconds))
            print(f"scrapes of {pods} pods: { ({k: v[pods] for k, v in scrapes.items()}) }")
    finally:
        engine.terminate()
        engine.wait(timeout=10)
    rows = [
        "| client | phase | clients | requests/s | CPU per request | CPU share |",
        "|---|---|---|---:|---:|---:|",
    ]
    labels = ("cold", "", "after c = 128")
    for name, phases in results.items():
        for label, row in zip(labels, phases, strict=True):
            cells = (
                name,
                label,
                row["clients"],
                f"{row['requests_per_s']:,.0f}",
                f"{row['cpu_us_per_request']:,.0f} µs",
                f"{row['cpu_share']:.0%}",
            )
            rows.append("| " + " | ".join(map(str, cells)) + " |")
    httpx_128, aiohttp_128 = results["httpx"][1], results[AIOHTTP][1]
    ratio = httpx_128["cpu_us_per_request"] / aiohttp_128["cpu_us_per_request"]
    rows.append(
        f"\nAt c = 128 httpx spends {ratio:.1f}x the CPU per request of the router's "
        "aiohttp client."
    )
    rows += [
        "",
        f"Scrapes (one request per pod every {SCRAPE_INTERVAL:g} s), share of a core:",
        "",
        "| client | " + " | ".join(f"{n} pods" for n in SCRAPED_PODS) + " |",
        "|---|" + "---:|" * len(SCRAPED_PODS),
    ]
    for name, shares in scrapes.items():
        rows.append(f"| {name} | " + " | ".join(f"{shares[n]:.1%}" for n in SCRAPED_PODS) + " |")
    md = "\n".join(rows)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_pool.md").write_text(
        f"{time.strftime('%Y-%m-%d')}, {platform.node() or 'this machine'} "
        f"({platform.processor() or platform.machine()}), `lab/bench/client_pool.py --seconds "
        f"{args.seconds:g}`\n\n{md}\n"
    )
    (args.out / "client_pool.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "seconds": args.seconds,
                "results": results,
                "scrape_cpu_share": scrapes,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
