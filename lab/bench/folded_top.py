"""Where a process spent its samples: py-spy's raw output (`py-spy record --format raw`, folded
stacks, one `frame;frame;... count` per line; .xz read as is) as two tables, the frames that
were on top of the stack and the frames anywhere in it, by share of all samples.

    .venv/bin/python lab/bench/folded_top.py lab/results/gpu-envelope-37-router-stall-conn.folded.xz
"""

from __future__ import annotations

import argparse
import lzma
from collections import Counter
from collections.abc import Iterable
from pathlib import Path


def parse_folded(lines: Iterable[str]) -> list[tuple[list[str], int]]:
    """`frame;frame;... count` lines, outermost frame first, as (frames, count)."""
    stacks = []
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def read_folded(path: Path) -> list[tuple[list[str], int]]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as fh:
        return parse_folded(fh)


def tops(stacks: list[tuple[list[str], int]]) -> tuple[int, Counter[str], Counter[str]]:
    """All samples, samples by the frame on top, samples by every frame in the stack (once per
    stack, however deep it recursed)."""
    total, leaf, inclusive = 0, Counter[str](), Counter[str]()
    for frames, count in stacks:
        total += count
        leaf[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return total, leaf, inclusive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folded", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    total, leaf, inclusive = tops(read_folded(args.folded))
    if not total:
        raise SystemExit(f"{args.folded}: no samples")
    print(f"{total} samples in {args.folded.name}")
    for title, counts in (("on top of the stack", leaf), ("anywhere in the stack", inclusive)):
        print(f"\n| samples | share | frame ({title}) |\n| ---: | ---: | --- |")
        for frame, n in counts.most_common(args.top):
            print(f"| {n} | {n / total:.1%} | `{frame}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
