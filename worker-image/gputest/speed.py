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


def closed_loop(port: int, clients: int, seconds: float, warmup: float = 3.0) -> float:
    counted = {"tokens": 0}
    lock = threading.Lock()
    stop_at = time.time() + warmup + seconds
    window_start = time.time() + warmup

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.time() < stop_at:
            ids = [rng.randrange(3, 32000) for _ in range(32)]
            status, body = call(port, "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": 256, "temperature": 0.0, "ignore_eos": True}})  # fmt: skip
            done = time.time()
            if status == 200 and window_start <= done <= stop_at:
                with lock:
                    counted["tokens"] += len(body["output_ids"])  # type: ignore[index]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counted["tokens"] / seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="speed-results")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--only", help="comma-separated subset of the servers")
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
                rate = closed_loop(port, c, args.seconds)
                results["tok_s"][name][str(c)] = round(rate, 1)
                log(f"{name} c={c}: {rate:.0f} tok/s")
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
