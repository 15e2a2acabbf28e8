"""The GPU envelope's table and plot, and the simulator calibrated on it.

Reads the windows lab/bench/gpu_envelope.py saved (lab/results/gpu-envelope-*.json), and writes
  gpu_envelope.md    per concurrency: median output tok/s of each server with the spread of its
                     windows, TPOT p50/p99, accept length, the threshold specgate's router had
                     pushed, and X_d / max(X_a, X_b);
  gpu_envelope.png   the four curves (and the pinned-off servers), with the calibrated
                     simulator's plain and speculating curves dashed;
  gpu_envelope.json  the same figures;
and, with --write-profile, the simulator profile fitted to the sweep
(sim/specgate_sim/profiles/h200-3b-synthetic.json). The fit: the profile's step costs and
batch exponent by least squares on log tok/s of the plain and always-on medians (the simulator's own
closed-loop runs, 32-token prompts and 128 new tokens as in the sweep), the acceptance from the
measured accept length. Its error is reported against every server-level median the simulator
models: plain, always-on, and the patched server pinned off.

The sweep as the operator's pods run it (prefill CUDA graphs, jobs 32-33) has a profile of its
own (h200-3b-synthetic-deployed.json), fitted and checked the same way in its section, with its
plot (gpu_envelope_deployed.png); --held-out refits it to four levels and reports its error at
the other four (minutes of fitting). The same sweep with the routed engine's off steps four
tokens a request (jobs 82-88) is checked against that profile's plain and always-on, and
plotted with upstream's adaptive curve from jobs 32 and 38 (gpu_envelope_deployed_off_step_4.png);
the envelope's ratio by off-step length goes in gpu_envelope_deployed_ratio.png.

    .venv/bin/python lab/bench/envelope_report.py [--write-profile] [--held-out]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from specgate_sim.engine import closed_loop_throughput
from specgate_sim.profile import Profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))
from patchsum import patch_sha256  # type: ignore[import-not-found]

RESULTS = Path(__file__).resolve().parent.parent / "results"
PROFILE_PATH = (
    Path(__file__).resolve().parents[2] / "sim/specgate_sim/profiles/h200-3b-synthetic.json"
)
NAMES = {
    "plain": "(a) no speculation",
    "always-on": "(b) EAGLE-3 always on",
    "upstream-0step": "(c) upstream adaptive, off above 8",
    "specgate": "(d) patched + specgate router",
    "specgate-probes": "(d') the same, router probing",
    "specgate-probes-direct": "(d') direct to the engine, no proxy",
    # Jobs 1-11 ran the lean draft extend every off step; later ones the lagged KV write.
    "patched-off": "patched, pinned off",
    "patched-off-lean": "patched, pinned off, lean draft extend every step",
    # Job 1 only: the deferred draft extend was removed from the patch after it lost.
    "patched-off-deferred": "patched, pinned off, deferred draft extend",
    "patched-off-upstream-extend": "patched, pinned off, upstream's draft extend",
    # From the eighth session: the draft's whole prefill, where the patch writes its KV alone.
    "patched-off-full-prefill": "patched, pinned off, the draft's whole prefill",
    # From the sixteenth session: the prompts' draft KV write kernel by kernel, not from graphs.
    "patched-off-eager-prompt-kv": "patched, pinned off, prompts' draft KV write without graphs",
    # From the twenty-second session: several plain decode forwards per off step.
    "patched-off-2": "patched, pinned off, 2 tokens a request per off step",
    "patched-off-4": "patched, pinned off, 4 tokens a request per off step",
}
FITTED = (
    "overhead_s",
    "weights_s",
    "kv_s_per_request",
    "compute_s_per_token",
    "draft_overhead_s",
    "draft_s_per_request",
    "batch_exponent",
)
SIM_THRESHOLD: dict[str, int | None] = {"plain": 0, "always-on": None, "patched-off": 0}
"""Servers the simulator models, by the threshold that reproduces them (its off step is a plain
decode step: sync cost 0, which the patched-off / plain ratio supports)."""

Stats = dict[str, dict[int, dict[str, Any]]]

ENVELOPE_TEMPERATURE = 0.9
"""The sweep's sampling temperature (accept length near 3.3). Jobs at another temperature run
another draft quality: their figures get their own section and never fill the sweep's table."""
SWEEP_NEW_TOKENS = (64, 192)
"""The sweep's new tokens per request (gpu_envelope.py's NEW_TOKENS; a test keeps them equal)."""
SWEEP_SHAPE = "Llama 3B-class (hidden 3072, 28 layers, GQA 24/8), synthetic pair, bf16"
"""The sweep's target (gpu_envelope.py --shape 3b; a test keeps them equal). Jobs on another
shape get their own section."""


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def off_steps(tokens: int) -> str:
    """workload()'s words for a run whose routed servers decode `tokens` a request per off step."""
    return f"off steps of {tokens} tokens a request (routed, patched-8)"


def section_key(tp: int, temperature: float, differs: str) -> str:
    """The summary's key for the runs of one "Another workload" section."""
    return f"tp{tp}_t{temperature:g}_{slug(differs)}"


def workload(result: dict[str, Any]) -> str:
    """How a run's workload or host differs from the sweep's ('' where it does not). Other
    request lengths or prefill CUDA graphs change how much of a step is prefill, pinned
    servers run on fewer CPUs, and emptied prefix caches spare the servers the evictions of a
    full one: such runs get a section of their own, like another temperature."""
    differences = []
    if (shape := result.get("shape", SWEEP_SHAPE)) != SWEEP_SHAPE:
        differences.append(f"target {shape.removesuffix(', synthetic pair, bf16')}")
    low, high = result.get("new_tokens") or SWEEP_NEW_TOKENS
    if (low, high) != SWEEP_NEW_TOKENS:
        differences.append(f"{low}-{high} new tokens a request")
    if graph_tokens := result.get("prefill_graph_tokens"):
        differences.append(f"prefill CUDA graphs up to {graph_tokens} tokens")
    if result.get("flush_cache"):
        differences.append("prefix caches emptied before each window")
    if (tokens := result.get("off_step_tokens") or 1) != 1:
        differences.append(off_steps(tokens))
    if sizes := sorted(
        {len(s["cpus"]) for s in result.get("servers", {}).values() if s.get("cpus")}
    ):
        each = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        differences.append(f"each server pinned to {each} CPUs")
    if result.get("scheduler_cores"):
        differences.append("each scheduler alone on a physical core")
    if any(w.get("pyspy") for w in result.get("windows", ())):
        # py-spy reads the scheduler's memory 200 times a second and the GC probe wakes a
        # thread ten times a second in every server process: small, but not the sweep's host.
        differences.append("py-spy recording each window's scheduler")
    return ", ".join(differences)


def measured_windows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's windows, less those after --freeze-gc-from-rep's freeze: job 45's GC probe
    walked the frozen objects ten times a second there (lab/bench/gcstats/sitecustomize.py), so
    they measured the probe, not the servers."""
    return [w for w in result.get("windows", ()) if not w.get("gc_frozen")]


def split_by_pinning(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A job that pinned its schedulers in odd repeats only (--scheduler-cores odd-reps) as two
    runs: its free windows under its own name, as a job that pinned nothing, and its pinned
    ones under NAME-pinned.json, whose workload says so (workload())."""
    split: dict[str, dict[str, Any]] = {}
    for name, result in results.items():
        windows = result.get("windows", ())
        if not any("scheduler_pinned" in w for w in windows):
            split[name] = result
            continue
        free = {k: v for k, v in result.items() if k != "scheduler_cores"}
        free["windows"] = [w for w in windows if not w.get("scheduler_pinned")]
        split[name] = free
        pinned = dict(result, windows=[w for w in windows if w.get("scheduler_pinned")])
        split[name.removesuffix(".json") + "-pinned.json"] = pinned
    return split


def summarise(windows: Sequence[dict[str, Any]]) -> Stats:
    """Per server and concurrency: median and spread of the windows' figures."""
    grouped: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for w in windows:
        grouped.setdefault(w["server"], {}).setdefault(w["c"], []).append(w)
    stats: Stats = {}
    for server, by_c in grouped.items():
        for c, ws in sorted(by_c.items()):
            rates = [w["tok_s"] for w in ws]

            def med(key: str, ws: list[dict[str, Any]] = ws) -> float | None:
                values = [w[key] for w in ws if w.get(key) is not None]
                return round(statistics.median(values), 3) if values else None

            stats.setdefault(server, {})[c] = {
                "tok_s": round(statistics.median(rates), 1),
                "tok_s_undisturbed": round(quantile(rates, UNDISTURBED_QUANTILE), 1),
                "min": min(rates),
                "max": max(rates),
                "windows": len(ws),
                "tpot_ms_p50": med("tpot_ms_p50"),
                "tpot_ms_p99": med("tpot_ms_p99"),
                "accept_length": med("accept_length"),
                "thresholds": sorted({w["threshold"] for w in ws if "threshold" in w}),
                "speculating_windows": sum(1 for w in ws if w.get("steps_on")),
            }
    return stats


ROUTED = ("specgate", "specgate-probes")
FITTED_RUNS = ("gpu-envelope-1-low-c.json", "gpu-envelope-2-high-c.json")
DEPLOYED = "prefill CUDA graphs up to 2048 tokens, prefix caches emptied before each window"
"""workload() of the sweep as the operator's pods run it (jobs 32-33), which has a simulator
profile of its own."""
DEPLOYED_OFF_STEP_4 = f"{DEPLOYED}, {off_steps(4)}"
"""workload() of the deployed sweep with the routed engine's off steps four tokens a request
(jobs 82-88)."""
DEPLOYED_PROFILE_PATH = PROFILE_PATH.with_name("h200-3b-synthetic-deployed.json")
DEPLOYED_FITTED_RUNS = (
    "gpu-envelope-32-sweep-deployed-low-c.json",
    "gpu-envelope-33-sweep-deployed-high-c.json",
)
HELD_OUT_FIT_LEVELS = (1, 4, 16, 64)
"""--held-out: the deployed profile refitted to these levels, its error at the others."""
"""The jobs the simulator profile is fitted to: the first two, run ten minutes apart. Jobs 3
and 4 ran hours later on a host up to 1.5x faster, and one smooth profile cannot fit rows from
both (refitted to the composed table, three points stayed 11-19% off)."""


START_THRESHOLD = 8
"""The threshold lab/bench/gpu_envelope.py starts the routed server at. Above it a router that saw
no sustained load yet holds speculation off (it has nothing to learn from), so a job without a
learning phase does not measure the router's choice there: compose() takes rows above it only
from jobs with one (their routed windows still count in that job's own ratios)."""


def run_order(name: str) -> tuple[Any, ...]:
    """Jobs in the order they ran: by the job number in their name (gpu-envelope-10 after -9)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def job_number(name: str) -> int:
    """The job number in a run's name (gpu-envelope-12-off-lagged-ab.json: 12)."""
    match = re.search(r"\d+", name)
    if match is None:
        raise ValueError(f"{name}: no job number in the name (gpu-envelope-N-what.json)")
    return int(match[0])


def learned(result: dict[str, Any]) -> bool:
    """Whether a job's router had a learning phase before the sweep."""
    return any(entry.get("phase") == "learn" for entry in result.get("router_log", []))


def compose(runs: dict[str, Stats], learning: Iterable[str] = ()) -> tuple[Stats, dict[int, str]]:
    """One run per concurrency: of the runs that measured plain, always-on and a routed server
    there (above START_THRESHOLD only runs in `learning`: their router learned before the
    sweep), the one whose three servers all have the most windows there, the last of equals
    (in name order, which is the order they ran). The host's speed moved by up to 1.5x between
    GPU jobs, so figures of one row must come from one job to stay side by side. A server that
    run did not measure comes from the last run that did, its row marked with that run
    ("run"), and no ratio is taken across runs (`envelope_ratio`)."""
    learning = set(learning)
    stats: Stats = {}
    source: dict[int, str] = {}
    most: dict[int, int] = {}
    for name, run in sorted(runs.items(), key=lambda kv: run_order(kv[0])):
        for c in sorted({c for by_c in run.values() for c in by_c}):
            if c > START_THRESHOLD and name not in learning:
                continue
            routed = [run[s][c] for s in ROUTED if c in run.get(s, {})]
            if not routed or not all(c in run.get(s, {}) for s in ("plain", "always-on")):
                continue
            windows = min(
                run["plain"][c].get("windows", 1),
                run["always-on"][c].get("windows", 1),
                max(r.get("windows", 1) for r in routed),
            )
            if windows >= most.get(c, 0):
                source[c], most[c] = name, windows
    for c, name in source.items():
        for other, run in sorted(runs.items(), key=lambda kv: run_order(kv[0])):
            for server, by_c in run.items():
                if c in by_c and (other == name or c not in runs[name].get(server, {})):
                    stats.setdefault(server, {})[c] = {**by_c[c], "run": other}
    return stats, dict(sorted(source.items()))


PER_LEVEL_PAIRS = 10
"""A job with at least this many same-mode pairs at a level gets its own row for that level."""


def same_mode_pairs(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The routed server against the static server running the mode it ran, window by window:
    each routed window that speculated on every step, over always-on's window of the same
    concurrency and repeat, and each that speculated on none, over plain's. Adjacent windows
    of one job, so what is left is the patch's and the router's cost plus window noise. Where
    the job also measured the routed engine directly (gpu_envelope.py --direct-too), each
    routed window over that one too (mode "proxy": the proxy's cost plus noise)."""
    pairs = []
    for run, windows in sorted(runs.items(), key=lambda kv: run_order(kv[0])):
        by_key = {(w["server"], w["c"], w.get("rep")): w for w in windows}
        for (server, c, rep), w in sorted(by_key.items(), key=lambda kv: (kv[0][1], str(kv[0]))):
            if server not in ROUTED or not (w.get("steps_on") or w.get("steps_off")):
                continue
            mode = "on" if not w.get("steps_off") else "off" if not w.get("steps_on") else None
            static = by_key.get(({"on": "always-on", "off": "plain"}.get(mode or ""), c, rep))
            direct = by_key.get((f"{server}-direct", c, rep))
            for kind, other in ((mode, static), ("proxy", direct)):
                if kind is not None and other is not None and other["tok_s"] > 0:
                    pairs.append(
                        {
                            "run": run,
                            "c": c,
                            "rep": rep,
                            "mode": kind,
                            "ratio": round(w["tok_s"] / other["tok_s"], 3),
                            "tok_s": w["tok_s"],
                            "other_tok_s": other["tok_s"],
                        }
                    )
    return pairs


OFF_VARIANTS = (
    ("patched-off", "plain"),
    ("patched-off-lean", "plain"),
    ("patched-off-upstream-extend", "plain"),
    ("patched-off-full-prefill", "plain"),
    ("patched-off", "patched-off-lean"),
    ("patched-off", "patched-off-upstream-extend"),
    ("patched-off", "patched-off-full-prefill"),
    ("patched-off-eager-prompt-kv", "plain"),
    ("patched-off", "patched-off-eager-prompt-kv"),
    ("patched-off-2", "plain"),
    ("patched-off-4", "plain"),
    ("patched-off-2", "patched-off"),
    ("patched-off-4", "patched-off"),
    ("patched-on", "always-on"),
    ("upstream-0step", "always-on"),
    ("always-on", "upstream-always-on"),
)
"""Pinned-off servers against plain and against each other: the patch's off step
(patched-off: the lean draft extend every step in jobs 1-11, the lagged draft KV write inside
the target's decode graph since), the lean draft extend every step (patched-off-lean),
upstream's generic one (patched-off-upstream-extend), and the draft's whole prefill where the
patch writes the draft's KV alone since the eighth session (patched-off-full-prefill), and that
write launched kernel by kernel, as before the sixteenth session's CUDA graphs
(patched-off-eager-prompt-kv); off steps of 2 and 4 tokens a request (patched-off-2,
patched-off-4, --speculative-off-step-tokens); and the patched server speculating on every step
with its threshold controller live (patched-on) against always-on: what the machinery costs a
speculating step. And two pairs of speculating servers across the patch: upstream's adaptive
server (unpatched; at c <= 8 it speculates with always-on's three steps) over always-on, and
always-on (the patched SGLang, no threshold) over EAGLE-3 from unpatched SGLang
(upstream-always-on): whether the patch costs a speculating step."""


def window_pairs(
    windows: Sequence[dict[str, Any]], num: str, den: str, replica: int | None = None
) -> dict[int, list[tuple[float, float]]]:
    """Per concurrency, the (num, den) tok/s of every repeat both servers ran: adjacent in
    time, so the host's slow spells mostly hit both. A run with several processes of each
    server (gpu_envelope.py --replicas) pairs replica K of one with replica K of the other;
    `replica` keeps one such pair of processes."""
    by_key = {(w["server"], w["c"], w.get("rep"), w.get("replica", 1)): w["tok_s"] for w in windows}
    pairs: dict[int, list[tuple[float, float]]] = {}
    for server, c, rep, k in sorted(by_key, key=str):
        if server == num and replica in (None, k) and by_key.get((den, c, rep, k)):
            pairs.setdefault(c, []).append((by_key[(num, c, rep, k)], by_key[(den, c, rep, k)]))
    return dict(sorted(pairs.items()))


def replica_pairs(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """variant_pairs() of the runs with several processes per server, one row per pair of
    processes (replica K over replica K): whether one pair of processes gives another ratio
    than the next (same_code_pairs() gives how far apart one server's own processes run)."""
    rows = []
    for run, windows in sorted(runs.items(), key=lambda kv: run_order(kv[0])):
        replicas = sorted({w["replica"] for w in windows if "replica" in w})
        for num, den in OFF_VARIANTS if len(replicas) > 1 else ():
            for k in replicas:
                for c, paired in window_pairs(windows, num, den, replica=k).items():
                    rows.append(
                        {
                            "run": run,
                            "c": c,
                            "server": num,
                            "over": den,
                            "replica": k,
                            **geometric_summary([a / b for a, b in paired]),
                        }
                    )
    return sorted(
        rows, key=lambda r: (run_order(r["run"]), r["server"], r["over"], r["c"], r["replica"])
    )


def same_code_pairs(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """In runs with several processes per server: each later process of a server over its
    first, same repeat and level. The same code against itself, so any distance from 1 is
    what this host does to one process and not another: the floor under every ratio a job
    takes between two servers."""
    rows = []
    for run, windows in sorted(runs.items(), key=lambda kv: run_order(kv[0])):
        by_key = {
            (w["server"], w["c"], w["rep"], w["replica"]): w["tok_s"]
            for w in windows
            if "replica" in w
        }
        ratios: dict[tuple[str, int, int], list[float]] = {}
        for (server, c, rep, k), tok_s in by_key.items():
            first = by_key.get((server, c, rep, 1))
            if k > 1 and first:
                ratios.setdefault((server, c, k), []).append(tok_s / first)
        for (server, c, k), r in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            rows.append(
                {"run": run, "server": server, "c": c, "replica": k, **geometric_summary(r)}
            )
    return rows


def variant_pairs(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per run, concurrency and pair of OFF_VARIANTS: the window-by-window ratios (same repeat,
    adjacent in time), their geometric summary, and the undisturbed ratio over those windows."""
    rows = []
    for run, windows in sorted(runs.items(), key=lambda kv: run_order(kv[0])):
        for num, den in OFF_VARIANTS:
            for c, paired in window_pairs(windows, num, den).items():
                rows.append(
                    {
                        "run": run,
                        "c": c,
                        "server": num,
                        "over": den,
                        **geometric_summary([a / b for a, b in paired]),
                        **undisturbed_ratio([a for a, _ in paired], [b for _, b in paired]),
                    }
                )
    return rows


UNDISTURBED_QUANTILE = 0.8
"""This host's noise only ever slows a window: spells of a few windows in which the host runs
slower while the GPU keeps its clocks (BENCHMARKS.md job 60: 1.47x between windows of one
server, tok/s moving with the GPU's utilisation, r = 0.97). Each server's 80th percentile over
its windows is its speed when undisturbed, which such a spell moves less than it moves a
pair of adjacent windows."""


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def undisturbed_ratio(
    a: Sequence[float], b: Sequence[float], q: float = UNDISTURBED_QUANTILE, draws: int = 4000
) -> dict[str, Any]:
    """a's q-quantile over b's, and a bootstrap 90% interval for it (each side's windows drawn
    again on their own; seeded, so that the report regenerates byte for byte). Empty below
    three windows a side."""
    import random

    if min(len(a), len(b)) < 3:
        return {}
    rng = random.Random(0)
    ratios = sorted(
        quantile(rng.choices(a, k=len(a)), q) / quantile(rng.choices(b, k=len(b)), q)
        for _ in range(draws)
    )
    return {
        "undisturbed": round(quantile(a, q) / quantile(b, q), 3),
        "undisturbed_p05": round(ratios[int(0.05 * draws)], 3),
        "undisturbed_p95": round(ratios[int(0.95 * draws) - 1], 3),
    }


def undisturbed_of(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """undisturbed_ratio() of same_mode_pairs(): the routed windows over the static ones."""
    return undisturbed_ratio([p["tok_s"] for p in pairs], [p["other_tok_s"] for p in pairs])


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: the header, its rule and one line a row, each ending in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def interval(row: dict[str, Any]) -> str:
    """A geometric_summary() row's 90% interval, as a table cell."""
    return f"{row['p05']}-{row['p95']}"


def undisturbed_cell(row: dict[str, Any]) -> str:
    """Two table cells: the undisturbed ratio and its interval (blank below three pairs)."""
    if "undisturbed" not in row:
        return " | "
    return f"{row['undisturbed']} | {row['undisturbed_p05']}-{row['undisturbed_p95']}"


def geometric_summary(ratios: Sequence[float], draws: int = 4000) -> dict[str, Any]:
    """Geometric mean of `ratios` and a bootstrap 90% interval for it (seeded: the report must
    regenerate byte for byte)."""
    import random

    logs = [math.log(r) for r in ratios]
    rng = random.Random(0)
    means = [math.exp(statistics.fmean(rng.choice(logs) for _ in logs)) for _ in range(draws)]
    return _bootstrap_summary(logs, means)


def _bootstrap_summary(logs: Sequence[float], means: Sequence[float]) -> dict[str, Any]:
    """The geometric mean behind `logs` (the ratios' logarithms) and the 90% interval of its
    bootstrap draws `means`."""
    ordered = sorted(means)
    return {
        "pairs": len(logs),
        "geomean": round(math.exp(statistics.fmean(logs)), 3),
        "p05": round(ordered[int(0.05 * len(ordered))], 3),
        "p95": round(ordered[int(0.95 * len(ordered)) - 1], 3),
    }


def clustered_geometric_summary(
    groups: Sequence[Sequence[float]], draws: int = 4000
) -> dict[str, Any]:
    """geometric_summary() of ratios that come in groups (one per job): the same geometric mean
    of all of them, with an interval from a two-stage bootstrap (draw the groups, then the
    ratios within each drawn group). On this host whole jobs sit apart by more than their
    own pairs' spread explains, so treating every pair as independent would claim an interval
    narrower than the jobs bear out; with few groups this one is still on the narrow side."""
    import random

    logs = [[math.log(r) for r in group] for group in groups if group]
    rng = random.Random(0)
    means = []
    for _ in range(draws):
        drawn = [
            log
            for group in rng.choices(logs, k=len(logs))
            for log in rng.choices(group, k=len(group))
        ]
        means.append(math.exp(statistics.fmean(drawn)))
    return _bootstrap_summary([log for group in logs for log in group], means)


def envelope_ratio(stats: Stats, routed: str = "specgate", key: str = "tok_s") -> dict[int, float]:
    """X_d / max(X_a, X_b) wherever all three ran (`routed`: specgate or specgate-probes), of
    each server's median tok/s, or of another figure of summarise() (`key`)."""
    out = {}
    for c, d in stats.get(routed, {}).items():
        a, b = stats.get("plain", {}).get(c), stats.get("always-on", {}).get(c)
        if a and b and len({row.get("run") for row in (a, b, d)}) == 1:
            out[c] = round(d[key] / max(a[key], b[key]), 3)
    return out


DAGGER = " \N{DAGGER}"
"""Marks a ratio over always-on alone, from a run without plain (`over_always_on`)."""


def always_on_wins(runs: dict[str, Stats]) -> set[int]:
    """Concurrencies where always-on beat plain in every run that measured both (and at least
    one did): there max(X_a, X_b) is X_b, so a run that measured no plain still gives a ratio."""
    verdicts: dict[int, list[bool]] = {}
    for run in runs.values():
        for c, b in run.get("always-on", {}).items():
            a = run.get("plain", {}).get(c)
            if a:
                verdicts.setdefault(c, []).append(b["tok_s"] > a["tok_s"])
    return {c for c, wins in verdicts.items() if all(wins)}


NOT_POOLED = ("gpu-envelope-42-misses-engines-capped-at-16.json",)
"""Runs listed with the others but left out of envelope_pairs' pools: job 42's engines admitted
16 requests at most, below the load its learning phase ran, and its router then held a
threshold (15) a fix has since removed (BENCHMARKS.md): a flawed run, kept for that bug."""


def envelope_pairs(
    results: dict[str, dict[str, Any]], runs: dict[str, Stats], learning: Iterable[str]
) -> list[dict[str, Any]]:
    """X_d' / max(X_a, X_b) window by window: at each level of each run that measured plain,
    always-on and specgate-probes there, the routed window over the adjacent window of the
    static server with the higher median in that run (not the higher of each pair, which
    would favour whichever noisy window ran fast). Above START_THRESHOLD only runs in
    `learning`, as in compose(). Per run and level, then pooled per level over the runs from
    FIXED_ROUTED_PATH_JOB on (less NOT_POOLED) where there are several (jobs resampled, then
    pairs)."""
    learning = set(learning)
    per_run: list[dict[str, Any]] = []
    for name in sorted(runs, key=run_order):
        run = runs[name]
        for c in sorted(run.get("specgate-probes", {})):
            a, b = run.get("plain", {}).get(c), run.get("always-on", {}).get(c)
            if not (a and b) or (c > START_THRESHOLD and name not in learning):
                continue
            better = "always-on" if b["tok_s"] >= a["tok_s"] else "plain"
            pairs = window_pairs(results[name]["windows"], "specgate-probes", better).get(c)
            if pairs:
                ratios = [n / d for n, d in pairs]
                per_run.append(
                    {
                        "run": name,
                        "c": c,
                        "over": better,
                        "ratios": ratios,
                        **geometric_summary(ratios),
                    }
                )
    pooled = []
    for c in sorted({row["c"] for row in per_run}):
        current = [row for row in per_run if row["c"] == c]
        current = [
            row
            for row in current
            if job_number(row["run"]) >= FIXED_ROUTED_PATH_JOB and row["run"] not in NOT_POOLED
        ]
        if len(current) > 1:
            summary = clustered_geometric_summary([row["ratios"] for row in current])
            pooled.append(
                {
                    "run": f"runs from {FIXED_ROUTED_PATH_JOB} on",
                    "c": c,
                    "over": "/".join(sorted({row["over"] for row in current})),
                    "runs": [row["run"] for row in current],
                    **summary,
                }
            )
    return [{k: v for k, v in row.items() if k != "ratios"} for row in per_run] + pooled


def over_always_on(run: Stats, routed: str, wins: set[int]) -> dict[int, float]:
    """X_routed / X_b in a run without plain, at the concurrencies in `wins`."""
    out = {}
    for c, d in run.get(routed, {}).items():
        b = run.get("always-on", {}).get(c)
        if b and c in wins and c not in run.get("plain", {}):
            out[c] = round(d["tok_s"] / b["tok_s"], 3)
    return out


def off_ratios(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Speculation off against plain decoding, within one run only (its windows alternate, so
    the ratio is side by side): the patched server pinned off, and specgate's windows in which
    no step speculated."""
    rows = []
    for run, windows in runs.items():
        plain: dict[int, list[float]] = {}
        off: dict[tuple[str, int], list[float]] = {}
        for w in windows:
            if w["server"] == "plain":
                plain.setdefault(w["c"], []).append(w["tok_s"])
            elif w["server"].startswith("patched-off") or (
                w["server"].startswith("specgate") and w.get("steps_on") == 0 and w.get("steps_off")
            ):
                off.setdefault((w["server"], w["c"]), []).append(w["tok_s"])
        for (server, c), rates in sorted(off.items()):
            if c in plain:
                rows.append(
                    {
                        "run": run,
                        "server": server,
                        "c": c,
                        "windows": f"{len(rates)} / {len(plain[c])}",
                        "off_tok_s": statistics.median(rates),
                        "plain_tok_s": statistics.median(plain[c]),
                        "ratio": round(statistics.median(rates) / statistics.median(plain[c]), 3),
                    }
                )
    return rows


def scheduler_per_step(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run, server and c, over the windows that timed it: a decode step's wall time and
    the first scheduler's main thread in it, on a CPU and waiting for one (from /proc). The
    rest of the wall time it was blocked (the GPU, a lock, a socket). Same work at more CPU
    time per step is a slower CPU; more run-queue time is a contended one."""
    rows: list[dict[str, Any]] = []
    for run in sorted(results, key=run_order):
        seconds = float(results[run].get("seconds") or 0.0)
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for w in results[run]["windows"]:
            if w.get("scheduler_run_ms") and w.get("decode_steps"):
                groups.setdefault((w["server"], w["c"]), []).append(w)
        for (server, c), ws in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            steps = sum(float(w["decode_steps"]) for w in ws)
            wall = seconds * 1000 * len(ws) / steps
            on_cpu = sum(w["scheduler_run_ms"][0] for w in ws) / steps
            waiting = sum(w["scheduler_runqueue_ms"][0] for w in ws) / steps
            rows.append(
                {
                    "run": run,
                    "server": server,
                    "c": c,
                    "windows": len(ws),
                    "wall_ms": round(wall, 3),
                    "on_cpu_ms": round(on_cpu, 3),
                    "runqueue_ms": round(waiting, 3),
                    "blocked_ms": round(wall - on_cpu - waiting, 3),
                }
            )
    return rows


def accept_rate(accept_length: float, steps: int) -> float:
    """The per-token rate a whose chain 1 + a + ... + a^steps gives this accept length."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**j for j in range(steps + 1)) < accept_length else (lo, mid)
    return round((lo + hi) / 2, 4)


def always_on_accept_length(stats: Stats) -> float:
    """The accept length always-on measured: the median over its concurrencies."""
    return float(statistics.median(row["accept_length"] for row in stats["always-on"].values()))


def at_acceptance(profile: Profile, accept_length: float) -> Profile:
    """The profile with its draft's acceptance moved to give `accept_length`."""
    rate = accept_rate(accept_length, profile.num_steps)
    acceptance = profile.acceptance.model_copy(update={"per_token_rate": rate})
    return profile.model_copy(update={"acceptance": acceptance})


def simulate(profile: Profile, server: str, c: int) -> float:
    return closed_loop_throughput(
        profile,
        c,
        threshold=SIM_THRESHOLD[server],
        output_tokens=128,
        prompt_tokens=32,
        requests_per_client=6,
    )


def with_costs(base: Profile, values: Sequence[float]) -> Profile:
    costs = dict(zip(FITTED, values, strict=True))
    costs["batch_exponent"] = min(1.0, costs["batch_exponent"])  # sub-linear at most
    step = base.step.model_copy(update=costs)
    return base.model_copy(update={"step": step})


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], iterations: int) -> list[float]:
    """Minimise f from x0 (a plain Nelder-Mead: no SciPy in the project's dependencies)."""
    n = len(x0)
    simplex = [x0] + [[x + (0.5 if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    scored = sorted((f(x), x) for x in simplex)
    for _ in range(iterations):
        (best, xb), (worst, xw) = scored[0], scored[-1]
        centre = [sum(x[i] for _, x in scored[:-1]) / n for i in range(n)]

        def towards(t: float, xw: list[float] = xw, centre: list[float] = centre) -> list[float]:
            return [ci + t * (wi - ci) for ci, wi in zip(centre, xw, strict=True)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < best:
            expanded = towards(-2.0)
            fe = f(expanded)
            scored[-1] = (fe, expanded) if fe < fr else (fr, reflected)
        elif fr < scored[-2][0]:
            scored[-1] = (fr, reflected)
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < worst:
                scored[-1] = (fc, contracted)
            else:  # shrink towards the best point
                scored = [scored[0]] + [
                    (f(y), y)
                    for y in (
                        [b + 0.5 * (x - b) for b, x in zip(xb, x2, strict=True)]
                        for _, x2 in scored[1:]
                    )
                ]
        scored.sort(key=lambda s: s[0])
    return scored[0][1]


def fit_profile(stats: Stats, base: Profile, iterations: int = 300, restarts: int = 3) -> Profile:
    """Step costs by least squares on log tok/s of the plain and always-on medians."""
    points = [
        (s, c, row["tok_s"]) for s in ("plain", "always-on") for c, row in stats.get(s, {}).items()
    ]
    accept = always_on_accept_length(stats)
    base = at_acceptance(base, accept)
    start = [math.log(max(getattr(base.step, k), 1e-7)) for k in FITTED]

    def loss(logs: list[float]) -> float:
        profile = with_costs(base, [math.exp(v) for v in logs])
        return sum((math.log(simulate(profile, s, c)) - math.log(x)) ** 2 for s, c, x in points)

    for _ in range(restarts):  # a fresh simplex around the best point escapes a collapsed one
        start = nelder_mead(loss, start, iterations)
    return with_costs(base, [math.exp(v) for v in start])


def held_out_check(stats: Stats, base: Profile, fit_levels: Sequence[int]) -> dict[str, Any]:
    """The profile refitted to `fit_levels` only, its error at every other level (minutes of
    fitting: run by --held-out, not by every report)."""

    def at(keep: Callable[[int], bool]) -> Stats:
        return {s: {c: r for c, r in by_c.items() if keep(c)} for s, by_c in stats.items()}

    fitted = fit_profile(at(lambda c: c in fit_levels), base)
    return sim_error(fitted, at(lambda c: c not in fit_levels))


def sim_error(profile: Profile, stats: Stats) -> dict[str, Any]:
    rows = []
    for server in SIM_THRESHOLD:
        for c, row in sorted(stats.get(server, {}).items()):
            simulated = simulate(profile, server, c)
            rows.append(
                {
                    "server": server,
                    "c": c,
                    "measured": row["tok_s"],
                    "simulated": round(simulated, 1),
                    "error": round(simulated / row["tok_s"] - 1, 3),
                }
            )
    mape = statistics.mean(abs(r["error"]) for r in rows) if rows else math.nan
    grid = sorted(set(stats.get("plain", {})) & set(stats.get("always-on", {})))
    wins = [c for c in grid if stats["always-on"][c]["tok_s"] > stats["plain"][c]["tok_s"]]
    return {
        "points": rows,
        "mape": round(mape, 3),
        "grid": grid,
        "measured_speculation_wins_at": wins,
        "simulated_crossover_batch": profile.crossover_batch(),
    }


def held_out_acceptance(profile: Profile, stats: Stats) -> dict[str, Any]:
    """The sweep's simulator profile, moved to another group's accept length, against that
    group's measurements: always-on over plain per concurrency, simulated and measured. A ratio
    within one job cancels the host's speed, which moved between jobs; what is left tests the
    simulator's model of speculation, away from the acceptance it was fitted at."""
    accept = always_on_accept_length(stats)
    moved = at_acceptance(profile, accept)
    rows = []
    for c in sorted(set(stats.get("plain", {})) & set(stats["always-on"])):
        simulated = simulate(moved, "always-on", c) / simulate(moved, "plain", c)
        measured = stats["always-on"][c]["tok_s"] / stats["plain"][c]["tok_s"]
        rows.append(
            {
                "c": c,
                "simulated": round(simulated, 3),
                "measured": round(measured, 3),
                "error": round(simulated / measured - 1, 3),
            }
        )
    return {
        "accept_length": accept,
        "rows": rows,
        "simulated_crossover_batch": moved.crossover_batch(),
    }


def held_out_table(check: dict[str, Any], profile: Profile) -> str:
    rows = "".join(
        f"| {r['c']} | {r['simulated']} | {r['measured']} | {r['error']:+.1%} |\n"
        for r in check["rows"]
    )
    return (
        f"\nThe simulator ({profile.name}, fitted at the sweep's accept length) moved to this "
        f"group's accept length {check['accept_length']:.2f}: always-on over plain, simulated "
        "and measured (one job's medians, so the host's speed cancels):\n\n"
        "| c | simulated | measured | error |\n|---|---|---|---|\n"
        + rows
        + f"\nSimulated crossover at this acceptance: batch {check['simulated_crossover_batch']}."
        "\n"
    )


def table(
    stats: Stats,
    ratio: dict[int, float],
    probing: dict[int, float] | None = None,
    source: dict[int, str] | None = None,
    probing_undisturbed: dict[int, float] | None = None,
) -> str:
    """The envelope table; `probing`: X_d' of the router that probes, where it ran, and
    `probing_undisturbed` the same of the servers' 80th percentiles; `source`: the run each
    row comes from."""
    levels = sorted({c for by_c in stats.values() for c in by_c})
    extra = " X_d' / max(X_a, X_b) |" if probing else ""
    extra += " X_d' / max(X_a, X_b), undisturbed |" if probing_undisturbed else ""
    columns = 3 + bool(probing) + bool(probing_undisturbed) + sum(s in stats for s in NAMES)
    lines = [
        "| c | run | "
        + " | ".join(NAMES[s] for s in NAMES if s in stats)
        + " | X_d / max(X_a, X_b) |"
        + extra,
        "|---" * columns + "|",
    ]
    for c in levels:
        cells = []
        for server in (s for s in NAMES if s in stats):
            row = stats[server].get(c)
            if row is None:
                cells.append("")
                continue
            extra = f"; T={'/'.join(map(str, row['thresholds']))}" if row["thresholds"] else ""
            if source and row.get("run", source.get(c)) != source.get(c):
                extra += f"; from {_short(row['run'])}"
            accept = row["accept_length"]
            cells.append(
                f"**{row['tok_s']:,.0f}** ({row['min']:,.0f}-{row['max']:,.0f}, n={row['windows']})"
                f"<br>TPOT {row['tpot_ms_p50']}/{row['tpot_ms_p99']} ms"
                + (f"<br>accept {accept:.2f}" if accept and accept > 1.01 else "")
                + extra
            )
        tail = f" {probing.get(c, '')} |" if probing else ""
        tail += f" {probing_undisturbed.get(c, '')} |" if probing_undisturbed else ""
        run = _short((source or {}).get(c, ""))
        lines.append(f"| {c} | {run} | " + " | ".join(cells) + f" | {ratio.get(c, '')} |" + tail)
    return "\n".join(lines)


def _short(run: str) -> str:
    return run.removeprefix("gpu-envelope-").removesuffix(".json")


def plot(
    stats: Stats,
    profile: Profile | None,
    path: Path,
    tp: int = 1,
    accept: float = 3.3,
    setup: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for server, label in NAMES.items():
        if server not in stats:
            continue
        cs = sorted(stats[server])
        rows = [stats[server][c] for c in cs]
        y = [r["tok_s"] for r in rows]
        # The median is rounded to 0.1 tok/s, the range is not: clamp at 0.
        err = [
            [max(0.0, r["tok_s"] - r["min"]) for r in rows],
            [max(0.0, r["max"] - r["tok_s"]) for r in rows],
        ]
        left.errorbar(cs, y, yerr=err, marker="o", capsize=3, label=label)
        right.plot(cs, [r["tpot_ms_p50"] for r in rows], marker="o", label=label)
    if profile is not None:
        grid = [1, 2, 4, 8, 16, 32, 64, 128]
        for server, style in (("plain", "k--"), ("always-on", "k:")):
            left.plot(
                grid,
                [simulate(profile, server, c) for c in grid],
                style,
                linewidth=1,
                label=f"simulator, {server}",
            )
    for ax, ylabel in ((left, "output tok/s (median, min-max)"), (right, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    left.legend(fontsize=7)
    where = "H200" if tp == 1 else f"{tp} H200s, tensor parallel {tp},"
    fig.suptitle(
        f"{where} 3B-class synthetic pair (accept length ~{accept:.1f}), SGLang 0.5.17 "
        f"+ specgate{', ' + setup if setup else ''}\n"
        "each concurrency from one GPU job where it could be (BENCHMARKS.md); servers "
        "that job lacked come from another, whose host ran up to 1.5x slower",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ENVELOPE_TARGET = 0.97
"""X_d' / max(X_a, X_b) at every concurrency: the envelope's target (BENCHMARKS.md)."""


def deployed_section(summary: dict[str, Any], differs: str) -> dict[str, Any]:
    """The summary of the deployed sweep's section with workload `differs` (TP 1, the sweep's
    temperature); {} where the report made none."""
    found: dict[str, Any] = summary.get(section_key(1, ENVELOPE_TEMPERATURE, differs)) or {}
    return found


def deployed_ratio_series(
    summary: dict[str, Any],
) -> list[tuple[str, dict[int, float], dict[int, float]]]:
    """Per off-step length the deployed sweep ran at (TP 1, temperature 0.9), a label naming
    the jobs its rows come from, and its medians' and 80th percentiles' envelope ratios."""
    series = []
    for tokens, differs in ((1, DEPLOYED), (4, DEPLOYED_OFF_STEP_4)):
        found = deployed_section(summary, differs)
        if rows := found.get("row_source"):
            jobs = ", ".join(map(str, sorted({job_number(run) for run in rows.values()})))
            series.append(
                (
                    f"offStepTokens {tokens} (jobs {jobs})",
                    found["ratio_router_probing"],
                    found["ratio_router_probing_undisturbed"],
                )
            )
    return series


def plot_envelope_ratios(
    series: Sequence[tuple[str, dict[int, float], dict[int, float]]], path: Path
) -> None:
    """The routed server over the better static server against concurrency, one colour per
    (label, medians' ratio, 80th percentiles' ratio), the second dashed, with the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, medians, undisturbed), colour in zip(series, ("C0", "C3", "C2"), strict=False):
        cs = sorted(medians)
        ax.plot(cs, [medians[c] for c in cs], "o-", color=colour, label=f"{label}: medians")
        us = sorted(undisturbed)
        ax.plot(
            us,
            [undisturbed[c] for c in us],
            "x--",
            color=colour,
            alpha=0.7,
            label=f"{label}: 80th percentiles",
        )
    ax.axhline(
        ENVELOPE_TARGET, color="k", linewidth=1, linestyle=":", label=f"target {ENVELOPE_TARGET}"
    )
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xscale("log", base=2)
    grid = [1, 2, 4, 8, 16, 32, 64, 128]
    ax.set_xticks(grid, [str(c) for c in grid])
    ax.set_xlabel("concurrency (closed-loop clients)")
    ax.set_ylabel("routed server / max(plain, always-on)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(
        "H200, TP 1, as deployed: the router's envelope by tokens a request per off "
        "step\n(each level from one GPU job, every window side by side)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


OFF_HISTORY_LEVELS = (16, 64)
"""The worker-image target's two levels: the off step at >= OFF_TARGET of plain at both."""
OFF_TARGET = 0.95
LAST_LEAN_EXTEND_JOB = 11
"""Jobs up to this one ran the lean draft extend every off step; later ones the lagged draft
KV write inside the target's decode graph."""


def requests_label(result: dict[str, Any]) -> str:
    """A run's target and request lengths, the two things that move off over plain most: how
    much of a step the GPU sets, and how much of the host's time goes to prefills."""
    shape = result.get("shape", SWEEP_SHAPE).split(" (")[0].removeprefix("Llama ")
    low, high = result.get("new_tokens") or SWEEP_NEW_TOKENS
    return f"{shape} target, {low}-{high} new tokens"


def off_over_plain_history(
    results: dict[str, dict[str, Any]], variants: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Of `variants` (variant_pairs() rows of `results`' runs): patched-off over plain in every
    tensor-parallel-1 run that ran both at OFF_HISTORY_LEVELS, in job order, with
    requests_label() and whether the job ran the lean draft extend (LAST_LEAN_EXTEND_JOB)."""
    rows = []
    for row in sorted(variants, key=lambda r: (run_order(r["run"]), r["c"])):
        result = results[row["run"]]
        if (
            (row["server"], row["over"]) == ("patched-off", "plain")
            and row["c"] in OFF_HISTORY_LEVELS
            and (result.get("tp") or 1) == 1
        ):
            lean = job_number(row["run"]) <= LAST_LEAN_EXTEND_JOB
            rows.append(
                {
                    **row,
                    "run": _short(row["run"]),
                    "requests": requests_label(result),
                    "lean_extend": lean,
                }
            )
    return rows


UNRECORDED_PATCH_SHA256 = "6ada12efa6708ed2898427cf5537ff2cc2e06317f820b86f429a097f074de89a"
UNRECORDED_PATCH_JOBS = frozenset(range(63, 69))
"""Jobs 63-68 ran the patch with this checksum before gpu_envelope.py recorded one in its
results (`patch_sha256`); they count as the patch in the tree while it has this checksum."""


SAME_SOURCE_PATCH_SHA256 = {
    "6110794d32b7cabf00e6ca78a12487db4fbde21328f384fe04f7ddd228f6e679": "d3eb44f2153a635cce91c32a6b42c058238f69faa9941a1b7ec7348e8df8c181",  # noqa: E501
}
"""Checksums that GPU runs recorded, each with the checksum of a later patch file that applies
the same source. Jobs 73-76 ran a patch file that also held `Binary files ... differ`
stanzas for `__pycache__/*.cpython-311.pyc`, which `patch` turns into empty files Python 3.12
never reads; the next commit dropped them, changing the checksum and not one line of source."""


SAME_STEPS_PATCH_SHA256 = {
    "3b32944d20e5744a0194aeb130062845327a158b66cd9f2f0f3d1eacc96c3002": "bf5b1680eb0dea8903198f4fff12bfc486e8c32e86f7d3b7dcf3ce6054888d06",  # noqa: E501
    "bf5b1680eb0dea8903198f4fff12bfc486e8c32e86f7d3b7dcf3ce6054888d06": "cc14c4f8f41e014673f38fcaba8276b0b9d4c425c7462b0926943cce82f0a1cd",  # noqa: E501
}
"""Checksums that GPU runs recorded, each with the checksum of a later patch whose steps compute
the same on the path those runs took. Jobs 77-81 ran the patch of 73e8933. The next one
(1) counts all K tokens of an off step of several in the engine's generated-token counters
(decode moments, realtime tokens, logged throughput), where 73e8933 counted one a request; the
benchmark counts tokens at its clients; and (2) lays the off step's KV slot indices out one
contiguous row per forward, the same values, which a decode CUDA graph copies into its own
buffer either way (only an eager decode's KV store reads them in place; the runs' batches
all fit the graphs). Their figures stand for both. The patch of bf5b168 became the product
patch without its four A/B environment switches (kept in git history as
lab/gpu/patches/ab-toggles.patch): with the switches unset, as every run of the product's
servers left them, the same steps. Checksums chain: a run of 3b32944 counts for the product
patch of cc14c4f8. The patch after it samples the draft's first proposal on every 8th off
step (acceptance while off), so no run of these counts for it."""


def ran_patch(name: str, result: dict[str, Any], sha: str) -> bool:
    """Whether run `name` measured the patch whose checksum is `sha` (patchsum.py), or one that
    applies the same source or computes the same steps (SAME_SOURCE_PATCH_SHA256,
    SAME_STEPS_PATCH_SHA256)."""
    recorded = result.get("patch_sha256")
    if recorded is not None:
        seen: set[str] = set()
        while isinstance(recorded, str) and recorded not in seen:
            if recorded == sha:
                return True
            seen.add(recorded)
            recorded = SAME_SOURCE_PATCH_SHA256.get(recorded) or SAME_STEPS_PATCH_SHA256.get(
                recorded
            )
        return False
    return sha == UNRECORDED_PATCH_SHA256 and job_number(name) in UNRECORDED_PATCH_JOBS


POOLED_OFF_SERVERS = ("patched-off", "patched-off-2", "patched-off-4")
"""The pinned-off servers pooled against plain: one token a request per off step (the
engine's default) and 2 or 4 (--speculative-off-step-tokens)."""


def off_over_plain_pooled(
    results: dict[str, dict[str, Any]], sha: str, server: str = "patched-off"
) -> list[dict[str, Any]]:
    """`server` (a pinned-off kind) over plain at OFF_HISTORY_LEVELS, the window pairs of every
    tensor-parallel-1 run of the patch `sha` pooled per workload() and level: one job on this
    host can sit 5-10% from the next, so the worker-image target is judged on the pool, and
    runs whose workload or host differed (other requests, pinned servers, py-spy recording)
    pool apart. The interval resamples jobs, then pairs within them
    (clustered_geometric_summary)."""
    pooled: dict[tuple[str, int], list[list[float]]] = {}
    jobs: dict[tuple[str, int], list[int]] = {}
    for name, result in sorted(results.items(), key=lambda kv: run_order(kv[0])):
        if (result.get("tp") or 1) != 1 or not ran_patch(name, result, sha):
            continue
        for c, paired in window_pairs(result["windows"], server, "plain").items():
            if c in OFF_HISTORY_LEVELS:
                key = (workload(result), c)
                pooled.setdefault(key, []).append([a / b for a, b in paired])
                jobs.setdefault(key, []).append(job_number(name))
    return [
        {
            "server": server,
            "workload": setup,
            "c": c,
            "jobs": jobs[(setup, c)],
            **clustered_geometric_summary(groups),
        }
        for (setup, c), groups in sorted(pooled.items())
    ]


def target_verdict(row: dict[str, Any], target: float = OFF_TARGET) -> str:
    """yes: the whole 90% interval at or above `target`; no: all of it below; else the pairs
    do not tell."""
    if row["p05"] >= target:
        return "yes"
    return "no" if row["p95"] < target else "not resolved"


def off_over_plain_pooled_table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        "off server",
        "workload",
        "c",
        "jobs",
        "pairs",
        "geometric mean",
        "90% interval",
        "target met",
    )
    return md_table(
        header,
        (
            (
                r["server"],
                r["workload"] or "the sweep",
                r["c"],
                ", ".join(map(str, r["jobs"])),
                r["pairs"],
                r["geomean"],
                interval(r),
                target_verdict(r),
            )
            for r in rows
        ),
    )


def off_over_plain_table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        "run",
        "c",
        "requests",
        "pairs",
        "geometric mean",
        "90% interval",
        "undisturbed",
        "90% interval",
    )
    return md_table(
        header,
        (
            (
                r["run"],
                r["c"],
                r["requests"],
                r["pairs"],
                r["geomean"],
                interval(r),
                undisturbed_cell(r),
            )
            for r in rows
        ),
    )


def plot_off_over_plain(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per level: each run's geometric mean and 90% interval, and (x) its
    undisturbed ratio, coloured by requests_label(), against the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = list(dict.fromkeys(r["run"] for r in rows))
    labels = list(dict.fromkeys(r["requests"] for r in rows))
    colours = {label: f"C{i}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(
        1, len(OFF_HISTORY_LEVELS), figsize=(12, 0.25 * len(runs) + 2), sharey=True
    )
    handles: dict[str, Any] = {}
    for ax, c in zip(axes, OFF_HISTORY_LEVELS, strict=True):
        for r in (r for r in rows if r["c"] == c):
            colour = colours[r["requests"]]
            err = [[r["geomean"] - r["p05"]], [r["p95"] - r["geomean"]]]
            handles[r["requests"]] = ax.errorbar(
                r["geomean"],
                runs.index(r["run"]),
                xerr=err,
                fmt="o",
                capsize=2,
                color=colour,
                markerfacecolor="white" if r["lean_extend"] else colour,
            )
            if "undisturbed" in r:
                ax.plot(r["undisturbed"], runs.index(r["run"]), "x", color=colour, markersize=7)
        handles[f"target {OFF_TARGET}"] = ax.axvline(
            OFF_TARGET, color="k", linestyle="--", linewidth=1
        )
        ax.axvline(1.0, color="grey", linewidth=0.5)
        ax.set_title(f"c = {c}")
        ax.set_xlabel("off over plain, window by window (geometric mean, 90% interval)")
        ax.grid(alpha=0.3)
    if any("undisturbed" in r for r in rows):
        handles["x: undisturbed (the 80th percentiles' ratio)"] = Line2D(
            [], [], marker="x", color="k", linestyle="none"
        )
    axes[0].set_yticks(range(len(runs)), runs, fontsize=7)
    axes[0].invert_yaxis()
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(
        "The patch's speculation-off step against a plain server, one H200, every job "
        f"that ran both (BENCHMARKS.md); hollow: jobs 1-{LAST_LEAN_EXTEND_JOB}, the "
        "lean draft extend every off step",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_off_over_plain_pooled(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The pooled off servers against plain (off_over_plain_pooled), one group of bars per
    level and workload: each server's geometric mean and 90% interval, against the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    groups = list(dict.fromkeys((r["workload"], r["c"]) for r in rows))
    width = 0.8 / len(servers)
    fig, ax = plt.subplots(figsize=(max(8.0, 2.4 * len(groups) + 2), 4.8))
    for i, server in enumerate(servers):
        xs, means, low, high = [], [], [], []
        for r in (r for r in rows if r["server"] == server):
            xs.append(groups.index((r["workload"], r["c"])) + (i - (len(servers) - 1) / 2) * width)
            means.append(r["geomean"])
            low.append(r["geomean"] - r["p05"])
            high.append(r["p95"] - r["geomean"])
        ax.bar(xs, means, width, yerr=[low, high], capsize=3, label=server, color=f"C{i}")
    ax.axhline(OFF_TARGET, color="k", linestyle="--", linewidth=1, label=f"target {OFF_TARGET}")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ticks = [f"c = {c}" + (f"\n{textwrap.fill(w, 36)}" if w else "") for w, c in groups]
    ax.set_xticks(range(len(groups)), ticks, fontsize=7)
    ax.set_ylim(0.6, max(1.1, max(r["p95"] for r in rows) + 0.05))
    ax.set_ylabel("tok/s over plain, window pairs pooled over jobs")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        "Speculation off over a plain server, the patch in the tree:\none token a "
        "request per off step (patched-off), 2 or 4 (--speculative-off-step-tokens);\n"
        "geometric mean and 90% interval (jobs, then pairs, resampled)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_clock_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run, server and c, from the windows gpu_envelope.py's GPU telemetry covered: the
    spread of tok/s beside the spread of the GPU's clocks, power and utilisation, the
    clock-event reasons seen, and the correlation of a window's tok/s with its mean SM clock
    and with its GPU utilisation (None below three windows or where either is constant). A
    clock that moves with tok/s puts the noise on the GPU; a steady clock with utilisation
    moving with tok/s puts it on the host, which left the GPU idle."""
    rows = []
    for name, result in sorted(results.items(), key=lambda kv: run_order(kv[0])):
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for w in result["windows"]:
            if w.get("gpu_sm_mhz_mean") is not None:
                groups.setdefault((w["server"], w["c"]), []).append(w)
        for (server, c), ws in sorted(groups.items()):
            tok_s = [w["tok_s"] for w in ws]
            sm = [w["gpu_sm_mhz_mean"] for w in ws]
            power = [w["gpu_power_w_mean"] for w in ws if w.get("gpu_power_w_mean") is not None]
            util = [w["gpu_util_mean"] for w in ws if w.get("gpu_util_mean") is not None]
            steal = [100 * w["host_cpu_steal"] for w in ws if w.get("host_cpu_steal") is not None]
            rows.append(
                {
                    "run": _short(name),
                    "server": server,
                    "c": c,
                    "windows": len(ws),
                    "tok_s": (min(tok_s), max(tok_s)),
                    "sm_mhz_mean": (min(sm), max(sm)),
                    "sm_mhz_lowest": min(w.get("gpu_sm_mhz_min", w["gpu_sm_mhz_mean"]) for w in ws),
                    "power_w": (min(power), max(power)) if power else None,
                    "util": (min(util), max(util)) if util else None,
                    "host_steal_pct": (min(steal), max(steal)) if steal else None,
                    "reasons": sorted({x for w in ws for x in w.get("gpu_clock_reasons", ())}),
                    "r_tok_s_sm": correlation(tok_s, sm),
                    "r_tok_s_util": correlation(tok_s, util) if len(util) == len(ws) else None,
                }
            )
    return rows


def correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r to two places; None below three points or where either side is constant."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return round(statistics.correlation(xs, ys), 2)


def gpu_clock_table(rows: Sequence[dict[str, Any]]) -> str:
    def span(pair: tuple[float, float] | None) -> str:
        return "" if pair is None else f"{pair[0]:,.0f}-{pair[1]:,.0f}"

    # Stolen CPU is a few percent at most: one decimal.
    def share(pair: tuple[float, float] | None) -> str:
        return "" if pair is None else f"{pair[0]:.1f}-{pair[1]:.1f}"

    lines = [
        "| run | server | c | windows | tok/s | SM clock, window means (MHz) | lowest SM clock "
        "| power (W) | GPU utilisation (%) | host CPU stolen (%) | clock reasons "
        "| r(tok/s, SM clock) | r(tok/s, utilisation) |",
        "|---" * 13 + "|",
    ]
    for r in rows:
        reasons = ", ".join(r["reasons"]) or "none"
        lines.append(
            f"| {r['run']} | {r['server']} | {r['c']} | {r['windows']} | {span(r['tok_s'])} | "
            f"{span(r['sm_mhz_mean'])} | {r['sm_mhz_lowest']:,.0f} | {span(r['power_w'])} | "
            f"{span(r['util'])} | {share(r['host_steal_pct'])} | {reasons} | {r['r_tok_s_sm']} | "
            f"{r['r_tok_s_util']} |"
        )
    return "\n".join(lines) + "\n"


def idle_servers_slept(result: dict[str, Any]) -> bool:
    """Whether a run started every server it launched with --sleep-on-idle. Runs that did not
    record their servers' arguments (jobs 1-23) all ran SGLang's busy idle loop."""
    launched = [s for s in result.get("servers", {}).values() if "direct_of" not in s]
    return bool(launched) and all("--sleep-on-idle" in s.get("args", ()) for s in launched)


FIXED_ROUTED_PATH_JOB = 38
"""The first job after the two faults the sweep found were fixed (a stream sync on every
prefill in the patch, the router's httpx pool; BENCHMARKS.md jobs 36-40): the routed server's
pools from it on measure the code as it stands, the "all runs" pools its history too."""


def run_section(results: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any], Stats]:
    """The table, every run's ratios, off against plain and the same-mode pairs of one group of
    runs (one tensor-parallel size): markdown, the figures, and the composed table's stats."""
    runs = {name: summarise(r["windows"]) for name, r in results.items()}
    learning = [name for name, r in results.items() if learned(r)]
    stats, source = compose(runs, learning)
    side_by_side = off_ratios({name: r["windows"] for name, r in results.items()})
    pairs = same_mode_pairs({name: r["windows"] for name, r in results.items()})
    ratio = envelope_ratio(stats)
    by_pairs = envelope_pairs(results, runs, learning)
    probing = envelope_ratio(stats, "specgate-probes")
    probing_undisturbed = envelope_ratio(stats, "specgate-probes", key="tok_s_undisturbed")
    every_run = []
    wins = always_on_wins(runs)
    for name, run in runs.items():
        by_routed = {r: envelope_ratio(run, r) for r in (*ROUTED, "upstream-0step")}
        no_plain = {r: over_always_on(run, r, wins) for r in ROUTED}
        for r, extra in no_plain.items():
            by_routed[r].update(extra)
        for c in sorted({c for by_c in by_routed.values() for c in by_c}):
            every_run.append(
                {
                    "run": name,
                    "c": c,
                    **{r: by_c.get(c) for r, by_c in by_routed.items()},
                    "over_always_on_only": any(c in extra for extra in no_plain.values()),
                }
            )
    same_mode_rows = []
    for mode, static in (("on", "always-on"), ("off", "plain"), ("proxy", "the engine direct")):
        for low, high in ((1, START_THRESHOLD), (START_THRESHOLD + 1, 1 << 20)):
            chosen = [p for p in pairs if p["mode"] == mode and low <= p["c"] <= high]
            span = f"{low}-{high}" if high < 1 << 20 else f">= {low}"
            runs_here = sorted({p["run"] for p in chosen}, key=run_order)
            current = [run for run in runs_here if job_number(run) >= FIXED_ROUTED_PATH_JOB]
            pools = {"all runs": runs_here} if len(runs_here) > 1 else {}
            if 1 < len(current) < len(runs_here):
                pools[f"runs from {FIXED_ROUTED_PATH_JOB} on"] = current
            for run in runs_here + list(pools):
                mine = [p for p in chosen if p["run"] in pools.get(run, [run])]
                # Percentiles pooled over jobs or levels would mix speeds: one run, one level.
                one_level = len({p["c"] for p in mine}) == 1
                upper = undisturbed_of(mine) if run not in pools and one_level else {}
                if mine:
                    ratios = [p["ratio"] for p in mine]
                    same_mode_rows.append(
                        {
                            "mode": mode,
                            "static": static,
                            "c": span,
                            "run": run,
                            **geometric_summary(ratios),
                            **upper,
                        }
                    )
                # A job with many pairs per level also answers per level.
                levels = sorted({p["c"] for p in chosen if p["run"] == run})
                for c in levels if run not in pools and len(levels) > 1 else []:
                    at_c = [p for p in chosen if p["run"] == run and p["c"] == c]
                    if len(at_c) >= PER_LEVEL_PAIRS:
                        same_mode_rows.append(
                            {
                                "mode": mode,
                                "static": static,
                                "c": str(c),
                                "run": run,
                                **geometric_summary([p["ratio"] for p in at_c]),
                                **undisturbed_of(at_c),
                            }
                        )
    md = (
        table(stats, ratio, probing, source, probing_undisturbed)
        + "\n\nEvery run's ratios (each side by side within its run):\n\n"
        + "| run | c | X_c / max(X_a, X_b) | X_d / max(X_a, X_b) | X_d' / max(X_a, X_b) |\n"
        + "|---|---|---|---|---|\n"
        + "".join(
            f"| {r['run']} | {r['c']} | {r['upstream-0step'] or ''} | {r['specgate'] or ''} | "
            f"{r['specgate-probes'] or ''}{DAGGER if r['over_always_on_only'] else ''} |\n"
            for r in every_run
        )
        + (
            f"\n{DAGGER.strip()} the run measured no plain server: the routed server over "
            "always-on, which beat plain at this c in every run that measured both.\n"
            if any(r["over_always_on_only"] for r in every_run)
            else ""
        )
    )
    if by_pairs:
        md += (
            "\nThe routed server over the better static server (by each run's medians), window "
            "by window: per run and level, and pooled per level over runs from "
            f"{FIXED_ROUTED_PATH_JOB} on except {', '.join(map(_short, NOT_POOLED))} (geometric "
            "mean, bootstrap 90% interval; the target "
            f"{ENVELOPE_TARGET} met where the whole interval is at or above it):\n\n"
        )
        md += md_table(
            (
                "c",
                "run",
                "over",
                "pairs",
                "geometric mean",
                "90% interval",
                f">= {ENVELOPE_TARGET}",
            ),
            (
                (
                    r["c"],
                    _short(r["run"]),
                    r["over"],
                    r["pairs"],
                    r["geomean"],
                    interval(r),
                    target_verdict(r, ENVELOPE_TARGET),
                )
                for r in sorted(by_pairs, key=lambda r: r["c"])
            ),
        )
    md += "\nSpeculation off against plain, side by side (one run's windows):\n\n"
    md += md_table(
        ("run", "server", "c", "windows (off / plain)", "off tok/s", "plain tok/s", "ratio"),
        (
            (
                r["run"],
                r["server"],
                r["c"],
                r["windows"],
                f"{r['off_tok_s']:,.0f}",
                f"{r['plain_tok_s']:,.0f}",
                r["ratio"],
            )
            for r in side_by_side
        ),
    )
    md += (
        "\nThe routed server against the static server in the same mode, window by window "
        "(every routed window that ran one mode throughout, over the adjacent window of "
        "always-on or plain; per run and pooled; geometric mean, bootstrap 90% interval; "
        "undisturbed, per run and level: the 80th percentiles' ratio over those windows):\n\n"
    )
    md += md_table(
        (
            "mode",
            "over",
            "c",
            "run",
            "pairs",
            "geometric mean",
            "90% interval",
            "undisturbed",
            "90% interval",
        ),
        (
            (
                r["mode"],
                r["static"],
                r["c"],
                _short(r["run"]),
                r["pairs"],
                r["geomean"],
                interval(r),
                undisturbed_cell(r),
            )
            for r in same_mode_rows
        ),
    )
    variants = variant_pairs({name: r["windows"] for name, r in results.items()})
    if variants:
        md += (
            "\nThe off step's variants, window by window (same repeat; geometric mean, "
            "bootstrap 90% interval), and undisturbed (the ratio of the two servers' 80th "
            "percentiles over those windows; each side drawn again on its own for the "
            "interval):\n\n"
        )
        md += md_table(
            (
                "run",
                "c",
                "server",
                "over",
                "pairs",
                "geometric mean",
                "90% interval",
                "undisturbed",
                "90% interval",
            ),
            (
                (
                    _short(r["run"]),
                    r["c"],
                    r["server"],
                    r["over"],
                    r["pairs"],
                    r["geomean"],
                    interval(r),
                    undisturbed_cell(r),
                )
                for r in variants
            ),
        )
    by_process = replica_pairs({name: r["windows"] for name, r in results.items()})
    if by_process:
        md += (
            "\nThe same, process by process, in runs with several processes per server "
            "(`--replicas`; replica K over replica K):\n\n"
        )
        md += md_table(
            ("run", "c", "server", "over", "replica", "pairs", "geometric mean", "90% interval"),
            (
                (
                    _short(r["run"]),
                    r["c"],
                    r["server"],
                    r["over"],
                    r["replica"],
                    r["pairs"],
                    r["geomean"],
                    interval(r),
                )
                for r in by_process
            ),
        )
    same_code = same_code_pairs({name: r["windows"] for name, r in results.items()})
    if same_code:
        md += (
            "\nThe same code against itself: each server's second process over its first, "
            "window by window (same repeat and level):\n\n"
        )
        md += md_table(
            ("run", "c", "server", "processes", "pairs", "geometric mean", "90% interval"),
            (
                (
                    _short(r["run"]),
                    r["c"],
                    r["server"],
                    f"{r['replica']} over 1",
                    r["pairs"],
                    r["geomean"],
                    interval(r),
                )
                for r in same_code
            ),
        )
    host = scheduler_per_step(results)
    if host:
        md += (
            "\nA decode step's time and the scheduler's main thread in it (rank 0, /proc "
            "schedstat; ms per decode step of the windows, prefills included):\n\n"
        )
        md += md_table(
            ("run", "server", "c", "windows", "wall", "on a CPU", "waiting for a CPU", "blocked"),
            (
                (
                    _short(r["run"]),
                    r["server"],
                    r["c"],
                    r["windows"],
                    r["wall_ms"],
                    r["on_cpu_ms"],
                    r["runqueue_ms"],
                    r["blocked_ms"],
                )
                for r in host
            ),
        )
    slept = sorted((name for name, r in results.items() if idle_servers_slept(r)), key=run_order)
    busy = "each spun a core in SGLang's busy idle loop while another server was measured"
    if slept and len(slept) == len(results):
        md += "\nIdle servers: asleep (`--sleep-on-idle`) in every run"
    elif slept:
        asleep = ", ".join(map(_short, slept))
        md += f"\nIdle servers: asleep (`--sleep-on-idle`) in {asleep}; in every other run {busy}"
    else:
        md += f"\nIdle servers: in every run {busy}"
    md += ' (BENCHMARKS.md, "This host\'s noise").\n'
    figures = {
        "inputs": sorted(results, key=run_order),
        "stats": stats,
        "ratio": ratio,
        "idle_servers_slept": slept,
        "ratio_router_probing": probing,
        "ratio_router_probing_undisturbed": probing_undisturbed,
        "row_source": source,
        "every_run": every_run,
        "envelope_pairs": by_pairs,
        "off_vs_plain_side_by_side": side_by_side,
        "same_mode_pairs": pairs,
        "same_mode_summary": same_mode_rows,
        "off_variant_pairs": variants,
        "off_variant_pairs_by_process": by_process,
        "same_code_pairs": same_code,
        "scheduler_per_step": host,
    }
    return md, figures, stats


def load_profile(path: Path) -> Profile:
    return Profile.model_validate(json.loads(path.read_text()))


def write_profile(profile: Profile, path: Path) -> None:
    data = profile.model_dump(by_alias=True)
    data["step"] = {k: round(v, 8) for k, v in data["step"].items()}
    path.write_text(json.dumps(data, indent=2) + "\n")


def deployed_calibration(
    group: dict[str, dict[str, Any]],
    table: Stats,
    args: argparse.Namespace,
    summary: dict[str, Any],
    accept: float,
) -> str:
    """The deployed profile against the runs it is fitted to and the section's table (refitted
    first with --write-profile, checked on held-out levels with --held-out), and the section's
    plot with its curves: markdown ('' where the group holds none of those runs)."""
    runs = [name for name in DEPLOYED_FITTED_RUNS if name in group]
    if not runs:
        return ""
    fitted_stats = summarise([w for name in runs for w in group[name]["windows"]])
    profile = load_profile(DEPLOYED_PROFILE_PATH)
    if args.write_profile:
        profile = fit_profile(fitted_stats, profile)
        write_profile(profile, DEPLOYED_PROFILE_PATH)
    fitted = sim_error(profile, fitted_stats)
    composed = sim_error(profile, table) if table else None
    summary.update(simulator=fitted, simulator_vs_table=composed)
    against_table = (
        f", {composed['mape']:.1%} over the table's {len(composed['points'])}" if composed else ""
    )
    md = (
        f"\nThe simulator ({profile.name}): MAPE {fitted['mape']:.1%} over the "
        f"{len(fitted['points'])} medians of the runs it is fitted to "
        f"({', '.join(map(_short, runs))}){against_table}; speculation wins (measured) at "
        f"c = {fitted['measured_speculation_wins_at']}, simulated crossover batch "
        f"{fitted['simulated_crossover_batch']}.\n"
    )
    if args.held_out:
        check = held_out_check(fitted_stats, profile, HELD_OUT_FIT_LEVELS)
        summary["simulator_held_out"] = check
        md += (
            f"Refitted to c = {', '.join(map(str, HELD_OUT_FIT_LEVELS))} only: MAPE "
            f"{check['mape']:.1%} at the other levels (worst "
            f"{max(abs(p['error']) for p in check['points']):.1%}).\n"
        )
    plot(
        table or fitted_stats,
        profile,
        args.out / "gpu_envelope_deployed.png",
        accept=accept,
        setup="as deployed (prefill CUDA graphs, caches emptied before each window)",
    )
    return md


def off_step_4_check(table: Stats, summary: dict[str, Any]) -> str:
    """The deployed profile against the static servers of the deployed sweep with four-token off
    steps: off steps change only the routed server, so these are held-out jobs of the servers
    the profile was fitted to (markdown; the error goes into `summary`)."""
    profile = load_profile(DEPLOYED_PROFILE_PATH)
    error = sim_error(profile, table)
    summary["simulator"] = error
    if not error["points"]:
        return ""
    return (
        f"\nThe simulator ({profile.name}, fitted to jobs "
        f"{', '.join(str(job_number(run)) for run in DEPLOYED_FITTED_RUNS)}) against this "
        f"table's plain and always-on, which off steps do not touch: MAPE "
        f"{error['mape']:.1%} over {len(error['points'])} medians; speculation wins "
        f"(measured) at c = {error['measured_speculation_wins_at']}, simulated crossover "
        f"batch {error['simulated_crossover_batch']}.\n"
    )


def with_rows_of(stats: Stats, donor: Stats, server: str) -> Stats:
    """`stats` with `server`'s rows taken from `donor` where `stats` has none: a curve for the
    plot from another section whose server the difference between them does not touch."""
    if server in stats or server not in donor:
        return stats
    return {**stats, server: donor[server]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--write-profile", action="store_true")
    parser.add_argument(
        "--fit-runs",
        default=",".join(FITTED_RUNS),
        help="the runs (file names) the profile is fitted to, pooled",
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="also refit the deployed profile to c = "
        f"{', '.join(map(str, HELD_OUT_FIT_LEVELS))} and print its error at "
        "the other levels (minutes)",
    )
    args = parser.parse_args(argv)
    inputs = args.inputs or sorted(
        RESULTS.glob("gpu-envelope-*.json"), key=lambda path: run_order(path.name)
    )
    results = split_by_pinning({p.name: json.loads(p.read_text()) for p in inputs})
    for result in results.values():
        result["windows"] = measured_windows(result)
    groups: dict[tuple[int, float, str], dict[str, dict[str, Any]]] = {}
    for name, result in results.items():
        group_key = (
            result.get("tp") or 1,
            result.get("temperature", ENVELOPE_TEMPERATURE),
            workload(result),
        )
        groups.setdefault(group_key, {})[name] = result
    fit_runs = sorted(name for name in results if name in args.fit_runs.split(","))
    fitted_stats = summarise([w for name in fit_runs for w in results[name]["windows"]])
    profile = None
    if PROFILE_PATH.exists() and not args.write_profile:
        profile = load_profile(PROFILE_PATH)
    elif args.write_profile:
        if not PROFILE_PATH.exists():
            raise SystemExit(f"{PROFILE_PATH} is missing: it holds the metadata to fit into")
        profile = fit_profile(fitted_stats, load_profile(PROFILE_PATH))
        write_profile(profile, PROFILE_PATH)
    args.out.mkdir(parents=True, exist_ok=True)
    md, summary, stats = run_section(groups.pop((1, ENVELOPE_TEMPERATURE, ""), {}))
    variants = list(summary.get("off_variant_pairs", ()))
    error = sim_error(profile, fitted_stats) if profile else None
    error_composed = sim_error(profile, stats) if profile else None
    summary.update(simulator=error, simulator_vs_table=error_composed)
    if stats:
        plot(stats, profile, args.out / "gpu_envelope.png")
    for (tp, temperature, differs), group in sorted(
        groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])
    ):
        group_md, group_summary, group_stats = run_section(group)
        variants += group_summary.get("off_variant_pairs", ())
        accept = statistics.median(r["predicted_accept_length"] for r in group.values())
        if differs:
            md += (
                f"\n## Another workload ({differs}), temperature {temperature:g}, tensor "
                f"parallel {tp}\n\n" + group_md
            )
            summary[section_key(tp, temperature, differs)] = group_summary
            if (differs, tp, temperature) == (DEPLOYED, 1, ENVELOPE_TEMPERATURE):
                # The deployed sweep has a simulator profile of its own; other workloads none.
                md += deployed_calibration(group, group_stats, args, group_summary, accept)
            elif (differs, tp, temperature) == (DEPLOYED_OFF_STEP_4, 1, ENVELOPE_TEMPERATURE):
                md += off_step_4_check(group_stats, group_summary)
            continue
        if temperature == ENVELOPE_TEMPERATURE:
            md += f"\n## Tensor parallel {tp}: every server spans {tp} GPUs\n\n" + group_md
            key, png = f"tp{tp}", f"gpu_envelope_tp{tp}.png"
        else:
            md += (
                f"\n## Temperature {temperature:g}, tensor parallel {tp}: a weaker draft "
                f"(accept length ~{accept:.1f})\n\n" + group_md
            )
            key, png = f"tp{tp}_t{temperature:g}", f"gpu_envelope_tp{tp}_t{temperature:g}.png"
        if profile is not None and tp == 1 and temperature != ENVELOPE_TEMPERATURE and group_stats:
            check = held_out_acceptance(profile, group_stats)
            md += held_out_table(check, profile)
            group_summary["simulator_at_this_acceptance"] = check
        summary[key] = group_summary
        if group_stats:
            plot(group_stats, None, args.out / png, tp=tp, accept=accept)
    if len(by_tokens := deployed_ratio_series(summary)) == 2:
        plot_envelope_ratios(by_tokens, args.out / "gpu_envelope_deployed_ratio.png")
    if four := deployed_section(summary, DEPLOYED_OFF_STEP_4).get("stats"):
        # The four curves as the operator would run them with four-token off steps; upstream's
        # adaptive server (unpatched: no off step of ours) from the one-token sweep's jobs.
        one = deployed_section(summary, DEPLOYED).get("stats", {})
        plot(
            with_rows_of(four, one, "upstream-0step"),
            load_profile(DEPLOYED_PROFILE_PATH),
            args.out / "gpu_envelope_deployed_off_step_4.png",
            accept=always_on_accept_length(four),
            setup="as deployed, the routed engine's off steps 4 tokens a request",
        )
    history = off_over_plain_history(results, variants)
    if history:
        md += (
            "\n## Speculation off over plain, every run at tensor parallel 1\n\n"
            "Window by window (same repeat; geometric mean, bootstrap 90% interval); the "
            "worker-image target is 0.95 at both levels. Plot: off_over_plain.png.\n\n"
            + off_over_plain_table(history)
        )
        summary["off_over_plain"] = history
        plot_off_over_plain(history, args.out / "off_over_plain.png")
    sha = patch_sha256()
    if pooled := [
        row for server in POOLED_OFF_SERVERS for row in off_over_plain_pooled(results, sha, server)
    ]:
        md += (
            "\n## Speculation off over plain, the patch as it stands, pooled\n\n"
            "The engine's default off step (patched-off, one token a request) and off steps "
            "of 2 and 4 tokens a request (--speculative-off-step-tokens). "
            f"Every window pair of the runs that measured the patch in the tree (checksum "
            f"`{sha[:12]}`, or one that applies the same source or computes the same steps "
            f"on the path the runs took: SAME_SOURCE_PATCH_SHA256, SAME_STEPS_PATCH_SHA256), "
            f"pooled by workload (its differences from the sweep's; runs "
            f"that differ pool apart) and level: the geometric mean of every pair, and a "
            f"90% interval that resamples the jobs, then the pairs within each (whole jobs "
            f"sit further apart on this host than their pairs' spread explains). Target "
            f"met: the whole interval at or above {OFF_TARGET}; not met: all of it below; "
            "not resolved: the interval straddles it. Plot: off_over_plain_pooled.png.\n\n"
            + off_over_plain_pooled_table(pooled)
        )
        summary["off_over_plain_pooled"] = pooled
        plot_off_over_plain_pooled(pooled, args.out / "off_over_plain_pooled.png")
    if clocks := gpu_clock_rows(results):
        md += (
            "\n## The GPU's clocks in each window (gpu_envelope.py's telemetry)\n\n"
            + gpu_clock_table(clocks)
        )
        summary["gpu_clocks"] = clocks
    print(md)
    if error and error_composed:
        print(
            f"\nsimulator ({profile.name if profile else ''}): MAPE {error['mape']:.1%} over "
            f"the {len(error['points'])} medians of the runs it is fitted to "
            f"({', '.join(map(_short, fit_runs))}), "
            f"{error_composed['mape']:.1%} over the table's {len(error_composed['points'])}; "
            f"speculation wins (measured) at c = "
            f"{error_composed['measured_speculation_wins_at']}, simulated crossover batch "
            f"{error['simulated_crossover_batch']}"
        )
    (args.out / "gpu_envelope.md").write_text(md + "\n")
    summary["inputs"] = [p.name for p in inputs]
    (args.out / "gpu_envelope.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
