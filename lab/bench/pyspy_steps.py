"""Where a scheduler's host time per decode step goes, server against server: the py-spy
recordings `gpu_envelope.py --pyspy` takes of each window (OUT/pyspy/*.txt, folded stacks,
aggregated by function) summed over the windows of each server, level and condition (GC frozen,
schedulers pinned or free), divided by the decode steps those windows ran.

    .venv/bin/python lab/bench/pyspy_steps.py OUT [--base plain --other patched-off] [--top 40]
        [--plot steps.png]

Each table has a function's busy time per decode step (us; the function and what it called)
under each server and the difference, largest differences first. With py-spy's 200 samples a
second, a 4-s window of about 1,000 steps gives one sample per 5 us of a step; the sum of ten
windows resolves about 1 us per step. py-spy records without pausing the process, so the
figures carry none of the torch profiler's overhead, but a garbage collection is charged to
the line that allocated last (gpu_envelope.py --gc-stats times those on their own).
--plot draws each server's step split by part of the scheduler loop (PARTS), level by level;
--part NAME makes the tables of that part's stacks alone (what "the rest of run_batch" holds,
say, where plain spends the same time inside the target's forward).
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from folded_top import parse_folded, tops

SAMPLE_RATE = 200
"""Samples a second, as gpu_envelope.PySpy takes them."""


PARTS = (
    ("the target's forward", ("TpModelWorker.forward_batch_generation",)),
    ("the prompts' draft KV write", ("EAGLEWorkerV2._write_prompt_draft_kv",)),
    ("the rest of run_batch", ("Scheduler.run_batch",)),
    ("get_next_batch_to_run", ("Scheduler.get_next_batch_to_run",)),
    ("process_batch_result", ("Scheduler.process_batch_result",)),
)
"""Parts of a scheduler's step, each a stack holding one of its functions; a stack counts for
the first part it matches (the target's forward, plain's and the off step's alike, before the
run_batch around it), and stacks matching none are "the rest"."""


def part_of(frames: list[str]) -> str:
    names = {frame.partition(" (")[0] for frame in frames}
    for part, functions in PARTS:
        if any(f in names for f in functions):
            return part
    return "the rest"


Key = tuple[str, int, str]
"""A group of windows: (server, c, condition: '' or what set the windows apart, condition())."""
Recording = tuple[Key, float, list[tuple[list[str], int]]]


def condition(window: dict[str, Any]) -> str:
    """What sets a window's host apart within its job: after /freeze_gc
    (--freeze-gc-from-rep), or its schedulers pinned or free (--scheduler-cores odd-reps)."""
    if window.get("gc_frozen"):
        return "GC frozen"
    if "scheduler_pinned" in window:
        return "schedulers pinned" if window["scheduler_pinned"] else "schedulers free"
    return ""


def recordings(windows: list[dict[str, Any]], read: Any) -> list[Recording]:
    """Each window that has a recording (`read(name)` gives its lines, or None) and ran decode
    steps: its group, its decode steps and its stacks, read and parsed once."""
    found = []
    for w in windows:
        name = w.get("pyspy")
        lines = read(name) if name else None
        if lines is None or not w.get("decode_steps"):
            continue
        key = (w["server"], w["c"], condition(w))
        found.append((key, w["decode_steps"], parse_folded(lines)))
    return found


def only_part(recorded: list[Recording], part: str) -> list[Recording]:
    """The recordings with only the stacks that count for `part` (part_of)."""
    return [
        (key, steps, [(frames, n) for frames, n in stacks if part_of(frames) == part])
        for key, steps, stacks in recorded
    ]


def group_parts(recorded: list[Recording], rate: int = SAMPLE_RATE) -> dict[Key, dict[str, float]]:
    """Per group: us per decode step in each part (part_of)."""
    samples: dict[Key, Counter[str]] = {}
    steps: dict[Key, float] = {}
    for key, decode_steps, stacks in recorded:
        steps[key] = steps.get(key, 0.0) + decode_steps
        counts = samples.setdefault(key, Counter())
        for frames, n in stacks:
            counts[part_of(frames)] += n
    return {
        key: {part: n * 1e6 / rate / steps[key] for part, n in counts.items()}
        for key, counts in samples.items()
    }


def plot_parts(parts: dict[Key, dict[str, float]], path: Path, title: str) -> None:
    """Horizontal stacked bars: each server and level's scheduler time per decode step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(parts, key=lambda k: (k[2], k[1], k[0]))
    names = [p for p, _ in PARTS] + ["the rest"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(keys) + 2.4))
    left = [0.0] * len(keys)
    for name in names:
        widths = [parts[k].get(name, 0.0) / 1000 for k in keys]
        ax.barh(range(len(keys)), widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:.2f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(keys)), [f"{s} c={c}{f' ({f})' if f else ''}" for s, c, f in keys])
    ax.invert_yaxis()
    ax.set_xlabel("scheduler time per decode step (ms, py-spy busy samples)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def short(frame: str) -> str:
    """`name (path/to/sglang/srt/x.py:12)` as `name (srt/x.py:12)`: the path from the
    package's top, however the file was found."""
    name, _, where = frame.partition(" (")
    for top in ("sglang/", "torch/", "triton/", "specgate"):
        if top in where:
            where = where[where.index(top) :]
            break
    return f"{name} ({where}" if where else name


def group_costs(recorded: list[Recording], rate: int = SAMPLE_RATE) -> dict[Key, dict[str, Any]]:
    """Per group: decode steps, busy us per step, and each frame's us per step."""
    groups: dict[Key, dict[str, Any]] = {}
    for key, decode_steps, stacks in recorded:
        total, _, counts = tops(stacks)
        g = groups.setdefault(
            key, {"steps": 0, "samples": 0, "frames": Counter[str](), "windows": 0}
        )
        g["steps"] += decode_steps
        g["samples"] += total
        g["windows"] += 1
        for frame, n in counts.items():
            g["frames"][short(frame)] += n
    for g in groups.values():
        per_sample_us = 1e6 / rate / g["steps"]
        g["busy_us"] = g["samples"] * per_sample_us
        g["us"] = {f: n * per_sample_us for f, n in g["frames"].items()}
    return groups


def table(
    base: dict[str, Any], other: dict[str, Any], names: tuple[str, str], top: int
) -> list[str]:
    """The frames whose us per step differ most between two groups, as Markdown rows."""
    frames = set(base["us"]) | set(other["us"])
    diffs = sorted(frames, key=lambda f: (-abs(other["us"].get(f, 0) - base["us"].get(f, 0)), f))
    rows = [
        f"| {names[0]} us/step | {names[1]} us/step | difference | function |",
        "| ---: | ---: | ---: | --- |",
        f"| {base['busy_us']:.0f} | {other['busy_us']:.0f} | "
        f"{other['busy_us'] - base['busy_us']:+.0f} | (all busy samples) |",
    ]
    for f in diffs[:top]:
        b, o = base["us"].get(f, 0.0), other["us"].get(f, 0.0)
        rows.append(f"| {b:.0f} | {o:.0f} | {o - b:+.0f} | `{f}` |")
    return rows


def reader(out: Path) -> Any:
    """Reads OUT/pyspy/NAME, or NAME from OUT/logs.tar.xz's pyspy/ when the job packed it."""
    folder = out / "pyspy"
    packed = out / "logs.tar.xz"
    members: dict[str, bytes] = {}
    if not folder.is_dir() and packed.is_file():
        with tarfile.open(packed) as tar:
            for m in tar.getmembers():
                if m.isfile() and "/pyspy/" in f"/{m.name}":
                    fh = tar.extractfile(m)
                    if fh is not None:
                        members[Path(m.name).name] = fh.read()

    def read(name: str) -> list[str] | None:
        if name in members:
            return members[name].decode(errors="replace").splitlines()
        path = folder / name
        for candidate in (path, path.with_name(path.name + ".xz")):
            if candidate.is_file():
                opener = lzma.open if candidate.suffix == ".xz" else open
                with opener(candidate, "rt") as fh:
                    return fh.read().splitlines()
        return None

    return read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="gpu_envelope.py's --out folder (envelope.json)")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="envelope.json elsewhere (default: OUT/envelope.json)",
    )
    parser.add_argument("--base", default="plain")
    parser.add_argument("--other", default="patched-off")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="a PNG of each server's step split by part of the loop",
    )
    parser.add_argument(
        "--part",
        choices=[name for name, _ in PARTS] + ["the rest"],
        help="the tables over this part of the loop's stacks only",
    )
    args = parser.parse_args(argv)
    results = json.loads((args.results or args.out / "envelope.json").read_text())
    recorded = recordings(results["windows"], reader(args.out))
    groups = group_costs(only_part(recorded, args.part) if args.part else recorded)
    if not groups:
        raise SystemExit(f"{args.out}: no window with a py-spy recording")
    for (server, c, cond), g in sorted(groups.items()):
        print(
            f"{server} c={c}{f', {cond}' if cond else ''}: {g['windows']} windows, "
            f"{g['steps']} decode steps, {g['samples']} busy samples, "
            f"{g['busy_us']:.0f} us busy per step"
        )
    for c, cond in sorted({(c, f) for _, c, f in groups}):
        base, other = groups.get((args.base, c, cond)), groups.get((args.other, c, cond))
        if base is None or other is None:
            continue
        print(f"\n## c = {c}{f', {cond}' if cond else ''}: {args.other} against {args.base}\n")
        print("\n".join(table(base, other, (args.base, args.other), args.top)))
    if args.plot is not None:
        parts = group_parts(recorded)
        plot_parts(parts, args.plot, f"{results.get('shape', '')}, {results.get('date', '')}")
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
