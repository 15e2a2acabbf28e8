"""The router under hostile clients and a frozen pod, as processes on loopback:

1. Header attack: N clients (--attackers, default 8 and 64) each stream request heads of up
   to --header-mib MiB as fast as the router reads them, reconnecting whenever it closes, for
   --attack-seconds, while a probe client sends an ordinary request every 20 ms. Reports the
   router's peak resident memory (sampled at every probe, from /proc) and the probe's
   answers.
2. A frozen pod: two simulated pods behind a router whose first-byte limit is --ttfb-limit
   seconds; one pod is stopped (SIGSTOP: its socket stays open) and --frozen-requests requests
   are sent one after another. Reports the longest wait, against the limit plus 1 s.
3. The cost of client keys: two routers in front of one instant pod, one without client
   authentication and one with it (a key with concurrency and rate limits), and with
   --baseline-tree a third from an older checkout, at --rate req/s, alternated --rounds times:
   added p99 over direct calls and the router's CPU per request for each.

    .venv/bin/python lab/bench/router_hostile.py [--out lab/results]
Writes router_hostile.json and router_hostile.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "gpu")]

from router_overhead import cpu_seconds, free_port, open_loop, pct, start, wait_up  # noqa: E402
from verify import stop_all  # type: ignore[import-not-found]  # noqa: E402

KEY = "bench-key"
CLIENT_KEY = "sg-bench-client"
BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def sim(port: int, profile: str = "instant.json") -> subprocess.Popen[bytes]:
    return start(
        [
            "sim",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--model",
            "bench",
            "--profile",
            str(HERE / "profiles" / profile),
            "--threshold",
            "none",
        ]
    )


def router(
    port: int, config: dict[str, Any], folder: Path, tree: Path | None = None
) -> subprocess.Popen[bytes]:
    """A router process; from another source tree (`tree`, a checkout of an older commit)
    for a before/after comparison."""
    path = folder / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump({"model": "bench", "engineApiKey": KEY, **config}))
    args = [
        "router",
        "--config",
        str(path),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    if tree is None:
        return start(args)
    paths = [tree, tree / "router", tree / "sim", tree / "operator"]
    return subprocess.Popen(
        [sys.executable, "-m", "specgate.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)},
    )


def attacker(port: int, mib: int, stop: float) -> tuple[int, int]:
    """One client streaming huge headers until `stop`, reconnecting whenever the router
    answers or closes; returns (connections, the most bytes one connection got in)."""
    connections, most = 0, 0
    chunk = b"a" * 65536
    while time.monotonic() < stop:
        sent = 0
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                connections += 1
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ")
                while sent < mib << 20 and time.monotonic() < stop:
                    s.sendall(chunk)
                    sent += len(chunk)
        except OSError:
            pass  # the router answered 431 and closed: the point
        most = max(most, sent)
    return connections, most


async def header_attack(
    port: int, pid: int, attackers: int, mib: int, seconds: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stop = time.monotonic() + seconds
    peak = rss_mib(pid) or 0.0
    before = peak
    probe_ok, probe_failed, waits = 0, 0, []
    attacks = [loop.run_in_executor(None, attacker, port, mib, stop) for _ in range(attackers)]
    async with aiohttp.ClientSession() as session:
        while not all(a.done() for a in attacks):
            peak = max(peak, rss_mib(pid) or 0.0)
            started = time.perf_counter()
            try:
                async with session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=BODY,
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            waits.append(time.perf_counter() - started)
            probe_ok, probe_failed = probe_ok + ok, probe_failed + (not ok)
            await asyncio.sleep(0.02)
    done = [await a for a in attacks]
    return {
        "attackers": attackers,
        "header_mib_each": mib,
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(peak, 1),
        "seconds": seconds,
        "connections": sum(c for c, _ in done),
        "bytes_sent_before_close_max": max(m for _, m in done),
        "probe_ok": probe_ok,
        "probe_failed": probe_failed,
        "probe_p99_ms": round(pct(waits, 99) * 1e3, 1) if waits else None,
    }


async def frozen_pod(folder: Path, limit: float, count: int) -> dict[str, Any]:
    ports = [free_port() for _ in range(3)]
    pods = [sim(ports[0], "paced.json"), sim(ports[1], "paced.json")]
    backends = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    front = router(
        ports[2], {"backends": backends, "resilience": {"firstByteTimeoutSeconds": limit}}, folder
    )
    procs = [*pods, front]
    waits: list[float] = []
    statuses: list[int] = []
    try:
        await wait_up(f"http://127.0.0.1:{ports[2]}/readyz")
        pods[0].send_signal(signal.SIGSTOP)
        async with aiohttp.ClientSession() as session:
            for _ in range(count):
                started = time.perf_counter()
                async with session.post(
                    f"http://127.0.0.1:{ports[2]}/v1/chat/completions",
                    json={**BODY, "max_tokens": 4},
                    timeout=aiohttp.ClientTimeout(total=limit * 4 + 30),
                ) as r:
                    await r.read()
                    statuses.append(r.status)
                waits.append(time.perf_counter() - started)
    finally:
        pods[0].send_signal(signal.SIGCONT)
        stop_all(procs)
    return {
        "first_byte_limit_s": limit,
        "requests": count,
        "ok": sum(1 for s in statuses if s == 200),
        "longest_wait_s": round(max(waits), 2),
        "target_s": limit + 1.0,
        "waits_s": [round(w, 3) for w in waits],
    }


async def auth_cost(
    folder: Path, rate: float, seconds: float, rounds: int, baseline: Path | None
) -> dict[str, Any]:
    from specgate_router.client_auth import hash_key

    pod_port, open_port, keyed_port, base_port = (free_port() for _ in range(4))
    backend = [f"http://127.0.0.1:{pod_port}"]
    keys = {
        "keys": [
            {
                "name": "bench",
                "sha256": hash_key(CLIENT_KEY),
                "maxConcurrent": 10_000,
                "requestsPerMinute": 10_000_000,
            }
        ]
    }
    procs = [
        sim(pod_port),
        router(open_port, {"backends": backend}, folder),
        router(keyed_port, {"backends": backend, "clientAuth": keys}, folder),
    ]
    names = ["open", "client-keys"]
    if baseline is not None:
        procs.append(router(base_port, {"backends": backend}, folder, baseline))
        names.append("baseline")
    added: dict[str, list[float]] = {name: [] for name in names}
    cpu_ms: dict[str, list[float]] = {name: [] for name in names}
    errors = 0

    async def routed(name: str, port: int, pid: int, headers: dict[str, str]) -> list[float]:
        before = cpu_seconds(pid)
        ok, failed = await open_loop(
            f"http://127.0.0.1:{port}/v1/chat/completions", rate, seconds, False, headers
        )
        after = cpu_seconds(pid)
        if before is not None and after is not None:
            cpu_ms[name].append(round((after - before) * 1e3 / max(1, len(ok) + failed), 3))
        nonlocal errors
        errors += failed
        return ok

    try:
        for port in (open_port, keyed_port, *([base_port] if baseline else [])):
            await wait_up(f"http://127.0.0.1:{port}/readyz")
        chat = "/v1/chat/completions"
        for _ in range(rounds):
            direct, e0 = await open_loop(
                f"http://127.0.0.1:{pod_port}{chat}",
                rate,
                seconds,
                False,
                {"Authorization": f"Bearer {KEY}"},
            )
            plain = await routed("open", open_port, procs[1].pid, {})
            keyed = await routed(
                "client-keys", keyed_port, procs[2].pid, {"Authorization": f"Bearer {CLIENT_KEY}"}
            )
            errors += e0
            added["open"].append((pct(plain, 99) - pct(direct, 99)) * 1e3)
            added["client-keys"].append((pct(keyed, 99) - pct(direct, 99)) * 1e3)
            if baseline is not None:
                base = await routed("baseline", base_port, procs[3].pid, {})
                added["baseline"].append((pct(base, 99) - pct(direct, 99)) * 1e3)
    finally:
        stop_all(procs)
    return {
        "rate": rate,
        "seconds_per_point": seconds,
        "baseline_tree": None if baseline is None else _describe(baseline),
        "added_p99_ms": {k: [round(v, 2) for v in vs] for k, vs in added.items()},
        "router_cpu_ms_per_request": cpu_ms,
        "errors": errors,
    }


def _describe(tree: Path) -> str:
    """The commit a baseline tree is at."""
    done = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h (%ad)", "--date=short"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or str(tree)


def report(results: dict[str, Any]) -> str:
    lines = [
        "| attackers | header each | connections | router RSS before | peak |"
        " probe answers ok / failed | probe p99 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in results["header_attack"]:
        lines.append(
            f"| {a['attackers']} | {a['header_mib_each']} MiB | {a['connections']} | "
            f"{a['rss_before_mib']} MiB | "
            f"**{a['rss_peak_mib']} MiB** | {a['probe_ok']} / {a['probe_failed']} | "
            f"{a['probe_p99_ms']} ms |"
        )
    f = results["frozen_pod"]
    lines += [
        "",
        f"Frozen pod (SIGSTOP, one of two), first-byte limit {f['first_byte_limit_s']} s: "
        f"{f['ok']} of {f['requests']} requests answered 200, longest wait "
        f"**{f['longest_wait_s']} s** (target {f['target_s']} s).",
    ]
    c = results["auth_cost"]
    med = {k: sorted(v)[len(v) // 2] for k, v in c["added_p99_ms"].items()}
    lines += [
        "",
        f"Added p99 over direct calls at {c['rate']:.0f} req/s, median of "
        f"{len(c['added_p99_ms']['open'])} alternated rounds: without client keys "
        f"**{med['open']:.2f} ms**, with client keys and limits **{med['client-keys']:.2f} ms** "
        f"(rounds: {c['added_p99_ms']['open']} and {c['added_p99_ms']['client-keys']}; "
        f"errors {c['errors']}).",
    ]
    cpu = {k: sorted(v)[len(v) // 2] for k, v in c["router_cpu_ms_per_request"].items() if v}
    if {"open", "client-keys"} <= cpu.keys():
        lines.append(
            f"Router CPU per request (steadier than latency on a shared host), median: without "
            f"client keys **{cpu['open']:.3f} ms**, with them **{cpu['client-keys']:.3f} ms**."
        )
    if "baseline" in c["added_p99_ms"]:
        lines.append(
            f"The router of {c.get('baseline_tree') or 'the baseline tree'} (no header limits, "
            f"no client keys) in the same rounds: added p99 **{med['baseline']:.2f} ms** "
            f"({c['added_p99_ms']['baseline']}), CPU per request "
            f"**{cpu.get('baseline', float('nan')):.3f} ms**."
        )
    return "\n".join(lines)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", default="8,64")
    parser.add_argument("--header-mib", type=int, default=100)
    parser.add_argument("--attack-seconds", type=float, default=10.0)
    parser.add_argument("--ttfb-limit", type=float, default=5.0)
    parser.add_argument("--frozen-requests", type=int, default=10)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of an older commit whose router joins the client-key rounds "
        "(git worktree add /tmp/base COMMIT)",
    )
    parser.add_argument("--out", default=str(HERE.parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="router-hostile-") as tmp:
        return await run(args, out, Path(tmp))


async def run(args: argparse.Namespace, out: Path, folder: Path) -> int:
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    pod_port, router_port = free_port(), free_port()
    procs = [
        sim(pod_port),
        router(router_port, {"backends": [f"http://127.0.0.1:{pod_port}"]}, folder),
    ]
    try:
        await wait_up(f"http://127.0.0.1:{router_port}/readyz")
        results["header_attack"] = []
        for n in (int(x) for x in args.attackers.split(",")):
            print(f"[header attack] {n} attackers x {args.header_mib} MiB ...", flush=True)
            row = await header_attack(
                router_port, procs[1].pid, n, args.header_mib, args.attack_seconds
            )
            print(f"  {row}", flush=True)
            results["header_attack"].append(row)
    finally:
        stop_all(procs)
    print(f"[frozen pod] limit {args.ttfb_limit} s ...", flush=True)
    results["frozen_pod"] = await frozen_pod(folder, args.ttfb_limit, args.frozen_requests)
    print(f"  longest wait {results['frozen_pod']['longest_wait_s']} s", flush=True)
    print(f"[client keys] {args.rounds} rounds at {args.rate:.0f} req/s ...", flush=True)
    results["auth_cost"] = await auth_cost(
        folder, args.rate, args.seconds, args.rounds, args.baseline_tree
    )
    table = report(results)
    print("\n" + table)
    (out / "router_hostile.json").write_text(json.dumps(results, indent=1))
    (out / "router_hostile.md").write_text(
        f"Router under hostile input, {results['date']}, {results['cpus']} CPUs; command: "
        "`.venv/bin/python lab/bench/router_hostile.py`\n\n" + table + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
