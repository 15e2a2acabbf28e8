"""How long `specgate --help` takes, against a parser that loads every component's arguments
(how `specgate --help` built its parser before the lazy subcommands), side by side in one run.

    .venv/bin/python lab/bench/cli_startup.py [--runs 15]

Each run is a fresh interpreter; the two commands alternate so that a noisy machine slows
both alike. Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

LAZY = "from specgate.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
EAGER = "from specgate.cli import build_parser\nbuild_parser().format_help()\n"


def seconds(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)
    seconds(LAZY), seconds(EAGER)  # warm the file cache and byte-compiled modules
    lazy, eager = [], []
    for _ in range(args.runs):
        lazy.append(seconds(LAZY))
        eager.append(seconds(EAGER))
    lazy_s, eager_s = statistics.median(lazy), statistics.median(eager)
    print(f"specgate --help, lazy subcommands: {lazy_s * 1000:.0f} ms (median of {args.runs})")
    print(f"every component's arguments loaded: {eager_s * 1000:.0f} ms")
    print(f"ratio lazy/eager: {lazy_s / eager_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
