"""Where does a decode step's time go? Summarise torch-profiler traces from `speed.py --profile`.

For each trace: the span from the first to the last GPU kernel, how much of it the GPU was busy
(union of kernel intervals), the top kernels by total time, and the CPU-side annotated ranges
(SGLang's `draft` / `draft_extend` / `verify` stage spans and the scheduler's own ranges).

    python3 profile_summary.py out/speed/profiles [--top 15]
    python3 profile_summary.py out/speed/profiles --functions 40 [--kind EXTEND]
    python3 profile_summary.py out/speed/profiles --functions 40 --part get_next_batch_to_run
    python3 profile_summary.py out/speed/profiles --syncs

--functions N: the host side of a decode step instead. For each trace, the scheduler's
`run_batch` ranges that hold a `step[DECODE ...]` annotation (`step[EXTEND ...]`, a prefill,
with --kind EXTEND), and the N Python functions with the most inclusive time per such step,
the traces side by side as columns. Traces taken minutes apart on a shared host run at
different speeds: compare functions within one trace, and across traces only what both run
(the target's decode) to see how far the host moved.

--gpu-per-step: the GPU side of a step, for traces of 24 steps each (`gpu_envelope.py
--profile-levels 16,64 --profile-activities GPU`, kernels only): per profiled step the span,
the GPU's busy time (kernels and copies, overlaps once) and its idle time, then each kernel's
time per step, every server of a level against the first (its folder `NAME-cC`; plain sorts
first). Busy time above plain's is GPU work an off step adds. Idle time is the host setting
the pace, and the profiler still slows the host (job 53: plain's span 6.5 ms a step against
3.6 ms a decode step unprofiled), so span and idle time are upper bounds; busy time is not.
With --plot PNG, busy time over plain's by kernel family (needs matplotlib: run it where the
traces came back, on the job's logs.tar.xz).

--syncs: every cudaStreamSynchronize / cudaEventSynchronize / cudaDeviceSynchronize during the
steps, grouped by the Python frames around it. The overlap scheduler keeps the host a step
ahead of the GPU; a sync outside the result copy makes it wait for the GPU to drain (job 35:
one in the lagged writer's forget() on every prefill).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:  # type: ignore[operator]
        trace = json.load(fh)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace event categories of work on the GPU (kernels, copies, memsets)."""


def gpu_work(events: list[dict]) -> tuple[list[dict], list[tuple[float, float]]]:
    """A trace's GPU events and their (start, end) intervals, in microseconds."""
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    return kernels, [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]


def summarise(path: Path, top: int) -> dict:
    events = load(path)
    kernels, spans = gpu_work(events)
    if not kernels:
        return {"trace": str(path), "error": "no GPU kernels in the trace"}
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e["name"][:90]].append(float(e.get("dur", 0)))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    annotations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation":
            annotations[e["name"][:60]].append(float(e.get("dur", 0)))
    graph_launches = sum(1 for e in events if e.get("name") == "cudaGraphLaunch")
    return {
        "trace": str(path),
        "span_ms": round((last - first) / 1000, 2),
        "gpu_busy_ms": round(union_length(spans) / 1000, 2),
        "kernels": len(kernels),
        "cuda_graph_launches": graph_launches,
        "top_kernels": [
            {
                "name": n,
                "count": len(d),
                "total_ms": round(sum(d) / 1000, 3),
                "mean_us": round(sum(d) / len(d), 1),
            }
            for n, d in ranked
        ],
        "annotations": {
            n: {"count": len(d), "mean_us": round(sum(d) / len(d), 1)}
            for n, d in sorted(annotations.items(), key=lambda kv: -sum(kv[1]))[:top]
        },
    }


def step_functions(
    path: Path, kind: str = "DECODE", part: str = "run_batch"
) -> tuple[int, float, dict[str, float]]:
    """Steps of one kind (DECODE, EXTEND), their mean `run_batch` time, and each Python
    function's inclusive time per such step (microseconds), from one trace.

    With `part` another range of the scheduler loop (SCHEDULER_PARTS: get_next_batch_to_run,
    process_batch_result, ...): every such range on the thread that runs the steps, whatever
    kind of step it prepares or finishes, and the functions' time per range. An off step's
    host time outside run_batch is there (job 20: get_next_batch_to_run took twice plain's)."""
    events = load(path)
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    steps = [e for e in ranges if e["name"].startswith(f"step[{kind}")]
    batches = [
        r
        for r in ranges
        if r["name"] == "scheduler.run_batch"
        and any(s["tid"] == r["tid"] and r["ts"] <= s["ts"] < r["ts"] + r["dur"] for s in steps)
    ]
    if part != "run_batch":
        threads = {r["tid"] for r in batches}
        batches = outermost(
            [r for r in ranges if r["name"] == f"scheduler.{part}" and r["tid"] in threads]
        )
    per_function: dict[str, float] = defaultdict(float)
    functions = [e for e in events if e.get("cat") == "python_function"]
    for r in batches:
        start, stop = float(r["ts"]), float(r["ts"]) + float(r["dur"])
        for e in functions:
            if e["tid"] == r["tid"] and start <= e["ts"] and e["ts"] + e["dur"] <= stop:
                per_function[e["name"]] += float(e["dur"])
    n = len(batches)
    if not n:
        return 0, 0.0, {}
    mean = sum(float(r["dur"]) for r in batches) / n
    return n, mean, {name: total / n for name, total in per_function.items()}


SCHEDULER_PARTS = (
    "scheduler.get_next_batch_to_run",
    "scheduler.process_batch_result",
    "scheduler.recv_requests",
)
"""The scheduler loop's other ranges, beside run_batch, that --steps accounts for."""


def outermost(found: list[dict]) -> list[dict]:
    """Ranges of one name on one thread, nested repeats dropped (the outermost kept)."""
    kept: list[dict] = []
    for r in sorted(found, key=lambda r: (r["ts"], -r["dur"])):
        if not kept or r["ts"] >= kept[-1]["ts"] + kept[-1]["dur"]:
            kept.append(r)
    return kept


def step_kinds(path: Path) -> dict:
    """Where the scheduler thread's time went, by kind of step: for each kind (DECODE, EXTEND,
    ...) the `run_batch` ranges holding such a step, their count and total time, and the
    `draft_extend` time inside them; the loop's other ranges; all over the span from the first
    run_batch to the end of the last. Nested ranges of one name count once (the outermost)."""
    ranges = [e for e in load(path) if e.get("cat") == "user_annotation"]
    batches = [r for r in ranges if r["name"] == "scheduler.run_batch"]
    if not batches:
        return {}
    tid = batches[0]["tid"]

    def named(name: str) -> list[dict]:
        return outermost([r for r in ranges if r["name"] == name and r["tid"] == tid])

    def inside(r: dict, e: dict) -> bool:
        return r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]

    batches = named("scheduler.run_batch")
    steps = [r for r in ranges if r["name"].startswith("step[") and r["tid"] == tid]
    drafts = named("draft_extend")
    begin = min(float(r["ts"]) for r in batches)
    end = max(float(r["ts"]) + float(r["dur"]) for r in batches)
    kinds: dict[str, dict[str, float]] = {}
    for r in batches:
        kind = next((s["name"][5:].split()[0].rstrip("]") for s in steps if inside(r, s)), "other")
        entry = kinds.setdefault(kind, {"count": 0, "run_batch_us": 0.0, "draft_extend_us": 0.0})
        entry["count"] += 1
        entry["run_batch_us"] += float(r["dur"])
        entry["draft_extend_us"] += sum(float(d["dur"]) for d in drafts if inside(r, d))
    parts = {
        name: sum(float(r["dur"]) for r in named(name) if begin <= r["ts"] < end)
        for name in SCHEDULER_PARTS
    }
    return {"span_us": end - begin, "kinds": kinds, "parts": parts}


def print_step_kinds(traces: list[Path]) -> None:
    for trace in traces:
        s = step_kinds(trace)
        if not s:
            print(f"{trace.parent.name or trace.name}: no scheduler.run_batch ranges")
            continue
        # A run_batch with no step in it is where the profiler started (the first, some
        # 300 ms): left out of the shares.
        unannotated = s["kinds"].pop("other", {}).get("run_batch_us", 0.0)
        span = s["span_us"] - unannotated
        print(
            f"{trace.parent.name or trace.name}: {span / 1000:.1f} ms from the first "
            f"run_batch to the end of the last, without {unannotated / 1000:.1f} ms of "
            "run_batch holding no step (the profiler starting)"
        )
        for kind, k in sorted(s["kinds"].items(), key=lambda kv: -kv[1]["run_batch_us"]):
            draft = k["draft_extend_us"] / k["count"]
            print(
                f"  run_batch {kind:8s} {k['count']:4.0f} x {k['run_batch_us'] / k['count']:8.0f}"
                f" us = {k['run_batch_us'] / 1000:7.1f} ms ({k['run_batch_us'] / span:4.0%})"
                + (f", draft_extend {draft:.0f} us a step" if draft else "")
            )
        for name, total in s["parts"].items():
            print(f"  {name:34s} {total / 1000:7.1f} ms ({total / span:4.0%})")


def gpu_per_step(path: Path, steps: int) -> dict:
    """A trace's span, GPU busy and idle time per step (us), and each kernel's time per step."""
    kernels, spans = gpu_work(load(path))
    if not kernels:
        return {}
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = union_length(spans)
    per_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        per_kernel[e["name"][:90]] += float(e.get("dur", 0)) / steps
    return {
        "span_us": span / steps,
        "busy_us": busy / steps,
        "idle_us": (span - busy) / steps,
        "kernels": dict(per_kernel),
    }


def level_of(trace: Path) -> tuple[str, str]:
    """(level, server) from a trace's folder, `NAME-cC` (gpu_envelope.py's profiles)."""
    name = trace.parent.name
    server, sep, level = name.rpartition("-c")
    return (f"c = {level}", server) if sep and level.isdigit() else ("", name)


KERNEL_FAMILIES = (
    ("GEMMs", ("nvjet", "gemm", "cutlass", "splitkreduce", "cublas", "sm90_xmma")),
    ("norms", ("norm",)),  # before attention: flashinfer's norms are "flashinfer::norm::..."
    ("attention", ("_fwd_kernel", "_fwd_grouped", "flash", "attn")),
    ("rope, KV store", ("rope", "rotary", "store_kv")),
    ("gathers, scatters", ("index", "gather", "scatter", "select")),
    ("copies, concatenations", ("copy", "memcpy", "cat")),
    ("elementwise", ("elementwise", "functor", "fill", "reduce")),
)
"""Kernel families by lower-case name fragment, first match wins; the rest are "other"."""


def kernel_family(name: str) -> str:
    lower = name.lower()
    for family, fragments in KERNEL_FAMILIES:
        if any(f in lower for f in fragments):
            return family
    return "other"


def plot_gpu_per_step(levels: dict[str, list[tuple[str, dict]]], path: Path) -> None:
    """Per level, each server's GPU time per step over the first server's (plain), by kernel
    family: what an off step adds on the GPU, and where."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f, _ in KERNEL_FAMILIES] + ["other"]
    shown = by_level(levels)
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.2), squeeze=False)
    for ax, level in zip(axes[0], shown, strict=True):
        base_name, base = levels[level][0]
        others = levels[level][1:]
        width = 0.8 / max(len(others), 1)
        for i, (name, run) in enumerate(others):
            extra = dict.fromkeys(families, 0.0)
            for kernel, us in run["kernels"].items():
                extra[kernel_family(kernel)] += us
            for kernel, us in base["kernels"].items():
                extra[kernel_family(kernel)] -= us
            xs = [j + i * width for j in range(len(families))]
            ax.bar(xs, [extra[f] for f in families], width, label=f"{name} - {base_name}")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(families))],
            families,
            rotation=35,
            ha="right",
            fontsize=8,
        )
        ax.set_ylabel("GPU time per profiled step, difference (us)")
        busy = ", ".join(f"{n} {r['busy_us']:.0f}" for n, r in levels[level])
        ax.set_title(f"{level}: GPU busy {busy} us a step", fontsize=9)
        if others:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def by_level(levels: dict[str, Any]) -> list[str]:
    """Level names (`c = 16`, `c = 128`, or "" where the folders name none) in numeric order."""
    return sorted(levels, key=lambda level: int(level[4:] or 0))


STEP_ROWS = {
    "span_us": "**span** (the step's period; an upper bound)",
    "busy_us": "**GPU busy**",
    "idle_us": "**GPU idle** (the host sets the pace; an upper bound)",
}


def print_gpu_per_step(traces: list[Path], steps: int, top: int, plot: Path | None = None) -> None:
    levels: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for trace in traces:
        level, server = level_of(trace)
        got = gpu_per_step(trace, steps)
        if got:
            levels[level].append((server, got))
    for runs in levels.values():
        runs.sort(key=lambda r: (r[0] != "plain", r[0]))
    if plot is not None:
        plot_gpu_per_step(levels, plot)
    for level in by_level(levels):
        runs = levels[level]
        first = runs[0][1]
        print(f"\n## {level or 'traces'}: us per profiled step ({steps} steps a trace)\n")
        print("| " + " | ".join(name for name, _ in runs) + " | |")
        print("|" + " ---: |" * len(runs) + " --- |")
        for row, label in STEP_ROWS.items():
            print("| " + " | ".join(f"{r[row]:.0f}" for _, r in runs) + f" | {label} |")
        names = {k for _, r in runs for k in r["kernels"]}
        gap = {
            k: max(abs(r["kernels"].get(k, 0.0) - first["kernels"].get(k, 0.0)) for _, r in runs)
            for k in names
        }
        for k in sorted(names, key=lambda k: (-gap[k], k))[:top]:
            cells = [f"{r['kernels'].get(k, 0.0):.1f}" for _, r in runs]
            print("| " + " | ".join(cells) + f" | `{k}` |")


SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
"""CUDA runtime calls that block the host until the GPU catches up."""


def host_syncs(path: Path, depth: int = 4) -> tuple[int, dict[tuple[str, str], list[float]]]:
    """The decode and prefill steps' blocking syncs, by call and by the innermost `depth` Python
    frames around each (innermost first): how many steps, and each site's wait times (us)."""
    events = load(path)
    steps = [
        e
        for e in events
        if e.get("cat") == "user_annotation" and str(e["name"]).startswith("step[")
    ]
    frames = sorted(
        (e for e in events if e.get("cat") == "python_function"), key=lambda e: float(e["ts"])
    )
    sites: dict[tuple[str, str], list[float]] = defaultdict(list)
    if not steps:
        return 0, sites
    begin = min(float(e["ts"]) for e in steps)
    end = max(float(e["ts"]) + float(e["dur"]) for e in steps)
    for sync in events:
        start = float(sync["ts"])
        if sync.get("name") not in SYNC_CALLS or not begin <= start <= end:
            continue
        stop = start + float(sync.get("dur", 0))
        around = [
            f
            for f in frames
            if f.get("tid") == sync.get("tid")
            and float(f["ts"]) <= start <= stop <= float(f["ts"]) + float(f["dur"])
        ]
        around.sort(key=lambda f: float(f["dur"]))
        # Builtins are named with their object's address ("... of Event object at 0x7f..."):
        # dropped, so one site in several traces reads the same.
        where = " < ".join(
            re.sub(r" at 0x[0-9a-f]+", "", str(f["name"]).rsplit(": ", 1)[-1])
            for f in around[:depth]
        )
        sites[(str(sync["name"]), where or "(no Python frame)")].append(float(sync.get("dur", 0)))
    return len(steps), sites


def print_syncs(traces: list[Path]) -> None:
    for trace in traces:
        steps, sites = host_syncs(trace)
        total = sum(sum(waits) for waits in sites.values())
        print(
            f"{trace.parent.name or trace.name}: {sum(map(len, sites.values()))} blocking "
            f"syncs in {steps} steps, {total / 1000:.1f} ms waiting"
        )
        for (call, where), waits in sorted(sites.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {len(waits):4d} x {call:22s} {sum(waits) / 1000:7.1f} ms  in {where}")


def print_functions(
    traces: list[Path], top: int, kind: str = "DECODE", part: str = "run_batch"
) -> None:
    results = [step_functions(t, kind, part) for t in traces]
    for trace, (n, mean, _) in zip(traces, results, strict=True):
        what = f"{kind} steps, run_batch" if part == "run_batch" else f"{part} ranges, each"
        print(f"{trace.parent.name or trace.name}: {n} {what} {mean:.0f} us")
    names = {name for _, _, functions in results for name in functions}
    ranked = sorted(names, key=lambda name: -max(r[2].get(name, 0.0) for r in results))
    print(" | ".join(f"{t.parent.name[:14]:>14}" for t in traces) + " | function (us per step)")
    for name in ranked[:top]:
        print(" | ".join(f"{r[2].get(name, 0.0):14.0f}" for r in results) + f" | {name[:100]}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--functions",
        type=int,
        default=0,
        metavar="N",
        help="the N Python functions with most time per --kind step",
    )
    parser.add_argument(
        "--kind",
        default="DECODE",
        help="with --functions, the kind of step: DECODE (default) or EXTEND (prefills)",
    )
    loop_parts = [name.removeprefix("scheduler.") for name in SCHEDULER_PARTS]
    parser.add_argument(
        "--part",
        default="run_batch",
        choices=["run_batch", *loop_parts],
        help="with --functions, the scheduler loop's range to split: run_batch "
        "(the steps of --kind, default) or another part of the loop, every "
        "range of it",
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="the scheduler thread's time by kind of step (decode, prefill) and by loop part",
    )
    parser.add_argument(
        "--gpu-per-step",
        action="store_true",
        help="GPU busy and idle time per step, and kernels per step, each "
        "level's servers side by side (traces of --trace-steps steps)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="with --gpu-per-step, a PNG of each server's GPU time per step "
        "over plain's, by kernel family",
    )
    parser.add_argument(
        "--trace-steps",
        type=int,
        default=24,
        help="steps each trace holds (the profile's num_steps)",
    )
    parser.add_argument(
        "--syncs",
        action="store_true",
        help="the blocking host-device syncs during the steps, by call and by "
        "the Python frames around them (each drains the overlap scheduler's "
        "queue)",
    )
    args = parser.parse_args()
    traces = sorted(Path(args.folder).rglob("*.trace.json*"))
    if not traces:
        print(f"no traces under {args.folder}", file=sys.stderr)
        return 1
    if args.steps:
        print_step_kinds(traces)
        return 0
    if args.gpu_per_step:
        print_gpu_per_step(traces, args.trace_steps, args.top, args.plot)
        return 0
    if args.syncs:
        print_syncs(traces)
        return 0
    if args.functions:
        print_functions(traces, args.functions, args.kind, args.part)
        return 0
    for trace in traces:
        s = summarise(trace, args.top)
        print(f"\n== {s['trace']}")
        if "error" in s:
            print(s["error"])
            continue
        print(
            f"span {s['span_ms']} ms, GPU busy {s['gpu_busy_ms']} ms "
            f"({100 * s['gpu_busy_ms'] / max(s['span_ms'], 1e-9):.0f}%), "
            f"{s['kernels']} kernels, {s['cuda_graph_launches']} graph launches"
        )
        for k in s["top_kernels"]:
            print(f"  {k['total_ms']:9.3f} ms {k['count']:6d}x {k['mean_us']:8.1f} us  {k['name']}")
        for name, a in s["annotations"].items():
            print(f"  [cpu range] {name}: {a['count']}x, mean {a['mean_us']} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
