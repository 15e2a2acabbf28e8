"""The controller on a GPU as a user deploys it: loads held a minute, no learning phase.

Three servers share one GPU, on the synthetic 3B-class pair (lab/gpu/synthetic.py; the request
temperature sets the accept length: 0.8 gives about 3.8, 1.0 about 2.3):

  plain    upstream SGLang 0.5.17 without speculation
  eagle3   upstream SGLang 0.5.17 with EAGLE-3 always on
  routed   the patched engine behind specgate's router, the engine's threshold flags and the
           router's whole control section rendered by the operator from a SpecDecodeDeployment
           that sets only its models (every control default as shipped)

For each level c in --levels, in order: the routed server first holds the previous level (or
--first-from) for --pre seconds, so that c is arrived at from another load, then c for --hold
seconds, of which the last --measure are measured in --window-second windows; then plain and
eagle3 each run c for the same windows, and the routed server once more as they did ("routed
again": how far the host's speed drifted while the cell ran), then its engine directly, past
the router (what the router's proxying costs). A cell is routed / max(plain, eagle3), medians
over its windows, with every window's figure kept (the spread). The router's threshold and
its prediction are read each window from /specgate/pods.

--engine-key-from-env starts the routed engine with its key in SGLANG_API_KEY instead of
--api-key (as the operator does) and checks that it refuses a request without the key;
--engine-user UID runs it as that user, HOME in a fresh folder (as spec.engine.runAsUser does).

--step T1,T2 adds an acceptance step at c = --step-level: T1 held --hold seconds, then T2, the
routed pod's threshold read every second; it says when the threshold settled after the step.

--request-cost T measures what a request costs outside its decode steps in each mode (its
prefill, the draft's prefill, and what the scheduler runs around them), at --step-level closed-
loop streams and temperature T, once the rest is done: every server runs requests of --short
new tokens, then --long, then --short again, and with R(n) the output tok/s at n new tokens,
1/R(n) = (decode time per token) + p/n gives p = (1/R(short) - 1/R(long)) / (1/short - 1/long).
The router is stopped first and the patched engine's threshold pushed directly: 0 (off) and
its largest batch (speculating).

    bash lab/gpu/run-on-gpu.sh SITE OUT lab/bench/hold_grid.py --temperature 0.8
Results: OUT/hold-grid.json after every cell; lab/bench/hold_grid.py --report OUT/hold-grid.json
[more.json ...] [--plot grid.png] prints the tables and draws them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
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

NEW_TOKENS = (64, 192)
"""Each request's max_new_tokens (ignore_eos), uniform in this range, after a 32-token prompt."""
ROUTER_PORT_OFFSET = 500
MAX_RUNNING = 128
"""Every server's largest batch (and CUDA graph): a threshold this high speculates at all."""


def operator_defaults(
    replicas: int = 1, pools: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The router's config and the engine's control flags as the operator renders them for a
    resource that names only its models and `replicas` (and `pools`, its spec.router.pools,
    when given): (router config without cluster discovery, flags)."""
    spec: dict[str, Any] = {
        "replicas": replicas,
        "model": {"path": "/models/target"},
        "speculative": {"draftModel": {"path": "/models/draft"}},
    }
    if pools:
        spec["router"] = {"pools": pools}
    sdd = api.SpecDecodeDeployment.model_validate(
        {
            "apiVersion": "specgate.io/v1alpha1",
            "kind": "SpecDecodeDeployment",
            "metadata": {"name": "hold-grid", "namespace": "lab"},
            "spec": spec,
        }
    )
    config = render.router_config(sdd)
    for cluster_only in ("discovery", "leaderElection", "statusTarget"):
        config.pop(cluster_only, None)
    args = render.engine_args(sdd)
    flags: list[str] = []
    for flag in ("--speculative-disable-batch-threshold", "--speculative-off-step-tokens"):
        if flag in args:
            flags += [flag, args[args.index(flag) + 1]]
    return config, flags


def rate(clients: Any, start: float, stop: float) -> float:
    """Output tok/s of `clients` (verify.ClosedLoopClients) inside [start, stop]."""
    return float(tokens_in_window(clients.snapshot(), start, stop)) / (stop - start)


def pod_view(router_port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{router_port}/specgate/pods", timeout=5
        ) as resp:
            pods = json.loads(resp.read())["pods"]
    except (OSError, ValueError, KeyError) as exc:
        return {"error": str(exc)}
    view: dict[str, Any] = pods[0] if pods else {}
    return {k: view.get(k) for k in ("threshold", "prediction", "acceptance", "learning")}


def windows(clients: Any, count: int, seconds: float) -> list[float]:
    rates = []
    for _ in range(count):
        start = time.monotonic()
        time.sleep(seconds)
        rates.append(round(rate(clients, start, time.monotonic()), 1))
    return rates


def routed_cell(
    router_port: int, c: int, before: int, temperature: float, args: argparse.Namespace
) -> dict[str, Any]:
    warm = verify.ClosedLoopClients(router_port, before, temperature, NEW_TOKENS)
    time.sleep(args.pre)
    warm.stop()
    clients = verify.ClosedLoopClients(router_port, c, temperature, NEW_TOKENS)
    time.sleep(args.hold - args.measure)
    rates, views = [], []
    for _ in range(int(args.measure / args.window)):
        rates += windows(clients, 1, args.window)
        views.append(pod_view(router_port))
    clients.stop()
    return {"from": before, "tok_s": rates, "pods": views, "errors": clients.errors}


def static_cell(port: int, c: int, temperature: float, args: argparse.Namespace) -> list[float]:
    clients = verify.ClosedLoopClients(port, c, temperature, NEW_TOKENS)
    time.sleep(args.warmup)
    rates = windows(clients, args.static_windows, args.window)
    clients.stop()
    return rates


def seconds_per_request(rate_short: float, rate_long: float, short: int, long: int) -> float | None:
    """What a request costs outside its decode steps, in seconds, from the output tok/s of the
    same closed-loop load at `short` and at `long` new tokens a request: with a decode time per
    token d (the batch the same in both), 1/R(n) = d + p/n. None when a rate is not positive."""
    if rate_short <= 0 or rate_long <= 0 or short >= long:
        return None
    return (1 / rate_short - 1 / rate_long) / (1 / short - 1 / long)


def request_cost(port: int, temperature: float, args: argparse.Namespace) -> dict[str, Any]:
    """One server's tok/s at --short, --long and --short new tokens a request (the shorts on
    either side of the long, so that a drifting host shows), and p from their means."""
    rates: dict[str, list[float]] = {}
    busy_before, answered = prefill_busy_us(port), 0
    for label, n in (("short", args.short), ("long", args.long), ("short", args.short)):
        clients = verify.ClosedLoopClients(port, args.step_level, temperature, (n, n))
        time.sleep(args.warmup)
        rates.setdefault(label, []).extend(windows(clients, args.static_windows, args.window))
        clients.stop()
        answered += len(clients.snapshot())
    busy_after = prefill_busy_us(port)
    short, long = statistics.mean(rates["short"]), statistics.mean(rates["long"])
    p = seconds_per_request(short, long, args.short, args.long)
    busy = None
    if busy_before is not None and busy_after is not None and answered:
        busy = round((busy_after - busy_before) / answered / 1000, 1)
    return {**rates, "ms_per_request": None if p is None else round(p * 1000, 1),
            "prefill_busy_ms_per_request": busy}  # fmt: skip


def prefill_busy_us(port: int) -> int | None:
    """The engine's own count of microseconds in prefill batches (/v1/loads'
    total_prefill_busy_us: from a prefill's launch to its result processed)."""
    try:
        status, body = verify.call(port, "/v1/loads?include=core", timeout=10)
        return int(body["loads"][0]["total_prefill_busy_us"]) if status == 200 else None
    except (OSError, KeyError, IndexError, TypeError, ValueError):
        return None


def acceptance_step(router_port: int, args: argparse.Namespace) -> dict[str, Any]:
    """T1 held --hold seconds at --step-level, then T2 as long: the routed pod's threshold read
    every second, and its output tok/s over the last --measure seconds of T2."""
    t1, t2 = (float(x) for x in args.step.split(","))
    trace: list[dict[str, Any]] = []
    origin = time.monotonic()
    routed_after: list[float] = []
    for temperature in (t1, t2):
        clients = verify.ClosedLoopClients(router_port, args.step_level, temperature, NEW_TOKENS)
        end = time.monotonic() + args.hold
        while time.monotonic() < end:
            time.sleep(1.0)
            view = pod_view(router_port)
            trace.append({"t": round(time.monotonic() - origin, 1), "T": temperature, **view})
        if temperature == t2:
            stop = time.monotonic()
            start = stop - args.measure
            routed_after = [
                round(rate(clients, t, t + args.window), 1)
                for t in (start + i * args.window for i in range(int(args.measure / args.window)))
            ]
        clients.stop()
    after = [p for p in trace if p["T"] == t2]
    final = after[-1].get("threshold") if after else None
    settled = next((p["t"] - after[0]["t"] for p in after if p.get("threshold") == final), None)
    return {"temperatures": [t1, t2], "c": args.step_level, "trace": trace,
            "settled_after_step_s": settled, "final_threshold": final,
            "routed_after": routed_after}  # fmt: skip


MODELS = Path("/tmp/specgate-models-synthetic")


def synthetic_server_flags(c: float, mem_fraction: float) -> tuple[list[str], list[str]]:
    """Write the synthetic pair to MODELS; (flags every server on it shares, the EAGLE-3
    flags a speculating one adds)."""
    write_synthetic_pair(MODELS, c)
    common = verify.server_flags(
        MODELS / "target",
        mem_fraction=mem_fraction,
        max_running=MAX_RUNNING,
        max_graph_batch=MAX_RUNNING,
        dummy_weights=False,
        sleep_on_idle=True,
    )
    return common, [*verify.EAGLE, "--speculative-draft-model-path", str(MODELS / "draft")]


def readable_by_all(root: Path) -> None:
    """Open `root` to every user: safetensors writes weights as 0600, and a pod's weights are
    readable by its user (a volume's fsGroup, or an image's layers)."""
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))


def routed_engine_setup(
    flags: list[str], env: dict[str, str], args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    """The routed engine's flags and environment with --engine-key-from-env/--engine-user."""
    if args.engine_key_from_env:
        at = flags.index("--api-key")
        flags = flags[:at] + flags[at + 2 :]
        env = {**env, "SGLANG_API_KEY": verify.KEY}
    if args.engine_user is not None:
        readable_by_all(MODELS)
        home = Path(f"/tmp/engine-home-{args.engine_user}")
        home.mkdir(exist_ok=True)
        os.chown(home, args.engine_user, args.engine_user)
        # The lab's shared kernel caches belong to root: the engine keeps its own under HOME,
        # where SGLang's dependencies put them when nothing else says.
        env = {
            **env,
            "HOME": str(home),
            "XDG_CACHE_HOME": f"{home}/.cache",
            "TRITON_CACHE_DIR": f"{home}/.triton/cache",
            "TVM_FFI_CACHE_DIR": f"{home}/.cache/tvm-ffi",
        }
    return flags, env


def engine_checks(port: int, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Who the engine runs as, and what it answers without and with the key."""

    def status(headers: dict[str, str]) -> int | str:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError as exc:
            return str(exc)

    uids = [
        line.split()[1:]
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        if line.startswith(("Uid:", "Gid:"))
    ]
    return {
        "uid_gid": uids,
        "without_key": status({}),
        "with_key": status({"Authorization": f"Bearer {verify.KEY}"}),
    }


def start_router(engine_port: int, router_port: int, out: Path) -> subprocess.Popen[bytes]:
    config, _ = operator_defaults()
    config["backends"] = [f"http://127.0.0.1:{engine_port}"]
    config["engineApiKey"] = verify.KEY
    path = out / "router.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return launch_router(path, router_port, out)


def report(results: dict[str, Any]) -> str:
    lines = [
        f"T = {results['temperature']} (accept length {results['predicted_accept_length']} "
        "by construction): routed / max(plain, EAGLE-3), medians over windows",
        "",
        "| c | from | plain | EAGLE-3 | routed | ratio | routed windows | routed again (/ better) "
        "| its engine directly | threshold | observed / predicted step rate | confident |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in results["cells"]:
        views = cell["routed"]["pods"]
        thresholds = sorted({str(v.get("threshold")) for v in views})
        predictions = [v.get("prediction") or {} for v in views]
        residuals = sorted(
            {
                f"{mode} {ratio}"
                for p in predictions[-1:]
                for mode, ratio in (p.get("observedOverPredicted") or {}).items()
                if ratio is not None
            }
        )
        confident = sum(1 for p in predictions if p.get("confident"))
        again = cell.get("routed_again")
        better = max(cell["plain_median"], cell["eagle3_median"])
        again_text = (
            f"{statistics.median(again):.0f} ({statistics.median(again) / better:.2f})"
            if again
            else "-"
        )
        direct = cell.get("routed_direct")
        lines.append(
            f"| {cell['c']} | {cell['routed']['from']} | {cell['plain_median']:.0f} | "
            f"{cell['eagle3_median']:.0f} | {cell['routed_median']:.0f} | "
            f"**{cell['ratio']:.3f}** | {min(cell['routed']['tok_s']):.0f}-"
            f"{max(cell['routed']['tok_s']):.0f} | "
            f"{again_text} | "
            f"{f'{statistics.median(direct):.0f}' if direct else '-'} | {', '.join(thresholds)} | "
            f"{', '.join(residuals) or '-'} | {confident} of {len(predictions)} |"
        )
    step = results.get("step")
    if step:
        lines += [
            "",
            f"Acceptance step at c = {step['c']}, T {step['temperatures'][0]} -> "
            f"{step['temperatures'][1]}: threshold {step['final_threshold']} "
            f"{step['settled_after_step_s']:.0f} s after the step.",
        ]
        if step.get("routed_after") and step.get("plain_after"):
            routed = statistics.median(step["routed_after"])
            plain = statistics.median(step["plain_after"])
            eagle3 = statistics.median(step["eagle3_after"])
            lines.append(
                f"Last {len(step['routed_after'])} windows after the step: routed {routed:.0f} "
                f"({min(step['routed_after']):.0f}-{max(step['routed_after']):.0f}), plain "
                f"{plain:.0f}, EAGLE-3 {eagle3:.0f}: **{routed / max(plain, eagle3):.3f}**"
            )
    costs = results.get("request_cost")
    if costs:
        lines += [
            "",
            f"Per request outside decode steps, c = {costs['c']}, T {costs['T']} "
            f"({costs['short']} vs {costs['long']} new tokens):",
            "",
            "| server | tok/s short (before, after) | tok/s long | ms a request | "
            "of which in prefill batches (engine's count) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name in ("plain", "eagle3", "routed_off", "routed_on"):
            cost = costs.get(name) or {}
            if "long" not in cost:
                continue
            lines.append(
                f"| {name} | {', '.join(f'{r:.0f}' for r in cost['short'])} | "
                f"{', '.join(f'{r:.0f}' for r in cost['long'])} | {cost['ms_per_request']} | "
                f"{cost.get('prefill_busy_ms_per_request')} |"
            )
    engine = results.get("routed_engine")
    if engine:
        lines += [
            "",
            f"Routed engine: uid/gid {engine['uid_gid']}, /v1/models without the key "
            f"{engine['without_key']}, with it {engine['with_key']}.",
        ]
    return "\n".join(lines)


def merge_by_temperature(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per temperature: the cells of runs at the same temperature together (largest c
    first), the later run's step and engine checks kept."""
    merged: dict[float, dict[str, Any]] = {}
    for results in runs:
        into = merged.setdefault(results["temperature"], {**results, "cells": []})
        into.update({k: v for k, v in results.items() if k != "cells"})
        into["cells"] += results["cells"]
    for results in merged.values():
        results["cells"].sort(key=lambda cell: -cell["c"])
    return list(merged.values())


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Output tok/s of plain, EAGLE-3 and routed at each held level, one panel a run (with
    every window's figure as a dot: the spread is part of the result)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install 'specgate[plot]')", file=sys.stderr)
        return
    # Wide enough for every cell: a level measured in several runs shows once per run.
    width = max(5.0, 0.8 * max(len(results["cells"]) for results in runs))
    fig, axes = plt.subplots(1, len(runs), figsize=(width * len(runs), 4), squeeze=False)
    for ax, results in zip(axes[0], runs, strict=True):
        cells = sorted(results["cells"], key=lambda cell: cell["c"])
        for i, (name, key, color) in enumerate(
            (
                ("plain", "plain", "#999999"),
                ("EAGLE-3", "eagle3", "#4c72b0"),
                ("routed", "routed", "#dd8452"),
            )
        ):
            for j, cell in enumerate(cells):
                windows = cell["routed"]["tok_s"] if key == "routed" else cell[key]
                x = j + (i - 1) * 0.27
                ax.bar(
                    x, statistics.median(windows), 0.25, color=color, label=name if j == 0 else None
                )
                ax.plot([x] * len(windows), windows, "k.", markersize=3)
            for j, cell in enumerate(cells):
                ax.text(
                    j + 0.27,
                    cell["routed_median"],
                    f"{cell['ratio']:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(
            range(len(cells)),
            [f"c = {cell['c']}\nfrom {cell['routed']['from']}" for cell in cells],
            fontsize=8,
        )
        ax.set_ylabel("output tok/s")
        ax.set_title(
            f"T {results['temperature']} (accept length {results['predicted_accept_length']})",
            fontsize=10,
        )
        ax.legend(fontsize=8)
    fig.suptitle("Held a minute: routed (operator defaults) vs upstream servers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="hold-grid-results")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument("--levels", default="16,64,4,1")
    parser.add_argument("--first-from", type=int, default=64)
    parser.add_argument("--pre", type=float, default=20.0)
    parser.add_argument("--hold", type=float, default=60.0)
    parser.add_argument("--measure", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--static-windows", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=1, help="static servers, routed again and direct, interleaved"
    )
    parser.add_argument("--step", default="", help="T1,T2: an acceptance step after the grid")
    parser.add_argument("--step-level", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=570.0, help="no new cell after this")
    parser.add_argument("--request-cost", type=float, help="T: per-request cost in each mode")
    parser.add_argument("--short", type=int, default=32, help="with --request-cost")
    parser.add_argument("--long", type=int, default=256, help="with --request-cost")
    parser.add_argument("--mem-fraction", type=float, default=0.25)
    parser.add_argument("--port-base", type=int, default=32400)
    parser.add_argument("--engine-key-from-env", action="store_true")
    parser.add_argument("--engine-user", type=int, help="run the routed engine as this uid")
    parser.add_argument(
        "--report", type=Path, nargs="+", help="print the tables of results files (no run)"
    )
    parser.add_argument("--plot", type=Path, help="with --report: draw them into this PNG")
    args = parser.parse_args()
    if args.report:
        runs = merge_by_temperature([json.loads(path.read_text()) for path in args.report])
        print("\n\n".join(report(results) for results in runs))
        if args.plot:
            plot(runs, args.plot)
        return 0
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common, eagle = synthetic_server_flags(args.c, args.mem_fraction)
    _, control_flags = operator_defaults()
    upstream = os.environ.get("SPECGATE_UPSTREAM_SITE")
    servers: dict[str, tuple[list[str], dict[str, str]]] = {
        "plain": (common, {"PYTHONPATH": upstream} if upstream else {}),
        "eagle3": ([*common, *eagle], {"PYTHONPATH": upstream} if upstream else {}),
        "routed": routed_engine_setup([*common, *eagle, *control_flags], {}, args),
    }
    ports = {name: args.port_base + i for i, name in enumerate(servers)}
    router_port = args.port_base + ROUTER_PORT_OFFSET
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "temperature": args.temperature,
        "predicted_accept_length": round(acceptance(args.c, args.temperature, 3)[1], 2),
        "engine_control_flags": control_flags,
        "router_control": operator_defaults()[0]["control"],
        "cells": [],
    }
    path = out / "hold-grid.json"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, (flags, env) in servers.items():
            user = args.engine_user if name == "routed" else None
            procs.append(verify.start(name, flags, ports[name], out, env, user=user))
            try:
                verify.wait_for_log(out / f"{name}.log", verify.MEMORY_SIZED, procs[-1])
            except RuntimeError as exc:
                if user is None:
                    raise
                # Keep the grid: say why the engine failed as that user, then run it as root.
                results["engine_user_failed"] = str(exc)
                (out / f"{name}.log").rename(out / f"{name}-as-{user}.log")
                verify.log(f"{name} as uid {user} failed ({exc}); starting it as root")
                procs[-1] = verify.start(name, flags, ports[name], out, env)
                verify.wait_for_log(out / f"{name}.log", verify.MEMORY_SIZED, procs[-1])
        for (name, _), proc in zip(servers.items(), procs, strict=True):
            results[f"startup_seconds_{name}"] = round(verify.wait_healthy(ports[name], proc), 1)
        results["routed_engine"] = engine_checks(ports["routed"], procs[-1])
        verify.log(f"routed engine: {results['routed_engine']}")
        procs.append(start_router(ports["routed"], router_port, out))
        verify.log(f"servers and router up after {time.monotonic() - started:.0f} s")
        before = args.first_from
        for c in (int(x) for x in args.levels.split(",") if x):
            if time.monotonic() - started > args.deadline:
                break
            routed = routed_cell(router_port, c, before, args.temperature, args)
            plain: list[float] = []
            eagle3: list[float] = []
            again: list[float] = []
            direct: list[float] = []
            # Rounds interleave the servers, so a host that drifts (by tens of percent over
            # a minute here) slows them alike rather than whichever ran last.
            for _ in range(args.rounds):
                plain += static_cell(ports["plain"], c, args.temperature, args)
                eagle3 += static_cell(ports["eagle3"], c, args.temperature, args)
                # The routed pod once more, as briefly as the static servers: a routed figure
                # far from the held one says the cell's ratio measured the host, not the
                # control.
                again += static_cell(router_port, c, args.temperature, args)
                # And straight to its engine, the router still scraping and controlling it:
                # what the router's proxying costs against what the patched engine does.
                direct += static_cell(ports["routed"], c, args.temperature, args)
            cell = {
                "c": c,
                "routed": routed,
                "plain": plain,
                "eagle3": eagle3,
                "routed_again": again,
                "routed_direct": direct,
                "routed_median": statistics.median(routed["tok_s"]),
                "plain_median": statistics.median(plain),
                "eagle3_median": statistics.median(eagle3),
            }
            cell["ratio"] = round(
                cell["routed_median"] / max(cell["plain_median"], cell["eagle3_median"]), 3
            )
            results["cells"].append(cell)
            path.write_text(json.dumps(results, indent=1))
            verify.log(f"c={c}: ratio {cell['ratio']} threshold {routed['pods'][-1]}")
            before = c
        if args.step and time.monotonic() - started + 2 * args.hold < args.deadline + 30:
            step = acceptance_step(router_port, args)
            t2 = step["temperatures"][1]
            step["plain_after"] = static_cell(ports["plain"], args.step_level, t2, args)
            step["eagle3_after"] = static_cell(ports["eagle3"], args.step_level, t2, args)
            results["step"] = step
            path.write_text(json.dumps(results, indent=1))
        if args.request_cost is not None:
            verify.stop_all(procs[-1:])  # the router: the engine's threshold is set directly
            costs: dict[str, Any] = {"T": args.request_cost, "c": args.step_level,
                                     "short": args.short, "long": args.long}  # fmt: skip
            for name in ("plain", "eagle3"):
                costs[name] = request_cost(ports[name], args.request_cost, args)
            for mode, value in (("routed_off", 0), ("routed_on", MAX_RUNNING)):
                costs[mode] = {"set": verify.set_threshold(ports["routed"], value)[0]}
                costs[mode].update(request_cost(ports["routed"], args.request_cost, args))
            results["request_cost"] = costs
            verify.log(f"per-request cost: {costs}")
    except Exception as exc:  # keep what was measured
        results["error"] = f"{type(exc).__name__}: {exc}"
        verify.log(results["error"])
    finally:
        path.write_text(json.dumps(results, indent=1))
        verify.stop_all(procs)
    if results["cells"] or "step" in results or "request_cost" in results:
        print(report(results))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
