"""Check 3's draft-KV half: after a stretch with speculation off, the draft reads the positions
the off steps wrote into its KV cache.

The pair (synthetic.py --context-gain) has a draft that attends uniformly over its own KV cache.
Each request's prompt is PREFIX copies of a token A and then one B; the target then repeats B
greedily. While A fills most of the draft's context the draft proposes A and every draft is
rejected (accept length 1); once the cache holds `synthetic.context_flip` B tokens beyond the
prompt it proposes B and every draft is accepted (4). Three runs on one patched server, eight
requests each, greedy:

  control   speculating from the first token: the first window after the prompt runs at about 1
            (the draft does read its context);
  early     off for 0.3x the flip point, then speculating: still about 1 (the off stretch's B
            tokens are not yet enough);
  synced    off for 2x the flip point, then speculating: about 4, but only if every off step
            wrote its position into the draft KV cache. Had the off steps skipped it, the cache
            would hold no more B tokens than in `early`, and the window would run at about 1.

Pass: control and early below 2, synced above 3.5 (tokens per request per speculating step,
over the first WINDOW seconds after speculation starts).

    python3 draftkv.py --out results/ [--gain 8 --prefix 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from recovery import moments, speculating_accept_length
from synthetic import configs, context_flip
from verify import (
    EAGLE,
    call,
    log,
    off_step_flags,
    server_flags,
    start,
    stop_all,
    wait_healthy,
)

HERE = Path(__file__).resolve().parent
SHAPE = {"hidden": 2048, "layers": 8, "heads": 16, "kv_heads": 8, "intermediate": 4096}
"""Small: the check is about the draft's inputs, not speed (kv_heads x head_dim = 1024). EAGLE-3
reads the target's hidden states after layers 2, n/2 and n-3 (SGLang's default), three distinct
ones only from 6 layers up: with 4 the draft's fc got two (the first GPU run, 2026-11-30)."""
CLIENTS = 8
WINDOW = 0.3
RUNS = {"control": 0.0, "early": 0.3, "synced": 2.0}
"""Each run's off stretch in tokens, as a multiple of the flip point (over a K-th as many off
steps with --off-step-tokens K)."""


def judge(results: dict[str, dict[str, Any]]) -> bool:
    """control and early below 2 tokens per speculating step, synced above 3.5."""
    got = {name: r.get("accept_length") for name, r in results.items()}
    if any(v is None for v in got.values()) or set(got) != set(RUNS):
        return False
    return got["control"] < 2.0 and got["early"] < 2.0 and got["synced"] > 3.5


def prompt(run: int, i: int, prefix: int) -> list[int]:
    """PREFIX copies of one token, then another; distinct per run and request, so no prefix
    is shared through the radix cache."""
    a = 1000 + 97 * (run * CLIENTS + i)
    return [a] * prefix + [a + 31]


def one_run(port: int, index: int, off_steps: int, prefix: int, max_new: int) -> dict[str, Any]:
    threshold = 0 if off_steps else None
    status, body = call(
        port,
        "/set_internal_state",
        {"server_args": {"speculative_disable_batch_threshold": threshold}},
    )
    assert status == 200, body
    before = moments(port)
    sampling = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=call,
            args=(
                port,
                "/generate",
                {"input_ids": prompt(index, i, prefix), "sampling_params": sampling},
            ),
            kwargs={"timeout": 120},
            daemon=True,
        )
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while off_steps and moments(port)[4] - before[4] < off_steps and time.time() < deadline:
        time.sleep(0.005)
    if off_steps:
        status, body = call(
            port,
            "/set_internal_state",
            {"server_args": {"speculative_disable_batch_threshold": None}},
        )
        assert status == 200, body
    else:
        # The control's window starts with the first decode steps, after the prefills.
        while moments(port)[0] == before[0] and time.time() < deadline:
            time.sleep(0.002)
    first = moments(port)
    time.sleep(WINDOW)
    last = moments(port)
    for t in threads:
        t.join(timeout=120)
    d = [b - a for a, b in zip(first, last, strict=True)]
    window = {
        "threshold": None,
        "accept_length": round(d[2] / d[1], 3) if d[1] else None,
        "steps_on": d[3],
        "steps_off": d[4],
    }
    return {
        "off_steps_before": round(first[4] - before[4]),
        "window": window,
        "accept_length": speculating_accept_length(window),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="draftkv-results")
    parser.add_argument("--gain", type=float, default=8.0, help="the draft's context gain")
    parser.add_argument("--prefix", type=int, default=200, help="copies of A in each prompt")
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument("--port", type=int, default=32300)
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=0,
        help="replay SGLang's breakable prefill CUDA graphs up to this many "
        "tokens, as SGLang does by default (0: eager prefills)",
    )
    parser.add_argument(
        "--off-step-tokens",
        type=int,
        default=1,
        help="tokens a request decodes per speculation-off step (--speculative-off-step-tokens)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, _ = configs(
        SHAPE["hidden"], SHAPE["layers"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["intermediate"]
    )
    kv_dim = SHAPE["kv_heads"] * target["head_dim"]
    flip = context_flip(args.prefix, args.gain, SHAPE["hidden"], kv_dim)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "shape": SHAPE,
        "gain": args.gain,
        "prefix": args.prefix,
        "flip_point": flip,
        "clients": CLIENTS,
        "window_s": WINDOW,
        "runs": {},
        "prefill_graph_tokens": args.prefill_graph_tokens,
        "off_step_tokens": args.off_step_tokens,
    }
    models = Path("/tmp/specgate-models-draftkv")
    began = time.time()
    subprocess.run(
        [
            sys.executable,
            str(HERE / "synthetic.py"),
            str(models),
            "--context-gain",
            str(args.gain),
            "--c",
            str(args.c),
            *(x for k, v in SHAPE.items() for x in (f"--{k.replace('_', '-')}", str(v))),
        ],
        check=True,
        timeout=600,
    )
    log(f"pair written in {time.time() - began:.0f}s; flip point {flip:.0f} tokens")
    flags = [
        *server_flags(
            models / "target",
            mem_fraction=args.mem_fraction,
            max_running=16,
            max_graph_batch=16,
            dummy_weights=False,
            prefill_graph_tokens=args.prefill_graph_tokens,
        ),
        *EAGLE,
        "--speculative-draft-model-path",
        str(models / "draft"),
        "--speculative-disable-batch-threshold",
        "0",
        *off_step_flags(args.off_step_tokens),
    ]
    proc = start("draftkv", flags, args.port, out, {})
    try:
        results["startup_s"] = round(wait_healthy(args.port, proc), 1)
        max_new = int(3 * flip) + 200
        for index, (name, share) in enumerate(RUNS.items()):
            off_steps = round(share * flip / args.off_step_tokens)
            results["runs"][name] = one_run(args.port, index, off_steps, args.prefix, max_new)
            log(f"{name}: {results['runs'][name]}")
            (out / "draftkv.json").write_text(json.dumps(results, indent=1))
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(results["error"])
    finally:
        stop_all([proc])
    results["passed"] = judge(results["runs"]) and "error" not in results
    (out / "draftkv.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
