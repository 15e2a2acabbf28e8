"""Time each Python process spends in the garbage collector, for the GPU benchmarks.

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one, so
putting this folder first on PYTHONPATH loads it into a server and every process the server
spawns (SGLang's scheduler, tokenizer and detokenizer). It does nothing unless
SPECGATE_GC_STATS_DIR names a folder. Then it times every collection (gc.callbacks) and a
daemon thread writes the running totals to DIR/gc-PID.json ten times a second, which
lab/bench/gpu_envelope.py reads before and after each window (read_gc_stats).

Why: an off step's host time is 5-11% above a plain step's (lab/NOTEBOOK.md job 41), spread thin
over the spec-v2 scheduler. A collection pauses whatever line allocated last, so profilers charge
it to that line; this measures it directly, per generation.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time

ENV = "SPECGATE_GC_STATS_DIR"
WRITE_EVERY_S = 0.1


class GcTotals:
    """Collections, seconds and objects collected per generation since the process started."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]
        self._started: float | None = None

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif phase == "stop" and self._started is not None:
            generation = info.get("generation", 2)
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started
            self.collected[generation] += info.get("collected", 0)
            self._started = None

    def snapshot(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "time": time.time(),
            "collections": list(self.collections),
            "ms": [round(s * 1000, 3) for s in self.seconds],
            "collected": list(self.collected),
            "thresholds": list(gc.get_threshold()),
            # Not gc.get_freeze_count(): it walks the frozen objects' list, millions of them
            # after SGLang's /freeze_gc, and held the scheduler's GIL for half of every
            # second in job 45's frozen windows.
        }


def _write_forever(totals: GcTotals, path: str) -> None:
    tmp = f"{path}.tmp"
    while True:
        try:
            with open(tmp, "w") as fh:
                json.dump(totals.snapshot(), fh)
            os.replace(tmp, path)
        except OSError:
            return  # the folder went away: nobody is reading any more
        time.sleep(WRITE_EVERY_S)


def _install() -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return
    totals = GcTotals()
    gc.callbacks.append(totals.callback)
    path = os.path.join(folder, f"gc-{os.getpid()}.json")
    threading.Thread(
        target=_write_forever, args=(totals, path), name="specgate-gcstats", daemon=True
    ).start()


_install()
