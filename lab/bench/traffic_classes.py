"""Traffic classes: two patched pods behind specgate's router against static two-pod setups.

Mixed traffic, closed loop: --latency streams of the latency class and --throughput streams of
the throughput class (each request says its class in `x-specgate-class`), every request
streamed so that its time per output token (TPOT) is measured at the client. Configurations,
each on its own pair of pods:

  routed      the patched engine twice behind specgate's router, the router's config and the
              engines' threshold flags rendered by the operator from a resource that sets only
              its models and `replicas: 2` (every control default as shipped); held --hold
              seconds, the last --measure measured
  plain x2    upstream plain decoding on both pods, each stream of each class on one of them
              in turn (an ideal balancer)
  EAGLE-3 x2  upstream EAGLE-3 on both, streams spread the same way
  split       the latency streams on one EAGLE-3 pod, the throughput streams on one plain pod
  EAGLE-3 alone  the latency streams alone on one EAGLE-3 pod: the latency class's reference

--tpot-target-ms and --throughput-batch-per-pod set the resource's
spec.router.pools.latencyTpotTargetMs and throughputBatchPerPod (unset: the defaults);
--static picks the static configurations to measure (only their servers start).

Targets (issue: traffic classes): routed total output tok/s >= the best static two-pod
configuration's; routed latency-class TPOT p50 <= 1.05 x EAGLE-3 alone's.

--engine sglang (the default) runs on one GPU with SGLang 0.5.17 (lab/gpu/run-on-gpu.sh puts
the patched and upstream trees on the path): six servers on the synthetic 3B-class pair, at
--mem-fraction of the GPU each, started one after another. Two pods on one GPU take turns at
it, so a latency pod's steps wait for its sibling's throughput steps however the router
splits the classes; --gpus 2 puts each pair's pods on GPUs of their own (the "-a" servers on
GPU 0, the "-b" on GPU 1), as a deployment's pods are in a cluster. --engine sim runs the same
flow on CPU against simulated pods (`specgate sim`: the routed pair with dynamic thresholds,
the plain pair never speculating, the EAGLE-3 pair always; on one simulated GPU with --gpus 1,
on two with --gpus 2), which checks the script and the router's pools, not the GPU.

    bash lab/gpu/run-on-gpu.sh SITE OUT lab/bench/traffic_classes.py --temperature 0.9
    .venv/bin/python lab/bench/traffic_classes.py --engine sim --out /tmp/tc --hold 20 \
        --measure 10 --static-measure 8
Results: OUT/traffic-classes.json after every configuration; --report prints its table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(REPO / "lab" / "gpu"),
    str(REPO / "lab" / "bench"),
    str(REPO),
    str(REPO / "router"),
    str(REPO / "operator"),
    str(REPO / "sim"),
]

import verify  # type: ignore[import-not-found]  # noqa: E402
from gpu_envelope import launch_router  # noqa: E402
from hold_grid import (  # noqa: E402
    NEW_TOKENS,
    ROUTER_PORT_OFFSET,
    operator_defaults,
    synthetic_server_flags,
)
from speed import tokens_in_window  # type: ignore[import-not-found]  # noqa: E402


class StreamingClients:
    """Closed-loop clients, each bound to one port, streaming SGLang's /generate: every
    answered request's (began, ended, tokens) and its TPOT (first to last token over the
    tokens after the first)."""

    def __init__(self, ports: list[int], traffic_class: str, temperature: float, seed: int) -> None:
        self.traffic_class, self.temperature = traffic_class, temperature
        self.spans: list[tuple[float, float, int]] = []
        self.tpots: list[tuple[float, float]] = []  # (ended, seconds per token)
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(port, seed * 1000 + i), daemon=True)
            for i, port in enumerate(ports)
        ]
        for t in self._threads:
            t.start()

    def _run(self, port: int, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            body = {
                "input_ids": [rng.randrange(3, 32000) for _ in range(32)],
                "sampling_params": {
                    "max_new_tokens": rng.randint(*NEW_TOKENS),
                    "temperature": self.temperature,
                    "ignore_eos": True,
                },
                "stream": True,
            }
            try:
                began, first, last, n_first, n_last = self._one(port, body)
            except (OSError, ValueError, http.client.HTTPException):
                with self._lock:
                    self.errors += 1
                time.sleep(0.2)
                continue
            with self._lock:
                self.spans.append((began, last, n_last))
                if n_last > n_first and last > first:
                    self.tpots.append((last, (last - first) / (n_last - n_first)))

    def _one(self, port: int, body: dict[str, Any]) -> tuple[float, float, float, int, int]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        headers = {**verify.HEADERS, "x-specgate-class": self.traffic_class}
        began = time.monotonic()
        conn.request("POST", "/generate", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            conn.close()
            raise ValueError(f"HTTP {resp.status}")
        first = last = began
        n_first = n_last = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            tokens = int(json.loads(line[5:])["meta_info"]["completion_tokens"])
            now = time.monotonic()
            if n_first == 0:
                first, n_first = now, tokens
            last, n_last = now, tokens
        conn.close()
        if n_last == 0:
            raise ValueError("no tokens")
        return began, first, last, n_first, n_last

    def window(self, start: float, stop: float) -> dict[str, Any]:
        with self._lock:
            spans, tpots = list(self.spans), [t for end, t in self.tpots if start <= end <= stop]
        return {
            "tok_s": round(tokens_in_window(spans, start, stop) / (stop - start), 1),
            "tpot_p50_ms": round(1e3 * statistics.median(tpots), 3) if tpots else None,
            "requests": len(tpots),
        }

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)


def spread(ports: list[int], streams: int) -> list[int]:
    """One port a stream, in turn: an ideal balancer for identical pods."""
    return [ports[i % len(ports)] for i in range(streams)]


def measure(
    latency_ports: list[int],
    throughput_ports: list[int],
    args: argparse.Namespace,
    *,
    settle: float,
    seconds: float,
) -> dict[str, Any]:
    """Both classes' clients for `settle` + `seconds`, the last `seconds` measured."""
    latency = StreamingClients(latency_ports, "latency", args.temperature, 1)
    throughput = StreamingClients(throughput_ports, "throughput", args.temperature, 2)
    time.sleep(settle)
    start = time.monotonic()
    time.sleep(seconds)
    stop = time.monotonic()
    latency.stop()
    throughput.stop()
    lat, thr = latency.window(start, stop), throughput.window(start, stop)
    return {
        "latency": lat,
        "throughput": thr,
        "total_tok_s": round(lat["tok_s"] + thr["tok_s"], 1),
        "errors": latency.errors + throughput.errors,
    }


STATICS = ("plain x2", "EAGLE-3 x2", "split", "EAGLE-3 alone")
NEEDS = {"plain x2": ("plain",), "EAGLE-3 x2": ("eagle",), "split": ("plain", "eagle"),
         "EAGLE-3 alone": ("eagle",)}  # fmt: skip


def pools_of(args: argparse.Namespace) -> dict[str, Any]:
    """The resource's spec.router.pools the options set (empty: the defaults)."""
    pools: dict[str, Any] = {}
    if args.tpot_target_ms is not None:
        pools["latencyTpotTargetMs"] = args.tpot_target_ms
    if args.throughput_batch_per_pod is not None:
        pools["throughputBatchPerPod"] = args.throughput_batch_per_pod
    return pools


def start_sglang(args: argparse.Namespace, out: Path, procs: list[Any]) -> dict[str, int]:
    """The servers, each appended to `procs` as it starts (the caller stops them, also when
    one fails to start)."""
    common, eagle = synthetic_server_flags(args.c, args.mem_fraction)
    _, control_flags = operator_defaults(replicas=2)
    upstream = os.environ.get("SPECGATE_UPSTREAM_SITE")
    env = {"PYTHONPATH": upstream} if upstream else {}
    every = {
        "routed-a": ([*common, *eagle, *control_flags], {}),
        "routed-b": ([*common, *eagle, *control_flags], {}),
        "plain-a": (common, env),
        "plain-b": (common, env),
        "eagle-a": ([*common, *eagle], env),
        "eagle-b": ([*common, *eagle], env),
    }
    if args.gpus == 2:  # each pair's pods on GPUs of their own, as in a cluster
        every = {
            name: (flags, {**extra, "CUDA_VISIBLE_DEVICES": "0" if name.endswith("-a") else "1"})
            for name, (flags, extra) in every.items()
        }
    ports = {name: args.port_base + i for i, name in enumerate(every)}
    pairs = {"routed", *(pair for name in args.static for pair in NEEDS[name])}
    servers = {name: v for name, v in every.items() if name.rsplit("-", 1)[0] in pairs}
    ports = {name: port for name, port in ports.items() if name in servers}
    # The static servers first, overlapped (each waits for the previous one to size its
    # memory); the routed ones last, one at a time: each measures its step profile at start-up,
    # and another server capturing CUDA graphs meanwhile inflates it (a speculating step at
    # batch 1 read 5.49 ms instead of 3.20 with three servers starting beside it).
    statics = [name for name in servers if not name.startswith("routed")]
    for name in statics:
        procs.append(verify.start(name, servers[name][0], ports[name], out, servers[name][1]))
        verify.wait_for_log(out / f"{name}.log", verify.MEMORY_SIZED, procs[-1])
    for name, proc in zip(statics, procs, strict=True):  # procs holds the statics alone here
        verify.wait_healthy(ports[name], proc)
    for name in ("routed-a", "routed-b"):
        procs.append(verify.start(name, servers[name][0], ports[name], out, servers[name][1]))
        verify.wait_healthy(ports[name], procs[-1])
    return ports


def start_sim(args: argparse.Namespace, out: Path, procs: list[Any]) -> dict[str, int]:
    """`specgate sim` processes, appended to `procs`: the routed pair (thresholds the
    router's), the plain pair (never speculating) and the EAGLE-3 pair (always). One process
    a simulated GPU (pods share a GPU only within a process): with --gpus 1 all six pods on
    one, as the six servers are on the GPU machine; with --gpus 2 the "-a" pods on one and
    the "-b" pods on the other."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("", "router", "sim", "operator")),
        "SGLANG_API_KEY": verify.KEY,
    }
    pairs = [("routed", "8"), ("plain", "0"), ("eagle", "none")]
    sides = [("a", "b")] if args.gpus == 1 else [("a",), ("b",)]
    ports: dict[str, int] = {}
    waits: list[tuple[int, Any]] = []
    for gpu, names in enumerate(sides):
        pods = [(f"{pair}-{side}", threshold) for pair, threshold in pairs for side in names]
        base = args.port_base + len(ports)
        cmd = [sys.executable, "-m", "specgate.cli", "sim", "--pods", str(len(pods))]
        cmd += ["--port", str(base), "--profile", args.sim_profile, "--seed", str(gpu)]
        cmd += ["--thresholds", ",".join(t for _, t in pods), "--gpus", "1"]
        log = open(out / f"sim-gpu{gpu}.log", "wb")  # noqa: SIM115 (the process writes it)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        for i, (name, _) in enumerate(pods):
            ports[name] = base + i
            waits.append((base + i, procs[-1]))
    for port, proc in waits:
        verify.wait_healthy(port, proc, timeout=60)
    return ports


def pools_view(router_port: int) -> dict[str, Any]:
    """The router's latency pool, the batch it holds for the TPOT target, and each pod's pool,
    threshold and room for throughput requests, as /specgate/pods says at the end."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", router_port, timeout=5)
        conn.request("GET", "/specgate/pods")
        body = json.loads(conn.getresponse().read())
        conn.close()
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
    pods = [
        {k: pod.get(k) for k in ("name", "pool", "threshold", "throughputRoom")}
        for pod in body.get("pods", [])
    ]
    return {"latencyPool": body.get("latencyPool"), "latencyBatch": body.get("latencyBatch"),
            "pods": pods}  # fmt: skip


def report(results: dict[str, Any]) -> str:
    rows = results["configurations"]
    lines = [
        f"{results['latency_streams']} latency + {results['throughput_streams']} throughput "
        f"streams, T {results['temperature']} ({results['engine']}; "
        + ("a pair's pods on one GPU)" if results.get("gpus", 1) == 1 else "a GPU a pod)"),
        "",
        "| configuration | total tok/s | latency TPOT p50 | throughput TPOT p50 | errors |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        lat = row.get("latency", {}).get("tpot_p50_ms")
        thr = row.get("throughput", {}).get("tpot_p50_ms")
        lines.append(
            f"| {name} | {row.get('total_tok_s', 0):.0f} | {lat if lat is not None else '-'} ms "
            f"| {thr if thr is not None else '-'} ms | {row.get('errors', 0)} |"
        )
    routed, alone = rows.get("routed"), rows.get("EAGLE-3 alone")
    if routed and routed.get("pools"):
        lines.append(f"\nrouted pools at the end: {json.dumps(routed['pools'])}")
    statics = [rows[n]["total_tok_s"] for n in ("plain x2", "EAGLE-3 x2", "split") if n in rows]
    if routed and statics:
        lines.append(
            f"\nrouted total / best static two-pod: **{routed['total_tok_s'] / max(statics):.3f}**"
            " (target >= 1)"
        )
    if routed and alone and routed["latency"]["tpot_p50_ms"] and alone["latency"]["tpot_p50_ms"]:
        ratio = routed["latency"]["tpot_p50_ms"] / alone["latency"]["tpot_p50_ms"]
        lines.append(f"routed latency TPOT p50 / EAGLE-3 alone: **{ratio:.3f}** (target <= 1.05)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="traffic-classes-results")
    parser.add_argument("--engine", choices=("sglang", "sim"), default="sglang")
    parser.add_argument("--sim-profile", default="h200-3b-synthetic-deployed")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument("--latency", type=int, default=2, help="latency-class streams")
    parser.add_argument("--throughput", type=int, default=32, help="throughput-class streams")
    parser.add_argument("--hold", type=float, default=60.0)
    parser.add_argument("--measure", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--static-measure", type=float, default=15.0)
    parser.add_argument("--mem-fraction", type=float, default=0.12)
    parser.add_argument(
        "--gpus",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: both pods of a pair share one GPU (their steps take turns); 2: each pod of a "
        "pair has a GPU of its own, as pods of a deployment have in a cluster",
    )
    parser.add_argument("--port-base", type=int, default=32600)
    parser.add_argument(
        "--tpot-target-ms", type=float, help="spec.router.pools.latencyTpotTargetMs"
    )
    parser.add_argument("--throughput-batch-per-pod", type=int)
    parser.add_argument(
        "--static",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=list(STATICS),
        help=f"static configurations, comma-separated (default: {','.join(STATICS)})",
    )
    parser.add_argument("--report", type=Path, help="print the table of a results file (no run)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.static) - set(STATICS))
    if unknown:
        parser.error(f"--static: unknown {', '.join(unknown)}; choose from {', '.join(STATICS)}")
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "temperature": args.temperature,
        "latency_streams": args.latency,
        "throughput_streams": args.throughput,
        "gpus": args.gpus,
        "router": operator_defaults(replicas=2, pools=pools_of(args))[0],
        "configurations": {},
    }
    path = out / "traffic-classes.json"
    procs: list[Any] = []
    rows = results["configurations"]
    try:
        start = start_sim if args.engine == "sim" else start_sglang
        ports = start(args, out, procs)
        config, _ = operator_defaults(replicas=2, pools=pools_of(args))
        config["backends"] = [f"http://127.0.0.1:{ports[p]}" for p in ("routed-a", "routed-b")]
        config["engineApiKey"] = verify.KEY
        (out / "router.yaml").write_text(json.dumps(config))  # JSON is YAML
        router_port = args.port_base + ROUTER_PORT_OFFSET
        procs.append(launch_router(out / "router.yaml", router_port, out))
        verify.log(f"servers and router up after {time.monotonic() - started:.0f} s")
        L, T = args.latency, args.throughput
        rows["routed"] = measure(
            [router_port] * L, [router_port] * T, args,
            settle=args.hold - args.measure, seconds=args.measure,
        )  # fmt: skip
        rows["routed"]["pools"] = pools_view(router_port)
        path.write_text(json.dumps(results, indent=1))
        pods = {name: ports.get(name, 0) for name in
                ("plain-a", "plain-b", "eagle-a", "eagle-b")}  # fmt: skip
        statics = {
            "plain x2": (spread([pods["plain-a"], pods["plain-b"]], L),
                         spread([pods["plain-b"], pods["plain-a"]], T)),
            "EAGLE-3 x2": (spread([pods["eagle-a"], pods["eagle-b"]], L),
                           spread([pods["eagle-b"], pods["eagle-a"]], T)),
            "split": ([pods["eagle-a"]] * L, [pods["plain-b"]] * T),
            "EAGLE-3 alone": ([pods["eagle-a"]] * L, []),
        }  # fmt: skip
        for name, (lat_ports, thr_ports) in statics.items():
            if name not in args.static:
                continue
            rows[name] = measure(
                lat_ports, thr_ports, args, settle=args.warmup, seconds=args.static_measure
            )
            path.write_text(json.dumps(results, indent=1))
            verify.log(f"{name}: {rows[name]['total_tok_s']} tok/s")
    except Exception as exc:  # keep what was measured
        results["error"] = f"{type(exc).__name__}: {exc}"
        verify.log(results["error"])
    finally:
        path.write_text(json.dumps(results, indent=1))
        verify.stop_all(procs)
    print(report(results))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
