"""A hostile engine pod beside a good one: the router's latency for requests the good pod serves,
and the router's memory, against the same load with two good pods, measured side by side.

Two hostile pods (served by this script), one attack each: "profile" answers its scrapes with
a /v1/loads of about 3.5 MB (under the router's former 4 MiB cap) carrying a 220,000-point step
profile (the contract allows 64); "answer" reports itself idle, so the router sends it requests,
and answers each with 100 MB, non-streamed. The good pods are `specgate sim` with an instant
profile. Clients: eight closed-loop "legitimate" clients (short chat requests) and four
"attackers" whose requests the router may send to the hostile pod. Rounds alternate between
the fleets (two good pods; good + each hostile pod), `--repeat` rounds each, each with its own
router process, so the ratio hostile/good is read in one run. With `--baseline REF`, a router
from the git revision REF runs the same rounds too.

    .venv/bin/python lab/bench/hostile_pod.py [--seconds 10] [--repeat 2] [--baseline REF]
        [--out lab/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from router_overhead import HERE, free_port, pct, router, start, wait_up, worktree

KEY = "bench-key"
PROFILE_POINTS = 220_000
ANSWER_MB = 100
LEGIT_CLIENTS = 8
ATTACKERS = 4
BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def hostile_loads(attack: str) -> bytes:
    speculative: dict[str, Any] = {"disable_batch_threshold": 8, "speculating": True}
    if attack == "profile":
        points = [[b, round(0.01 + b * 1e-7, 4)] for b in range(1, PROFILE_POINTS + 1)]
        speculative["step_profile"] = {"on": points, "off": [[1, 0.01], [2, 0.011]]}
    load = {
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "max_running_requests": 256,
        "speculative": speculative,
    }
    return json.dumps({"loads": [load]}, separators=(",", ":")).encode()


def serve_hostile(port: int, attack: str) -> None:
    """A hostile engine ("profile" or "answer"), in this process until killed."""
    loads = hostile_loads(attack)
    chunk = b"a" * (1 << 20)

    async def get_loads(request: web.Request) -> web.Response:
        return web.Response(body=loads, content_type="application/json")

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"speculative_disable_batch_threshold": 8})

    async def push(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response([True])

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"choices": [{"message": {"content": "')
        for _ in range(ANSWER_MB):
            await response.write(chunk)
        await response.write(b'"}}], "usage": {"completion_tokens": 8}}')
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=1 << 20)
    app.router.add_get("/v1/loads", get_loads)
    app.router.add_get("/server_info", info)
    app.router.add_post("/set_internal_state", push)
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def round_of_load(url: str, pid: int, seconds: float) -> dict[str, Any]:
    """Legitimate and attacking clients for `seconds`; latencies of the legitimate requests
    the good pods served, and the router's peak memory."""
    good: list[float] = []
    to_hostile = failed = 0
    peak = rss_mib(pid) or 0.0
    stop_at = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def legit() -> None:
            nonlocal to_hostile, failed
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    async with s.post(url + "/v1/chat/completions", json=BODY) as r:
                        body = await r.read()
                except (TimeoutError, aiohttp.ClientError):
                    failed += 1
                    continue
                took = time.perf_counter() - started
                if r.status != 200:
                    failed += 1
                elif len(body) > 1 << 20:
                    to_hostile += 1
                else:
                    good.append(took)

        async def attacker() -> None:
            while time.perf_counter() < stop_at:
                try:
                    async with s.post(url + "/v1/chat/completions", json=BODY) as r:
                        async for _ in r.content.iter_chunked(1 << 20):
                            pass
                except (TimeoutError, aiohttp.ClientError):
                    await asyncio.sleep(0.05)

        async def sample() -> None:
            nonlocal peak
            while time.perf_counter() < stop_at:
                peak = max(peak, rss_mib(pid) or 0.0)
                await asyncio.sleep(0.1)

        await asyncio.gather(
            *(legit() for _ in range(LEGIT_CLIENTS)),
            *(attacker() for _ in range(ATTACKERS)),
            sample(),
        )
    return {"good": good, "to_hostile": to_hostile, "failed": failed, "peak_rss_mib": peak}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    good = [t for r in rounds for t in r["good"]]
    return {
        "requests": len(good),
        "p50_ms": round(pct(good, 50) * 1e3, 2) if good else None,
        "p99_ms": round(pct(good, 99) * 1e3, 2) if good else None,
        "to_hostile": sum(r["to_hostile"] for r in rounds),
        "failed": sum(r["failed"] for r in rounds),
        "peak_rss_mib": round(max(r["peak_rss_mib"] for r in rounds), 1),
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline", help="a git revision whose router runs the same rounds")
    parser.add_argument("--out", default=str(HERE.parent / "results"))
    args = parser.parse_args()
    pods = [free_port() for _ in range(2)]
    hostile = {"profile": free_port(), "answer": free_port()}
    instant = str(HERE / "profiles" / "instant.json")
    procs = [
        start(["sim", "--port", str(p), "--api-key", KEY, "--model", "bench",
               "--profile", instant, "--threshold", "none"])
        for p in pods
    ]  # fmt: skip
    procs += [
        subprocess.Popen(
            [sys.executable, __file__, "--serve-hostile", str(port), attack],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for attack, port in hostile.items()
    ]
    trees: dict[str, Path | None] = {"this": None}
    if args.baseline:
        trees[args.baseline] = worktree(args.baseline)
    fleets = {
        "two good pods": [pods[0], pods[1]],
        "good + profile": [pods[0], hostile["profile"]],
        "good + answer": [pods[0], hostile["answer"]],
    }
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for p in pods:
            await wait_up(f"http://127.0.0.1:{p}/health")
        for port in hostile.values():
            await wait_up(f"http://127.0.0.1:{port}/health")
        for i in range(args.repeat):
            for name, tree in trees.items():
                for fleet, backends in fleets.items():
                    port = free_port()
                    proc = router(port, backends[0], KEY, tree, extra_backends=backends[1:])
                    try:
                        await wait_up(f"http://127.0.0.1:{port}/healthz")
                        await asyncio.sleep(1.0)  # a few scrapes before the load
                        one = await round_of_load(
                            f"http://127.0.0.1:{port}", proc.pid, args.seconds
                        )
                    finally:
                        proc.terminate()
                        proc.wait(timeout=30)
                    results.setdefault((name, fleet), []).append(one)
                    print(
                        f"round {i + 1}/{args.repeat} {name:>10} {fleet:<15}"
                        f" {len(one['good'])} good answers, {one['to_hostile']} to the hostile"
                        f" pod, peak RSS {one['peak_rss_mib']:.0f} MiB",
                        flush=True,
                    )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    rows: list[dict[str, Any]] = []
    for name in trees:
        good = summary(results[(name, "two good pods")])
        for fleet in fleets:
            row = summary(results[(name, fleet)])
            row["ratio"] = {
                key: None if not good[key] or row[key] is None else round(row[key] / good[key], 2)
                for key in ("p50_ms", "p99_ms", "peak_rss_mib")
            }
            rows.append({"router": name, "fleet": fleet, **row})
    print()
    print(f"{'router':>10} {'fleet':<15} {'answers':>8} {'p50':>9} {'p99':>9} {'peak RSS':>9}"
          f" {'to hostile':>10} {'failed':>6}   p99, RSS / two good")  # fmt: skip
    for r in rows:
        print(f"{r['router']:>10} {r['fleet']:<15} {r['requests']:>8} {r['p50_ms']!s:>7}ms"
              f" {r['p99_ms']!s:>7}ms {r['peak_rss_mib']:>6}MiB {r['to_hostile']:>10}"
              f" {r['failed']:>6}   {r['ratio']['p99_ms']}x,"
              f" {r['ratio']['peak_rss_mib']}x")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hostile-pod.json"
    path.write_text(
        json.dumps(
            {
                "seconds": args.seconds,
                "repeat": args.repeat,
                "profile_points": PROFILE_POINTS,
                "answer_mb": ANSWER_MB,
                "clients": {"legitimate": LEGIT_CLIENTS, "attackers": ATTACKERS},
                "host": platform.node(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-hostile"]:  # a hostile engine's own process
        serve_hostile(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    sys.exit(asyncio.run(main()))
