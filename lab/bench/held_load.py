"""Held loads on a GPU, measured so that 3% shows: four servers interleaved in rounds.

Four servers share one GPU, on the synthetic 3B-class pair (lab/gpu/synthetic.py; the request
temperature sets the accept length: 0.8 gives about 3.8, 1.0 about 2.3, 1.1 about 1.5):

  plain     upstream SGLang 0.5.17 without speculation
  eagle3    upstream SGLang 0.5.17 with EAGLE-3 always on
  adaptive  upstream SGLang 0.5.17 with EAGLE-3 and --speculative-adaptive: its own draft
            steps per batch size, step 0 included (what a user would pick instead of specgate)
  routed    the patched engine behind specgate's router, as the operator renders them for the
            single-GPU example (examples/tiny-single-gpu.yaml: every control default, four
            tokens a step while off)

Two more servers measure what the off mode costs or gains against plain decoding (the
patched engine held at threshold 0, four tokens a step, as the example renders it):

  off            the patched engine with speculation off, the draft's agreement sampled on
                 every 8th off step (its default: the accept length estimated while off)
  off-unsampled  the same with SGLANG_SPEC_OFF_AGREEMENT_EVERY=0 (no sampling)
  off-sparse     the same sampled on every 32nd off step (a quarter of the default's cost)

`--servers plain,off,off-unsampled` runs only those; every cell then reports each server over
plain as well.

A cell is one load (c closed-loop clients) at one temperature. The routed pod first holds c for
--settle seconds (arriving from the cell before), then --rounds rounds run every server for a
--window-second window each (after --ramp seconds that fill the closed loop), in an order
rotated each round, so that a host whose speed drifts slows them alike. Each server's figure is
its median over the rounds and its noise the spread between them ((max - min) / median); a
cell counts only where every server's spread is under 3%. The cell's ratio is routed over the
best of the other three.

--step T1,T2 adds an acceptance step at c = --step-level: T1 for --hold seconds, then T2 as
long, the routed pod's threshold and rule read every second; then the other servers at T2.
It says when the threshold settled after the step and the routed pod's last 30 s against them.

    bash lab/gpu/run-on-gpu.sh .gpu/site312.tar.xz $OUT/g lab/bench/held_load.py \\
        --temperatures 0.8 --levels 64,16 [--workload short] [--deadline 420]
Results: OUT/held-load.json after every cell; `lab/bench/held_load.py --report FILE...
[--plot grid.png]` prints the tables and draws them (no GPU needed).

Starting the four servers takes most of a device call. `--keep-servers FILE` starts them,
writes their ports to FILE and leaves them running (run the call under `setsid`, so that they
outlive it while the machine stays warm); `--attach FILE` measures on servers started so,
and calls chained within the machine's warm period measure a cell each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(REPO / "lab" / "gpu"),
    str(REPO / "lab" / "bench"),
    str(REPO),
    str(REPO / "router"),
    str(REPO / "operator"),
]

import verify  # type: ignore[import-not-found]  # noqa: E402
from gpu_envelope import launch_router  # noqa: E402
from speed import tokens_in_window, write_synthetic_pair  # type: ignore[import-not-found]  # noqa: E402
from synthetic import acceptance  # type: ignore[import-not-found]  # noqa: E402

from specgate import api  # noqa: E402
from specgate_operator import render  # noqa: E402

SERVERS = ("plain", "eagle3", "adaptive", "routed", "off", "off-unsampled", "off-sparse")
DEFAULT_SERVERS = SERVERS[:4]
ADAPTIVE_TIERS = {
    "1": {"candidate_steps": [1, 3]},
    "8": {"candidate_steps": [0, 1, 3]},
    "32": {"candidate_steps": [0, 1]},
    "64": {"candidate_steps": [0]},
}
"""SGLang 0.5.17's default adaptive tiers (speculative/adaptive_spec_params.py), step 0
included, less the 7-step candidate of its first tier: with three draft steps' buffers, the
default config failed its CUDA-graph capture on an H100 (illegal memory access in
`_rebuild_topk1_chain_buffers`)."""
WORKLOADS = {"long": (128, 512), "short": (16, 64)}
"""New tokens a request (ignore_eos), uniform in the range, after a 32-token prompt: `long`
requests are mostly decode steps, `short` ones mostly prefills."""
NOISE_LIMIT = 0.03
"""A cell counts where every server's spread between rounds is under this."""
MAX_RUNNING = 128
ROUTER_PORT_OFFSET = 500
MODELS = Path("/tmp/specgate-models-synthetic")
AGREEMENT_ENV = "SGLANG_SPEC_OFF_AGREEMENT_EVERY"
SPARSE_EVERY = 32
"""`off-sparse` samples the draft's agreement on every this many off steps."""
EXAMPLE = REPO / "examples" / "tiny-single-gpu.yaml"


def operator_defaults() -> tuple[dict[str, Any], list[str]]:
    """The router's config and the engine's control flags as the operator renders them for
    the single-GPU example with the synthetic pair's paths: (router config without cluster
    discovery, engine control flags)."""
    import yaml

    resource = yaml.safe_load(EXAMPLE.read_text())
    spec = resource["spec"]
    spec["model"] = {"path": "/models/target"}
    spec["speculative"]["draftModel"] = {"path": "/models/draft"}
    sdd = api.SpecDecodeDeployment.model_validate(resource)
    config = render.router_config(sdd)
    for cluster_only in ("discovery", "leaderElection", "statusTarget"):
        config.pop(cluster_only, None)
    args = render.engine_args(sdd)
    flags: list[str] = []
    for flag in ("--speculative-disable-batch-threshold", "--speculative-off-step-tokens"):
        if flag in args:
            flags += [flag, args[args.index(flag) + 1]]
    return config, flags


def pod_view(router_port: int) -> dict[str, Any]:
    """The routed pod's threshold, rule and model as /specgate/pods shows them."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{router_port}/specgate/pods", timeout=5
        ) as resp:
            pods = json.loads(resp.read())["pods"]
    except (OSError, ValueError, KeyError) as exc:
        return {"error": str(exc)}
    view: dict[str, Any] = pods[0] if pods else {}
    return {k: view.get(k) for k in ("batch", "threshold", "rule", "reason", "prediction")}


def window(port: int, c: int, temperature: float, new: tuple[int, int],
           ramp: float, seconds: float) -> tuple[float, int]:  # fmt: skip
    """Output tok/s of c closed-loop clients over `seconds` after `ramp`, and their errors."""
    clients = verify.ClosedLoopClients(port, c, temperature, new)
    time.sleep(ramp)
    start = time.monotonic()
    time.sleep(seconds)
    stop = time.monotonic()
    clients.stop()
    tokens = tokens_in_window(clients.snapshot(), start, stop)
    return round(tokens / (stop - start), 1), clients.errors


def spread(values: list[float]) -> float:
    """(max - min) / median: how far a server's rounds lie apart."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else float("inf")


def measure_cell(
    c: int,
    temperature: float,
    ports: dict[str, int],
    args: argparse.Namespace,
    progress: Any = None,
) -> dict[str, Any]:
    """One cell: the routed pod held at c for --settle seconds, then --rounds rounds (each
    round's rates passed to `progress`, where given, as they come)."""
    new = WORKLOADS[args.workload]
    router_port = ports.get("routed")
    if router_port is not None:
        clients = verify.ClosedLoopClients(router_port, c, temperature, new)
        time.sleep(args.settle)
        clients.stop()
    names = [name for name in SERVERS if name in args.servers and name in ports]
    rates: dict[str, list[float]] = {name: [] for name in names}
    views: list[dict[str, Any]] = []
    errors = 0
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            rate, failed = window(ports[name], c, temperature, new, args.ramp, args.window)
            rates[name].append(rate)
            errors += failed
            if name == "routed":
                views.append(pod_view(ports["routed"]))
        if progress is not None:
            progress({"c": c, "temperature": temperature, "rates": rates, "views": views})
    medians = {name: statistics.median(values) for name, values in rates.items()}
    spreads = {name: round(spread(values), 4) for name, values in rates.items()}
    others = [medians[name] for name in names if name != "routed"]
    best = max(others) if "routed" in medians and others else 0.0
    plain = medians.get("plain", 0.0)
    return {
        "c": c,
        "temperature": temperature,
        "rates": rates,
        "medians": medians,
        "spreads": spreads,
        "counts": max(spreads.values()) < NOISE_LIMIT,
        "ratio": round(medians["routed"] / best, 3) if best > 0 else None,
        "over_plain": {n: round(m / plain, 3) for n, m in medians.items()} if plain > 0 else {},
        "routed_views": views,
        "errors": errors,
    }


def acceptance_step(ports: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """T1 held --hold seconds at --step-level, then T2 as long, the routed pod read every
    second; its last 30 s at T2 against each other server at T2 right after."""
    t1, t2 = (float(x) for x in args.step.split(","))
    new = WORKLOADS[args.workload]
    trace: list[dict[str, Any]] = []
    origin = time.monotonic()
    last: list[float] = []
    for temperature in (t1, t2):
        clients = verify.ClosedLoopClients(ports["routed"], args.step_level, temperature, new)
        end = time.monotonic() + args.hold
        while time.monotonic() < end:
            time.sleep(1.0)
            view = pod_view(ports["routed"])
            trace.append({"t": round(time.monotonic() - origin, 1), "T": temperature, **view})
        stop = time.monotonic()
        clients.stop()
        if temperature == t2:
            spans = clients.snapshot()
            last = [round(tokens_in_window(spans, stop - 30, stop) / 30, 1)]
    others = {
        name: window(ports[name], args.step_level, t2, new, args.ramp, 30)[0]
        for name in SERVERS
        if name != "routed" and name in args.servers and name in ports
    }
    after = [p for p in trace if p["T"] == t2]
    final = after[-1].get("threshold") if after else None
    settled = next((p["t"] - after[0]["t"] for p in after if p.get("threshold") == final), None)
    return {
        "c": args.step_level, "temperatures": [t1, t2], "trace": trace,
        "final_threshold": final, "settled_after_step_s": settled, "routed_last_30s": last,
        "others_at_t2": others,
        "ratio": round(last[0] / max(others.values()), 3) if last and others else None,
    }  # fmt: skip


def start_servers(
    args: argparse.Namespace, out: Path
) -> tuple[dict[str, int], list[subprocess.Popen[bytes]], dict[str, Any]]:
    """The four servers (one after another: each sizes its KV pool from the memory the others
    left) and the router; (ports, processes, what was started)."""
    write_synthetic_pair(MODELS, args.c)
    common = verify.server_flags(
        MODELS / "target", mem_fraction=args.mem_fraction, max_running=MAX_RUNNING,
        max_graph_batch=MAX_RUNNING, dummy_weights=False, sleep_on_idle=True,
    )  # fmt: skip
    eagle = [*verify.EAGLE, "--speculative-draft-model-path", str(MODELS / "draft")]
    config, control_flags = operator_defaults()
    off_flags = [*control_flags]
    off_flags[off_flags.index("--speculative-disable-batch-threshold") + 1] = "0"
    upstream = os.environ.get("SPECGATE_UPSTREAM_SITE")
    env = {"PYTHONPATH": upstream} if upstream else {}
    (out / "adaptive-tiers.json").write_text(json.dumps(ADAPTIVE_TIERS))
    servers: dict[str, tuple[list[str], dict[str, str]]] = {
        "plain": (common, env),
        "eagle3": ([*common, *eagle], env),
        "adaptive": (
            [
                *common,
                *eagle,
                "--speculative-adaptive",
                "--speculative-adaptive-config",
                str(out / "adaptive-tiers.json"),
            ],
            env,
        ),
        "routed": ([*common, *eagle, *control_flags], {}),
        "off": ([*common, *eagle, *off_flags], {}),
        "off-unsampled": ([*common, *eagle, *off_flags], {AGREEMENT_ENV: "0"}),
        "off-sparse": ([*common, *eagle, *off_flags], {AGREEMENT_ENV: str(SPARSE_EVERY)}),
    }
    servers = {name: server for name, server in servers.items() if name in args.servers}
    ports = {name: args.port_base + i for i, name in enumerate(servers)}
    procs: list[subprocess.Popen[bytes]] = []
    cpus = pinned_cpus(list(servers)) if args.pin else {}
    for name, (flags, server_env) in servers.items():
        procs.append(verify.start(name, flags, ports[name], out, server_env, cpus.get(name)))
        verify.wait_for_log(out / f"{name}.log", verify.MEMORY_SIZED, procs[-1])
    started: dict[str, float] = {}
    failed: dict[str, str] = {}
    for (name, _), proc in zip(servers.items(), procs, strict=True):
        try:
            started[name] = round(verify.wait_healthy(ports[name], proc), 1)
        except RuntimeError as exc:
            if name == "routed":
                raise
            # A baseline that cannot start (upstream's adaptive mode has failed its CUDA-graph
            # capture) leaves the others to measure; the results say which and why.
            failed[name] = str(exc)
            verify.log(f"{name} did not start ({exc}); measuring without it (see {name}.log)")
            del ports[name]
    if "routed" not in ports:
        return ports, procs, {"startup_seconds": started, "failed_to_start": failed}
    config["backends"] = [f"http://127.0.0.1:{ports['routed']}"]
    config["engineApiKey"] = verify.KEY
    path = out / "router.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    router_port = args.port_base + ROUTER_PORT_OFFSET
    procs.append(launch_router(path, router_port, out))
    engine_port = ports["routed"]
    ports["routed"] = router_port  # clients of the routed server go through its router
    ports["routed_engine"] = engine_port
    return ports, procs, {"startup_seconds": started, "failed_to_start": failed,
                          "engine_control_flags": control_flags,
                          "router_control": config["control"]}  # fmt: skip


def pinned_cpus(names: list[str]) -> dict[str, list[int]]:
    """`--pin`: each server's processes on cores of their own and this process (the clients,
    the router it starts) on the rest, so that a scheduler bound by its host's work shares no
    core with another server or the client threads."""
    cores = sorted(os.sched_getaffinity(0))
    each = max(1, (len(cores) - 4) // max(1, len(names)))
    placed = {name: cores[i * each : (i + 1) * each] for i, name in enumerate(names)}
    rest = cores[len(names) * each :] or cores
    os.sched_setaffinity(0, rest)
    return placed


def report(results: dict[str, Any]) -> str:
    lines: list[str] = [
        f"Workload {results['workload']} ({WORKLOADS[results['workload']][0]}-"
        f"{WORKLOADS[results['workload']][1]} new tokens), {results['rounds']} rounds of "
        f"{results['window']:.0f} s windows; medians over rounds, spread = (max - min) / median",
        "",
    ]
    ran = [n for n in SERVERS if any(n in cell["medians"] for cell in results["cells"])]
    routed = "routed" in ran
    lines += [
        "| T | accept length | c | " + " | ".join(ran)
        + (" | routed / best" if routed else " | over plain") + " | largest spread | counts |"
        + (" routed thresholds |" if routed else ""),
        "| --- " * (len(ran) + 6 + routed) + "|",
    ]  # fmt: skip
    for cell in results["cells"]:
        m, sp = cell["medians"], cell["spreads"]
        worst = max(sp, key=lambda k: sp[k])
        if routed:
            thresholds = sorted({str(v.get("threshold")) for v in cell["routed_views"]})
            versus = f"**{cell['ratio']:.3f}**"
        else:
            versus = ", ".join(
                f"{n} {r:.3f}" for n, r in cell.get("over_plain", {}).items() if n != "plain"
            )
        lines.append(
            f"| {cell['temperature']} | {results['accept_lengths'].get(str(cell['temperature']))}"
            f" | {cell['c']} | " + " | ".join(f"{m.get(n, 0):.0f}" for n in ran)
            + f" | {versus} | {sp[worst]:.1%} ({worst}) | {'yes' if cell['counts'] else 'no'} |"
            + (f" {', '.join(thresholds)} |" if routed else "")
        )  # fmt: skip
    step = results.get("step")
    if step:
        lines += [
            "",
            f"Acceptance step at c = {step['c']}, T {step['temperatures'][0]} -> "
            f"{step['temperatures'][1]}: threshold {step['final_threshold']} settled "
            f"{step['settled_after_step_s']} s after the step; routed's last 30 s over the best "
            f"other server at T {step['temperatures'][1]}: **{step['ratio']}**",
        ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Each server's median per cell, with its rounds as dots (the noise is part of it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(cells)), 4))
    colors = {"plain": "#999999", "eagle3": "#4c72b0", "adaptive": "#55a868", "routed": "#dd8452",
              "off": "#8172b3", "off-unsampled": "#c44e52", "off-sparse": "#937860"}  # fmt: skip
    ran = [n for n in SERVERS if any(n in cell["medians"] for cell in cells)]
    width = 0.8 / len(ran)
    for i, name in enumerate(ran):
        for j, cell in enumerate(cells):
            if name not in cell["medians"]:
                continue
            x = j + (i - (len(ran) - 1) / 2) * width
            ax.bar(
                x, cell["medians"][name], width * 0.9, color=colors[name],
                label=name if j == 0 else None,
            )  # fmt: skip
            ax.plot([x] * len(cell["rates"][name]), cell["rates"][name], "k.", markersize=3)
    for j, cell in enumerate(cells):
        mark = "" if cell["counts"] else " (noisy)"
        if cell.get("ratio") is not None:
            ax.text(j + 0.3, cell["medians"]["routed"], f"{cell['ratio']:.3f}{mark}", fontsize=7)
    ax.set_xticks(range(len(cells)), [f"T {c['temperature']}\nc = {c['c']}" for c in cells])
    ax.set_ylabel("output tok/s")
    versus = "routed / best of the others" if "routed" in ran else "each over plain"
    ax.set_title(f"held loads, workload {results['workload']}: {versus}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/held-load")
    parser.add_argument("--temperatures", default="0.8,1.0,1.1")
    parser.add_argument("--levels", default="1,4,16,64,128")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="long")
    parser.add_argument(
        "--servers", type=lambda v: v.split(","), default=list(DEFAULT_SERVERS),
        help=f"which of {','.join(SERVERS)} to run",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="servers and clients on own cores")
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--ramp", type=float, default=4.0)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--step", help="T1,T2: an acceptance step at --step-level")
    parser.add_argument("--step-level", type=int, default=16)
    parser.add_argument("--hold", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=1e9, help="no new cell after this")
    parser.add_argument("--c", type=float, default=12.0, help="the synthetic pair's repeat logit")
    parser.add_argument("--mem-fraction", type=float, default=0.18)
    parser.add_argument("--port-base", type=int, default=32600)
    parser.add_argument(
        "--keep-servers", type=Path, help="start the servers, write their ports here"
    )
    parser.add_argument("--attach", type=Path, help="measure on servers --keep-servers started")
    parser.add_argument("--report", type=Path, nargs="+", help="print results files (no run)")
    parser.add_argument("--plot", type=Path, help="with --report: draw the last into this PNG")
    args = parser.parse_args()
    if args.report:
        runs = [json.loads(path.read_text()) for path in args.report]
        print("\n\n".join(report(results) for results in runs))
        if args.plot:
            plot(runs[-1], args.plot)
        return 0
    began = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "workload": args.workload, "rounds": args.rounds,
        "window": args.window, "settle": args.settle, "cells": [],
        "accept_lengths": {str(t): round(acceptance(args.c, t, 3)[1], 2) for t in temperatures},
    }  # fmt: skip
    path = out / "held-load.json"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.attach:
            ports = {k: int(v) for k, v in json.loads(args.attach.read_text()).items()}
            if args.pin:  # the clients on the cores the servers left them
                pinned_cpus([name for name in SERVERS if name in ports])
        else:
            ports, procs, started = start_servers(args, out)
            results.update(started)
            verify.log(f"servers and router up after {time.monotonic() - began:.0f} s")
        if args.keep_servers:
            args.keep_servers.write_text(json.dumps(ports))
            procs = []  # left running for --attach
            return 0
        for temperature in temperatures:
            for c in (int(x) for x in args.levels.split(",") if x):
                if time.monotonic() - began > args.deadline:
                    break

                def partial(state: dict[str, Any]) -> None:
                    results["partial"] = state  # what a call cut short still brings back
                    path.write_text(json.dumps(results, indent=1))

                cell = measure_cell(c, temperature, ports, args, partial)
                results.pop("partial", None)
                results["cells"].append(cell)
                path.write_text(json.dumps(results, indent=1))
                verify.log(f"T {temperature} c={c}: {cell['ratio']} spreads {cell['spreads']}")
        if args.step and time.monotonic() - began < args.deadline:
            results["step"] = acceptance_step(ports, args)
    except Exception as exc:  # keep what was measured
        results["error"] = f"{type(exc).__name__}: {exc}"
        verify.log(results["error"])
    finally:
        path.write_text(json.dumps(results, indent=1))
        verify.stop_all(procs)
    if results["cells"] or "step" in results:
        print(report(results))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
