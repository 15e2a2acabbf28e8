"""Is speculation "off" as cheap as a plain server? Output tok/s side by side in one run.

Three servers on the same 3B-class Llama shape (dummy weights: acceptance does not matter when
nothing is drafted), started one after another on one GPU:
  plain            no speculation
  patched-off      EAGLE-3 + the specgate patch with --speculative-disable-batch-threshold 0
  upstream-0step   EAGLE-3 + upstream 0.5.17 --speculative-adaptive, drafting off above batch 8
Closed loop: c clients, each sends its next request (32-token prompt, 256 new tokens, ignore_eos)
when the last returns; tok/s over a fixed window after a warm-up.

    python3 speed.py --out results/ [--concurrency 16,64] [--seconds 12]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from verify import COMMON, EAGLE, call, log, start, wait_healthy

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
DRAFT = {**SHAPE, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
         "draft_vocab_size": 32000}  # fmt: skip


def closed_loop(
    port: int, clients: int, seconds: float, warmup: float = 3.0, profile: Path | None = None
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
            status, body = call(port, "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}})  # fmt: skip
            if status == 200:
                with lock:
                    spans.append((began, time.time(), len(body["output_ids"])))  # type: ignore[index]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    if profile is not None:
        time.sleep(warmup)
        status, body = call(port, "/start_profile", {
            "output_dir": str(profile), "num_steps": 24, "activities": ["CPU", "GPU"]})  # fmt: skip
        log(f"profile into {profile}: {status} {body}")
    for t in threads:
        t.join()
    tokens = sum(
        n * max(0.0, min(end, stop_at) - max(began, window_start)) / max(end - began, 1e-9)
        for began, end, n in spans
    )
    return tokens / seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="speed-results")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument(
        "--repeat", type=int, default=1, help="windows per point; the median is reported"
    )
    parser.add_argument("--only", help="comma-separated subset of the servers")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each measurement, a torch profile of 24 steps under the same load",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path("/tmp/specgate-models-3b")
    for name, cfg in (("target", SHAPE), ("draft", DRAFT)):
        (models / name).mkdir(parents=True, exist_ok=True)
        (models / name / "config.json").write_text(json.dumps(cfg))
    adaptive_cfg = out / "adaptive-off-above-8.json"
    adaptive_cfg.write_text(json.dumps({
        "1": {"candidate_steps": [3]}, "9": {"candidate_steps": [0]}}))  # fmt: skip
    common = [*COMMON, "--model-path", str(models / "target")]
    common[common.index("--cuda-graph-max-bs-decode") + 1] = "64"  # graphs up to c=64
    common[common.index("--mem-fraction-static") + 1] = "0.6"
    # SGLang caps speculative servers at 48 running requests by default; the same cap for all
    # keeps c=64 a comparison of step cost, not of admission.
    common += ["--max-running-requests", "64"]
    eagle = [*EAGLE, "--speculative-draft-model-path", str(models / "draft")]
    servers = {
        "plain": common,
        "patched-off": [*common, *eagle, "--speculative-disable-batch-threshold", "0"],
        "upstream-0step": [*common, *eagle, "--speculative-adaptive",
                           "--speculative-adaptive-config", str(adaptive_cfg)],
    }  # fmt: skip
    if args.only:
        servers = {k: v for k, v in servers.items() if k in args.only.split(",")}
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict = {"date": time.strftime("%Y-%m-%d"), "shape": "Llama 3B-class (hidden 3072, "
                     "28 layers, GQA 24/8), dummy weights, bf16", "tok_s": {}}  # fmt: skip
    for port, (name, flags) in enumerate(servers.items(), start=30300):
        proc = start(name, flags, port, out)
        try:
            results[f"startup_seconds_{name}"] = round(wait_healthy(port, proc, timeout=480), 1)
            results["tok_s"][name] = {}
            for c in levels:
                rates = [closed_loop(port, c, args.seconds) for _ in range(args.repeat)]
                rate = statistics.median(rates)
                results["tok_s"][name][str(c)] = round(rate, 1)
                results.setdefault("runs", {}).setdefault(name, {})[str(c)] = [
                    round(r, 1) for r in rates]  # fmt: skip
                log(f"{name} c={c}: {rate:.0f} tok/s (runs {', '.join(f'{r:.0f}' for r in rates)})")
                if args.profile:
                    closed_loop(port, c, 6.0, profile=out / "profiles" / f"{name}-c{c}")
        except Exception as exc:
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            log(results["errors"][name])
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:
                proc.kill()
            time.sleep(3)
    plain = results["tok_s"].get("plain", {})
    results["ratio_to_plain"] = {
        name: {c: round(v / plain[c], 3) for c, v in rates.items() if plain.get(c)}
        for name, rates in results["tok_s"].items() if name != "plain"
    }  # fmt: skip
    (out / "speed.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
