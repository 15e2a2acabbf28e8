"""`specgate demo`: the local stack under a changing mix of latency and throughput traffic, with a
live view, a summary table and a plot of the speculation control at work."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from specgate import argtypes
from specgate_sim.cluster import free_ports
from specgate_sim.loadgen import LoadGenerator, Phase, Result, percentile
from specgate_sim.local import StackConfig, running_stack
from specgate_sim.profile import Profile
from specgate_sim.profile import load as load_profile


@dataclass(frozen=True)
class PodPoint:
    t: float
    pod: str
    batch: int
    threshold: int | None
    speculating: bool
    pool: str
    tok_s: float


def phases(duration: float) -> list[Phase]:
    """1 stream -> a ramp to 64 -> 64 -> 4 -> 24, mixing classes, scaled to `duration`."""
    return [
        Phase("1 latency stream", 0.12 * duration, 1, 0),
        Phase("ramp to 64 streams", 0.33 * duration, 4, 60, ramp_from=(1, 2)),
        Phase("64 streams, mostly throughput", 0.2 * duration, 16, 48),
        Phase("4 latency streams", 0.15 * duration, 4, 0),
        Phase("24 streams, mixed", 0.2 * duration, 8, 16),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=argtypes.positive_float("--duration"),
        default=60.0,
        help="seconds of load",
    )
    parser.add_argument("--pods", type=argtypes.count("--pods", 1, 64), default=3)
    parser.add_argument(
        "--threshold",
        type=argtypes.count("--threshold", 0, 4096),
        default=16,
        help="initial threshold (deliberately high, so the controller's learning shows)",
    )
    parser.add_argument("--out", default="out/demo", help="folder for the plot and raw data")
    parser.add_argument("--profile", default="rtx-pro-6000-x8")
    parser.add_argument("--no-live", action="store_true", help="no live view (CI logs)")
    parser.add_argument("--no-plot", action="store_true", help="no plot (needs matplotlib)")


PLOT_HINT = (
    "the demo's plot needs matplotlib: pip install 'specgate[plot]' (make demo installs it);"
    " running without the plot"
)


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _fmt(value: float | None, scale: float = 1000.0, unit: str = "ms") -> str:
    return "-" if value is None else f"{value * scale:.0f}{unit}"


def class_stats(results: list[Result], cls: str) -> dict[str, Any]:
    mine = [r for r in results if r.traffic_class == cls and r.ok]
    ttft = [r.ttft for r in mine if r.ttft is not None]
    tpot = [t for r in mine if (t := r.tpot) is not None]
    return {
        "requests": len(mine),
        "failed": sum(1 for r in results if r.traffic_class == cls and not r.ok),
        "tokens": sum(r.tokens for r in mine),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
    }


def live_view(points: list[PodPoint], gen: LoadGenerator, elapsed: float) -> str:
    latest: dict[str, PodPoint] = {}
    for p in points:
        latest[p.pod] = p
    recent = [r for r in gen.results if r.ended > elapsed - 10]
    bar_len = 30
    done = min(1.0, elapsed / gen.duration)
    lines = [
        f"specgate demo  [{'#' * int(done * bar_len):<{bar_len}}] {elapsed:5.1f}/"
        f"{gen.duration:.0f}s  phase: {gen.phase_name}",
        "",
        f"{'pod':<22}{'pool':<12}{'batch':>6}{'threshold':>11}{'speculating':>13}{'tok/s':>8}",
    ]
    for name in sorted(latest):
        p = latest[name]
        thr = "always" if p.threshold is None else str(p.threshold)
        lines.append(
            f"{name:<22}{p.pool:<12}{p.batch:>6}{thr:>11}"
            f"{'yes' if p.speculating else 'no':>13}{p.tok_s:>8.0f}"
        )
    lines += [
        "",
        f"{'class (last 10 s)':<22}{'reqs':>6}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}",
    ]
    for cls in ("latency", "throughput"):
        s = class_stats(recent, cls)
        ttft = f"{_fmt(s['ttft_p50']):>10}{_fmt(s['ttft_p99']):>8}"
        tpot = f"{_fmt(s['tpot_p50']):>10}{_fmt(s['tpot_p99']):>8}"
        lines.append(f"{cls:<22}{s['requests']:>6}{ttft}{tpot}")
    return "\n".join(lines)


async def _sample(url: str, points: list[PodPoint], t0: float, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=2) as client:
        while not stop.is_set():
            try:
                view = (await client.get(url + "/specgate/pods")).json()
            except (httpx.HTTPError, ValueError):
                view = {"pods": []}
            now = time.monotonic() - t0
            for p in view["pods"]:
                points.append(
                    PodPoint(
                        now,
                        p["name"],
                        p["batch"] or 0,
                        p["threshold"],
                        bool(p["speculating"]),
                        p["pool"],
                        p.get("genThroughput") or 0.0,
                    )
                )
            await asyncio.sleep(0.5)


async def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = StackConfig(
        pods=args.pods,
        port=free_ports(1)[0],
        threshold=args.threshold,
        profile=args.profile,
        model="sim-model",
        control={
            "cooldownSeconds": 3,
            "hysteresis": 1,
            "scrapeIntervalSeconds": 0.25,
            "staleAfterSeconds": 1.5,
            "staggerSeconds": 0.25,
            "minSamples": 3,
        },
        pools={"classMixWindowSeconds": 3},
    )
    live = not args.no_live and sys.stdout.isatty()
    want_plot = not args.no_plot
    if want_plot and not plotting_available():
        print(PLOT_HINT, file=sys.stderr)
        want_plot = False
    print(f"starting {cfg.pods} simulated pods ({cfg.profile}) and the router...", flush=True)
    async with running_stack(cfg) as stack:
        gen = LoadGenerator(stack.router_url, cfg.model, phases(args.duration))
        points: list[PodPoint] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(_sample(stack.router_url, points, t0, stop))
        load = asyncio.create_task(gen.run())
        last_print = 0.0
        while not load.done():
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - t0
            if live:
                sys.stdout.write("\x1b[H\x1b[2J" + live_view(points, gen, elapsed) + "\n")
                sys.stdout.flush()
            elif elapsed - last_print >= 10:
                last_print = elapsed
                print(
                    f"[{elapsed:5.1f}s] {gen.phase_name}: {len(gen.results)} requests done",
                    flush=True,
                )
        results = load.result()
        stop.set()
        await sampler
    summary = summarize(results, points, gen)
    print()
    print(render_summary(summary))
    (out / "demo.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "points": [asdict(p) for p in points],
                "results": [asdict(r) for r in results],
            },
            default=str,
        )
    )
    if want_plot:
        png = plot(points, results, gen, out / "demo.png", profile=load_profile(cfg.profile))
        print(f"\nplot: {png}")
    print(f"raw data: {out / 'demo.json'}")
    failed = sum(1 for r in results if not r.ok)
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    return 0 if results and failed == 0 else 1


def summarize(results: list[Result], points: list[PodPoint], gen: LoadGenerator) -> dict[str, Any]:
    per_phase = []
    elapsed = 0.0
    for phase in gen.phases:
        mine = [r for r in results if r.phase == phase.name]
        per_phase.append(
            {
                "phase": phase.name,
                "tok_s": sum(r.tokens for r in mine if r.ok) / phase.seconds,
                **{cls: class_stats(mine, cls) for cls in ("latency", "throughput")},
            }
        )
        elapsed += phase.seconds
    pods: dict[str, Any] = {}
    for name in sorted({p.pod for p in points}):
        seen = [p for p in points if p.pod == name]
        thresholds = [p.threshold for p in seen]
        busy = [p for p in seen if p.batch > 0]
        pods[name] = {
            "first_threshold": thresholds[0] if thresholds else None,
            "final_threshold": thresholds[-1] if thresholds else None,
            "threshold_changes": sum(1 for a, b in itertools.pairwise(thresholds) if a != b),
            "speculating_share": sum(1 for p in busy if p.speculating) / max(1, len(busy)),
        }
    return {
        "phases": per_phase,
        "pods": pods,
        "latency": class_stats(results, "latency"),
        "throughput": class_stats(results, "throughput"),
    }


def render_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"{'phase':<32}{'tok/s':>8}{'lat TPOT p50':>14}{'lat TTFT p99':>14}{'thr TPOT p50':>14}"
    ]
    for ph in summary["phases"]:
        lines.append(
            f"{ph['phase']:<32}{ph['tok_s']:>8.0f}{_fmt(ph['latency']['tpot_p50']):>14}"
            f"{_fmt(ph['latency']['ttft_p99']):>14}"
            f"{_fmt(ph['throughput']['tpot_p50']):>14}"
        )
    lines += ["", f"{'pod':<22}{'threshold':>14}{'changes':>9}{'speculating (busy)':>20}"]
    for name, p in summary["pods"].items():
        moved = f"{p['first_threshold']} -> {p['final_threshold']}"
        lines.append(
            f"{name:<22}{moved:>14}{p['threshold_changes']:>9}{p['speculating_share']:>19.0%}"
        )
    for cls in ("latency", "throughput"):
        s = summary[cls]
        lines.append(
            f"{cls}: {s['requests']} requests, {s['failed']} failed, TTFT p50/p99 "
            f"{_fmt(s['ttft_p50'])}/{_fmt(s['ttft_p99'])}, TPOT p50/p99 "
            f"{_fmt(s['tpot_p50'])}/{_fmt(s['tpot_p99'])}"
        )
    return "\n".join(lines)


def role(points: list[PodPoint], pod: str) -> str:
    """A pod's name in the plot: its number and the pool it spent most of the run in."""
    pools = [p.pool for p in points if p.pod == pod and p.batch > 0] or ["mixed"]
    pool = max(set(pools), key=pools.count)
    return {"latency": "latency pool", "throughput": "throughput pool"}.get(pool, "both classes")


def static_baselines(
    points: list[PodPoint], profile: Profile
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per sample time, the profile's steady tok/s summed over the pods at the batches they
    ran: in the mode each pod ran (the router's choice), always speculating and never
    speculating. Steady rates, not the engines' smoothed counters: the three lines differ only
    by the mode, so they show what the choice is worth at each moment."""
    by_time: dict[float, list[PodPoint]] = {}
    for p in points:
        by_time.setdefault(p.t, []).append(p)
    times = sorted(by_time)
    routed = [
        sum(profile.steady_throughput(p.batch, p.speculating) for p in by_time[t] if p.batch)
        for t in times
    ]
    on = [
        sum(profile.steady_throughput(p.batch, True) for p in by_time[t] if p.batch) for t in times
    ]
    off = [
        sum(profile.steady_throughput(p.batch, False) for p in by_time[t] if p.batch) for t in times
    ]
    return times, routed, on, off


def plot(
    points: list[PodPoint],
    results: list[Result],
    gen: LoadGenerator,
    path: Path,
    *,
    profile: Profile,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    pods = sorted({p.pod for p in points})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    times, routed, on, off = static_baselines(points, profile)
    axes[0].plot(times, routed, color="black", label="as routed (each pod's mode)")
    axes[0].plot(times, on, color="tab:green", linestyle="--", label="always speculating")
    axes[0].plot(times, off, color="tab:red", linestyle=":", label="never speculating")
    for i, name in enumerate(pods):
        mine = [p for p in points if p.pod == name]
        c = colors[i % len(colors)]
        label = f"pod {i + 1} ({role(points, name)})"
        t = [p.t for p in mine]
        axes[1].plot(t, [p.batch for p in mine], color=c, label=f"{label}: batch")
        thr = [p.threshold if p.threshold is not None else float("nan") for p in mine]
        axes[1].step(t, thr, where="post", color=c, linestyle="--", label=f"{label}: threshold")
        spec_t = [p.t for p in mine if p.speculating and p.batch > 0]
        axes[1].scatter(spec_t, [-1.5 - i * 0.8] * len(spec_t), color=c, marker="|", s=40)
    axes[0].set_ylabel("output tok/s")
    axes[0].set_title(
        "specgate demo: steady tok/s at the pods' batches by mode, batch vs threshold,"
        " latency by class",
        fontsize=10,
    )
    axes[1].set_ylabel("running requests")
    axes[1].text(
        0.01, 0.02, "ticks below 0: pod speculating", transform=axes[1].transAxes, fontsize=8
    )
    for cls, marker in (("latency", "o"), ("throughput", "x")):
        timed = [(r.ended, tpot) for r in results if r.traffic_class == cls and (tpot := r.tpot)]
        axes[2].scatter(
            [e for e, _ in timed],
            [v * 1000 for _, v in timed],
            marker=marker,
            s=12,
            label=f"{cls} class TPOT",
        )
    axes[2].set_ylabel("TPOT (ms)")
    axes[2].set_xlabel("seconds")
    start = 0.0
    for i, phase in enumerate(gen.phases):
        for ax in axes:
            ax.axvline(start, color="grey", linewidth=0.5)
        axes[0].text(
            start + 0.3,
            0.95 - 0.07 * (i % 2),
            phase.name,
            fontsize=7,
            transform=axes[0].get_xaxis_transform(),
        )
        start += phase.seconds
    for ax in axes:  # legends beside the plots, never over the data
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    try:
        load_profile(args.profile)
    except ValueError as exc:
        raise SystemExit(f"error: --profile: {exc}") from None
    return asyncio.run(run_demo(args))
