"""Router overhead: latency added by the router over direct calls to a simulated pod whose steps
take no time, at fixed request rates, streaming and not; then how many concurrent streams the
router holds without errors.

Processes on loopback: `specgate sim` (profile lab/bench/profiles/instant.json), `specgate
router` in front of it, and this load generator (aiohttp, open loop: requests are sent on a
fixed schedule whatever the answers do). Direct and routed runs alternate at each rate, so the
ratio is measured side by side in one run. With `--baseline REF`, a second router from the git
revision REF (checked out into a temporary worktree, run from its sources) serves the same pod,
and its runs alternate with the others, `--repeat` rounds of each.

    .venv/bin/python lab/bench/router_overhead.py [--seconds 10] [--streams 1000]
        [--baseline REF] [--repeat 3] [--rates 50,200,500] [--out lab/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "gpu")]

from verify import stop_all  # type: ignore[import-not-found]  # noqa: E402

BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(
    args: list[str], tree: Path | None = None, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`specgate ARGS`, from `tree`'s sources where given (a worktree of another revision)."""
    env = {**os.environ, **(extra_env or {})}
    if tree is not None:
        paths = [tree, tree / "router", tree / "operator", tree / "sim"]
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return subprocess.Popen(
        [sys.executable, "-m", "specgate.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )


def router(
    port: int,
    pod_port: int,
    key: str,
    tree: Path | None = None,
    extra_backends: list[int] | tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """A router on `port` in front of the pod on `pod_port` (and those on `extra_backends`)."""
    backends = [a for p in (pod_port, *extra_backends)
                for a in ("--backend", f"http://127.0.0.1:{p}")]  # fmt: skip
    return start(
        [
            "router", "--port", str(port), "--host", "127.0.0.1", *backends,
            "--model", "bench", "--log-level", "warning",
        ],
        tree,
        {"SPECGATE_ENGINE_API_KEY": key},  # every revision reads the key from there
    )  # fmt: skip


def worktree(ref: str) -> Path:
    """A detached checkout of `ref` beside this one's sources (made once, reused)."""
    repo = HERE.parent.parent
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", ref],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specgate-baseline-{sha}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(path), sha],
            check=True, capture_output=True,
        )  # fmt: skip
    return path


def stack(
    key: str, pod_port: int, router_port: int, profile: str, threshold: str
) -> list[subprocess.Popen[bytes]]:
    """A simulated pod with a bench profile and a router in front of it."""
    return [
        start(
            [
                "sim",
                "--port",
                str(pod_port),
                "--api-key",
                key,
                "--model",
                "bench",
                "--profile",
                str(HERE / "profiles" / profile),
                "--threshold",
                threshold,
            ]
        ),
        router(router_port, pod_port, key),
    ]


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def one(
    s: aiohttp.ClientSession, url: str, stream: bool, headers: dict[str, str]
) -> float | None:
    started = time.perf_counter()
    try:
        async with s.post(url, json={**BODY, "stream": stream}, headers=headers) as r:
            await r.read()
            if r.status != 200:
                return None
    except aiohttp.ClientError:
        return None
    return time.perf_counter() - started


async def open_loop(
    url: str, rate: float, seconds: float, stream: bool, headers: dict[str, str]
) -> tuple[list[float], int]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        tasks = []
        start_at = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start_at + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, url, stream, headers)))
        results = await asyncio.gather(*tasks)
    ok = [r for r in results if r is not None]
    return ok, len(results) - len(ok)


def fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def pct(values: list[float], q: int) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


async def held_streams(router: str, count: int) -> tuple[int, int, float]:
    """`count` streams open at once through the router (each ~4 s long); (ok, errors, secs)."""
    body = {**BODY, "max_tokens": 200, "stream": True}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def stream() -> bool:
            try:
                async with s.post(router + "/v1/chat/completions", json=body) as r:
                    if r.status != 200:
                        return False
                    data = await r.read()
                    return data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
            except (TimeoutError, aiohttp.ClientError):
                return False

        started = time.perf_counter()
        results = await asyncio.gather(*(stream() for _ in range(count)))
    return sum(results), count - sum(results), time.perf_counter() - started


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rates", default="50,200,500")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--out", default=str(HERE.parent / "results"))
    parser.add_argument("--baseline", help="a git revision whose router runs beside this one's")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds per point")
    args = parser.parse_args()
    key = "bench-key"
    pod_port, router_port, slow_port, slow_router_port, base_port = (free_port() for _ in range(5))
    procs = stack(key, pod_port, router_port, "instant.json", "none")
    routers = {"this": (f"http://127.0.0.1:{router_port}", procs[1])}
    if args.baseline:
        base = router(base_port, pod_port, key, worktree(args.baseline))
        procs.append(base)
        routers[args.baseline] = (f"http://127.0.0.1:{base_port}", base)
    try:
        direct = f"http://127.0.0.1:{pod_port}"
        await wait_up(direct + "/health")
        for url, _ in routers.values():
            await wait_up(url + "/readyz")
        auth = {"Authorization": f"Bearer {key}"}
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            for stream in (False, True):
                samples: dict[str, list[float]] = {"direct": []}
                cpu: dict[str, list[float]] = {}
                errors = 0
                for _ in range(args.repeat):
                    d, d_err = await open_loop(
                        direct + "/v1/chat/completions", rate, args.seconds, stream, auth
                    )
                    samples["direct"] += d
                    errors += d_err
                    for name, (url, proc) in routers.items():
                        cpu_before = cpu_seconds(proc.pid)
                        r, r_err = await open_loop(
                            url + "/v1/chat/completions", rate, args.seconds, stream, {}
                        )
                        cpu_after = cpu_seconds(proc.pid)
                        samples.setdefault(name, []).extend(r)
                        errors += r_err
                        # The router's own CPU per request: steadier than latency on a shared
                        # machine.
                        if cpu_before is not None and cpu_after is not None:
                            per = (cpu_after - cpu_before) * 1e3 / max(1, len(r) + r_err)
                            cpu.setdefault(name, []).append(per)
                d = samples["direct"]
                for name in routers:
                    r = samples[name]
                    row: dict[str, Any] = {
                        "rate": rate,
                        "stream": stream,
                        "router": name,
                        "direct_p50_ms": pct(d, 50) * 1e3,
                        "direct_p99_ms": pct(d, 99) * 1e3,
                        "router_p50_ms": pct(r, 50) * 1e3,
                        "router_p99_ms": pct(r, 99) * 1e3,
                        "router_cpu_ms_per_request": statistics.mean(cpu[name])
                        if cpu.get(name)
                        else None,
                        "errors": errors,
                    }
                    row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
                    row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
                    rows.append(row)
                    print(
                        f"rate {rate:>5.0f}/s stream={stream!s:<5} router {name:<10}"
                        f" added p50 {row['added_p50_ms']:6.2f} ms"
                        f"  p99 {row['added_p99_ms']:6.2f} ms"
                        f"  router CPU {fmt_ms(row['router_cpu_ms_per_request'])}/request"
                        f"  errors {row['errors']}",
                        flush=True,
                    )
        # Only now the second stack, so it adds no background work to the sweep above.
        # A paced pod (20 ms steps at any batch) for the held-streams test: ~4 s per stream.
        procs += stack(key, slow_port, slow_router_port, "paced.json", "0")
        await wait_up(f"http://127.0.0.1:{slow_router_port}/readyz")
        ok, errors, secs = await held_streams(f"http://127.0.0.1:{slow_router_port}", args.streams)
    finally:
        stop_all(procs)
    header = (
        "| req/s | stream | router | direct p50 | direct p99 | router p50 | router p99 |"
        " added p50 | added p99 | router CPU per request | errors |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header] + [
        f"| {r['rate']:.0f} | {'yes' if r['stream'] else 'no'} | {r['router']} "
        f"| {r['direct_p50_ms']:.2f} ms "
        f"| {r['direct_p99_ms']:.2f} ms | {r['router_p50_ms']:.2f} ms "
        f"| {r['router_p99_ms']:.2f} ms | {r['added_p50_ms']:.2f} ms "
        f"| {r['added_p99_ms']:.2f} ms | {fmt_ms(r['router_cpu_ms_per_request'])} "
        f"| {r['errors']} |"
        for r in rows
    ]
    lines.append(
        f"\nConcurrent streams through the router: {args.streams} opened at once, "
        f"{ok} completed, {errors} errors, {secs:.1f} s."
    )
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "seconds_per_point": args.seconds,
        "repeat": args.repeat,
        "baseline": args.baseline,
    }
    streams = {"opened": args.streams, "ok": ok, "errors": errors, "seconds": secs}
    (out / "router_overhead.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "streams": streams}, indent=1)
    )
    (out / "router_overhead.md").write_text(
        f"Router overhead, {meta['date']}, {meta['cpus']} CPUs ({meta['machine']}), "
        f"{args.seconds:.0f} s per point, {args.repeat} interleaved rounds; command: "
        f"`.venv/bin/python lab/bench/router_overhead.py {' '.join(sys.argv[1:])}`\n\n"
        + table
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
