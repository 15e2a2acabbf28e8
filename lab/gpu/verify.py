"""GPU verification of the patched SGLang: runtime speculation control and output identity.

Runs wherever SGLang 0.5.17 with the specgate patch imports and a GPU is visible; standard
library only. It writes tiny local models (config.json only; --load-format dummy), starts the
patched EAGLE-3 server and, for the identity check, a plain server, and prints one JSON line per
check plus a summary. Exit status 0 only when every check passed.

    python3 verify.py --out results/ [--checks control,identity]

Checks (the worker-image issue's list):
  control   threshold 2 with 8 concurrent requests: the speculation-off step counter takes
            nearly all decode steps; threshold 64: the reverse; a change made while requests run
            takes effect within a few steps; /server_info and /metrics echo the value; bad
            values get HTTP 400 and change nothing (accept-length counters included).
  identity  greedy outputs of 16 prompts are token-for-token those of a server without
            speculation while the threshold flips between 0 and 64 every 200 ms.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

KEY = "gputest-key"
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
DRAFT = {
    **LLAMA,
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "draft_vocab_size": 32000,
}
COMMON = [
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--enable-metrics",
    "--host",
    "127.0.0.1",
    "--mem-fraction-static",
    "0.35",
    "--cuda-graph-max-bs-decode",
    "16",
    "--disable-prefill-cuda-graph",
    "--api-key",
    KEY,
]
EAGLE = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
]


def server_flags(
    target: Path,
    *,
    mem_fraction: float,
    max_running: int | None = None,
    max_graph_batch: int | None = None,
    dummy_weights: bool = True,
    sleep_on_idle: bool = False,
    prefill_graph_tokens: int = 0,
) -> list[str]:
    """COMMON for one target model: its weights (random with `dummy_weights`), its share of the
    GPU, and where set the running-request cap and the largest decode CUDA-graph batch.

    `sleep_on_idle`: for benchmarks that run servers side by side. An idle SGLang scheduler
    otherwise polls its sockets in a busy loop, one thread at 100% of a core each, and the
    server being measured shares the host's cores with every idle one.

    `prefill_graph_tokens`: above 0, prefills of up to that many tokens replay SGLang's
    breakable CUDA graphs (its default outside these tests) instead of running eagerly."""
    flags = [*COMMON, "--model-path", str(target)]
    if sleep_on_idle:
        flags.append("--sleep-on-idle")
    if prefill_graph_tokens > 0:
        flags.remove("--disable-prefill-cuda-graph")
        flags += [
            "--cuda-graph-backend-prefill",
            "breakable",
            "--cuda-graph-max-bs-prefill",
            str(prefill_graph_tokens),
        ]
    if not dummy_weights:
        at = flags.index("--load-format")
        del flags[at : at + 2]
    flags[flags.index("--mem-fraction-static") + 1] = str(mem_fraction)
    if max_graph_batch is not None:
        flags[flags.index("--cuda-graph-max-bs-decode") + 1] = str(max_graph_batch)
    if max_running is not None:
        flags += ["--max-running-requests", str(max_running)]
    return flags


def off_step_flags(tokens: int) -> list[str]:
    """The patched server's flag for `tokens` a request per speculation-off step (none for 1,
    the default, so that the flag's absence is what the earlier runs tested)."""
    return [] if tokens == 1 else ["--speculative-off-step-tokens", str(tokens)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
"""What every request to a test server carries."""


def answer(status: int, raw: bytes) -> tuple[int, object]:
    """A server's answer: its JSON, else its text (an error page), None when empty."""
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def call(
    port: int, path: str, body: object | None = None, timeout: float = 120
) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=HEADERS)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return answer(status, raw)


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return resp.read().decode()


def spec_loads(port: int) -> dict:
    status, body = call(port, "/v1/loads?include=core,spec")
    assert status == 200, body
    load = body["loads"][0]  # type: ignore[index]
    return {"running": load.get("num_running_reqs"), **(load.get("speculative") or {})}


# The four variables below switched the engine's off path to an alternative in an A/B copy of
# the patch (git history: lab/gpu/patches/ab-toggles.patch, removed once stale); the product
# patch has no such switches, and under it these runs measure the product's path.
UPSTREAM_EXTEND_ENV = {"SGLANG_SPEC_LEAN_OFF_DRAFT_EXTEND": "0"}
"""Speculation-off steps run their draft extend through upstream's generic path, not the
patch's lagged KV write or lean draft extend (for side-by-side speed runs)."""
LEAN_EXTEND_ENV = {"SGLANG_SPEC_LAGGED_DRAFT_KV": "0"}
"""Speculation-off steps run the lean draft extend every step, not the lagged draft KV write
inside the target's decode graph (the patch's off step before 2026-11-30's second session)."""
FULL_PREFILL_ENV = {"SGLANG_SPEC_DRAFT_KV_ONLY_PREFILL": "0"}
"""Prefills run the draft's whole prefill even before a likely speculation-off step, not the
draft-KV-only write (the patch's prefill before 2026-11-30's eighth session)."""
EAGER_PROMPT_KV_ENV = {"SGLANG_SPEC_PROMPT_KV_GRAPHS": "0"}
"""The draft-KV-only prefill launches its write kernel by kernel, not from a CUDA graph (the
patch's prefill before 2026-12-01's sixteenth session)."""


def start(
    name: str,
    args: list[str],
    port: int,
    logs: Path,
    env: dict[str, str] | None = None,
    cpus: Collection[int] | None = None,
    user: int | None = None,
) -> subprocess.Popen[bytes]:
    """Launch one SGLang server; with `cpus`, it and every process it spawns run on those
    CPUs only (set in the child before it starts Python: inherited by the scheduler); with
    `user`, as that user and group id with no supplementary groups (as a pod's runAsUser)."""
    log(f"starting {name} on :{port}" + (f" with {env}" if env else ""))
    out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 (the server process writes it)
    pin = pin_to(cpus)

    def in_child() -> None:
        if pin is not None:
            pin()
        if user is not None:
            os.setgroups([])
            os.setgid(user)
            os.setuid(user)

    return subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *args, "--port", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        preexec_fn=in_child if pin is not None or user is not None else None,
    )


def stop_all(procs: Iterable[subprocess.Popen[bytes] | None], timeout: float = 30) -> None:
    """Terminate every process first (they stop in parallel), then wait for each and kill
    what outlives `timeout`."""
    running = [p for p in procs if p is not None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


class ClosedLoopClients:
    """`n` closed-loop clients on one port until `stop`: each sends a 32-token prompt of random
    ids for a number of new tokens drawn from `new` (ignore_eos), then the next. Keeps every
    answered request's (began, ended, tokens) and its meta_info accept length."""

    def __init__(self, port: int, n: int, temperature: float, new: tuple[int, int]) -> None:
        self.port, self.temperature, self.new = port, temperature, new
        self.spans: list[tuple[float, float, int]] = []
        self.accept_lengths: list[float | None] = []
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        rng = random.Random(i * 7919 + self.port)
        while not self._stop.is_set():
            body = {
                "input_ids": [rng.randrange(3, 32000) for _ in range(32)],
                "sampling_params": {
                    "max_new_tokens": rng.randint(*self.new),
                    "temperature": self.temperature,
                    "ignore_eos": True,
                },
            }
            began = time.monotonic()
            status, answer = call(self.port, "/generate", body, timeout=120)
            ended = time.monotonic()
            with self._lock:
                if status != 200 or not isinstance(answer, dict):
                    self.errors += 1
                    continue
                meta = answer.get("meta_info", {})
                self.spans.append((began, ended, int(meta.get("completion_tokens", 0))))
                self.accept_lengths.append(meta.get("spec_accept_length"))

    @property
    def tokens(self) -> int:
        """Output tokens of the requests answered so far."""
        with self._lock:
            return sum(n for _, _, n in self.spans)

    def snapshot(self) -> list[tuple[float, float, int]]:
        with self._lock:
            return list(self.spans)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def pin_to(cpus: Collection[int] | None) -> Callable[[], None] | None:
    """A preexec_fn that confines the child process (and what it spawns) to `cpus`; None, and
    so no pinning, without them."""
    if cpus is None:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 420) -> float:
    started = time.time()
    while time.time() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server on :{port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise RuntimeError(f"server on :{port} not healthy after {timeout}s")


MEMORY_SIZED = "Memory pool end"
"""SGLang's log line once a server has sized its KV pool. A server profiles the free memory of
its GPU when it starts, so a second server on the same GPU starts after this line: two that
profile at once can each count memory the other then takes."""


def wait_for_log(
    path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 300
) -> None:
    started = time.time()
    while time.time() - started < timeout:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name}: server exited with {proc.returncode}")
        time.sleep(1)
    raise RuntimeError(f"{path.name}: no {text!r} after {timeout}s")


def generate(port: int, ids: list[int], new: int) -> list[int]:
    status, body = call(
        port,
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
        },
    )
    assert status == 200, body
    return list(body["output_ids"])  # type: ignore[index]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randrange(8, 48))] for _ in range(n)]


def steps_between(before: dict, after: dict) -> tuple[int, int]:
    """(speculating, plain) decode steps between two /v1/loads snapshots."""
    return (
        after["decode_steps_on"] - before["decode_steps_on"],
        after["decode_steps_off"] - before["decode_steps_off"],
    )


def set_threshold(port: int, value: object) -> tuple[int, object]:
    return call(
        port, "/set_internal_state", {"server_args": {"speculative_disable_batch_threshold": value}}
    )


def run_batch(port: int, n: int, new: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda ids: generate(port, ids, new), prompts(n, seed=n)))


def check_control(port: int) -> dict:
    out: dict = {}
    status, info = call(port, "/server_info")
    out["server_info_threshold_at_start"] = info.get("speculative_disable_batch_threshold")  # type: ignore[union-attr]
    before = spec_loads(port)
    run_batch(port, 8, 96)
    after_low = spec_loads(port)
    on, off = steps_between(before, after_low)
    out["threshold_2_batch_8"] = {"steps_on": on, "steps_off": off}
    ok_low = off > 5 * max(on, 1)
    assert set_threshold(port, 64)[0] == 200
    run_batch(port, 8, 96)
    after_high = spec_loads(port)
    on2, off2 = steps_between(after_low, after_high)
    out["threshold_64_batch_8"] = {"steps_on": on2, "steps_off": off2}
    ok_high = on2 > 5 * max(off2, 1)
    # A change while requests run: speculation stops within a few steps.
    worker = threading.Thread(target=run_batch, args=(port, 8, 3000))
    worker.start()
    time.sleep(0.8)
    mid = spec_loads(port)
    assert set_threshold(port, 0)[0] == 200
    time.sleep(0.3)
    late = spec_loads(port)
    time.sleep(0.5)
    later = spec_loads(port)
    worker.join()
    (on_soon, off_soon), (on_later, off_later) = (
        steps_between(mid, late),
        steps_between(late, later),
    )
    out["live_change"] = {
        "on_during_0.3s_after_set": on_soon,
        "off_during_0.3s_after_set": off_soon,
        "on_in_next_0.5s": on_later,
        "off_in_next_0.5s": off_later,
    }
    ok_live = (
        out["live_change"]["on_in_next_0.5s"] == 0 and out["live_change"]["off_in_next_0.5s"] > 3
    )
    accept_before = spec_loads(port).get("accept_length")
    bad = {}
    for value in (-1, 2.5, "3", True, [4]):
        status, _ = set_threshold(port, value)
        bad[repr(value)] = status
    status, _ = call(
        port,
        "/set_internal_state",
        {"server_args": {"speculative_disable_batch_threshold": 4, "pp_max_micro_batch_size": 2}},
    )
    bad["with another key"] = status
    out["bad_values_status"] = bad
    ok_bad = all(s == 400 for s in bad.values())
    info_after_bad = call(port, "/server_info")[1]
    accept_after = spec_loads(port).get("accept_length")
    out["accept_length_before_after_bad"] = [accept_before, accept_after]
    assert set_threshold(port, 5)[0] == 200
    info5 = call(port, "/server_info")[1]
    out["server_info_after_set_5"] = info5.get("speculative_disable_batch_threshold")  # type: ignore[union-attr]
    run_batch(port, 2, 200)  # past decode_log_interval so the gauges refresh
    text = metrics(port)
    out["metrics_lines"] = [
        line
        for line in text.splitlines()
        if line.startswith(
            (
                "sglang:spec_disable_batch_threshold",
                "sglang:spec_decode_steps_total",
                "sglang:spec_prefills_total",
                "sglang:spec_accept_length",
            )
        )
    ]
    ok_metrics = any(
        line.startswith("sglang:spec_disable_batch_threshold") and line.endswith(" 5.0")
        for line in out["metrics_lines"]
    )
    assert set_threshold(port, None)[0] == 200
    out["server_info_after_null"] = call(port, "/server_info")[1].get(  # type: ignore[union-attr]
        "speculative_disable_batch_threshold", "missing"
    )
    out["threshold_0_threshold_after_bad"] = info_after_bad.get(
        "speculative_disable_batch_threshold"
    )  # type: ignore[union-attr]
    out["passed"] = {
        "threshold_2_off_dominates": ok_low,
        "threshold_64_on_dominates": ok_high,
        "live_change_takes_effect": ok_live,
        "bad_values_400": ok_bad,
        "accept_length_kept": accept_before == accept_after,
        "server_info_echo": out["server_info_after_set_5"] == 5
        and out["server_info_after_null"] is None,
        "metrics_echo": ok_metrics,
    }
    return out


def check_identity(spec_port: int, plain_port: int) -> dict:
    items = prompts(16, seed=123)
    new_tokens = 1024  # long enough for the threshold to flip many times mid-generation
    reference = [generate(plain_port, ids, new_tokens) for ids in items]
    stop = threading.Event()
    flips = 0

    def flipper() -> None:
        nonlocal flips
        value = 0
        while not stop.is_set():
            set_threshold(spec_port, value)
            flips += 1
            value = 64 if value == 0 else 0
            time.sleep(0.2)

    thread = threading.Thread(target=flipper)
    thread.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda ids: generate(spec_port, ids, new_tokens), items))
    stop.set()
    thread.join()
    mismatches = [i for i, (a, b) in enumerate(zip(reference, got, strict=True)) if a != b]
    first = None
    if mismatches:
        i = mismatches[0]
        first = next(
            k for k, (x, y) in enumerate(zip(reference[i], got[i], strict=False)) if x != y
        )
    return {
        "prompts": len(items),
        "flips": flips,
        "mismatching_prompts": mismatches,
        "first_divergence_token": first,
        "passed": {"identical": not mismatches},
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gputest-results")
    parser.add_argument("--checks", default="control,identity")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both servers")
    parser.add_argument(
        "--upstream-extend",
        action="store_true",
        help="off steps run upstream's draft extend, not the patch's lean one",
    )
    parser.add_argument("--port", type=int, default=30100, help="patched server; plain at +100")
    parser.add_argument("--mem-fraction", type=float, default=0.35, help="of each GPU per server")
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=0,
        help="both servers replay SGLang's breakable prefill CUDA graphs up to this many "
        "tokens, as SGLang does by default (0: eager prefills)",
    )
    parser.add_argument(
        "--off-step-tokens",
        type=int,
        default=1,
        help="tokens a request decodes per speculation-off step on the patched server "
        "(--speculative-off-step-tokens)",
    )
    args = parser.parse_args()
    spec_port, plain_port = args.port, args.port + 100
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(f"/tmp/specgate-models-{spec_port}")  # per run: runs may share a machine
    common = [
        *server_flags(
            models / "target",
            mem_fraction=args.mem_fraction,
            prefill_graph_tokens=args.prefill_graph_tokens,
        ),
        "--tp-size",
        str(args.tp),
    ]
    (models / "target").mkdir(parents=True, exist_ok=True)
    (models / "draft").mkdir(parents=True, exist_ok=True)
    (models / "target" / "config.json").write_text(json.dumps(LLAMA))
    (models / "draft" / "config.json").write_text(json.dumps(DRAFT))
    checks = set(args.checks.split(","))
    procs = []
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "tp": args.tp,
        "upstream_extend": args.upstream_extend,
        "prefill_graph_tokens": args.prefill_graph_tokens,
        "off_step_tokens": args.off_step_tokens,
    }
    try:
        spec_args = [
            *common,
            *EAGLE,
            "--speculative-draft-model-path",
            str(models / "draft"),
            "--speculative-disable-batch-threshold",
            "2",
            *off_step_flags(args.off_step_tokens),
        ]
        env = UPSTREAM_EXTEND_ENV if args.upstream_extend else None
        spec = start("patched-eagle3", spec_args, spec_port, out, env)
        procs.append(spec)
        results["startup_seconds_patched"] = round(wait_healthy(spec_port, spec), 1)
        log(f"patched server healthy after {results['startup_seconds_patched']}s")
        plain = None
        if "identity" in checks:  # started second: two servers profiling memory at once race
            plain = start("plain", common, plain_port, out)
            procs.append(plain)
        if "control" in checks:
            results["control"] = check_control(spec_port)
            log(json.dumps(results["control"]))
        if plain is not None:
            results["startup_seconds_plain"] = round(wait_healthy(plain_port, plain), 1)
            results["identity"] = check_identity(spec_port, plain_port)
            log(json.dumps(results["identity"]))
    except Exception as exc:  # report what happened, with the server logs' tails
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(results["error"])
    finally:
        stop_all(procs)
    passed = {
        f"{k}.{c}": v
        for k in ("control", "identity")
        if k in results
        for c, v in results[k]["passed"].items()
    }
    results["all_passed"] = bool(passed) and all(passed.values()) and "error" not in results
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if results["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
