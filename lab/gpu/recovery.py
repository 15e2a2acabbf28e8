"""Check 3 of the worker-image issue, as far as the synthetic pair allows, and the pair's
acceptance measured against what synthetic.py predicts.

On the 3B-class synthetic pair (synthetic.py), a patched server runs eight clients with long
requests while the threshold goes unset (always speculate) -> 0 -> unset -> 0 -> unset, a few
seconds each. The accept length of each window comes from SGLang's per-step `decode_moments` in
/v1/loads (tokens generated per request per decode step; 1.0 exactly while speculation is off),
so it is measured over the window itself and not over the server's lifetime. Pass: every window
after speculation comes back is within 5% of the window before the first switch, at every
temperature.

What it can and cannot catch: the pair's draft predicts from the target's hidden state, so a
draft that resumes from a wrong or stale hidden state after an off stretch loses acceptance
here. Its attention output is zero, so a draft KV cache left out of sync would not show
(GPU-RESULTS.md, check 3).

    python3 recovery.py --out results/ [--upstream-extend-too] [--temperatures 0,0.9,1.0]
    --upstream-extend-too: a second server whose off steps run upstream's draft extend
    (SGLANG_SPEC_LEAN_OFF_DRAFT_EXTEND=0), on the next GPU when there is one, runs the same
    schedule at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from speed import DRAFT, write_synthetic_pair
from synthetic import acceptance
from verify import (
    EAGLE,
    MEMORY_SIZED,
    UPSTREAM_EXTEND_ENV,
    call,
    log,
    server_flags,
    spec_loads,
    start,
    stop_all,
    wait_healthy,
)

CLIENTS = 8
SCHEDULE = [  # (threshold, seconds); None: always speculate
    (None, 3.0),
    (0, 3.0),
    (None, 1.0),
    (None, 2.0),
    (0, 3.0),
    (None, 1.0),
    (None, 2.0),
]


def moments(port: int) -> tuple[float, float, float, int, int]:
    """(decode steps, sum of batch sizes, generated tokens, steps on, steps off) so far."""
    status, body = call(port, "/v1/loads?include=core,spec")
    assert status == 200, body
    load = body["loads"][0]  # type: ignore[index]
    steps, batch, _, _, _, generated = load.get("decode_moments") or [0.0] * 6
    spec = load.get("speculative") or {}
    return steps, batch, generated, spec.get("decode_steps_on", 0), spec.get("decode_steps_off", 0)


def run_schedule(port: int, temperature: float) -> list[dict]:
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            ids = [(i * 7919 + k * 104729) % 31000 + 3 for k in range(32)]
            sampling = {"max_new_tokens": 3000, "temperature": temperature, "ignore_eos": True}
            call(port, "/generate", {"input_ids": ids, "sampling_params": sampling}, timeout=300)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # every client past its prefill
    windows = []
    try:
        for threshold, seconds in SCHEDULE:
            status, body = call(
                port,
                "/set_internal_state",
                {"server_args": {"speculative_disable_batch_threshold": threshold}},
            )
            assert status == 200, body
            before = moments(port)
            time.sleep(seconds)
            after = moments(port)
            d = [a - b for a, b in zip(after, before, strict=True)]
            windows.append(
                {
                    "threshold": threshold,
                    "seconds": seconds,
                    "decode_steps": d[0],
                    "mean_batch": round(d[1] / d[0], 2) if d[0] else None,
                    "accept_length": round(d[2] / d[1], 3) if d[1] else None,
                    "steps_on": d[3],
                    "steps_off": d[4],
                }
            )
            log(f":{port} T={temperature} {windows[-1]}")
    finally:
        stop.set()
        call(port, "/abort_request", {"abort_all": True})
        for t in threads:
            t.join(timeout=60)
    return windows


def speculating_accept_length(window: dict) -> float | None:
    """Tokens per request per speculating step in a window. A window also holds the few steps
    the switch took to land, and an off step yields exactly one token per request, so at a
    steady batch those steps come out exactly."""
    on, off, per_step = window["steps_on"], window["steps_off"], window["accept_length"]
    if not on or per_step is None:
        return None
    return (per_step * (on + off) - off) / on


def judge(windows: list[dict]) -> dict:
    """Passed: every window after speculation comes back within 5% of the first window's
    accept length (over speculating steps), and the off windows ran >= 95% of steps off."""
    base = speculating_accept_length(windows[0])
    after = [
        speculating_accept_length(w)
        for i, w in enumerate(windows)
        if i > 0 and w["threshold"] is None
    ]
    off_share = [
        w["steps_off"] / max(1, w["steps_on"] + w["steps_off"])
        for w in windows
        if w["threshold"] == 0
    ]
    ok = bool(base) and all(a is not None and abs(a / base - 1) <= 0.05 for a in after)  # type: ignore[operator]
    return {
        "before_first_switch": round(base, 3) if base else None,
        "after_switching_back": [round(a, 3) if a else None for a in after],
        "worst_ratio": round(min(a / base for a in after), 3)  # type: ignore[operator]
        if ok and after
        else None,
        "off_step_share": [round(x, 3) for x in off_share],
        "passed": ok and all(x >= 0.95 for x in off_share),
    }


def windows_from_log(text: str) -> dict[tuple[int, float], list[dict]]:
    """The windows a run logged, by (port, temperature): to judge a run again."""
    import ast
    import re

    found: dict[tuple[int, float], list[dict]] = {}
    for line in text.splitlines():
        m = re.match(r"\[[\d:]+\] :(\d+) T=([\d.]+) (\{.*\})$", line.strip())
        if m:
            found.setdefault((int(m[1]), float(m[2])), []).append(ast.literal_eval(m[3]))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="recovery-results")
    parser.add_argument("--temperatures", default="0,0.9,1.0")
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument("--upstream-extend-too", action="store_true")
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument("--port", type=int, default=32100)
    parser.add_argument(
        "--after-log",
        type=Path,
        help="start the servers once this server log says its memory is sized (or 300 s on): "
        "other servers starting on the same GPUs, a tensor-parallel one above all, would "
        "otherwise see memory move under them",
    )
    parser.add_argument("--rejudge", type=Path, help="judge the windows of this run's log")
    args = parser.parse_args()
    if args.rejudge:
        logged = windows_from_log(args.rejudge.read_text())
        verdicts = {f":{port} T={t}": judge(w) for (port, t), w in logged.items()}
        print(json.dumps(verdicts, indent=1))
        return 0 if verdicts and all(v["passed"] for v in verdicts.values()) else 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path("/tmp/specgate-models-synthetic")
    started = time.time()
    write_synthetic_pair(models, args.c)
    log(f"synthetic pair written in {time.time() - started:.0f}s")
    while args.after_log and time.time() - started < 300:
        if args.after_log.exists() and MEMORY_SIZED in args.after_log.read_text(errors="replace"):
            break
        time.sleep(1)
    assert DRAFT["num_hidden_layers"] == 1
    common = [
        *server_flags(
            models / "target", mem_fraction=args.mem_fraction, max_running=16, dummy_weights=False
        ),
        *EAGLE,
        "--speculative-draft-model-path",
        str(models / "draft"),
    ]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")
    variants = {
        "patched": None,
        **({"patched-upstream-extend": UPSTREAM_EXTEND_ENV} if args.upstream_extend_too else {}),
    }
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "c": args.c,
        "clients": CLIENTS,
        "schedule": SCHEDULE,
        "servers": {},
    }
    procs = {}
    try:
        for i, (name, env) in enumerate(variants.items()):
            env = {**(env or {}), "CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]}
            procs[name] = start(
                name,
                [*common, "--speculative-disable-batch-threshold", "0"],
                args.port + i,
                out,
                env,
            )
        for i, name in enumerate(variants):
            results[f"startup_seconds_{name}"] = round(wait_healthy(args.port + i, procs[name]), 1)

        def measure(i: int, name: str) -> None:
            per_t = results["servers"].setdefault(name, {})
            for t in (float(x) for x in args.temperatures.split(",")):
                windows = run_schedule(args.port + i, t)
                per_t[str(t)] = {
                    "predicted_accept_length": round(acceptance(args.c, t, 3)[1], 3),
                    "windows": windows,
                    **judge(windows),
                }
            per_t["lifetime_loads"] = spec_loads(args.port + i)

        threads = [threading.Thread(target=measure, args=(i, n)) for i, n in enumerate(variants)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(results["error"])
    finally:
        stop_all(procs.values())
    verdicts = [
        v["passed"]
        for s in results["servers"].values()
        for k, v in s.items()
        if isinstance(v, dict) and "passed" in v
    ]
    results["all_passed"] = bool(verdicts) and all(verdicts) and "error" not in results
    (out / "recovery.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "servers"}, indent=1))
    for name, per_t in results["servers"].items():
        for t, v in per_t.items():
            if isinstance(v, dict) and "passed" in v:
                print(
                    f"{name} T={t}: predicted {v['predicted_accept_length']}, before "
                    f"{v['before_first_switch']}, after {v['after_switching_back']}, "
                    f"off-step share {v['off_step_share']}, passed {v['passed']}"
                )
    return 0 if results["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
