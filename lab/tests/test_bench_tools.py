"""Small lab/bench/ tools: the engine-client comparison (lab/bench/client_pool.py), the py-spy
profile summary (lab/bench/folded_top.py) and the per-step comparison of py-spy recordings
(lab/bench/pyspy_steps.py, with gpu_envelope.py's recorder)."""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, free_port_base, load_module


def test_the_client_comparison_runs_both_clients_through_every_phase(tmp_path: Path) -> None:
    """Short phases against the stand-in engine: both clients answer at every phase and the
    report names them (the figures themselves are BENCHMARKS.md's, not a test's)."""
    bench = load_module(ROOT / "lab" / "bench" / "client_pool.py", "client_pool")
    assert bench.main(["--seconds", "0.4", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "client_pool.json").read_text())["results"]
    assert set(results) == {"httpx", "aiohttp (EngineHttp)"}
    for phases in results.values():
        assert [p["clients"] for p in phases] == [16, 128, 16]
        assert all(p["requests_per_s"] > 0 and p["cpu_us_per_request"] > 0 for p in phases)
    md = (tmp_path / "client_pool.md").read_text()
    assert "| aiohttp (EngineHttp) | after c = 128 | 16 |" in md
    assert "the CPU per request of the router's aiohttp client" in md
    shares = json.loads((tmp_path / "client_pool.json").read_text())["scrape_cpu_share"]
    assert set(shares) == set(results) and all(set(s) == {"8", "64"} for s in shares.values())
    assert "| client | 8 pods | 64 pods |" in md


def test_folded_stacks_are_counted_on_top_and_anywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frame is counted once per stack however deep it recurses; .xz files read as is."""
    tool = load_module(ROOT / "lab" / "bench" / "folded_top.py", "folded_top")
    folded = tmp_path / "router.folded.xz"
    with lzma.open(folded, "wt") as fh:
        fh.write("run (a.py:1);poll (b.py:2) 6\n")
        fh.write("run (a.py:1);pool (c.py:3);pool (c.py:3);is_idle (c.py:9) 3\n")
        fh.write("not a stack line\n")
    total, leaf, inclusive = tool.tops(tool.read_folded(folded))
    assert total == 9
    assert leaf == {"poll (b.py:2)": 6, "is_idle (c.py:9)": 3}
    assert inclusive["pool (c.py:3)"] == 3 and inclusive["run (a.py:1)"] == 9
    assert tool.main([str(folded), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "9 samples in router.folded.xz" in out and "| 6 | 66.7% | `poll (b.py:2)` |" in out


BUSY = """
import sys, time

def spin(seconds):
    end = time.time() + seconds
    while time.time() < end:
        sum(range(1000))

def extra_work():
    spin(0.001)

def step(extra):
    spin(0.002)
    if extra:
        extra_work()

print("ready", flush=True)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    step(sys.argv[1] == "extra")
"""


def test_py_spy_recordings_give_each_function_time_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpu_envelope's recorder runs the real py-spy against two busy processes, one of which
    spends half as long again in each "step"; pyspy_steps sums the recordings per server and
    level and divides by the steps, so the extra function shows up as the difference."""
    import shutil
    import subprocess
    import sys

    binary = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    assert binary is not None, "py-spy is a dev dependency (pyproject.toml)"
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    steps = load_module(ROOT / "lab" / "bench" / "pyspy_steps.py", "pyspy_steps")
    out = tmp_path / "run"
    spy = envelope.PySpy(Path(binary), out / "pyspy")
    windows = []
    for server, mode in (("plain", "plain"), ("patched-off", "extra")):
        script = tmp_path / f"{server}.py"
        script.write_text(BUSY)
        proc = subprocess.Popen(
            [sys.executable, str(script), mode, "3"], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        recorder = spy.start(proc.pid, f"{server}-c16-rep0", 2)
        assert recorder.wait(timeout=30) == 0, recorder.stderr
        proc.wait(timeout=30)
        windows.append(
            {
                "server": server,
                "c": 16,
                "rep": 0,
                "decode_steps": 100,
                "pyspy": f"{server}-c16-rep0.txt",
            }
        )
    (out / "envelope.json").write_text(json.dumps({"windows": windows}))
    groups = steps.group_costs(steps.recordings(windows, steps.reader(out)))
    plain, off = groups[("plain", 16, "")], groups[("patched-off", 16, "")]
    # 2 s of busy samples over 100 steps: about 20,000 us a step in both.
    for g in (plain, off):
        assert 14_000 < g["busy_us"] < 23_000
    step_frame = next(f for f in off["us"] if f.startswith("step ("))
    assert step_frame.endswith(".py:12)")  # the function's first line, not the current one
    extra = next(f for f in off["us"] if f.startswith("extra_work ("))
    assert extra not in plain["us"]
    assert 0.2 < off["us"][extra] / off["busy_us"] < 0.45  # a third of each of its steps
    assert steps.main([str(out), "--top", "5"]) == 0
    printed = capsys.readouterr().out
    assert "## c = 16: patched-off against plain" in printed
    assert "| (all busy samples) |" in printed


def test_pyspy_steps_groups_frozen_windows_apart_and_skips_unrecorded_ones(
    tmp_path: Path,
) -> None:
    """Windows after the GC freeze form their own group, as do windows with the schedulers
    pinned and free (--scheduler-cores odd-reps); a window with no recording, or whose file is
    missing, counts nowhere; a packed logs.tar.xz is read as the folder."""
    import tarfile

    steps = load_module(ROOT / "lab" / "bench" / "pyspy_steps.py", "pyspy_steps")
    folder = tmp_path / "pyspy"
    folder.mkdir()
    (folder / "a.txt").write_text("main (x/sglang/srt/s.py:1);run (x/sglang/srt/s.py:5) 400\n")
    (folder / "b.txt").write_text("main (x/sglang/srt/s.py:1) 200\n")
    recorded_b = {"server": "plain", "c": 64, "pyspy": "b.txt"}
    windows = [
        {"server": "plain", "c": 64, "decode_steps": 1000, "pyspy": "a.txt"},
        {"server": "plain", "c": 64, "decode_steps": 1000, "pyspy": "b.txt", "gc_frozen": True},
        {"server": "plain", "c": 64, "decode_steps": 1000},
        {"server": "plain", "c": 64, "decode_steps": 1000, "pyspy": "gone.txt"},
        {**recorded_b, "decode_steps": 500, "scheduler_pinned": True},
        {**recorded_b, "decode_steps": 250, "scheduler_pinned": False},
    ]
    with tarfile.open(tmp_path / "logs.tar.xz", "w:xz") as tar:
        tar.add(folder, arcname="gpu0/pyspy")
    for where in (tmp_path, tmp_path / "packed"):
        if where != tmp_path:
            where.mkdir()
            (tmp_path / "logs.tar.xz").rename(where / "logs.tar.xz")
        groups = steps.group_costs(steps.recordings(windows, steps.reader(where)))
        assert set(groups) == {
            ("plain", 64, ""),
            ("plain", 64, "GC frozen"),
            ("plain", 64, "schedulers pinned"),
            ("plain", 64, "schedulers free"),
        }
        unfrozen = groups[("plain", 64, "")]
        assert unfrozen["windows"] == 1 and unfrozen["busy_us"] == 2000  # 400 x 5 ms / 1000
        assert unfrozen["us"] == {"main (sglang/srt/s.py:1)": 2000, "run (sglang/srt/s.py:5)": 2000}
        assert groups[("plain", 64, "GC frozen")]["busy_us"] == 1000
        assert groups[("plain", 64, "schedulers pinned")]["busy_us"] == 2000
        assert groups[("plain", 64, "schedulers free")]["busy_us"] == 4000


def test_a_step_splits_into_the_parts_of_the_scheduler_loop(tmp_path: Path) -> None:
    """Each stack counts once, for the first part it matches: the target's forward inside
    run_batch is the forward, not "the rest of run_batch"; the prompts' draft KV write is its
    own part; stacks outside the named functions are "the rest". --plot writes the PNG."""
    steps = load_module(ROOT / "lab" / "bench" / "pyspy_steps.py", "pyspy_steps")
    loop = "event_loop_overlap (sglang/srt/managers/scheduler.py:1)"
    run = f"{loop};Scheduler.run_batch (sglang/srt/managers/scheduler.py:2)"
    lines = [
        f"{run};EAGLEWorkerV2.forward_batch_generation (w.py:1);"
        "TpModelWorker.forward_batch_generation (t.py:1) 300",
        f"{run};EAGLEWorkerV2._write_prompt_draft_kv (w.py:2) 40",
        f"{run};FutureMap.resolve_seq_lens_cpu (o.py:1) 60",
        f"{loop};Scheduler.get_next_batch_to_run (s.py:3) 100",
        f"{loop};Scheduler.process_batch_result (s.py:4) 200",
        "Thread._bootstrap (threading.py:1);_write_forever (sitecustomize.py:1) 20",
    ]
    folder = tmp_path / "pyspy"
    folder.mkdir()
    (folder / "off.txt").write_text("\n".join(lines) + "\n")
    windows = [{"server": "patched-off", "c": 16, "decode_steps": 1000, "pyspy": "off.txt"}]
    parts = steps.group_parts(steps.recordings(windows, steps.reader(tmp_path)))
    assert parts == {
        ("patched-off", 16, ""): {
            "the target's forward": 1500.0,
            "the prompts' draft KV write": 200.0,
            "the rest of run_batch": 300.0,
            "get_next_batch_to_run": 500.0,
            "process_batch_result": 1000.0,
            "the rest": 100.0,
        }
    }
    (tmp_path / "envelope.json").write_text(json.dumps({"windows": windows}))
    png = tmp_path / "steps.png"
    assert steps.main([str(tmp_path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --part: the functions of one part's stacks alone (run_batch's, not the forward inside it).
    recorded = steps.recordings(windows, steps.reader(tmp_path))
    in_part = steps.only_part(recorded, "the rest of run_batch")
    rest = steps.group_costs(in_part)[("patched-off", 16, "")]
    assert rest["busy_us"] == 300.0
    assert rest["us"]["FutureMap.resolve_seq_lens_cpu (o.py:1)"] == 300.0
    assert "TpModelWorker.forward_batch_generation (t.py:1)" not in rest["us"]


def test_every_envelope_server_has_engine_flags_and_the_off_step_extras_their_tokens() -> None:
    """A server kind without engine flags would stop a GPU job at its start; the several-token
    off servers are pinned off (threshold 0) with their tokens a step, as the engine reads
    them, and nothing else differs from patched-off."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    common, eagle = ["--common"], ["--eagle"]
    flags = {
        name: envelope.engine_args(name, common, eagle, Path("adaptive.json"))
        for name in (*envelope.SERVERS, *envelope.EXTRAS)
    }
    assert set(envelope.SIM_THRESHOLD) <= set(flags)
    off = flags["patched-off"]
    for name, tokens in (("patched-off-2", "2"), ("patched-off-4", "4")):
        assert flags[name] == [*off, "--speculative-off-step-tokens", tokens]
        assert envelope.SIM_THRESHOLD[name] == "0"
    # --off-step-tokens: the servers whose steps go off where a threshold says take it; the
    # pinned ones keep their own.
    four = {
        name: envelope.engine_args(name, common, eagle, Path("adaptive.json"), off_step_tokens=4)
        for name in (*envelope.SERVERS, *envelope.EXTRAS)
    }
    several = ["--speculative-off-step-tokens", "4"]
    changed = {name for name in four if four[name] != flags[name]}
    assert changed == {"specgate", "specgate-probes", "patched-8"}
    assert all(four[name] == [*flags[name], *several] for name in changed)


def test_the_hold_grid_runs_the_router_and_engine_as_the_operator_renders_them(
    tmp_path: Path,
) -> None:
    """The GPU hold grid measures the product as deployed: the router's control section and
    the engine's threshold flags come from the operator's rendering of a resource that sets
    only its models, so a changed default reaches the benchmark, and the router accepts it."""
    from specgate import api
    from specgate_router import settings

    grid = load_module(ROOT / "lab" / "bench" / "hold_grid.py", "hold_grid")
    config, flags = grid.operator_defaults()
    defaults = api.SpeculationControl()
    assert flags[:2] == ["--speculative-disable-batch-threshold", str(defaults.threshold)]
    assert "discovery" not in config and "leaderElection" not in config
    config.update(backends=["http://127.0.0.1:9"], engineApiKey="k")
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(config))
    loaded = settings.load(path)
    assert loaded.control.max_threshold == defaults.max_threshold
    assert loaded.control.cooldown_seconds == defaults.cooldown_seconds
    cell = {
        "c": 16,
        "routed": {
            "from": 64,
            "tok_s": [900.0, 1000.0],
            "pods": [
                {"threshold": 32},
                {
                    "threshold": 32,
                    "prediction": {
                        "observedOverPredicted": {"on": 0.95, "off": None},
                        "confident": True,
                    },
                },
            ],
        },
        "plain_median": 800.0,
        "eagle3_median": 1000.0,
        "routed_median": 950.0,
        "ratio": 0.95,
    }
    table = grid.report({"temperature": 0.8, "predicted_accept_length": 3.83, "cells": [cell]})
    row = "| 16 | 64 | 800 | 1000 | 950 | **0.950** | 900-1000 | - | - | 32 | on 0.95 | 1 of 2 |"
    assert row in table
    again = grid.report(
        {"temperature": 0.8, "predicted_accept_length": 3.83,
         "cells": [{**cell, "routed_again": [700.0, 1200.0, 800.0], "routed_direct": [990.0]}]}
    )  # fmt: skip
    assert "| 900-1000 | 800 (0.80) | 990 | 32 |" in again
    step = {"c": 16, "temperatures": [0.8, 1.1], "final_threshold": 14,
            "settled_after_step_s": 12.0, "routed_after": [2900.0, 3000.0, 3100.0],
            "plain_after": [3200.0], "eagle3_after": [2800.0]}  # fmt: skip
    engine = {"uid_gid": [["65534"] * 4] * 2, "without_key": 401, "with_key": 200}
    table = grid.report(
        {"temperature": 0.8, "predicted_accept_length": 3.83, "cells": [cell], "step": step,
         "routed_engine": engine}
    )  # fmt: skip
    assert "T 0.8 -> 1.1: threshold 14 12 s after the step" in table
    assert "routed 3000 (2900-3100), plain 3200, EAGLE-3 2800: **0.938**" in table
    assert "without the key 401, with it 200" in table


def test_the_hold_grid_separates_what_a_request_costs_from_its_decode_steps() -> None:
    """p from two lengths of the same load: a server spending 2 ms a token in decode and 48 ms
    a request elsewhere gives back 48 ms, whatever the lengths; the table shows every mode."""
    grid = load_module(ROOT / "lab" / "bench" / "hold_grid.py", "hold_grid")

    def rate(n: int, per_token: float = 0.002, per_request: float = 0.048) -> float:
        return n / (n * per_token + per_request)

    assert grid.seconds_per_request(rate(32), rate(256), 32, 256) == pytest.approx(0.048)
    assert grid.seconds_per_request(rate(16), rate(64), 16, 64) == pytest.approx(0.048)
    assert grid.seconds_per_request(rate(32, per_request=0), rate(256, per_request=0), 32, 256) == (
        pytest.approx(0.0, abs=1e-12)
    )
    assert grid.seconds_per_request(0.0, rate(256), 32, 256) is None
    assert grid.seconds_per_request(rate(32), rate(256), 256, 256) is None
    costs = {"T": 1.1, "c": 16, "short": 32, "long": 256,
             "plain": {"short": [3000.0, 2900.0], "long": [4100.0], "ms_per_request": 21.0,
                       "prefill_busy_ms_per_request": 9.5},
             "routed_on": {"set": 200, "short": [1800.0], "long": [3000.0],
                           "ms_per_request": 48.2}}  # fmt: skip
    table = grid.report(
        {"temperature": 0.8, "predicted_accept_length": 3.83, "cells": [], "request_cost": costs}
    )
    assert "c = 16, T 1.1 (32 vs 256 new tokens)" in table
    assert "| plain | 3000, 2900 | 4100 | 21.0 | 9.5 |" in table
    assert "| routed_on | 1800 | 3000 | 48.2 | None |" in table
    assert "eagle3" not in table


def test_the_hold_grid_can_pass_the_engine_key_as_the_operator_does(tmp_path: Path) -> None:
    """--engine-key-from-env takes the key off the command line and into SGLANG_API_KEY (the
    variable the patched engine reads), as the operator's engine pods carry it."""
    import argparse

    grid = load_module(ROOT / "lab" / "bench" / "hold_grid.py", "hold_grid")
    flags = ["--model-path", "m", "--api-key", "k", "--port", "1"]
    setup = argparse.Namespace(engine_key_from_env=True, engine_user=None)
    moved, env = grid.routed_engine_setup(flags, {"A": "1"}, setup)
    assert moved == ["--model-path", "m", "--port", "1"]
    assert env == {"A": "1", "SGLANG_API_KEY": grid.verify.KEY}
    setup = argparse.Namespace(engine_key_from_env=False, engine_user=None)
    assert grid.routed_engine_setup(flags, {}, setup) == (flags, {})


def test_the_hostile_benchmark_reports_memory_wait_and_key_cost_side_by_side() -> None:
    bench = load_module(ROOT / "lab" / "bench" / "router_hostile.py", "router_hostile")
    results = {
        "header_attack": [
            {"attackers": 8, "header_mib_each": 100, "connections": 10, "rss_before_mib": 64.0,
             "rss_peak_mib": 65.0, "probe_ok": 9, "probe_failed": 1, "probe_p99_ms": 20.0}
        ],
        "frozen_pod": {"first_byte_limit_s": 5.0, "requests": 3, "ok": 3,
                       "longest_wait_s": 5.2, "target_s": 6.0},
        "auth_cost": {
            "rate": 200.0, "errors": 0, "baseline_tree": "abc123 (2026-12-03)",
            "added_p99_ms": {"open": [1.0, 3.0, 2.0], "client-keys": [2.0, 1.0, 4.0],
                             "baseline": [5.0, 1.0, 3.0]},
            "router_cpu_ms_per_request": {"open": [1.0, 1.2, 1.1], "client-keys": [1.3, 1.1, 1.2],
                                          "baseline": [1.4, 1.2, 1.0]},
        },
    }  # fmt: skip
    table = bench.report(results)
    assert "| 8 | 100 MiB | 10 | 64.0 MiB | **65.0 MiB** | 9 / 1 | 20.0 ms |" in table
    assert "longest wait **5.2 s** (target 6.0 s)" in table
    assert "without client keys **2.00 ms**, with client keys and limits **2.00 ms**" in table
    assert "**1.100 ms**, with them **1.200 ms**" in table
    assert "router of abc123 (2026-12-03)" in table and "added p99 **3.00 ms**" in table


def test_the_traffic_class_benchmark_runs_every_configuration_on_simulated_pods(
    tmp_path: Path,
) -> None:
    """`--engine sim`: the routed pair behind the real router and the static pairs, both
    classes streamed; every configuration delivers, the latency class's TPOT is measured, and
    the report states both targets (the figures are the GPU run's to judge, not a test's)."""
    bench = load_module(ROOT / "lab" / "bench" / "traffic_classes.py", "traffic_classes")
    argv = ["--engine", "sim", "--out", str(tmp_path), "--hold", "6", "--measure", "3"]
    argv += ["--static-measure", "2", "--warmup", "1", "--throughput", "4"]
    argv += ["--port-base", str(free_port_base(6, offsets=[bench.ROUTER_PORT_OFFSET]))]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "traffic-classes.json").read_text())
    rows = results["configurations"]
    assert list(rows) == ["routed", "plain x2", "EAGLE-3 x2", "split", "EAGLE-3 alone"]
    for name, row in rows.items():
        assert row["errors"] == 0 and row["latency"]["tpot_p50_ms"] > 0, name
        assert row["total_tok_s"] > 0, name
    assert rows["EAGLE-3 alone"]["throughput"]["tok_s"] == 0
    assert len(results["router"]["control"]) > 0 and "pools" in results["router"]
    text = bench.report(results)
    assert "routed total / best static two-pod" in text
    assert "routed latency TPOT p50 / EAGLE-3 alone" in text


def test_a_tpot_target_forms_a_latency_pool_behind_the_real_router(tmp_path: Path) -> None:
    """Two simulated pods that speculate at every batch, 2 latency and 24 throughput streams:
    spread, all would speculate at 13 a pod, so only the TPOT target (met up to a few requests
    by the pods' models) makes the router hold one pod for the latency class; the pool, its
    batch and the throughput room it leaves come back in /specgate/pods. Held 25 s: the
    router sizes pools from in-flight requests smoothed over 10 s."""
    bench = load_module(ROOT / "lab" / "bench" / "traffic_classes.py", "traffic_classes_tpot")
    argv = ["--engine", "sim", "--out", str(tmp_path), "--hold", "25", "--measure", "3"]
    argv += ["--throughput", "24", "--tpot-target-ms", "2.0", "--throughput-batch-per-pod", "64"]
    argv += ["--static", "EAGLE-3 alone", "--static-measure", "1", "--warmup", "0.5"]
    # A GPU a pod, as in a cluster: pods sharing one take turns, and the target cannot be met.
    argv += ["--gpus", "2"]
    argv += ["--port-base", str(free_port_base(6, offsets=[bench.ROUTER_PORT_OFFSET]))]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "traffic-classes.json").read_text())
    assert results["router"]["pools"]["latencyTpotTargetMs"] == 2.0
    assert list(results["configurations"]) == ["routed", "EAGLE-3 alone"]
    pools = results["configurations"]["routed"]["pools"]
    assert len(pools["latencyPool"]) == 1, pools
    assert 1 <= pools["latencyBatch"] < 13, pools
    latency = [p for p in pools["pods"] if p["pool"] == "latency"]
    assert latency and latency[0]["throughputRoom"] == max(0, pools["latencyBatch"] - 2), pools


def test_a_server_that_fails_to_start_leaves_no_other_running(tmp_path: Path) -> None:
    """One pod's port is taken: the run fails with the error recorded, and nothing it
    started listens on any of its ports any more."""
    import socket

    bench = load_module(ROOT / "lab" / "bench" / "traffic_classes.py", "traffic_classes_fail")
    # Fixed numbers would sit in the kernel's ephemeral range, where any outgoing connection
    # may hold one: the base is chosen free now.
    base = free_port_base(6, offsets=[bench.ROUTER_PORT_OFFSET])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        argv = ["--engine", "sim", "--out", str(tmp_path), "--port-base", str(base), "--hold", "1"]
        assert bench.main(argv) == 1
    results = json.loads((tmp_path / "traffic-classes.json").read_text())
    assert "exited" in results["error"]
    for port in (base, base + 1, base + 3, base + 4, base + 5):  # one process of six pods
        # Refused, not bound: another test's outgoing connection may hold the port as its
        # ephemeral local one, but only a leaked pod would accept a connection there.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_the_auth_cost_benchmark_identifies_every_kind_of_client(tmp_path: Path) -> None:
    """lab/bench/auth_cost.py: each kind of credential is accepted by the router's
    ClientAuth before it is timed, and the report gives one row per kind (the figures are
    BENCHMARKS.md's, not a test's)."""
    bench = load_module(ROOT / "lab" / "bench" / "auth_cost.py", "auth_cost")
    assert bench.main(["--calls", "3", "--rounds", "1", "--keys", "5", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "auth_cost.json").read_text())
    assert set(results["median_us"]) == {
        "API key", "RS256 token, first use", "ES256 token, first use", "RS256 token, again"
    }  # fmt: skip
    assert (tmp_path / "auth_cost.md").read_text().count("\n| ") == 5


@pytest.mark.parametrize("gpus", [1, 2])
def test_traffic_classes_puts_a_pairs_pods_on_gpus_of_their_own_with_gpus_2(
    gpus: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--gpus 2: every pair's "-a" server on GPU 0 and "-b" on GPU 1 (pods of a deployment
    do not share a GPU in a cluster); --gpus 1 leaves them all on the one GPU."""
    bench = load_module(ROOT / "lab" / "bench" / "traffic_classes.py", f"traffic_classes_{gpus}")
    started: dict[str, dict[str, str]] = {}

    def start(name: str, flags: list[str], port: int, out: Path, env: dict[str, str]) -> object:
        started[name] = env
        return object()

    monkeypatch.setattr(bench.verify, "start", start)
    monkeypatch.setattr(bench.verify, "wait_for_log", lambda *a, **k: None)
    monkeypatch.setattr(bench.verify, "wait_healthy", lambda *a, **k: None)
    # The synthetic pair is written with torch on the GPU machine; only the flags matter here.
    monkeypatch.setattr(bench, "synthetic_server_flags", lambda c, f: (["--x"], ["--eagle"]))
    args = bench.main.__globals__["argparse"].Namespace(
        c=12.0, mem_fraction=0.12, gpus=gpus, port_base=1000, static=["split"]
    )
    bench.start_sglang(args, tmp_path, [])
    assert set(started) == {"routed-a", "routed-b", "plain-a", "plain-b", "eagle-a", "eagle-b"}
    for name, env in started.items():
        expected = ("0" if name.endswith("-a") else "1") if gpus == 2 else None
        assert env.get("CUDA_VISIBLE_DEVICES") == expected, (name, env)


def test_random_scenarios_run_without_the_prediction_on_request() -> None:
    """`--without-prediction`: the engine reports no step profile, the law reads its rates
    from samples (its reasons say so), and the files say so."""
    sweep = load_module(ROOT / "lab" / "bench" / "control_random.py", "control_random")
    with_model = sweep.run_scenario(sweep.draw(20107))
    assert "accept length" in (with_model["last_reason"] or "")
    without = sweep.run_scenario({**sweep.draw(20107), "model_inputs": False})
    assert without["model_inputs"] is False
    assert "accept length" not in (without["last_reason"] or "")
    assert "engines reporting no profile" in sweep.report([without], 0.0, 20107)


def test_random_scenarios_let_the_old_load_drain_before_the_window() -> None:
    """The measured window compares the new load: the longest request in flight at the change
    finishes within 20 s in the slower mode, and request lengths vary (a single length keeps
    plain decoding's requests in lockstep, prefilling in waves)."""
    sweep = load_module(ROOT / "lab" / "bench" / "control_random.py", "control_random")
    from specgate_sim.profile import Profile

    for seed in range(100, 140):
        s = sweep.draw(seed)
        profile = Profile.model_validate(s["profile"])
        lo, hi = s["output_tokens"]
        assert lo < hi
        slowest = min(
            profile.steady_throughput(s["c_before"], on, s["off_step_tokens"]) / s["c_before"]
            for on in (True, False)
        )
        assert hi <= 16 or hi / slowest <= 20


def test_probe_readings_compares_a_trial_with_the_steady_runs() -> None:
    """Seed 1044: plain decoding leads 1.06x steadily at 48 streams of 1k-token prompts. The
    script finds the trial readings after the change and the static runs' ratio over the
    measured 30 s, from the seed alone."""
    sys.path.insert(0, str(ROOT / "lab" / "bench"))
    try:
        readings = load_module(ROOT / "lab" / "bench" / "probe_readings.py", "probe_readings")
    finally:
        sys.path.remove(str(ROOT / "lab" / "bench"))
    seed, found, steady = readings.readings(1044)
    assert seed == 1044 and found, found
    assert steady == pytest.approx(0.943, abs=0.01)
    assert all(0.8 < r < 1.25 for r in found), found


def test_the_held_load_counts_a_cell_only_where_every_server_is_steady(tmp_path: Path) -> None:
    """lab/bench/held_load.py: each server's median over its rounds and the spread between
    them; a cell counts only where every spread is under 3%. The routed engine and its router
    are rendered from the single-GPU example: every control default, four-token off steps."""
    sys.path[:0] = [str(ROOT / "lab" / "gpu"), str(ROOT / "lab" / "bench")]
    try:
        held = load_module(ROOT / "lab" / "bench" / "held_load.py", "held_load")
    finally:
        del sys.path[:2]
    config, flags = held.operator_defaults()
    assert flags == [
        "--speculative-disable-batch-threshold",
        "8",
        "--speculative-off-step-tokens",
        "4",
    ]
    assert config["control"]["mode"] == "dynamic" and "discovery" not in config
    assert held.spread([100.0, 103.0, 101.0]) == pytest.approx(0.03 / 1.01)
    cell = {
        "c": 64, "temperature": 0.8, "counts": False, "ratio": 0.98,
        "rates": {"plain": [7569.1, 6872.5, 8411.6], "eagle3": [9948.8, 8924.6, 10179.1],
                  "routed": [9603.0, 9879.9, 9751.7]},
        "medians": {"plain": 7569.1, "eagle3": 9948.8, "routed": 9751.7},
        "spreads": {"plain": 0.2033, "eagle3": 0.1261, "routed": 0.0284},
        "routed_views": [{"threshold": 74}],
    }  # fmt: skip
    results = {"workload": "long", "rounds": 3, "window": 20.0, "accept_lengths": {"0.8": 3.83},
               "cells": [cell]}  # fmt: skip
    table = held.report(results)
    assert "| 0.8 | 3.83 | 64 | 7569 | 9949 | 9752 | **0.980** | 20.3% (plain) | no | 74 |" in table
    held.plot(results, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0
    # The off mode against plain decoding: no routed server, each server over plain.
    off = {
        "c": 16, "temperature": 1.1, "counts": True, "ratio": None,
        "rates": {"plain": [4380.0, 4400.0, 4390.0], "off": [4820.0, 4800.0, 4810.0]},
        "medians": {"plain": 4390.0, "off": 4810.0}, "spreads": {"plain": 0.0046, "off": 0.0042},
        "over_plain": {"plain": 1.0, "off": 1.096}, "routed_views": [],
    }  # fmt: skip
    table = held.report({**results, "accept_lengths": {"1.1": 1.55}, "cells": [off]})
    assert "| T | accept length | c | plain | off | over plain |" in table
    assert "| 1.1 | 1.55 | 16 | 4390 | 4810 | off 1.096 | 0.5% (plain) | yes |" in table
    held.plot({**results, "cells": [off]}, tmp_path / "off.png")
    assert (tmp_path / "off.png").stat().st_size > 0


def test_the_control_cost_benchmark_times_every_pods_step() -> None:
    """lab/bench/control_cost.py on two pods: a figure per step and per pod, and the rules the
    law named (the simulated pods report profiles, so it predicts and moves)."""
    cost = load_module(ROOT / "lab" / "bench" / "control_cost.py", "control_cost")
    from specgate_router.settings import ControlSettings

    row = cost.measure(2, True, ControlSettings())
    assert row["pods"] == 2 and row["step_ms_median"] > 0
    assert row["per_pod_ms_median"] == pytest.approx(row["step_ms_median"] / 2, abs=1e-3)
    assert set(row["rules"]) <= {str(r) for r in __import__("specgate_router").control.Rule}
    assert sum(row["rules"].values()) == 2 * 120
    # One pod's turn is the longest the router's loop waits: under the whole step.
    assert 0 < row["longest_turn_ms_median"] <= row["step_ms_median"]


def test_the_held_load_starts_the_off_mode_servers_without_a_routed_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--servers plain,off,off-sparse,off-unsampled` starts those four and no router: each
    off server is the patched engine held at threshold 0, told how often to sample the draft's
    agreement (an earlier version looked up the routed pod's port and failed here on a GPU)."""
    sys.path[:0] = [str(ROOT / "lab" / "gpu"), str(ROOT / "lab" / "bench")]
    try:
        held = load_module(ROOT / "lab" / "bench" / "held_load.py", "held_load_off")
    finally:
        del sys.path[:2]
    started: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(name: str, flags: list[str], port: int, logs: Path, env: Any, cpus: Any) -> Any:
        started[name] = (flags, env)
        return name

    monkeypatch.setattr(held, "write_synthetic_pair", lambda *a: None)
    monkeypatch.setattr(held.verify, "start", start)
    monkeypatch.setattr(held.verify, "wait_for_log", lambda *a: None)
    monkeypatch.setattr(held.verify, "wait_healthy", lambda port, proc: 1.0)
    monkeypatch.setattr(held, "launch_router", lambda *a: pytest.fail("no router without routed"))
    args = argparse.Namespace(
        servers=["plain", "off", "off-sparse", "off-unsampled"], c=12.0, mem_fraction=0.18,
        pin=False, port_base=32600,
    )  # fmt: skip
    ports, procs, what = held.start_servers(args, tmp_path)
    assert sorted(ports) == sorted(args.servers) and "routed" not in ports
    assert sorted(procs) == sorted(args.servers)  # one process a server, no router
    assert what["startup_seconds"] == dict.fromkeys(args.servers, 1.0)
    env = {name: e.get(held.AGREEMENT_ENV) for name, (_, e) in started.items()}
    assert env == {"plain": None, "off": None, "off-sparse": "32", "off-unsampled": "0"}
    for name in ("off", "off-sparse", "off-unsampled"):
        flags = started[name][0]
        assert flags[flags.index("--speculative-disable-batch-threshold") + 1] == "0"
    assert "--speculative-disable-batch-threshold" not in started["plain"][0]
