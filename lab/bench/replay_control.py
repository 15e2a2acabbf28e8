"""Replay specgate's threshold controller over a pod's recorded samples, under the settings it
ran with and under others: the thresholds it would have taken, and why.

Input: the router's `GET /specgate/samples` answer saved to a file, or a GPU envelope job's
JSON (lab/bench/gpu_envelope.py keeps that answer as `router_samples`, beside the threshold
changes the live router logged; jobs up to 89 ran before it did). Prints each replay's
changes, and with --plot draws the samples (batch over time, by mode) under the replayed
thresholds.

    .venv/bin/python lab/bench/replay_control.py lab/results/gpu-envelope-NN-name.json \\
        [--pod HOST:PORT] [--set minSamples=6 --set hysteresis=2 ...] [--plot out.png]

Each --set is one control setting (its resource name, as in spec.speculative.control); all of
them together make the second replay, which reads the same samples: what those settings decide
from this evidence, not what a live run under them would have measured (the pod would have
run other modes). More on what a replay cannot see: router/specgate_router/replay.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specgate_router import control, settings
from specgate_router.replay import Change, pod_samples, replay
from specgate_router.settings import ControlSettings


def parse_override(item: str) -> tuple[str, Any]:
    """`name=value`; the value read as JSON where it is JSON (6, 2.5, true), else as text."""
    name, sep, raw = item.partition("=")
    if not sep or not name:
        raise ValueError(f"--set {item!r}: expected name=value, e.g. minSamples=6")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def with_overrides(base: ControlSettings, items: Sequence[str]) -> ControlSettings:
    data = base.model_dump(by_alias=True)
    for item in items:
        name, value = parse_override(item)
        if name not in data:
            raise ValueError(
                f"--set {item!r}: no control setting {name!r}; there are {', '.join(sorted(data))}"
            )
        data[name] = value
    try:
        return ControlSettings.model_validate(data)
    except ValidationError as exc:
        raise settings.explain(exc, f"--set {' '.join(items)}") from exc


def describe(params: ControlSettings) -> str:
    probes = (
        f"probes every {params.probe_interval_seconds:g} s"
        if params.probe_interval_seconds > 0
        else "no probes"
    )
    return (
        f"threshold {params.threshold} ({params.min_threshold}-{params.max_threshold}), "
        f"hysteresis {params.hysteresis}, cooldown {params.cooldown_seconds:g} s, "
        f"minSamples {params.min_samples}, {probes}"
    )


def table(changes: Sequence[Change], origin: float) -> str:
    lines = ["    t (s)  threshold  reason"]
    for change in changes:
        value = "always" if change.threshold is None else str(change.threshold)
        lines.append(f"  {change.at - origin:7.1f}  {value:>9}  {change.reason}")
    return "\n".join(lines)


def plot(
    samples: Sequence[control.Sample],
    runs: Sequence[tuple[str, list[Change]]],
    end: float,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = samples[0].at
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for speculating, colour, label in (
        (True, "tab:orange", "sample, speculating"),
        (False, "tab:blue", "sample, plain"),
    ):
        steady = control.STEADY_MODE_FRACTION
        chosen = [s for s in samples if (s.speculating_fraction >= steady) == speculating]
        ax.scatter(
            [s.at - origin for s in chosen],
            [s.batch for s in chosen],
            s=6,
            c=colour,
            alpha=0.5,
            label=label,
        )
    for (label, changes), style in zip(runs, ("k-", "r--", "g:"), strict=False):
        xs = [c.at - origin for c in changes] + [end - origin]
        ys = [c.threshold for c in changes] + [changes[-1].threshold]
        ax.step(
            xs,
            [float("nan") if y is None else y for y in ys],
            style,
            where="post",
            label=f"threshold, {label}",
        )
    ax.set_xlabel("seconds since the first sample")
    ax.set_ylabel("batch (running requests)")
    ax.set_yscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(
        "The threshold controller replayed over a pod's recorded samples "
        "(speculation runs at a batch at or below the threshold)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="a /specgate/samples answer or a job's JSON")
    parser.add_argument("--pod", help="the pod to replay (needed where the export has several)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a control setting for the second replay",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of the samples and thresholds")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.input.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"{args.input}: {exc}")
    export = data.get("router_samples", data) if isinstance(data, dict) else {}
    try:
        recorded = ControlSettings.model_validate(export.get("control", {}))
        name, samples = pod_samples(export, args.pod)
        other = with_overrides(recorded, args.overrides) if args.overrides else None
    except (ValueError, ValidationError) as exc:
        parser.error(f"{args.input}: {exc}")
    if not samples:
        parser.error(f"{args.input}: pod {name} has no samples to replay")
    origin, end = samples[0].at, max(s.at for s in samples)
    batches = [s.batch for s in samples]
    print(
        f"pod {name}: {len(samples)} samples over {end - origin:.1f} s "
        f"(batch {min(batches):.1f}-{max(batches):.1f})"
    )
    runs = [("the recorded settings", replay(samples, params=recorded))]
    print(
        f"\nreplay, the recorded settings ({describe(recorded)}): "
        f"{len(runs[0][1]) - 1} changes\n{table(runs[0][1], origin)}"
    )
    if other is not None:
        label = ", ".join(args.overrides)
        runs.append((label, replay(samples, params=other)))
        print(f"\nreplay, {label}: {len(runs[1][1]) - 1} changes\n{table(runs[1][1], origin)}")
    live = data.get("router_changes") if "router_samples" in data else None
    if live:
        print("\nlive (the router's log; seconds since the job began, another origin):")
        for change in live:
            print(f"  {change['t']:7.1f}  {change['change']}")
    if args.plot:
        plot(samples, runs, end, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
