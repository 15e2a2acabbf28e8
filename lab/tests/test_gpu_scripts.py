"""The lab's GPU scripts without a GPU: the helpers that start servers and judge their runs
(lab/gpu/verify.py, synthetic.py, recovery.py, draftkv.py), the profile summaries, and the job
scripts' orchestration with the GPU runner stood in for."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT, load_module

ENVELOPE = "lab/bench/gpu_envelope.py"


def _gputest_module(name: str) -> ModuleType:
    return load_module(ROOT / "lab" / "gpu" / f"{name}.py", name)


def test_server_flags_set_weights_memory_and_caps() -> None:
    """The one place the GPU scripts turn verify.COMMON into a server's flags."""
    verify = _gputest_module("verify")
    dummy = verify.server_flags(Path("/m/target"), mem_fraction=0.25)
    assert dummy[dummy.index("--load-format") + 1] == "dummy"
    assert dummy[dummy.index("--model-path") + 1] == "/m/target"
    assert dummy[dummy.index("--mem-fraction-static") + 1] == "0.25"
    assert dummy[dummy.index("--cuda-graph-max-bs-decode") + 1] == "16"  # COMMON's default
    assert "--max-running-requests" not in dummy
    real = verify.server_flags(
        Path("/m/target"),
        mem_fraction=0.3,
        max_running=128,
        max_graph_batch=128,
        dummy_weights=False,
    )
    assert "--load-format" not in real and "dummy" not in real
    assert real[real.index("--cuda-graph-max-bs-decode") + 1] == "128"
    assert real[real.index("--max-running-requests") + 1] == "128"
    assert real.count("--mem-fraction-static") == 1
    assert verify.COMMON[verify.COMMON.index("--mem-fraction-static") + 1] == "0.35"  # unchanged
    # Idle schedulers sleep only where asked (the benchmarks that run servers side by side).
    assert "--sleep-on-idle" not in dummy and "--sleep-on-idle" not in verify.COMMON
    assert "--sleep-on-idle" in verify.server_flags(
        Path("/m"), mem_fraction=0.2, sleep_on_idle=True
    )


def test_synthetic_pair_acceptance_by_construction() -> None:
    """The synthetic pair's predicted acceptance (its weights need torch and a GPU; this is the
    arithmetic the GPU run is compared against)."""
    synthetic = _gputest_module("synthetic")
    assert synthetic.acceptance(12.0, 0.0, steps=3) == (1.0, 4.0)  # greedy: always accepted
    p, length = synthetic.acceptance(11.8, 1.0, steps=3)
    assert p == pytest.approx(1 / (1 + 31999 * math.exp(-11.8)))
    share = p / (p + 1 - p**4)  # rounds that start after a repeated bonus token
    assert length == pytest.approx(share * (1 + p + p**2 + p**3) + (1 - share))
    # What the H200 measured with the 3B pair (c = 12): 2.22-2.36 at T = 1.0, 3.15-3.37 at 0.9.
    assert synthetic.acceptance(12.0, 1.0, steps=3)[1] == pytest.approx(2.31, abs=0.01)
    assert synthetic.acceptance(12.0, 0.9, steps=3)[1] == pytest.approx(3.28, abs=0.01)
    lengths = [synthetic.acceptance(12.0, t, steps=3)[1] for t in (0.8, 0.9, 1.0, 1.2)]
    assert lengths == sorted(lengths, reverse=True)  # hotter sampling, fewer accepted
    target, draft = synthetic.configs(3072, 28, 24, 8, 8192)
    assert target["head_dim"] * target["num_attention_heads"] == target["hidden_size"]
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft["num_hidden_layers"] == 1
    assert draft["draft_vocab_size"] == target["vocab_size"] == synthetic.VOCAB


def test_recovery_judge_on_the_recorded_gpu_run() -> None:
    """Check 3 as judged from the H200 run's log (both draft-extend paths, three temperatures),
    and the judge failing a draft that came back 10% worse."""
    for sibling in ("verify", "synthetic", "speed"):  # what recovery.py imports beside it
        _gputest_module(sibling)
    recovery = _gputest_module("recovery")
    log = (ROOT / "lab" / "gpu" / "results" / "recovery-2026-11-30-2xh200.log").read_text()
    runs = recovery.windows_from_log(log)
    assert len(runs) == 6  # two servers x three temperatures
    for windows in runs.values():
        assert recovery.judge(windows)["passed"]
    windows = [dict(w) for w in runs[(32100, 0.0)]]
    for w in windows[2:]:
        if w["threshold"] is None:
            w["accept_length"] *= 0.9
    assert not recovery.judge(windows)["passed"]
    # A switch that does not land: an "off" window that mostly speculated.
    stuck = [dict(w) for w in runs[(32100, 0.0)]]
    stuck[1].update(steps_on=600, steps_off=75)
    assert not recovery.judge(stuck)["passed"]


def test_draftkv_flip_point_and_judge() -> None:
    """Check 3's draft-KV half (draftkv.py, not yet run on a GPU): where the context-reading
    draft turns from the prompt's token to the repeated one, and the verdict on the three
    runs. The GPU run measures whether the synced run's off steps counted towards the flip."""
    for sibling in ("verify", "synthetic", "speed", "recovery"):
        _gputest_module(sibling)
    synthetic = _gputest_module("synthetic")
    draftkv = _gputest_module("draftkv")
    # g kv (f_A - f_B) = hidden: 8 * 1024 * (199 - n) = 2048 * (201 + n)  ->  n = 119
    assert synthetic.context_flip(200, 8.0, 2048, 1024) == pytest.approx(119.0)
    assert synthetic.context_flip(200, 16.0, 2048, 1024) > 119  # a louder context holds longer
    assert synthetic.context_flip(200, 0.0, 2048, 1024) == 0.0  # no context: never proposes A
    assert synthetic.context_flip(1, 8.0, 2048, 1024) == 0.0  # one A: B wins at once
    runs = {
        "control": {"accept_length": 1.05},
        "early": {"accept_length": 1.1},
        "synced": {"accept_length": 3.98},
    }
    assert draftkv.judge(runs)
    assert not draftkv.judge({**runs, "synced": {"accept_length": 1.2}})  # off steps not written
    assert not draftkv.judge({**runs, "control": {"accept_length": 3.9}})  # draft ignores context
    assert not draftkv.judge({**runs, "early": {"accept_length": None}})
    assert not draftkv.judge({k: v for k, v in runs.items() if k != "early"})
    prompts = [draftkv.prompt(run, i, 200) for run in range(3) for i in range(draftkv.CLIENTS)]
    assert len({tuple(p) for p in prompts}) == len(prompts)  # no shared prefix
    assert all(len(set(p)) == 2 and p[0] != p[-1] and len(p) == 201 for p in prompts)
    assert max(max(p) for p in prompts) < synthetic.VOCAB
    layers = draftkv.SHAPE["layers"]  # EAGLE-3's fc needs three distinct captured layers
    assert len({2, layers // 2, layers - 3}) == 3


def test_profile_summary_reads_a_torch_trace(tmp_path: Path) -> None:
    """gputest/profile_summary.py on a hand-made chrome trace: span, busy time (overlapping
    kernels counted once), kernels ranked by total time, graph launches, CPU ranges."""
    import gzip

    summary = _gputest_module("profile_summary")
    events = [
        {"ph": "X", "cat": "kernel", "name": "decode_attn", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "kernel", "name": "decode_attn", "ts": 5_000, "dur": 10_000},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100_000, "dur": 50_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 2},
        {"ph": "X", "cat": "user_annotation", "name": "draft_extend", "ts": 0, "dur": 30},
        {"ph": "i", "cat": "kernel", "name": "not-a-span", "ts": 1},
    ]
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    s = summary.summarise(trace, top=5)
    assert s["span_ms"] == 150.0 and s["gpu_busy_ms"] == 65.0  # the overlap counted once
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "decode_attn"]
    assert s["top_kernels"][1]["count"] == 2
    assert s["cuda_graph_launches"] == 1
    assert s["annotations"] == {"draft_extend": {"count": 1, "mean_us": 30.0}}


def test_profile_summary_splits_a_decode_steps_host_time(tmp_path: Path) -> None:
    """--functions: Python functions' inclusive time per decode step, counting only the
    scheduler's run_batch ranges that hold a decode step (not prefills)."""
    import gzip

    summary = _gputest_module("profile_summary")

    def span(cat: str, name: str, ts: int, dur: int, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        span("user_annotation", "scheduler.run_batch", 0, 1000),
        span("user_annotation", "step[DECODE bs=64]", 10, 900),
        span("python_function", "forward", 20, 600),
        span("python_function", "draft_extend", 650, 300),
        span("user_annotation", "scheduler.run_batch", 2000, 3000),
        span("user_annotation", "step[DECODE bs=64]", 2010, 2900),
        span("python_function", "forward", 2020, 1000),
        span("python_function", "forward", 2020, 1000, tid=2),  # another thread: not counted
        span("user_annotation", "scheduler.run_batch", 9000, 5000),  # a prefill: not counted
        span("user_annotation", "step[EXTEND bs=1 toks=32]", 9010, 4000),
        span("python_function", "forward", 9020, 4000),
    ]
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    n, mean, functions = summary.step_functions(trace)
    assert (n, mean) == (2, 2000.0)
    assert functions == {"forward": 800.0, "draft_extend": 150.0}
    # --kind EXTEND: the prefill's steps alone.
    assert summary.step_functions(trace, "EXTEND") == (1, 5000.0, {"forward": 4000.0})
    # --part: the loop's other ranges on the steps' thread (a nested repeat once), per range.
    more = [
        span("user_annotation", "scheduler.get_next_batch_to_run", 1000, 400),
        span("user_annotation", "scheduler.get_next_batch_to_run", 1010, 300),  # nested
        span("python_function", "prepare_for_decode", 1020, 200),
        span("user_annotation", "scheduler.get_next_batch_to_run", 5000, 600),
        span("python_function", "prepare_for_decode", 5010, 400),
        span("python_function", "filter_batch", 5420, 100),
        span("user_annotation", "scheduler.get_next_batch_to_run", 5000, 600, tid=2),
        span("python_function", "prepare_for_decode", 5010, 500, tid=2),
    ]
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events + more}, fh)
    assert summary.step_functions(trace, part="get_next_batch_to_run") == (
        2,
        500.0,
        {"prepare_for_decode": 300.0, "filter_batch": 50.0},
    )


def test_profile_summary_finds_the_syncs_that_block_the_host(tmp_path: Path) -> None:
    """--syncs: blocking syncs during the steps, grouped by call and by the Python frames around
    them on their thread (innermost first, object addresses dropped); syncs before the first
    step (the profiler starting) and runtime calls that do not block left out."""
    import gzip

    summary = _gputest_module("profile_summary")

    def span(cat: str, name: str, ts: int, dur: int, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [span("cuda_runtime", "cudaDeviceSynchronize", 0, 900)]  # before any step
    for ts in (1000, 5000):
        events += [
            span("user_annotation", "step[EXTEND bs=1 toks=32]", ts, 3000),
            span("python_function", "worker.py(10): forward_batch_generation", ts, 2000),
            span("python_function", "lagged_draft_kv.py(61): forget", ts + 100, 1500),
            span("cuda_runtime", "cudaStreamSynchronize", ts + 200, 1100),
            span("cuda_runtime", "cudaLaunchKernel", ts + 1400, 5),  # not a sync
            span(
                "python_function",
                "<built-in method synchronize of Event object at 0x7f1>",
                ts + 2100,
                50,
            ),
            span("cuda_runtime", "cudaEventSynchronize", ts + 2110, 30),
        ]
    events[-1]["tid"] = 2  # the second event sync on another thread: no frame around it
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    steps, sites = summary.host_syncs(trace)
    assert steps == 2
    assert sites == {
        ("cudaStreamSynchronize", "forget < forward_batch_generation"): [1100.0, 1100.0],
        ("cudaEventSynchronize", "<built-in method synchronize of Event object>"): [30.0],
        ("cudaEventSynchronize", "(no Python frame)"): [30.0],
    }


def test_profile_summary_puts_gpu_time_per_step_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--gpu-per-step: per profiled step each trace's span, GPU busy time (overlaps once) and
    idle time, and its kernels; a level's servers side by side, plain first, kernels by their
    largest difference from plain; with --plot, the differences by kernel family."""
    import gzip

    summary = _gputest_module("profile_summary")

    def trace(folder: str, kernels: list[tuple[str, int, int]]) -> None:
        events = [
            {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels
        ]
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": 0,
                "dur": 1_000_000,
            }
        )  # host side: not GPU time
        (tmp_path / folder).mkdir()
        with gzip.open(tmp_path / folder / "rank0.trace.json.gz", "wt") as fh:
            json.dump({"traceEvents": events}, fh)

    trace("plain-c16", [("gemm", 0, 300), ("attn", 300, 100), ("gemm", 1000, 300)])
    trace("patched-off-c16", [("gemm", 0, 300), ("kv_write", 250, 100), ("gemm", 1200, 300)])
    trace("plain-c64", [("gemm", 0, 500)])
    off = summary.gpu_per_step(tmp_path / "patched-off-c16" / "rank0.trace.json.gz", steps=2)
    assert off["span_us"] == 750 and off["busy_us"] == 325 and off["idle_us"] == 425
    assert off["kernels"] == {"gemm": 300, "kv_write": 50}
    assert summary.level_of(Path("x/patched-off-c64/t.json")) == ("c = 64", "patched-off")
    assert summary.level_of(Path("x/profiles/t.json")) == ("", "profiles")

    traces = sorted(tmp_path.rglob("*.trace.json*"))
    summary.print_gpu_per_step(traces, steps=2, top=5)
    out = capsys.readouterr().out
    sixteen = out.split("## c = 16")[1].split("## c = 64")[0]
    assert "| plain | patched-off | |" in sixteen
    assert "| 650 | 750 | **span** (the step's period; an upper bound) |" in sixteen
    assert "| 350 | 325 | **GPU busy** |" in sixteen
    rows = [line for line in sixteen.splitlines() if line.endswith("` |")]
    # attn and kv_write differ from plain by 50 us a step, gemm not at all.
    assert rows == [
        "| 50.0 | 0.0 | `attn` |",
        "| 0.0 | 50.0 | `kv_write` |",
        "| 300.0 | 300.0 | `gemm` |",
    ]
    assert "| plain | |" in out.split("## c = 64")[1]
    assert summary.by_level({"c = 128": 0, "c = 16": 0, "c = 64": 0}) == [
        "c = 16",
        "c = 64",
        "c = 128",
    ]
    # --plot: each server's GPU time over plain's by kernel family, one panel per level.
    png = tmp_path / "gpu.png"
    summary.print_gpu_per_step(traces, steps=2, top=5, plot=png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    family = summary.kernel_family
    assert family("nvjet_sm90_tst_64x64_64x13_4x1_v_bz_splitK_TNT") == "GEMMs"
    assert family("void cublasLt::splitKreduce_kernel<32, 16, int>") == "GEMMs"
    assert family("void flashinfer::norm::RMSNormKernel<8u>") == "norms"  # not attention
    assert family("_fwd_grouped_kernel_stage1") == "attention"
    assert family("void at::native::index_elementwise_kernel<128, 4>") == "gathers, scatters"
    assert family("Memcpy DtoD (Device -> Device)") == "copies, concatenations"
    assert family("assign_req_to_token_pool") == "other"


def test_profile_summary_splits_the_scheduler_thread_by_kind_of_step(tmp_path: Path) -> None:
    """--steps: run_batch ranges by the step they hold (nested ranges of one name once), the
    draft extend inside prefills, the loop's other parts, and the range holding no step (where
    the profiler started) kept out of the span's shares."""
    import gzip

    summary = _gputest_module("profile_summary")

    def span(name: str, ts: int, dur: int, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        span("scheduler.run_batch", 0, 300),  # the profiler starting: no step inside
        span("scheduler.run_batch", 1000, 2000),
        span("scheduler.run_batch", 1010, 1900),  # nested, the same range again
        span("step[EXTEND bs=1 toks=32]", 1020, 1800),
        span("draft_extend", 2500, 400),
        span("scheduler.process_batch_result", 3100, 500),
        span("scheduler.run_batch", 4000, 1000),
        span("step[DECODE bs=64]", 4010, 900),
        span("scheduler.run_batch", 4000, 1000, tid=2),  # another thread
        span("scheduler.get_next_batch_to_run", 5100, 200),
        span("scheduler.run_batch", 6000, 1000),
        span("step[DECODE bs=64]", 6010, 900),
    ]
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    s = summary.step_kinds(trace)
    assert s["span_us"] == 7000
    assert s["kinds"] == {
        "other": {"count": 1, "run_batch_us": 300.0, "draft_extend_us": 0.0},
        "EXTEND": {"count": 1, "run_batch_us": 2000.0, "draft_extend_us": 400.0},
        "DECODE": {"count": 2, "run_batch_us": 2000.0, "draft_extend_us": 0.0},
    }
    assert s["parts"]["scheduler.process_batch_result"] == 500
    assert s["parts"]["scheduler.get_next_batch_to_run"] == 200


@pytest.mark.parametrize("interleave", [False, True])
def test_speed_script_orchestration_without_a_gpu(
    interleave: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """speed.py's bookkeeping with the servers faked: which servers run, in which order the
    windows go, medians, ratios to plain, and the upstream-extend server's environment. What it
    measures on a GPU is in GPU-RESULTS.md."""
    monkeypatch.syspath_prepend(str(ROOT / "lab" / "gpu"))
    speed = _gputest_module("speed")
    started: list[tuple[str, dict[str, str] | None]] = []
    fractions: list[str] = []
    windows: list[tuple[int, int]] = []
    rates = {30300: [100.0, 120.0, 110.0], 30301: [60.0, 50.0, 55.0]}

    class Proc:
        def terminate(self) -> None: ...
        def wait(self, timeout: float) -> int:
            return 0

    def fake_start(
        name: str, args: list[str], port: int, logs: Path, env: dict[str, str] | None = None
    ) -> Proc:
        started.append((name, env))
        fractions.append(args[args.index("--mem-fraction-static") + 1])
        return Proc()

    def fake_loop(port: int, clients: int, seconds: float, **kw: object) -> float:
        windows.append((port, clients))
        return rates[port][sum(1 for p, c in windows if p == port and c == clients) - 1]

    monkeypatch.setattr(speed, "start", fake_start)
    monkeypatch.setattr(speed, "wait_healthy", lambda port, proc, timeout: 1.0)
    monkeypatch.setattr(speed, "wait_for_log", lambda path, text, proc, timeout=300: None)
    monkeypatch.setattr(speed, "closed_loop", fake_loop)
    monkeypatch.setattr(speed, "spec_loads", lambda port: {"accept_length": 1.0})
    monkeypatch.setattr(speed.time, "sleep", lambda s: None)
    argv = [
        "speed.py",
        "--out",
        str(tmp_path),
        "--only",
        "plain,patched-off-upstream-extend",
        "--concurrency",
        "16",
        "--repeat",
        "3",
    ]
    if interleave:
        argv.append("--interleave")
    monkeypatch.setattr(sys, "argv", argv)
    assert speed.main() == 0
    result = json.loads((tmp_path / "speed.json").read_text())
    assert [name for name, _ in started] == ["plain", "patched-off-upstream-extend"]
    assert started[1][1] == {"SGLANG_SPEC_LEAN_OFF_DRAFT_EXTEND": "0"}
    assert result["tok_s"] == {"plain": {"16": 110.0}, "patched-off-upstream-extend": {"16": 55.0}}
    assert result["ratio_to_plain"] == {"patched-off-upstream-extend": {"16": 0.5}}
    ports = [p for p, _ in windows]
    expected = [30300, 30301] * 3 if interleave else [30300] * 3 + [30301] * 3
    assert ports == expected
    # Together, two servers must share the GPU's memory.
    assert fractions == (["0.40", "0.40"] if interleave else ["0.6", "0.6"])


def _job(
    tmp_path: Path, job: str, *args: str, gpus: int = 2, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, str, str]], Path]:
    """lab/gpu/job.py JOB with run-on-gpu.sh and nvidia-smi stood in for: the runner's
    output, each run's (CUDA_VISIBLE_DEVICES, script, arguments) in the order they started
    (the set-up run included), and where the results came back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: H200'\n" for i in range(gpus)))
    calls = tmp_path / "calls.txt"
    runner = tmp_path / "run.sh"
    runner.write_text(f"""#!/usr/bin/env bash
echo "${{CUDA_VISIBLE_DEVICES-none}}|$3|${{*:4}}" >> {calls}
mkdir -p "$2"
case "$3" in
  none) ;;
  verify) echo '{{"all_passed": true}}' > "$2/results.json"; echo log > "$2/plain.log" ;;
  draftkv) echo '{{"passed": true}}' > "$2/draftkv.json" ;;
  *) echo '{{"windows": []}}' > "$2/envelope.json"; echo log > "$2/plain.log"
     echo log > "$2/router.log" ;;
esac
""")
    for script in (smi, runner):
        script.chmod(0o755)
    out = tmp_path / "out"
    run_env = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SPECGATE_GPU_RUN": str(runner),
        "SPECGATE_PYSPY_WHEEL": "", **(env or {}),
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(ROOT / "lab" / "gpu" / "job.py"), job, "--archive", "site.tar.xz",
         "--out", str(out), *args],
        capture_output=True, text=True, env=run_env, timeout=120,
    )  # fmt: skip
    lines = calls.read_text().splitlines() if calls.exists() else []
    ran = [tuple(line.split("|", 2)) for line in lines]
    return result, ran, out  # type: ignore[return-value]


def _by_gpu(ran: list[tuple[str, str, str]]) -> dict[str, str]:
    """Each GPU's one bench run's arguments (the set-up run left out)."""
    return {gpu: args for gpu, script, args in ran if script != "none"}


def _results_came_back(out: Path, files: set[str], logs: set[str]) -> None:
    """At most 8 files at the top (what the device tool returns), the rest in one archive."""
    import tarfile

    top = sorted(p.name for p in out.iterdir())
    assert len(top) <= 8 and all(p.is_file() for p in out.iterdir()), top
    assert files | {"logs.tar.xz"} <= set(top), top
    with tarfile.open(out / "logs.tar.xz") as archive:
        names = set(archive.getnames())
    assert logs | {"setup/setup.log", "setup/thread-siblings.txt"} <= names, names


def test_a_job_runs_its_lanes_side_by_side_one_gpu_each_with_the_callers_arguments(
    tmp_path: Path,
) -> None:
    """The sweep: low levels with all four servers on GPU 0 beside the learned high levels
    on GPU 1, both as deployed, on ports of their own; arguments after -- reach both, last."""
    result, ran, out = _job(tmp_path, "sweep", "--", "--seconds", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ran[0] == ("none", "none", "")  # set up once, before the runs
    by_gpu = _by_gpu(ran)
    assert set(by_gpu) == {"0", "1"}
    assert "--levels 4,8,2,1" in by_gpu["0"] and "upstream-0step" in by_gpu["0"]
    assert "--levels 16,128,64,32" in by_gpu["1"] and "--learn-seconds 90" in by_gpu["1"]
    assert "--port-base 31300" in by_gpu["1"] and "--port-base" not in by_gpu["0"]
    for args in by_gpu.values():
        assert "--prefill-graph-tokens 2048 --flush-cache" in args
        assert args.endswith("--seconds 3")
    _results_came_back(out, {"low.json", "high.json"}, {"low/plain.log", "high/plain.log"})
    assert (out / "low.log").read_text().splitlines()[-1] == "low: exit 0"


@pytest.mark.parametrize("gpus", [2, 1])
def test_checks_go_beside_the_bench_run_or_before_it_on_one_gpu(gpus: int, tmp_path: Path) -> None:
    """off-step: with two GPUs the checks run on GPU 0 beside the speed runs on GPU 1; with
    one, verify first and the speed runs after it on GPU 0, without draftkv (it needs a
    second GPU). --check-args replaces the checks' arguments; the bench run keeps its own.
    The profiles' summary is made where the run left profiles."""
    result, ran, out = _job(tmp_path, "off-step", "--check-args", "--checks control", gpus=gpus)
    assert result.returncode == 0, result.stdout + result.stderr
    started = [(gpu, script) for gpu, script, _ in ran[1:]]
    if gpus == 2:
        assert sorted(started) == [("0", "draftkv"), ("0", "verify"), ("1", ENVELOPE)]
    else:
        assert started == [("0", "verify"), ("0", ENVELOPE)]
    args = {script: a for _, script, a in ran[1:]}
    assert args["verify"] == "--checks control" and args.get("draftkv", "--checks control") == (
        "--checks control"
    )
    assert "--prefill-graph-tokens 2048" in args[ENVELOPE]
    _results_came_back(out, {"verify.json", "envelope.json"}, {"envelope/plain.log"})
    assert ("draftkv.json" in {p.name for p in out.iterdir()}) == (gpus == 2)


def test_only_names_the_runs_that_go_and_bad_names_are_refused(tmp_path: Path) -> None:
    """--only misses: the one run, alone on GPU 0. An unknown job or run is one line naming
    what there is, before a GPU is touched."""
    (tmp_path / "a").mkdir()
    result, ran, out = _job(tmp_path / "a", "misses", "--only", "misses")
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = [r for r in ran if r[1] != "none"]
    assert run[0] == "0" and "--levels 16,4" in run[2] and "--learn-seconds 90" in run[2]
    _results_came_back(out, {"misses.json"}, {"misses/plain.log"})
    (tmp_path / "b").mkdir()
    result, ran, _ = _job(tmp_path / "b", "misses", "--only", "fast")
    assert result.returncode == 2 and ran == []
    assert result.stdout.strip() == "job.py: --only fast: misses's runs are gpu0, misses"
    (tmp_path / "c").mkdir()
    result, ran, _ = _job(tmp_path / "c", "nope")
    assert result.returncode == 2 and ran == [] and "no job 'nope'; one of sweep," in result.stdout


def test_every_job_is_listed_with_what_it_measures() -> None:
    job = load_module(ROOT / "lab" / "gpu" / "job.py", "gpu_job")
    listed = subprocess.run(
        [sys.executable, str(ROOT / "lab" / "gpu" / "job.py"), "--list"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert [line.split()[0] for line in listed] == list(job.JOBS)
    for spec in job.JOBS.values():
        names = [r.name for lane in spec.lanes for r in lane]
        assert len(names) == len(set(names))  # each run's folder and results its own
        for run in (r for lane in spec.lanes for r in lane):
            assert run.script in ("verify", "draftkv", "recovery") or (
                run.script.startswith("record-router:") or (ROOT / run.script).is_file()
            ), run


def test_a_py_spy_job_unpacks_its_wheel_or_stops_before_any_server(tmp_path: Path) -> None:
    """host-time: each window's scheduler recorded by the py-spy unpacked from the carried
    wheel, its summary into pyspy-steps.md; without a wheel the job stops before starting a
    server."""
    wheel = tmp_path / "py_spy-0.4.3-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("py_spy-0.4.3.data/scripts/py-spy", "#!/bin/sh\n")
    spy_dir = tmp_path / "spy"
    (tmp_path / "job").mkdir()
    env = {"SPECGATE_PYSPY_WHEEL": str(wheel), "SPECGATE_PYSPY_DIR": str(spy_dir)}
    result, ran, out = _job(tmp_path / "job", "host-time", "--", "--seconds", "3", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    ((gpu, script, args),) = [r for r in ran if r[1] != "none"]
    assert gpu == "0" and script == ENVELOPE
    assert "--repeat 10 --gc-stats" in args and args.endswith("--seconds 3")
    assert f"--pyspy {spy_dir / 'py-spy'} " in args and (spy_dir / "py-spy").stat().st_mode & 0o100
    _results_came_back(out, {"host-time.json", "pyspy-steps.md"}, {"host-time/plain.log"})
    assert "no window with a py-spy recording" in (out / "pyspy-steps.md").read_text()
    (tmp_path / "none").mkdir()
    result, ran, _ = _job(tmp_path / "none", "host-time")
    assert result.returncode == 1 and ran == []
    assert "no py-spy: carry its wheel in .gpu/" in result.stdout


def test_a_recording_lane_goes_beside_the_gpu_runs_and_host_limits_come_back(
    tmp_path: Path,
) -> None:
    """router-stall on one GPU: conn then keep on GPU 0 (kept connections, ports of their
    own), the router's recorder beside them (no wheel: it says so and the job goes on), the
    host's network limits in the archive."""
    result, ran, out = _job(tmp_path, "router-stall", "--", "--seconds", "3", gpus=1)
    assert result.returncode == 0, result.stdout + result.stderr
    conn, keep = [args for _, script, args in ran if script == ENVELOPE]
    assert "--servers specgate-probes --direct-too --levels 128" in conn
    assert "--client-keepalive" not in conn and "--client-keepalive --port-base 31300" in keep
    assert conn.endswith("--seconds 3") and keep.endswith("--seconds 3")
    _results_came_back(out, {"conn.json", "keep.json"}, {"conn/router.log", "host/net.txt"})
    assert "no py-spy wheel" in (out / "pyspy.log").read_text()


def test_the_runner_splits_profiles_by_loop_part_and_lists_syncs(tmp_path: Path) -> None:
    """The three loop parts' function tables, then the syncs, for a folder of traces."""
    import gzip

    trace = tmp_path / "profiles" / "plain-c16" / "rank0.trace.json.gz"
    trace.parent.mkdir(parents=True)
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "scheduler.run_batch", "ts": 0, "dur": 900,
         "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=16]", "ts": 10, "dur": 800,
         "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "x.py(1): forget", "ts": 20, "dur": 500,
         "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 30, "dur": 400,
         "tid": 1},
    ]  # fmt: skip
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    job = load_module(ROOT / "lab" / "gpu" / "job.py", "gpu_job")
    job.Runner.profile_splits(tmp_path / "profiles", tmp_path / "functions.txt")
    text = (tmp_path / "functions.txt").read_text()
    headers = [line for line in text.splitlines() if line.startswith("# ")]
    assert headers == [
        "# profile_summary.py PROFILES --functions 50 --part run_batch",
        "# profile_summary.py PROFILES --functions 50 --part get_next_batch_to_run",
        "# profile_summary.py PROFILES --functions 50 --part process_batch_result",
        "# profile_summary.py PROFILES --syncs",
    ]
    assert "1 x cudaStreamSynchronize" in text and "in forget" in text


def test_a_warm_gpu_machine_patches_again_when_the_patch_changed(tmp_path: Path) -> None:
    """run-on-gpu.sh unpacks and patches the archive once per patch: a second call with the same
    patch keeps the patched tree (the device keeps a machine warm between calls), one with a
    changed patch starts again from the archive. A marker that only said "patched" once ran a
    GPU job against the previous call's patch."""
    repo = tmp_path / "repo"
    (repo / "lab" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "lab/gpu/run-on-gpu.sh", repo / "lab/gpu/")
    (repo / "worker-image" / "patches").mkdir(parents=True)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    (pristine / "engine.py").write_text("speed = 1\n")
    archive = tmp_path / "site.tar.xz"
    subprocess.run(["tar", "-cJf", str(archive), "-C", str(pristine), "engine.py"], check=True)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho fake GPU\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    site = tmp_path / "site"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "SPECGATE_SITE": str(site)}

    def run_with(new_line: str) -> str:
        patch = f"--- a/engine.py\n+++ b/engine.py\n@@ -1 +1 @@\n-speed = 1\n+{new_line}\n"
        (repo / "worker-image" / "patches" / "0001.patch").write_text(patch)
        subprocess.run(
            ["bash", "lab/gpu/run-on-gpu.sh", str(archive), str(tmp_path / "out"), "none"],
            cwd=repo,
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        return (site / "engine.py").read_text()

    assert run_with("speed = 2") == "speed = 2\n"
    (site / "engine.py").write_text("speed = 2\n# kept: same patch, no unpacking\n")
    assert run_with("speed = 2").endswith("# kept: same patch, no unpacking\n")
    assert run_with("speed = 3") == "speed = 3\n"
    assert (tmp_path / "site-upstream" / "engine.py").read_text() == "speed = 1\n"
