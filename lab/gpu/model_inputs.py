"""The engine's prediction inputs on the GPU: the step-cost profile, acceptance while off, no
stale accept length, and what they cost.

On the 3B-class synthetic pair (synthetic.py; acceptance set by the request temperature), two
patched servers share the GPU: `estimate` samples the draft's first proposal on every 8th off
step (the default), `no-estimate` never does (SGLANG_SPEC_OFF_AGREEMENT_EVERY=0). For each
temperature (accept length about 3.8 and about 2.3 by construction):

  on   threshold unset (always speculate), C clients for --seconds: the measured accept length
       (1 + accepted drafts / request steps from the lifetime counters) and first-draft
       acceptance;
  off  threshold 0, the same load: the first-position agreement of the sampled proposals, the
       accept length it predicts for a chain of 3 drafts (1 + p + p^2 + p^3) and the router's
       calibrated estimate (specgate_router.control.AcceptanceTracker fed the same counters);
       /v1/loads' accept_length (must be null while off), the decode log's accept length and
       each request's meta_info.spec_accept_length (must not be the off step's token count).

Then both servers at threshold 0, windows alternating between them (--cost-windows a server at
each of --cost-levels): the off mode's tok/s with the estimate against without it. And the
start-up profile: /server_info's `speculative_step_profile_startup_seconds` and the profile.

    bash lab/gpu/run-on-gpu.sh SITE OUT model_inputs [--seconds 12]
Results: OUT/model-inputs.json (and the servers' logs).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from speed import write_synthetic_pair
from synthetic import acceptance
from verify import (
    EAGLE,
    MEMORY_SIZED,
    ClosedLoopClients,
    call,
    log,
    metrics,
    off_step_flags,
    server_flags,
    set_threshold,
    start,
    stop_all,
    wait_for_log,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "router")]
from specgate_router.control import acceptance as tracking  # noqa: E402

NEW_TOKENS = (128, 384)
"""Each request's max_new_tokens (ignore_eos), uniform in this range, after a 32-token prompt."""
COUNTERS = (
    "spec_request_steps",
    "spec_accepted_tokens",
    "spec_first_agreed",
    "draft_first_proposed",
    "draft_first_agreed",
)


def loads(port: int) -> dict[str, Any]:
    status, body = call(port, "/v1/loads?include=core,spec")
    assert status == 200, body
    load = body["loads"][0]  # type: ignore[index]
    return {"running": load.get("num_running_reqs"), **(load.get("speculative") or {})}


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    return {k: float(after[k]) - float(before[k]) for k in COUNTERS}


def decode_log_accept(log_path: Path) -> float | None:
    """The accept length of the server log's last decode line."""
    found = re.findall(r"accept len: ([0-9.]+)", log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


def phase(port: int, threshold: object, clients: int, temperature: float, seconds: float,
          tracker: tracking.AcceptanceTracker) -> dict[str, Any]:  # fmt: skip
    status, body = set_threshold(port, threshold)
    assert status == 200, body
    load = ClosedLoopClients(port, clients, temperature, NEW_TOKENS)
    time.sleep(2.0)  # the mode settles; what ran before leaves the counters' window
    first = loads(port)
    tracker.update({k: float(first[k]) for k in COUNTERS}, time.monotonic(), 3)
    during: list[Any] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(1.0)
        snap = loads(port)
        during.append(snap.get("accept_length"))
        tracker.update({k: float(snap[k]) for k in COUNTERS}, time.monotonic(), 3)
    last = loads(port)
    gauge = re.findall(r"^sglang:spec_accept_length\{[^}]*\} ([0-9.eE+-]+)", metrics(port), re.M)
    load.stop()
    d = delta(first, last)
    out: dict[str, Any] = {
        "threshold": threshold,
        "counters": d,
        "v1_loads_accept_length_samples": during,
        "metrics_spec_accept_length": [float(g) for g in gauge],
        "request_accept_lengths": sorted({round(a, 2) for a in load.accept_lengths if a})[:20],
        "requests_without_accept_length": sum(1 for a in load.accept_lengths if a is None),
        "errors": load.errors,
        "tok_s": round(load.tokens / (seconds + 2.0), 1),
    }
    if d["spec_request_steps"] > 0:
        out["measured_accept_length"] = round(
            1 + d["spec_accepted_tokens"] / d["spec_request_steps"], 3
        )
        out["first_draft_acceptance"] = round(d["spec_first_agreed"] / d["spec_request_steps"], 4)
    if d["draft_first_proposed"] > 0:
        p1 = d["draft_first_agreed"] / d["draft_first_proposed"]
        out["first_position_agreement_off"] = round(p1, 4)
        out["chain_estimate"] = round(tracking.chain_accept_length(p1, 3), 3)
        current = tracker.current(time.monotonic())
        out["router_estimate"] = None if current is None else [round(current[0], 3), current[1]]
    return out


def cost_windows(ports: dict[str, int], clients: int, temperature: float, windows: int,
                 seconds: float) -> dict[str, Any]:  # fmt: skip
    """Off mode on both servers, windows alternating between them (order rotated)."""
    rates: dict[str, list[float]] = {name: [] for name in ports}
    names = list(ports)
    for w in range(windows):
        for name in names[w % 2 :] + names[: w % 2]:
            load = ClosedLoopClients(ports[name], clients, temperature, NEW_TOKENS)
            time.sleep(1.5)
            t0, n0 = time.monotonic(), load.tokens
            time.sleep(seconds)
            rate = (load.tokens - n0) / (time.monotonic() - t0)
            load.stop()
            rates[name].append(round(rate, 1))
    ratio = sum(rates["estimate"]) / max(1e-9, sum(rates["no-estimate"]))
    return {"tok_s": rates, "estimate_over_no_estimate": round(ratio, 4)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="model-inputs-results")
    parser.add_argument("--temperatures", default="0.8,1.0")
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--cost-levels", default="16,64")
    parser.add_argument("--cost-windows", type=int, default=3)
    parser.add_argument("--cost-seconds", type=float, default=6.0)
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument("--port", type=int, default=32300)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path("/tmp/specgate-models-synthetic")
    started = time.time()
    write_synthetic_pair(models, args.c)
    log(f"synthetic pair written in {time.time() - started:.0f}s")
    flags = [
        *server_flags(
            models / "target",
            mem_fraction=args.mem_fraction,
            max_running=128,
            max_graph_batch=128,
            dummy_weights=False,
            sleep_on_idle=True,
        ),
        *EAGLE,
        "--speculative-draft-model-path",
        str(models / "draft"),
        "--speculative-disable-batch-threshold",
        "8",
        *off_step_flags(4),
        "--decode-log-interval",
        "40",
    ]
    servers = {"estimate": {}, "no-estimate": {"SGLANG_SPEC_OFF_AGREEMENT_EVERY": "0"}}
    ports = {name: args.port + i for i, name in enumerate(servers)}
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "c": args.c, "levels": {}}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def save() -> None:
        (out / "model-inputs.json").write_text(json.dumps(results, indent=1))

    try:
        for name, env in servers.items():
            procs[name] = start(name, flags, ports[name], out, env)
            wait_for_log(out / f"{name}.log", MEMORY_SIZED, procs[name])
        for name in servers:
            results[f"startup_seconds_{name}"] = round(wait_healthy(ports[name], procs[name]), 1)
        _, info = call(ports["estimate"], "/server_info")
        state = (info or {}).get("internal_states", [{}])[0]  # type: ignore[union-attr]
        results["startup_profile_seconds"] = state.get("speculative_step_profile_startup_seconds")
        results["startup_profile"] = state.get("speculative_step_profile")
        profile_log = [
            line
            for line in (out / "estimate.log").read_text(errors="replace").splitlines()
            if "step profile at start-up" in line or "acceptance while off" in line
        ]
        results["startup_log"] = profile_log
        log(f"start-up profile: {results['startup_profile_seconds']} s; {profile_log}")
        save()
        for t in (float(x) for x in args.temperatures.split(",")):
            tracker = tracking.AcceptanceTracker()
            predicted = round(acceptance(args.c, t, 3)[1], 3)
            level: dict[str, Any] = {"predicted_accept_length": predicted}
            results["levels"][str(t)] = level
            level["on"] = phase(ports["estimate"], None, args.clients, t, args.seconds, tracker)
            level["off"] = phase(ports["estimate"], 0, args.clients, t, args.seconds, tracker)
            level["decode_log_accept_length_after_off"] = decode_log_accept(out / "estimate.log")
            measured = level["on"].get("measured_accept_length")
            for key in ("chain_estimate", "router_estimate"):
                est = level["off"].get(key)
                est = est[0] if isinstance(est, list) else est
                if measured and est:
                    level[f"{key}_over_measured"] = round(est / measured, 3)
            log(f"T={t}: " + json.dumps({k: v for k, v in level.items() if k not in ("on", "off")}))
            save()
        results["live_profile"] = loads(ports["estimate"]).get("step_profile")
        for name in servers:
            set_threshold(ports[name], 0)
        results["off_cost"] = {
            str(c): cost_windows(ports, c, 1.0, args.cost_windows, args.cost_seconds)
            for c in (int(x) for x in args.cost_levels.split(","))
        }
        log("off cost: " + json.dumps(results["off_cost"]))
        results["final_loads"] = loads(ports["estimate"])
    except Exception as exc:  # keep what was measured
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(results["error"])
    finally:
        save()
        stop_all(procs.values())
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
