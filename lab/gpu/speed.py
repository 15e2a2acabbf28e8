"""Output tok/s of servers side by side in one run, on one GPU, one server after another.

Servers on the same 3B-class Llama shape:
  plain            no speculation
  always-on        EAGLE-3, unpatched behaviour (no threshold)
  patched-8        EAGLE-3 + the specgate patch, --speculative-disable-batch-threshold 8
  patched-off      the same with threshold 0 (never speculates: the cost of "off")
  upstream-0step   EAGLE-3 + upstream 0.5.17 --speculative-adaptive, drafting off above batch 8
Weights: `dummy` (random, config only: acceptance near 0, fine for the cost of "off") or
`synthetic` (synthetic.py's pair: acceptance known by construction and set by --temperature).
Closed loop: c clients, each sends its next request (32-token prompt, 128-384 new tokens,
ignore_eos) when the last returns; tok/s over windows after a warm-up; accept length read
from /v1/loads after each point.

    python3 speed.py --out results/ [--only plain,patched-off] [--concurrency 16,64]
        [--repeat 3] [--interleave | --profile]
    --interleave runs the servers together and alternates their windows: the GPU machine's
    host is shared and drifts, and alternating keeps the ratios side by side.
    # the worker-image issue's check 4 (not run yet):
    python3 speed.py --out results/ --weights synthetic --temperature 1.0 \
        --only plain,always-on,patched-8,upstream-0step --concurrency 1,4,16,64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from verify import (
    EAGLE,
    MEMORY_SIZED,
    UPSTREAM_EXTEND_ENV,
    call,
    log,
    off_step_flags,
    server_flags,
    spec_loads,
    start,
    wait_for_log,
    wait_healthy,
)

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
DRAFT = {
    **SHAPE,
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "draft_vocab_size": 32000,
}


HERE = Path(__file__).resolve().parent
UNSAMPLED_ENV = {"SGLANG_SPEC_OFF_AGREEMENT_EVERY": "0"}
"""The patched engine's off steps without the draft's agreement sampling (the estimate of
the accept length while off; step_profile.py)."""
ADAPTIVE_OFF_ABOVE_8 = {"1": {"candidate_steps": [3]}, "9": {"candidate_steps": [0]}}
"""Upstream's --speculative-adaptive-config for the no-patch baseline: 3 draft steps up to
batch 8, drafting off above."""


SHAPE_8B = {
    **SHAPE,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
"""A Llama-3-8B-class target (about 7B parameters with the synthetic 32,000-token vocabulary):
a decode step reads about 14 GB of weights, so on an H200 the GPU sets the step's pace, where
SHAPE's 6 GB leave it to the host. One GPU's share of a 70B-class model served at tensor
parallel 8 is of this size."""
SHAPES = {"3b": SHAPE, "8b": SHAPE_8B}


def write_synthetic_pair(models: Path, c: float, shape: dict[str, Any] = SHAPE) -> None:
    """synthetic.py's pair at `shape` into `models`/{target,draft}, written by a child process
    so that its CUDA memory is gone before the servers start."""
    args = [
        "--hidden",
        shape["hidden_size"],
        "--layers",
        shape["num_hidden_layers"],
        "--heads",
        shape["num_attention_heads"],
        "--kv-heads",
        shape["num_key_value_heads"],
        "--intermediate",
        shape["intermediate_size"],
        "--c",
        c,
    ]
    subprocess.run(
        [sys.executable, str(HERE / "synthetic.py"), str(models), *map(str, args)],
        check=True,
        timeout=600,
    )


def tokens_in_window(spans: list[tuple[float, float, int]], start: float, stop: float) -> float:
    """Output tokens made inside [start, stop] by requests (began, ended, tokens), each request's
    tokens spread evenly over its lifetime: counting only whole requests that finish in the
    window quantises the rate to c x the mean output length per window."""
    return sum(
        n * max(0.0, min(end, stop) - max(began, start)) / max(end - began, 1e-9)
        for began, end, n in spans
    )


def closed_loop(
    port: int,
    clients: int,
    seconds: float,
    warmup: float = 3.0,
    profile: Path | None = None,
    temperature: float = 0.0,
) -> float:
    """Output tok/s of `clients` closed-loop clients over `seconds` after `warmup`.

    Output lengths are drawn from 128-384 so requests do not finish in lockstep, and every
    request that overlaps the window counts the share of its tokens made inside it (tokens
    spread evenly over its lifetime): counting only whole requests that finish in the window
    quantises the rate to c x 256 tokens per window. With `profile`, a torch profile of 24
    decode steps goes there instead (that window is slower and not a measurement)."""
    spans: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    window_start = time.time() + warmup
    stop_at = window_start + seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.time() < stop_at:
            ids = [rng.randrange(3, 32000) for _ in range(32)]
            new = rng.randrange(128, 385)
            began = time.time()
            sampling = {"max_new_tokens": new, "temperature": temperature, "ignore_eos": True}
            status, body = call(port, "/generate", {"input_ids": ids, "sampling_params": sampling})
            if status == 200:
                with lock:
                    spans.append((began, time.time(), len(body["output_ids"])))  # type: ignore[index]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    if profile is not None:
        time.sleep(warmup)
        status, body = call(
            port,
            "/start_profile",
            {"output_dir": str(profile), "num_steps": 24, "activities": ["CPU", "GPU"]},
        )
        log(f"profile into {profile}: {status} {body}")
    for t in threads:
        t.join()
    return tokens_in_window(spans, window_start, stop_at) / seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="speed-results")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument(
        "--repeat", type=int, default=1, help="windows per point; the median is reported"
    )
    parser.add_argument(
        "--only",
        default="plain,patched-off,upstream-0step",
        help="comma-separated servers: plain, always-on, patched-8, patched-off, upstream-0step, "
        "patched-off-upstream-extend (off steps run upstream's draft extend), patched-off-4 "
        "and patched-off-4-unsampled (four tokens a step, with and without the agreement "
        "sampling)",
    )
    parser.add_argument(
        "--weights",
        choices=["dummy", "synthetic"],
        default="dummy",
        help="random weights (acceptance near 0), or synthetic.py's pair (known acceptance)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="request temperature; sets acceptance"
    )
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="run all servers at once and alternate their windows (needs memory for all)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each measurement, a torch profile of 24 steps under the same load",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path("/tmp/specgate-models-3b")
    if args.weights == "synthetic":
        from synthetic import acceptance

        log(f"writing the synthetic pair (c={args.c}) into {models}")
        write_synthetic_pair(models, args.c)
        predicted = acceptance(args.c, args.temperature, steps=3)[1]
    else:
        for name, cfg in (("target", SHAPE), ("draft", DRAFT)):
            (models / name).mkdir(parents=True, exist_ok=True)
            (models / name / "config.json").write_text(json.dumps(cfg))
    adaptive_cfg = out / "adaptive-off-above-8.json"
    adaptive_cfg.write_text(json.dumps(ADAPTIVE_OFF_ABOVE_8))
    # Graphs up to c=64. SGLang caps speculative servers at 48 running requests by default; the
    # same cap for all keeps c=64 a comparison of step cost, not of admission.
    common = server_flags(
        models / "target",
        mem_fraction=0.6,
        max_running=64,
        max_graph_batch=64,
        dummy_weights=args.weights == "dummy",
        sleep_on_idle=True,
    )
    eagle = [*EAGLE, "--speculative-draft-model-path", str(models / "draft")]
    servers = {
        "plain": common,
        "always-on": [*common, *eagle],
        "patched-8": [*common, *eagle, "--speculative-disable-batch-threshold", "8"],
        "patched-off": [*common, *eagle, "--speculative-disable-batch-threshold", "0"],
        "patched-off-upstream-extend": [
            *common,
            *eagle,
            "--speculative-disable-batch-threshold",
            "0",
        ],
        "upstream-0step": [
            *common,
            *eagle,
            "--speculative-adaptive",
            "--speculative-adaptive-config",
            str(adaptive_cfg),
        ],
        # The off mode as the single-GPU example deploys it (four tokens a request a step),
        # with and without the draft's agreement sampled every eighth off step.
        "patched-off-4": [
            *common,
            *eagle,
            "--speculative-disable-batch-threshold",
            "0",
            *off_step_flags(4),
        ],
        "patched-off-4-unsampled": [
            *common,
            *eagle,
            "--speculative-disable-batch-threshold",
            "0",
            *off_step_flags(4),
        ],
    }
    servers = {k: v for k, v in servers.items() if k in args.only.split(",")}
    if args.interleave:
        # Every server holds its share of the GPU at once; leave room for graphs and buffers.
        share = f"{min(0.6, 0.8 / max(1, len(servers))):.2f}"
        for flags in servers.values():
            flags[flags.index("--mem-fraction-static") + 1] = share
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "shape": f"Llama 3B-class (hidden 3072, 28 layers, GQA 24/8), {args.weights} weights, bf16",
        "tok_s": {},
        "temperature": args.temperature,
    }
    if args.weights == "synthetic":
        results["predicted_accept_length"] = round(predicted, 3)
    ports = {name: port for port, name in enumerate(servers, start=30300)}

    def measure(name: str, c: int) -> None:
        """One window at concurrency c on one server; the accept length after it."""
        rate = closed_loop(ports[name], c, args.seconds, temperature=args.temperature)
        runs = results.setdefault("runs", {}).setdefault(name, {}).setdefault(str(c), [])
        runs.append(round(rate, 1))
        log(f"{name} c={c}: {rate:.0f} tok/s")
        if name != "plain":
            accept = spec_loads(ports[name]).get("accept_length")
            results.setdefault("accept_length", {}).setdefault(name, {})[str(c)] = accept

    def launch(name: str, wait: bool = True) -> subprocess.Popen[bytes]:
        """Start one server; with `wait`, until it is healthy, else until it has sized its
        KV pool (the next may then start: its memory profile sees this one's)."""
        env = UPSTREAM_EXTEND_ENV if name.endswith("-upstream-extend") else None
        if name.endswith("-unsampled"):
            env = UNSAMPLED_ENV
        proc = start(name, servers[name], ports[name], out, env)
        if wait:
            results[f"startup_seconds_{name}"] = round(
                wait_healthy(ports[name], proc, timeout=480), 1
            )
        else:
            wait_for_log(out / f"{name}.log", MEMORY_SIZED, proc)
        return proc

    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except Exception:
            proc.kill()
        time.sleep(3)

    if args.interleave:
        # All servers up at once (started one by one: concurrent memory profiling races),
        # and at each point the windows alternate between them, so a host that slows down
        # over the run slows every server alike and the ratios stay side by side.
        procs = []
        try:
            for name in servers:
                procs.append(launch(name, wait=False))
            # Their CUDA graphs captured side by side.
            for name, proc in zip(servers, procs, strict=True):
                results[f"startup_seconds_{name}"] = round(
                    wait_healthy(ports[name], proc, timeout=480), 1
                )
            for c in levels:
                for _ in range(args.repeat):
                    for name in servers:
                        measure(name, c)
        except Exception as exc:
            results.setdefault("errors", {})["interleaved"] = f"{type(exc).__name__}: {exc}"
            log(results["errors"]["interleaved"])
        finally:
            for proc in procs:
                stop(proc)
    else:
        for name in servers:
            proc = None
            try:
                proc = launch(name)
                for c in levels:
                    for _ in range(args.repeat):
                        measure(name, c)
                    if args.profile:
                        closed_loop(
                            ports[name],
                            c,
                            6.0,
                            profile=out / "profiles" / f"{name}-c{c}",
                            temperature=args.temperature,
                        )
            except Exception as exc:
                results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
                log(results["errors"][name])
            finally:
                if proc is not None:
                    stop(proc)
    for name, by_c in results.get("runs", {}).items():
        results["tok_s"][name] = {c: round(statistics.median(r), 1) for c, r in by_c.items()}
    plain = results["tok_s"].get("plain", {})
    results["ratio_to_plain"] = {
        name: {c: round(v / plain[c], 3) for c, v in rates.items() if plain.get(c)}
        for name, rates in results["tok_s"].items()
        if name != "plain"
    }
    (out / "speed.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
