"""lab/bench/envelope_report.py: the GPU envelope's figures and the simulator calibrated on them.
The GPU run itself (lab/bench/gpu_envelope.py) is rehearsed on the simulator in
test_gpu_envelope_rehearsal below; its real figures are in BENCHMARKS.md."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from specgate_sim import profile as profiles
from tests.conftest import ROOT, free_port_base, load_module


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return load_module(ROOT / "lab" / "bench" / "envelope_report.py", "envelope_report")


def window(server: str, c: int, tok_s: float, **kw: object) -> dict[str, object]:
    accept = kw.pop("accept", 1.0)
    return {
        "server": server,
        "c": c,
        "tok_s": tok_s,
        "tpot_ms_p50": 1000 * c / tok_s,
        "tpot_ms_p99": 1500 * c / tok_s,
        "accept_length": accept,
        **kw,
    }


def test_the_envelope_ratio_is_specgate_over_the_better_static_server(report: ModuleType) -> None:
    windows = [
        window("plain", 1, 300),
        window("plain", 1, 340),
        window("plain", 1, 320),
        window("always-on", 1, 600, accept=3.2),
        window("always-on", 1, 500, accept=3.3),
        window("specgate", 1, 570, threshold=8, steps_on=100, steps_off=0),
        window("plain", 64, 5000),
        window("always-on", 64, 4000, accept=3.2),
        window("specgate", 64, 4900, threshold=8, steps_on=0, steps_off=300),
        window("patched-off", 64, 4750, steps_on=0, steps_off=300),
    ]
    stats = report.summarise(windows)
    assert stats["plain"][1]["tok_s"] == 320 and stats["plain"][1]["min"] == 300
    assert stats["always-on"][1]["tok_s"] == 550  # the median of two
    assert stats["specgate"][64]["thresholds"] == [8]
    assert report.envelope_ratio(stats) == {1: round(570 / 550, 3), 64: round(4900 / 5000, 3)}
    rows = report.off_ratios({"run": windows})
    # specgate counts as off only where no step speculated (c = 64, not c = 1)
    assert [(r["server"], r["c"], r["ratio"]) for r in rows] == [
        ("patched-off", 64, 0.95),
        ("specgate", 64, 0.98),
    ]


def test_the_envelope_ratio_of_undisturbed_speeds_ignores_a_slow_spell(report: ModuleType) -> None:
    """Of each server's 80th percentile: two slow windows of the routed server's five move
    its median, not its undisturbed speed."""
    windows = [window("plain", 16, rate) for rate in (900, 910, 920, 930, 940)]
    windows += [window("always-on", 16, rate) for rate in (1000, 1010, 1020, 1030, 1040)]
    windows += [window("specgate-probes", 16, rate) for rate in (600, 650, 1000, 1010, 1020)]
    stats = report.summarise(windows)
    assert stats["always-on"][16]["tok_s_undisturbed"] == 1032.0
    assert report.envelope_ratio(stats, "specgate-probes") == {16: round(1000 / 1020, 3)}
    undisturbed = report.envelope_ratio(stats, "specgate-probes", key="tok_s_undisturbed")
    assert undisturbed == {16: round(1012 / 1032, 3)}


def test_rows_above_the_start_threshold_come_from_jobs_whose_router_learned(
    report: ModuleType,
) -> None:
    """A router that saw no sustained load holds its start threshold: such a job's c = 16 row
    does not stand for the router, an earlier job's (with a learning phase) does."""

    def job(router_rate: float, router_log: list[dict[str, object]]) -> dict[str, object]:
        windows = [
            window(s, c, rate)
            for c in (4, 16)
            for s, rate in (("plain", 1000), ("always-on", 1500))
        ]
        windows += [
            window("specgate-probes", c, router_rate, steps_on=0, steps_off=50) for c in (4, 16)
        ]
        return {"windows": windows, "router_log": router_log}

    results = {
        "gpu-envelope-1.json": job(1450, [{"phase": "learn", "threshold": 8}]),
        "gpu-envelope-2.json": job(1000, [{"phase": "sweep", "threshold": 8}]),
    }
    assert [report.learned(r) for r in results.values()] == [True, False]
    runs = {name: report.summarise(r["windows"]) for name, r in results.items()}
    stats, source = report.compose(runs, ["gpu-envelope-1.json"])
    assert source == {4: "gpu-envelope-2.json", 16: "gpu-envelope-1.json"}
    assert report.envelope_ratio(stats, "specgate-probes") == {4: 0.667, 16: 0.967}
    # Without the rule the later job wins both rows.
    assert report.compose(runs, runs)[1] == {4: "gpu-envelope-2.json", 16: "gpu-envelope-2.json"}


def test_a_row_comes_from_the_job_with_the_most_windows_there(report: ModuleType) -> None:
    """Job 85 measured c = 32 in three windows a server after job 84 had in eight: the row is
    job 84's. Of jobs with as many windows, the later one; a server's missing windows count."""

    def job(rates: dict[str, list[float]]) -> dict[str, Any]:
        windows = [
            window(s, 32, rate, steps_on=50, steps_off=0) for s, rs in rates.items() for rate in rs
        ]
        return report.summarise(windows)

    eight = {"plain": [1000] * 8, "always-on": [1500] * 8, "specgate-probes": [1400] * 8}
    three = {s: rates[:3] for s, rates in eight.items()}
    runs = {"gpu-envelope-84.json": job(eight), "gpu-envelope-85.json": job(three)}
    learning = list(runs)
    assert report.compose(runs, learning)[1] == {32: "gpu-envelope-84.json"}
    runs["gpu-envelope-86.json"] = job(eight)
    learning.append("gpu-envelope-86.json")
    assert report.compose(runs, learning)[1] == {32: "gpu-envelope-86.json"}
    thin_router = {**eight, "specgate-probes": [1400] * 2}
    runs["gpu-envelope-87.json"] = job(thin_router)
    assert report.compose(runs, [*runs])[1] == {32: "gpu-envelope-86.json"}


def test_envelope_pairs_take_the_better_server_by_medians_and_pool_sound_runs(
    report: ModuleType,
) -> None:
    """Window by window, the routed server over the static server with the higher median in
    its run (here plain at 64 in one run, though always-on ran faster in one of its windows),
    per run and level; pooled over runs from the fixed routed path on, less NOT_POOLED; and
    above the start threshold only from runs whose router learned."""

    def job(plain: list[float], on: list[float], routed: list[float]) -> dict[str, Any]:
        windows = [
            window(server, 64, rate, rep=rep)
            for server, rates in (("plain", plain), ("always-on", on), ("specgate-probes", routed))
            for rep, rate in enumerate(rates)
        ]
        return {"windows": windows}

    results = {
        "gpu-envelope-39-a.json": job([1000, 1000, 1000], [900, 1100, 900], [950, 1000, 1050]),
        "gpu-envelope-42-misses-engines-capped-at-16.json": job([1000] * 2, [800] * 2, [500] * 2),
        "gpu-envelope-84-b.json": job([1000, 1000], [800, 800], [1100, 1100]),
        "gpu-envelope-85-c.json": job([1000, 1000], [800, 800], [100, 100]),  # no learning
    }
    runs = {name: report.summarise(r["windows"]) for name, r in results.items()}
    learning = [name for name in results if "85" not in name]
    rows = report.envelope_pairs(results, runs, learning)
    per_run = {row["run"]: row for row in rows if "runs" not in row}
    assert set(per_run) == set(learning)  # job 85's router never learned: not its c = 64
    first = per_run["gpu-envelope-39-a.json"]
    assert first["over"] == "plain" and first["pairs"] == 3
    assert first["geomean"] == round((0.95 * 1.0 * 1.05) ** (1 / 3), 3)
    (pooled,) = [row for row in rows if "runs" in row]
    assert pooled["runs"] == ["gpu-envelope-39-a.json", "gpu-envelope-84-b.json"]
    assert pooled["pairs"] == 5
    assert pooled["geomean"] == round((0.95 * 1.0 * 1.05 * 1.1 * 1.1) ** (1 / 5), 3)


def test_the_deployed_ratio_plot_takes_both_off_step_lengths(
    report: ModuleType, tmp_path: Path
) -> None:
    """One series per off-step length the deployed sweep ran at, labelled with the jobs its
    rows come from; none for a group the report did not compose."""

    def key(differs: str) -> str:
        return str(report.section_key(1, report.ENVELOPE_TEMPERATURE, differs))

    one = {
        "row_source": {1: "gpu-envelope-38-a.json", 16: "gpu-envelope-57-b.json"},
        "ratio_router_probing": {1: 1.0, 16: 0.87},
        "ratio_router_probing_undisturbed": {1: 1.03, 16: 0.97},
    }
    four = {**one, "row_source": {16: "gpu-envelope-84-c.json", 128: "gpu-envelope-82-d.json"}}
    job_82 = {"prefill_graph_tokens": 2048, "flush_cache": True, "off_step_tokens": 4}
    assert report.workload(job_82) == report.DEPLOYED_OFF_STEP_4  # the section jobs 82-88 make
    summary = {key(report.DEPLOYED): one, key(report.DEPLOYED_OFF_STEP_4): four}
    series = report.deployed_ratio_series(summary)
    assert [label for label, _, _ in series] == [
        "offStepTokens 1 (jobs 38, 57)",
        "offStepTokens 4 (jobs 82, 84)",
    ]
    assert series[0][1] == {1: 1.0, 16: 0.87} and series[0][2] == {1: 1.03, 16: 0.97}
    del summary[key(report.DEPLOYED_OFF_STEP_4)]
    assert len(report.deployed_ratio_series(summary)) == 1
    report.plot_envelope_ratios(series, tmp_path / "ratio.png")
    assert (tmp_path / "ratio.png").stat().st_size > 10_000


def test_same_mode_pairs_compare_a_routed_window_with_the_static_server_in_its_mode(
    report: ModuleType,
) -> None:
    windows = [
        window("plain", 16, 1000, rep=0),
        window("always-on", 16, 1200, rep=0),
        window("specgate", 16, 1150, rep=0, steps_on=90, steps_off=0),  # on: over always-on
        window("plain", 16, 1100, rep=1),
        window("always-on", 16, 1300, rep=1),
        window("specgate", 16, 1045, rep=1, steps_on=0, steps_off=80),  # off: over plain
        window("plain", 16, 1000, rep=2),
        window("always-on", 16, 1200, rep=2),
        window("specgate", 16, 1100, rep=2, steps_on=40, steps_off=40),  # switched: no pair
    ]
    pairs = report.same_mode_pairs({"run": windows})
    assert [(p["rep"], p["mode"], p["ratio"]) for p in pairs] == [
        (0, "on", round(1150 / 1200, 3)),
        (1, "off", 0.95),
    ]
    # With the engine also measured directly, each routed window is paired with that one too.
    direct = [window("specgate-direct", 16, 1000, rep=r, steps_on=90, steps_off=0) for r in (0, 2)]
    pairs = report.same_mode_pairs({"run": windows + direct})
    assert [(p["rep"], p["mode"], p["ratio"]) for p in pairs if p["mode"] == "proxy"] == [
        (0, "proxy", 1.15),
        (2, "proxy", 1.1),
    ]
    summary = report.geometric_summary([0.9, 1.0, 1.1, 1.0])
    assert summary["pairs"] == 4 and summary["geomean"] == round(0.99**0.25, 3)
    assert summary["p05"] < summary["geomean"] < summary["p95"]
    assert report.geometric_summary([0.9, 1.0, 1.1, 1.0]) == summary  # seeded
    assert report.geometric_summary([1.0] * 5)["p05"] == report.geometric_summary([1.0] * 5)["p95"]


def test_the_same_mode_table_gives_the_undisturbed_ratio_per_run_at_one_level_only(
    report: ModuleType, tmp_path: Path
) -> None:
    """Percentiles over windows of several levels, or of several jobs, would mix speeds: the
    routed server's undisturbed ratio appears where one run measured one level."""

    def speculating(c: int, rep: int, routed: float, static: float) -> list[dict[str, object]]:
        return [
            window("always-on", c, static, rep=rep, steps_on=0, steps_off=0),
            window("specgate", c, routed, rep=rep, steps_on=90, steps_off=0),
        ]

    one = [w for rep in range(4) for w in speculating(16, rep, 950 + rep, 1000 + rep)]
    two = [w for rep in range(4) for w in speculating(16 if rep % 2 else 32, rep, 900, 1000)]
    job = {"tp": 1, "temperature": 0.9, "predicted_accept_length": 3.0}
    md = report_of(report, tmp_path, "gpu-envelope-61-one.json", {**job, "windows": one})
    assert "| on | always-on | >= 9 | 61-one | 4 | 0.95 | 0.95-0.95 | 0.95 | " in md
    md = report_of(report, tmp_path, "gpu-envelope-62-two.json", {**job, "windows": two})
    assert "| on | always-on | >= 9 | 62-two | 4 | 0.9 | 0.9-0.9 |  |  |" in md


def test_the_routed_pools_also_cover_only_the_jobs_after_the_fixes(report: ModuleType) -> None:
    """Jobs before the prefill-sync and httpx fixes measured code that no longer runs: the
    same-mode table pools the jobs from FIXED_ROUTED_PATH_JOB on as well as all of them."""

    def job(ratio: float) -> dict[str, object]:
        windows = [
            w
            for rep in range(2)
            for w in (
                window("always-on", 16, 1000, rep=rep, steps_on=0, steps_off=0),
                window("specgate", 16, 1000 * ratio, rep=rep, steps_on=90, steps_off=0),
            )
        ]
        return {"tp": 1, "temperature": 0.9, "predicted_accept_length": 3.0, "windows": windows}

    fixed = report.FIXED_ROUTED_PATH_JOB
    results = {
        f"gpu-envelope-{fixed - 5}-old.json": job(0.8),
        f"gpu-envelope-{fixed + 2}-new.json": job(0.95),
        f"gpu-envelope-{fixed + 3}-newer.json": job(1.0),
    }
    md, _, _ = report.run_section(results)
    assert "| on | always-on | >= 9 | all runs | 6 | " in md
    every = round((0.8 * 0.95 * 1.0) ** (1 / 3), 3)
    assert f"| all runs | 6 | {every} |" in md
    assert f"| runs from {fixed} on | 4 | {round((0.95 * 1.0) ** 0.5, 3)} |" in md
    # With every job after the fixes, the second pool would repeat the first: none.
    md, _, _ = report.run_section({k: v for k, v in results.items() if "old" not in k})
    assert "runs from" not in md and "| all runs | 4 |" in md


def test_a_run_without_plain_gives_a_ratio_only_where_always_on_won_everywhere(
    report: ModuleType,
) -> None:
    """A job that measured always-on and the router but no plain (30 pairs at c = 2 and 4)
    still gives X_d' / max(X_a, X_b) where always-on beat plain in every job with both."""
    with_plain = report.summarise(
        [
            window("plain", 2, 700),
            window("always-on", 2, 1100),
            window("plain", 64, 7000),
            window("always-on", 64, 6900),
        ]
    )
    other = report.summarise([window("plain", 2, 650), window("always-on", 2, 1000)])
    no_plain = report.summarise(
        [
            window("always-on", 2, 1000),
            window("specgate-probes", 2, 990),
            window("always-on", 64, 6000),
            window("specgate-probes", 64, 5900),
            window("always-on", 4, 1500),
            window("specgate-probes", 4, 1400),
        ]
    )
    runs = {"a": with_plain, "b": other, "c": no_plain}
    wins = report.always_on_wins(runs)
    assert wins == {2}  # not 64 (plain won there), not 4 (no job measured both)
    assert report.over_always_on(no_plain, "specgate-probes", wins) == {2: 0.99}
    # A run with plain takes the usual ratio, not this one.
    assert report.over_always_on(with_plain, "specgate-probes", wins) == {}


def test_off_variants_are_paired_window_by_window(report: ModuleType) -> None:
    windows = [
        window(server, 64, rate, rep=rep)
        for rep, rates in enumerate(((1000, 900, 800), (1200, 960, 1000)))
        for server, rate in zip(
            ("plain", "patched-off", "patched-off-upstream-extend"), rates, strict=True
        )
    ]
    rows = {(r["server"], r["over"]): r for r in report.variant_pairs({"job": windows})}
    assert rows[("patched-off", "plain")]["geomean"] == round((0.9 * 0.8) ** 0.5, 3)
    assert rows[("patched-off", "patched-off-upstream-extend")]["geomean"] == round(
        (900 / 800 * 960 / 1000) ** 0.5, 3
    )
    assert rows[("patched-off", "plain")]["pairs"] == 2


def test_speculating_servers_are_paired_across_the_patch(report: ModuleType) -> None:
    """Always-on (the patched SGLang) over unpatched EAGLE-3, and upstream's adaptive server
    over always-on: whether the patch costs a speculating step (lab/NOTEBOOK.md job 89)."""
    windows = [
        window(server, 8, rate, rep=rep)
        for rep, rates in enumerate(((900, 1000, 1100), (880, 1100, 990)))
        for server, rate in zip(
            ("always-on", "upstream-always-on", "upstream-0step"), rates, strict=True
        )
    ]
    rows = {(r["server"], r["over"]): r for r in report.variant_pairs({"job": windows})}
    assert rows[("always-on", "upstream-always-on")]["geomean"] == round((0.9 * 0.8) ** 0.5, 3)
    assert rows[("upstream-0step", "always-on")]["geomean"] == round(
        (1100 / 900 * 990 / 880) ** 0.5, 3
    )


def test_replicas_pair_process_k_with_process_k(report: ModuleType) -> None:
    """With two processes per server (--replicas 2), a pair is replica K over replica K in one
    repeat: never one process of off over the other process of plain. The per-process rows
    show how far two processes of the same code ran apart."""
    windows = []
    for rep in range(2):
        windows += [
            window("plain", 16, 1000.0, rep=rep, replica=1),
            window("patched-off", 16, 900.0, rep=rep, replica=1),
            window("plain", 16, 500.0, rep=rep, replica=2),  # a slow process
            window("patched-off", 16, 500.0, rep=rep, replica=2),
        ]
    windows.append(window("patched-off", 16, 10.0, rep=2, replica=2))  # no plain-r2 beside it
    (pooled,) = report.variant_pairs({"job": windows})
    assert pooled["pairs"] == 4
    assert pooled["geomean"] == round((0.9 * 1.0) ** 0.5, 3)  # 0.45 and 2.0 never form
    rows = report.replica_pairs({"gpu-envelope-70-replicas.json": windows})
    assert [(r["replica"], r["pairs"], r["geomean"]) for r in rows] == [(1, 2, 0.9), (2, 2, 1.0)]
    # A run with one process per server has no per-process rows.
    single = [w for w in windows if w.get("replica") == 1]
    for w in single:
        del w["replica"]
    assert report.replica_pairs({"gpu-envelope-71-single.json": single}) == []


def test_same_code_pairs_put_each_later_process_over_the_first(report: ModuleType) -> None:
    """An A/A comparison: plain's second process over its first in the same repeat. Its
    distance from 1 is the floor under any ratio the job takes between two servers."""
    windows = []
    for rep in range(3):
        windows += [
            window("plain", 64, 1000.0, rep=rep, replica=1),
            window("plain", 64, 900.0, rep=rep, replica=2),
            window("patched-off", 64, 800.0, rep=rep, replica=1),
            window("patched-off", 64, 800.0, rep=rep, replica=2),
        ]
    windows.append(window("plain", 16, 700.0, rep=0, replica=2))  # no first process there
    rows = report.same_code_pairs({"gpu-envelope-70-replicas.json": windows})
    assert [(r["server"], r["c"], r["replica"], r["pairs"], r["geomean"]) for r in rows] == [
        ("patched-off", 64, 2, 3, 1.0),
        ("plain", 64, 2, 3, 0.9),
    ]
    assert report.same_code_pairs({"gpu-envelope-71-single.json": [window("plain", 4, 1.0)]}) == []


def test_every_run_with_off_and_plain_goes_into_the_history_in_job_order(
    report: ModuleType, tmp_path: Path
) -> None:
    """The history the off-over-plain plot draws: TP-1 runs only, the target's two levels
    only, each run labelled by its target and request lengths, jobs up to 11 marked as the
    lean draft extend's."""

    def pairs(c: int, plain: float, off: float) -> list[dict[str, object]]:
        return [window("plain", c, plain, rep=0), window("patched-off", c, off, rep=0)]

    eight = "Llama 8B-class (hidden 4096, 32 layers, GQA 32/8), synthetic pair, bf16"
    results = {
        "gpu-envelope-58-long.json": {
            "new_tokens": [256, 512],
            "windows": pairs(16, 1000, 960) + pairs(64, 1000, 950),
        },
        "gpu-envelope-8-lean.json": {"windows": pairs(16, 1000, 900) + pairs(32, 1000, 800)},
        "gpu-envelope-11-tp2.json": {"tp": 2, "windows": pairs(16, 1000, 700)},
        "gpu-envelope-47-8b.json": {"shape": eight, "windows": pairs(64, 1000, 920)},
    }
    variants = report.variant_pairs({name: r["windows"] for name, r in results.items()})
    rows = report.off_over_plain_history(results, variants)
    assert [(r["run"], r["c"], r["geomean"]) for r in rows] == [
        ("8-lean", 16, 0.9),
        ("47-8b", 64, 0.92),
        ("58-long", 16, 0.96),
        ("58-long", 64, 0.95),
    ]
    assert [r["requests"] for r in rows] == [
        "3B-class target, 64-192 new tokens",
        "8B-class target, 64-192 new tokens",
        "3B-class target, 256-512 new tokens",
        "3B-class target, 256-512 new tokens",
    ]
    assert [r["lean_extend"] for r in rows] == [True, False, False, False]
    assert "| 58-long | 64 | 3B-class target, 256-512 new tokens | 1 | 0.95 | 0.95-0.95 |" in (
        report.off_over_plain_table(rows)
    )
    report.plot_off_over_plain(rows, tmp_path / "off.png")
    assert (tmp_path / "off.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="no job number"):
        report.job_number("gpu-envelope-rerun.json")


def test_the_gpus_clocks_are_set_beside_each_servers_tok_s(report: ModuleType) -> None:
    """Windows with the telemetry's figures, per server and level: the spreads, the reasons
    seen and the correlation of tok/s with the SM clock; windows without it count nowhere."""

    def clocked(server: str, tok_s: float, sm: float, **kw: object) -> dict[str, object]:
        return window(
            server,
            16,
            tok_s,
            gpu_sm_mhz_mean=sm,
            gpu_sm_mhz_min=sm - 100,
            gpu_power_w_mean=400.0,
            gpu_util_mean=tok_s / 100,
            host_cpu_steal=0.02,
            **kw,
        )

    windows = [
        clocked("always-on", 6000, 1980),
        clocked("always-on", 4000, 1500, gpu_clock_reasons=["0x04"]),
        clocked("always-on", 5000, 1900),
        clocked("plain", 4000, 1980),
        clocked("plain", 4100, 1980),
        window("plain", 16, 100),
    ]
    rows = report.gpu_clock_rows({"gpu-envelope-60-clocks.json": {"windows": windows}})
    by_server = {r["server"]: r for r in rows}
    assert by_server["always-on"]["r_tok_s_sm"] == 0.93
    assert by_server["always-on"]["sm_mhz_lowest"] == 1400
    assert by_server["always-on"]["reasons"] == ["0x04"]
    assert by_server["always-on"]["r_tok_s_util"] == 1.0
    assert by_server["plain"]["windows"] == 2 and by_server["plain"]["r_tok_s_sm"] is None
    table = report.gpu_clock_table(rows)
    row = (
        "| 60-clocks | always-on | 16 | 3 | 4,000-6,000 | 1,500-1,980 | 1,400 | 400-400 | 40-60 "
        "| 2.0-2.0 | 0x04 | 0.93 | 1.0 |"
    )
    assert row in table
    unclocked = {"gpu-envelope-1-x.json": {"windows": [window("plain", 1, 9)]}}
    assert report.gpu_clock_rows(unclocked) == []


def test_the_undisturbed_ratio_compares_each_servers_upper_windows(report: ModuleType) -> None:
    """A spell of slow windows that hits one server of a pair moves the pairs' geometric mean
    but not the ratio of the two servers' 80th percentiles; its interval comes from drawing
    each side's windows again, and fewer than three windows a side give none."""
    assert report.quantile([1, 2, 3, 4, 5], 0.8) == pytest.approx(4.2)
    assert report.quantile([7], 0.8) == 7
    plain = [1000.0] * 10
    off = [950.0] * 7 + [600.0] * 3  # three windows in a slow spell
    windows = [
        window(server, 16, rate, rep=rep)
        for rep, (a, b) in enumerate(zip(off, plain, strict=True))
        for server, rate in (("patched-off", a), ("plain", b))
    ]
    (row,) = report.variant_pairs({"job": windows})
    assert row["geomean"] < 0.85
    assert row["undisturbed"] == 0.95
    assert row["undisturbed_p05"] <= 0.95 <= row["undisturbed_p95"]
    assert report.undisturbed_ratio([1.0, 2.0], [1.0, 2.0, 3.0]) == {}
    assert report.undisturbed_cell({"pairs": 2}) == " | "


def test_jobs_sort_by_their_number(report: ModuleType) -> None:
    names = ["gpu-envelope-10-c128.json", "gpu-envelope-2-high-c.json", "gpu-envelope-9-x.json"]
    assert sorted(names, key=report.run_order) == [names[1], names[2], names[0]]


def test_accept_rate_inverts_the_chain(report: ModuleType) -> None:
    for rate in (0.5, 0.765, 0.87):
        length = sum(rate**j for j in range(4))
        assert report.accept_rate(length, 3) == pytest.approx(rate, abs=1e-3)


def test_fitting_recovers_a_profile_from_its_own_curves(report: ModuleType) -> None:
    """Curves made by a known profile, fitted from costs off by 2x: the fit finds costs that
    reproduce them (the measured sweep is noisier; BENCHMARKS.md gives its error)."""
    truth = profiles.load("rtx-pro-6000-x8")
    accept = truth.mean_accept_length()
    windows = [
        window(server, c, report.simulate(truth, server, c), accept=accept)
        for server in ("plain", "always-on")
        for c in (1, 8, 64)
    ]
    stats = report.summarise(windows)
    start = report.with_costs(truth, [2 * getattr(truth.step, k) for k in report.FITTED])
    assert report.sim_error(start, stats)["mape"] > 0.2
    fitted = report.fit_profile(stats, start, iterations=80, restarts=1)
    error = report.sim_error(fitted, stats)
    assert error["mape"] < 0.05, error["points"]
    assert error["measured_speculation_wins_at"] == [1]  # this profile's crossover is at 6
    assert 1 <= fitted.crossover_batch() < 8


def test_the_committed_report_matches_the_committed_sweep(
    report: ModuleType, tmp_path: Path
) -> None:
    """Regenerating the report from lab/results/gpu-envelope-*.json gives the committed table."""
    assert report.main(["--out", str(tmp_path)]) == 0
    committed = (ROOT / "lab" / "results" / "gpu_envelope.md").read_text()
    assert (tmp_path / "gpu_envelope.md").read_text() == committed
    summary = json.loads((tmp_path / "gpu_envelope.json").read_text())
    assert summary["simulator"]["mape"] == pytest.approx(0.048, abs=0.01)
    assert summary["simulator_vs_table"]["mape"] > summary["simulator"]["mape"]  # host drift
    assert (tmp_path / "gpu_envelope.png").stat().st_size > 20_000


def test_gpu_envelope_rehearsal(report: ModuleType, tmp_path: Path) -> None:
    """lab/bench/gpu_envelope.py's orchestration against simulated pods and the real router: every
    server measured at every level, the router in front of specgate, results saved. Two runs
    share the host at once, as on a two-GPU machine (one per GPU): the second with its own
    ports, a chosen server set and unpatched always-on."""
    import subprocess

    def run(out: Path, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "lab" / "bench" / "gpu_envelope.py"),
                "--engine",
                "sim",
                "--out",
                str(out),
                "--repeat",
                "2",
                "--seconds",
                "1",
                "--warmup",
                "0.3",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "SPECGATE_UPSTREAM_SITE": "/opt/sglang-unpatched",
                "CUDA_VISIBLE_DEVICES": "0,1",
            },
        )

    # Six servers and a router on the first run's ports, four and a router on the second's.
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    first_base = free_port_base(6, offsets=[envelope.ROUTER_OFFSET])
    second_base = free_port_base(4, offsets=[envelope.ROUTER_OFFSET])
    first = run(
        tmp_path / "first",
        "--port-base",
        str(first_base),
        "--levels",
        "1,4",
        "--learn-seconds",
        "2",
        "--extra",
        "patched-off,patched-8",
        "--extra-levels",
        "4",
        "--switch-first",
        "--profile-levels",
        "8",
        "--profile-servers",
        "plain",
        "--flush-cache",
    )
    second = run(
        tmp_path / "second",
        "--port-base",
        str(second_base),
        "--levels",
        "2",
        "--servers",
        "always-on,specgate-probes",
        "--extra",
        "upstream-always-on,patched-off-4",
        "--extra-levels",
        "2",
        "--tp",
        "2",
        "--direct-too",
        "--probe-interval",
        "90",
        "--busy-idle",
        "--new-tokens",
        "16,32",
        "--router-threshold",
        "146",
        "--client-keepalive",
        "--prefill-graph-tokens",
        "512",
        "--max-running",
        "64",
    )
    for proc in (first, second):
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-3000:]

    result = json.loads((tmp_path / "first" / "envelope.json").read_text())
    seen = {(w["server"], w["c"]) for w in result["windows"]}
    assert seen == {
        (s, c) for s in ("plain", "always-on", "upstream-0step", "specgate") for c in (1, 4)
    } | {("patched-off", 4), ("patched-8", 4)}
    assert len(result["windows"]) == 2 * (4 * 2 + 2)
    assert result["switched_first"] is True
    assert result["patch_sha256"] == report.patch_sha256()  # which patch it measured
    # Servers are sized for the largest client count run, profiled (the sim takes no profiles)
    # or learned: the learning pattern reaches 96.
    assert result["max_running"] == max(envelope.LEARN_PATTERN) == 96
    # Upstream's adaptive baseline runs on unpatched SGLang where one is provided; nothing else.
    envs = {name: server["env"] for name, server in result["servers"].items()}
    assert envs["upstream-0step"] == {"PYTHONPATH": "/opt/sglang-unpatched"}
    assert all("PYTHONPATH" not in env for name, env in envs.items() if name != "upstream-0step")
    # Idle servers sleep (an idle SGLang scheduler spins a core) unless --busy-idle.
    assert all("--sleep-on-idle" in server["args"] for server in result["servers"].values())
    specgate = [w for w in result["windows"] if w["server"] == "specgate"]
    assert all(w["threshold"] == 8 and w["errors"] == 0 for w in specgate)
    assert all(w["tok_s"] > 0 for w in result["windows"])
    assert result["router_log"] and "error" not in result
    # What the router's controller decided from, kept for lab/bench/replay_control.py.
    exported = result["router_samples"]
    assert exported["control"]["threshold"] == 8 and exported["pods"][0]["samples"]
    # --flush-cache: every window began with its idle engine's prefix cache emptied.
    assert result["flush_cache"] is True
    assert all(w["cache_flushed"] is True for w in result["windows"])
    # Decode steps counted; a simulated pod has no SGLang scheduler process to time.
    assert all(w["decode_steps"] > 0 for w in result["windows"])
    assert not any("scheduler_run_ms" in w for w in result["windows"])

    second_result = json.loads((tmp_path / "second" / "envelope.json").read_text())
    assert second_result["max_running"] == 64  # --max-running
    # Each routed run keeps its router's threshold changes (a list, empty if none moved).
    assert all(isinstance(r["router_changes"], list) for r in (result, second_result))
    assert {(w["server"], w["c"]) for w in second_result["windows"]} == {
        ("always-on", 2),
        ("specgate-probes", 2),
        ("specgate-probes-direct", 2),
        ("upstream-always-on", 2),
        ("patched-off-4", 2),
    }
    ports = {name: s["port"] for name, s in second_result["servers"].items()}
    b = second_base
    assert ports == {
        "always-on": b,
        "specgate-probes": b + 1,
        "upstream-always-on": b + 2,
        "patched-off-4": b + 3,
        "specgate-probes-direct": b + 1,
    }
    # The simulated patched-off-4 decodes four tokens a request per off step, as SGLang does
    # with --speculative-off-step-tokens 4 (fewer only at a request's end).
    # (A window's tokens a request per decode step: its "accept_length" field.)
    off4 = [w for w in second_result["windows"] if w["server"] == "patched-off-4"]
    assert all(w["steps_on"] == 0 and w["steps_off"] > 0 for w in off4)
    assert all(2.5 < w["accept_length"] <= 4.0 for w in off4), off4
    # --direct-too: the routed engine also at its own port, its threshold still the router's,
    # which started where --router-threshold put it.
    direct = [w for w in second_result["windows"] if w["server"] == "specgate-probes-direct"]
    assert len(direct) == 2 and all(w["threshold"] == 146 for w in direct)
    assert second_result["router_threshold"] == 146 and result["router_threshold"] == 8
    # Tensor-parallel servers all span both GPUs; the first run spread its servers over them.
    assert second_result["tp"] == 2
    assert {s["gpu"] for s in second_result["servers"].values()} == {"0,1"}
    assert {s["gpu"] for s in result["servers"].values()} == {"0", "1"}
    # specgate-probes' router probes, at --probe-interval; specgate's does not.
    assert '"probeIntervalSeconds": 90' in (tmp_path / "second" / "router.yaml").read_text()
    assert second_result["probe_interval_seconds"] == 90
    assert "probeIntervalSeconds" not in (tmp_path / "first" / "router.yaml").read_text()
    assert second_result["servers"]["upstream-always-on"]["env"] == {
        "PYTHONPATH": "/opt/sglang-unpatched"
    }
    launched = [s for s in second_result["servers"].values() if "direct_of" not in s]
    assert launched and not any("--sleep-on-idle" in s["args"] for s in launched)
    # Another workload: recorded, and prefills replay SGLang's breakable graphs, not eager.
    assert second_result["new_tokens"] == [16, 32] and second_result["prefill_graph_tokens"] == 512
    for server in launched:
        assert "--disable-prefill-cuda-graph" not in server["args"]
        at = server["args"].index("--cuda-graph-max-bs-prefill")
        assert server["args"][at + 1] == "512" and "breakable" in server["args"]
    assert all("--disable-prefill-cuda-graph" in s["args"] for s in result["servers"].values())
    assert result["new_tokens"] == [64, 192] and result["prefill_graph_tokens"] == 0
    assert second_result["flush_cache"] is False
    assert not any("cache_flushed" in w for w in second_result["windows"])
    assert all(w["errors"] == 0 and w["tok_s"] > 0 for w in second_result["windows"])
    assert "error" not in second_result
    # Through the router, each window samples the router's in-flight count and times its main
    # thread; every window counts the host's TCP trouble. --client-keepalive is recorded.
    assert second_result["client_keepalive"] is True and result["client_keepalive"] is False
    routed = [w for w in second_result["windows"] if w["server"] == "specgate-probes"]
    for w in routed:
        assert w["client_keepalive"] is True
        assert 1 <= w["router_in_flight_p50"] <= 2 and w["router_trace"]
        assert w["router_run_ms"] > 0 and "router_runqueue_ms" in w
    assert not any("router_trace" in w for w in direct)
    assert all(
        isinstance(w["tcp"], dict) and w["time_wait_sockets"] >= 0
        for w in result["windows"] + second_result["windows"]
    )


def test_gpu_envelope_runs_replicas_each_in_its_own_window(
    report: ModuleType, tmp_path: Path
) -> None:
    """--replicas 2 starts every server twice, with its own port and log, and gives each process
    its own window in every rotation; the windows say which process ran them."""
    import subprocess

    out = tmp_path / "replicas"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "lab" / "bench" / "gpu_envelope.py"),
            "--engine",
            "sim",
            "--out",
            str(out),
            "--servers",
            "always-on",
            "--extra",
            "patched-on",
            "--levels",
            "4",
            "--extra-levels",
            "4",
            "--replicas",
            "2",
            "--repeat",
            "2",
            "--seconds",
            "0.5",
            "--warmup",
            "0.2",
            "--port-base",
            str(free_port_base(4)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "envelope.json").read_text())
    assert result["replicas"] == 2
    assert sorted(result["servers"]) == ["always-on", "always-on-r2", "patched-on", "patched-on-r2"]
    assert result["servers"]["patched-on-r2"]["replica_of"] == "patched-on"
    assert len({s["port"] for s in result["servers"].values()}) == 4
    assert sorted((w["server"], w["replica"], w["rep"]) for w in result["windows"]) == sorted(
        (name, k, rep) for name in ("always-on", "patched-on") for k in (1, 2) for rep in (0, 1)
    )
    assert all((out / f"{label}.log").stat().st_size > 0 for label in result["servers"])
    # patched-on speculates on every step, as always-on does.
    assert all(w["steps_off"] == 0 and w["steps_on"] > 0 for w in result["windows"])
    (row,) = report.variant_pairs({"gpu-envelope-70-replicas.json": result["windows"]})
    assert (row["server"], row["over"], row["pairs"]) == ("patched-on", "always-on", 4)
    rows = report.replica_pairs({"gpu-envelope-70-replicas.json": result["windows"]})
    assert [(r["replica"], r["pairs"]) for r in rows] == [(1, 2), (2, 2)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--servers", "plain,fast-mode"], "--servers/--extra: unknown ['fast-mode']"),
        (
            [
                "--servers",
                "plain,always-on",
                "--profile-levels",
                "64",
                "--profile-servers",
                "patched-off",
            ],
            "--profile-servers: ['patched-off'] not among",
        ),
        # A learning phase shorter than the probing router's first-probe delay learns nothing.
        (
            ["--servers", "plain,specgate-probes", "--learn-seconds", "48"],
            "--learn-seconds 48: specgate-probes' first probe comes 60 s after",
        ),
        (
            ["--levels", "4,32", "--max-running", "16"],
            "--max-running 16: below the largest client count the job runs (32)",
        ),
        (["--new-tokens", "128"], "--new-tokens '128': give MIN,MAX"),
        (["--new-tokens", "192,64"], "need 1 <= MIN <= MAX"),
        (["--prefill-graph-tokens", "-1"], "--prefill-graph-tokens: 0 (eager prefills)"),
        (["--off-step-tokens", "5"], "--off-step-tokens 5: 1 to 4 (the engine's"),
        (["--off-step-tokens", "0"], "--off-step-tokens 0: 1 to 4"),
        (["--router-threshold", "146"], "--router-threshold 146: 0 to 128 for specgate"),
        (
            ["--servers", "specgate-probes", "--router-threshold", "-1"],
            "--router-threshold -1: 0 to 256 for specgate-probes",
        ),
        (["--pin-cpus", "3/2"], "--pin-cpus '3/2': give K/N with 1 <= K <= N"),
        (["--pin-cpus", "1/4096"], "cannot give 4096 parts one each"),
        (
            ["--repeat", "4", "--freeze-gc-from-rep", "4"],
            "--freeze-gc-from-rep 4: between 1 and --repeat - 1 (3)",
        ),
        (["--freeze-gc-from-rep", "0"], "--freeze-gc-from-rep 0: between 1 and"),
        (["--pyspy", "/nonexistent/py-spy"], "--pyspy /nonexistent/py-spy: no such file"),
        (["--servers", "plain", "--replicas", "0"], "--replicas 0: 1 to 4"),
        # One router fronts one engine: a routed server cannot be started twice.
        (
            ["--servers", "plain,specgate", "--replicas", "2"],
            "--replicas 2: not with specgate (one router",
        ),
        (
            ["--servers", "always-on", "--extra", "patched-on", "--max-running", "1024"],
            "--max-running 1024: patched-on speculates below 1024 running requests only",
        ),
        (["--gc-stats"], "--pyspy, --gc-stats and --freeze-gc-from-rep need SGLang servers"),
    ],
)
def test_gpu_envelope_refuses_bad_arguments(tmp_path: Path, args: list[str], message: str) -> None:
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "lab" / "bench" / "gpu_envelope.py"),
            "--engine",
            "sim",
            "--out",
            str(tmp_path),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr


def test_a_job_at_another_temperature_gets_a_section_of_its_own(
    report: ModuleType, tmp_path: Path
) -> None:
    """A weaker draft (a higher temperature) changes which mode wins: such a job's figures must
    not fill the sweep's table, even where it is the last job that measured a level."""

    def job(temperature: float, plain: float, always_on: float) -> dict[str, object]:
        windows = [
            window("plain", 4, plain),
            window("always-on", 4, always_on, accept=3.0),
            window("specgate-probes", 4, always_on, steps_on=50, steps_off=0),
        ]
        return {
            "tp": 1,
            "temperature": temperature,
            "predicted_accept_length": 3.0,
            "windows": windows,
        }

    inputs = []
    for name, result in (
        ("gpu-envelope-1-sweep.json", job(0.9, 1000, 1500)),
        ("gpu-envelope-2-weaker.json", job(1.0, 1200, 1100)),
    ):
        inputs.append(tmp_path / name)
        inputs[-1].write_text(json.dumps(result))
    out = tmp_path / "out"
    assert report.main([*map(str, inputs), "--out", str(out)]) == 0
    md = (out / "gpu_envelope.md").read_text()
    sweep, weaker = md.split("## Temperature 1, tensor parallel 1")
    assert "1-sweep" in sweep and "2-weaker" not in sweep
    assert "2-weaker" in weaker and "1,200" in weaker
    # Which runs' idle servers slept: none here (no arguments recorded, as in jobs 1-23).
    assert "in every run each spun a core" in sweep
    summary = json.loads((out / "gpu_envelope.json").read_text())
    assert summary["stats"]["plain"]["4"]["tok_s"] == 1000
    assert summary["idle_servers_slept"] == []
    assert summary["tp1_t1"]["stats"]["plain"]["4"]["tok_s"] == 1200
    assert (out / "gpu_envelope_tp1_t1.png").exists()


def test_a_job_with_another_workload_gets_a_section_of_its_own(
    report: ModuleType, tmp_path: Path
) -> None:
    """Longer requests or prefill CUDA graphs shrink the prefills' share of a server's time,
    and emptied prefix caches spare evictions, so off over plain moves: such a job stays out
    of the sweep's table and the simulator's check, and says how its workload differs."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    assert report.SWEEP_NEW_TOKENS == envelope.NEW_TOKENS

    def job(plain: float, **workload: object) -> dict[str, object]:
        windows = [
            window("plain", 4, plain),
            window("always-on", 4, 900, accept=3.0),
            window("specgate-probes", 4, plain, steps_on=0, steps_off=50),
        ]
        return {
            "tp": 1,
            "temperature": 0.9,
            "predicted_accept_length": 3.0,
            "windows": windows,
            **workload,
        }

    jobs = {
        "gpu-envelope-1-sweep.json": job(1000, new_tokens=[64, 192]),
        "gpu-envelope-2-long.json": job(1500, new_tokens=[512, 1024]),
        "gpu-envelope-3-graphs.json": job(1700, prefill_graph_tokens=2048),
        "gpu-envelope-4-pinned.json": job(
            800, servers={"plain": {"cpus": [4, 5, 6, 7]}, "always-on": {"cpus": [8, 9, 10]}}
        ),
        "gpu-envelope-5-flushed.json": job(1100, flush_cache=True),
        "gpu-envelope-6-not-flushed.json": job(1000, flush_cache=False),
    }
    for name, result in jobs.items():
        (tmp_path / name).write_text(json.dumps(result))
    out = tmp_path / "out"
    assert report.main([*(str(tmp_path / n) for n in jobs), "--out", str(out)]) == 0
    md = (out / "gpu_envelope.md").read_text()
    sweep, *others = md.split("## Another workload")
    assert "1-sweep" in sweep and "6-not-flushed" in sweep
    assert not any(run in sweep for run in ("2-long", "3-graphs", "4-pinned", "5-flushed"))
    assert [o.split(")")[0] for o in others] == [
        " (512-1024 new tokens a request",
        " (each server pinned to 3-4 CPUs",
        " (prefill CUDA graphs up to 2048 tokens",
        " (prefix caches emptied before each window",
    ]
    summary = json.loads((out / "gpu_envelope.json").read_text())
    assert summary["stats"]["plain"]["4"]["tok_s"] == 1000
    long_run = summary["tp1_t0.9_512-1024-new-tokens-a-request"]
    assert long_run["stats"]["plain"]["4"]["tok_s"] == 1500


def test_the_deployed_sweep_is_checked_against_its_own_profile(
    report: ModuleType, tmp_path: Path
) -> None:
    """Jobs with prefill graphs and emptied caches (the deployed sweep) get the deployed
    profile's error and a plot with its curves; a workload with no profile gets neither."""
    deployed = report.load_profile(report.DEPLOYED_PROFILE_PATH)
    levels = (1, 16, 128)
    windows = [
        window(server, c, report.simulate(deployed, server, c) * scale, accept=accept)
        for server, scale, accept in (("plain", 1.25, 1.0), ("always-on", 1.0, 3.3))
        for c in levels
    ]
    job = {
        "tp": 1,
        "temperature": 0.9,
        "predicted_accept_length": 3.3,
        "prefill_graph_tokens": 2048,
        "flush_cache": True,
        "windows": windows,
    }
    other = {**job, "flush_cache": False}
    inputs = {report.DEPLOYED_FITTED_RUNS[0]: job, "gpu-envelope-31-graphs-only.json": other}
    for name, result in inputs.items():
        (tmp_path / name).write_text(json.dumps(result))
    out = tmp_path / "out"
    assert report.main([*(str(tmp_path / n) for n in inputs), "--out", str(out)]) == 0
    md = (out / "gpu_envelope.md").read_text()
    graphs_only, deployed_section = md.split("## Another workload (")[1:]
    assert deployed_section.startswith(report.DEPLOYED)
    assert "The simulator" not in graphs_only
    # Plain ran 25% above the profile (-20% error), always-on on it: 10% over six medians.
    assert f"The simulator ({deployed.name}): MAPE 10.0% over the 6 medians" in deployed_section
    summary = json.loads((out / "gpu_envelope.json").read_text())
    check = summary[f"tp1_t0.9_{report.slug(report.DEPLOYED)}"]["simulator"]
    assert {p["server"]: p["error"] for p in check["points"] if p["c"] == 16} == {
        "plain": -0.2,
        "always-on": 0.0,
    }
    assert (out / "gpu_envelope_deployed.png").stat().st_size > 20_000


def test_the_four_token_sweep_is_checked_against_the_deployed_profiles_static_servers(
    report: ModuleType, tmp_path: Path
) -> None:
    """Off steps change only the routed server: the deployed sweep with four-token off steps
    gets the deployed profile's error over its plain and always-on (not refitted), and a plot
    whose upstream curve comes from the one-token sweep where it lacks one."""
    deployed = report.load_profile(report.DEPLOYED_PROFILE_PATH)
    levels = (1, 4)  # at or below the routed start threshold: no learning phase needed

    def job(scale: float, off_step_tokens: int, servers: tuple[str, ...]) -> dict[str, object]:
        windows = [
            window(
                server,
                c,
                report.simulate(deployed, server, c) * scale,
                accept=1.0 if server == "plain" else 3.3,
            )
            for server in servers
            for c in levels
        ]
        # The routed server (a table row needs one) and upstream's, which the simulator does
        # not model.
        windows += [window("specgate-probes", c, 600.0 * c, accept=3.3) for c in levels]
        if off_step_tokens == 1:
            windows += [window("upstream-0step", c, 500.0 * c, accept=3.3) for c in levels]
        return {
            "tp": 1,
            "temperature": 0.9,
            "predicted_accept_length": 3.3,
            "prefill_graph_tokens": 2048,
            "flush_cache": True,
            "off_step_tokens": off_step_tokens,
            "windows": windows,
        }

    inputs = {
        "gpu-envelope-38-a.json": job(1.0, 1, ("plain", "always-on")),
        # A host 20% slower than the profile's: every static median reads 25% high.
        "gpu-envelope-86-b.json": job(0.8, 4, ("plain", "always-on")),
    }
    for name, result in inputs.items():
        (tmp_path / name).write_text(json.dumps(result))
    out = tmp_path / "out"
    assert report.main([*(str(tmp_path / n) for n in inputs), "--out", str(out)]) == 0
    md = (out / "gpu_envelope.md").read_text()
    four = md.split(f"## Another workload ({report.DEPLOYED_OFF_STEP_4})")[1]
    assert "which off steps do not touch: MAPE 25.0% over 4 medians" in four.split("\n## ")[0]
    summary = json.loads((out / "gpu_envelope.json").read_text())
    key = report.section_key(1, 0.9, report.DEPLOYED_OFF_STEP_4)
    assert {p["error"] for p in summary[key]["simulator"]["points"]} == {0.25}
    assert (out / "gpu_envelope_deployed_off_step_4.png").stat().st_size > 20_000
    stats = {"plain": {1: {"tok_s": 1.0}}}
    donor = {"plain": {1: {"tok_s": 2.0}}, "upstream-0step": {1: {"tok_s": 3.0}}}
    merged = report.with_rows_of(stats, donor, "upstream-0step")
    assert merged == {"plain": {1: {"tok_s": 1.0}}, "upstream-0step": {1: {"tok_s": 3.0}}}
    assert report.with_rows_of(stats, donor, "plain") is stats  # its own rows stay
    assert report.with_rows_of(stats, {}, "upstream-0step") is stats


def test_a_run_whose_idle_servers_slept_is_told_apart(report: ModuleType) -> None:
    """A run counts as asleep only if every server it launched had --sleep-on-idle (the
    routed engine measured direct is no server of its own)."""
    server = {"port": 1, "gpu": "0", "env": {}}
    asleep = {
        "a": {**server, "args": ["--tp-size", "1", "--sleep-on-idle"]},
        "a-direct": {"port": 1, "gpu": "0", "direct_of": "a"},
    }
    assert report.idle_servers_slept({"servers": asleep})
    half = {**asleep, "b": {**server, "args": ["--tp-size", "1"]}}
    assert not report.idle_servers_slept({"servers": half})
    assert not report.idle_servers_slept({"servers": {"a": server}})  # jobs 1-23
    assert not report.idle_servers_slept({})


def test_the_simulator_is_checked_at_a_held_out_acceptance(report: ModuleType) -> None:
    """A group at another temperature tests the sweep's profile away from the acceptance it was
    fitted at: the profile moved to the group's accept length, always-on over plain simulated
    against measured within the group (so the host's speed cancels)."""
    base = profiles.load("h200-3b-synthetic")
    stats = report.summarise(
        [
            window("plain", 32, 4800),
            window("always-on", 32, 4470, accept=2.31),
            window("plain", 128, 10760),
            window("always-on", 128, 11670, accept=2.31),
            window("always-on", 8, 2000, accept=2.31),  # no plain here: no row
        ]
    )
    check = report.held_out_acceptance(base, stats)
    assert check["accept_length"] == 2.31
    assert [r["c"] for r in check["rows"]] == [32, 128]
    moved = report.at_acceptance(base, 2.31)
    assert moved.mean_accept_length() == pytest.approx(2.31, abs=0.01)
    at_32 = report.simulate(moved, "always-on", 32) / report.simulate(moved, "plain", 32)
    assert check["rows"][0]["simulated"] == round(at_32, 3)
    assert check["rows"][0]["measured"] == round(4470 / 4800, 3)
    at_128 = check["rows"][1]
    assert at_128["error"] == round(at_128["simulated"] / (11670 / 10760) - 1, 3)
    # A weaker draft moves the simulated crossover down from the sweep's.
    assert check["simulated_crossover_batch"] < base.crossover_batch()


def test_the_report_splits_a_decode_step_by_what_the_scheduler_thread_did(
    report: ModuleType, tmp_path: Path
) -> None:
    """Windows that timed their scheduler: per server and c, a decode step's wall time and the
    rank-0 scheduler's main thread on a CPU, waiting for one, and blocked; other windows and
    runs left out."""
    windows = [
        window(
            "plain",
            16,
            4000,
            decode_steps=1000,
            scheduler_run_ms=[3000.0, 1.0],
            scheduler_runqueue_ms=[100.0, 1.0],
        ),
        window(
            "plain",
            16,
            4000,
            decode_steps=1000,
            scheduler_run_ms=[3200.0],
            scheduler_runqueue_ms=[300.0],
        ),
        window(
            "patched-off",
            16,
            3600,
            decode_steps=800,
            scheduler_run_ms=[3400.0],
            scheduler_runqueue_ms=[0.0],
        ),
        window("always-on", 16, 6000),  # not timed
    ]
    run = {"seconds": 4.0, "tp": 1, "temperature": 0.9}
    untimed = [window("plain", 16, 4000)]
    results = {
        "gpu-envelope-40-timed.json": {**run, "windows": windows},
        "gpu-envelope-39-untimed.json": {**run, "windows": untimed},
    }
    rows = report.scheduler_per_step(results)
    assert rows == [
        {
            "run": "gpu-envelope-40-timed.json",
            "server": "patched-off",
            "c": 16,
            "windows": 1,
            "wall_ms": 5.0,
            "on_cpu_ms": 4.25,
            "runqueue_ms": 0.0,
            "blocked_ms": 0.75,
        },
        {
            "run": "gpu-envelope-40-timed.json",
            "server": "plain",
            "c": 16,
            "windows": 2,
            "wall_ms": 4.0,
            "on_cpu_ms": 3.1,
            "runqueue_ms": 0.2,
            "blocked_ms": 0.7,
        },
    ]
    md, figures, _ = report.run_section(results)
    assert "| 40-timed | plain | 16 | 2 | 4.0 | 3.1 | 0.2 | 0.7 |" in md
    assert figures["scheduler_per_step"] == rows
    untimed_md, _, _ = report.run_section(
        {"gpu-envelope-39-untimed.json": {**run, "windows": untimed}}
    )
    assert "scheduler's main thread" not in untimed_md


def test_a_window_times_each_scheduler_main_thread(tmp_path: Path) -> None:
    """The SGLang schedulers under a launched server (any depth, by their process name; the
    detokenizer and unrelated processes left out), their main threads' CPU and run-queue time
    from schedstat, and a window's differences (none where a scheduler went away)."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    proc = tmp_path / "proc"

    def process(pid: int, ppid: int, comm: str, schedstat: str | None = None) -> None:
        entry = proc / str(pid)
        entry.mkdir(parents=True)
        (entry / "stat").write_text(f"{pid} ({comm[:15]}) S {ppid} {pid} 0 0 -1\n")
        if schedstat is not None:
            (entry / "task" / str(pid)).mkdir(parents=True)
            (entry / "task" / str(pid) / "schedstat").write_text(schedstat)

    process(100, 1, "python3")  # the launched server (its HTTP process)
    process(101, 100, "python3")  # a wrapper between them
    process(105, 101, "sglang::scheduler_TP1", "9000000 1000000 40\n")
    process(103, 101, "sglang::scheduler_TP0", "5000000 2500000 30\n")
    process(104, 100, "sglang::detokenizer")
    process(200, 1, "sglang::scheduler_TP0")  # another server's
    (proc / "self").mkdir()  # not a process
    assert envelope.scheduler_pids(100, proc) == [103, 105]
    assert envelope.scheduler_pids(999, proc) == []
    before = envelope.scheduler_times([103, 105, 106], proc)  # 106 is gone
    assert before == [(5.0, 2.5), (9.0, 1.0)]
    (proc / "103" / "task" / "103" / "schedstat").write_text("8000000 2600000 50\n")
    after = envelope.scheduler_times([103, 105], proc)
    assert envelope.scheduler_deltas(before, after) == {
        "scheduler_run_ms": [3.0, 0.0],
        "scheduler_runqueue_ms": [0.1, 0.0],
    }
    assert envelope.scheduler_deltas(before, after[:1]) == {}
    assert envelope.scheduler_deltas([], []) == {}


def test_a_windows_gpu_figures_come_from_its_own_gpus_samples_inside_it() -> None:
    """gpu_window(): the samples of the server's GPUs (by index or UUID) read inside the
    window; unreadable values and the idle clock reason left out; nothing without samples."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    fields = (*envelope.GPU_FIELDS, "clocks_throttle_reasons.active")
    lines = [  # t, line
        (0.5, "0, GPU-a, 1000, 3201, 300.0, 40, 90, 0x0000000000000000"),  # before the window
        (1.0, "0, GPU-a, 1980, 3201, 500.5, 50, 99, 0x0000000000000000"),
        (1.1, "1, GPU-b, 500, 3201, 100.0, 70, 10, 0x0000000000000004"),  # another GPU
        (1.2, "0, GPU-a, 1500, 3201, [N/A], 55, 98, 0x0000000000000004"),  # power capped
        (1.3, "0, GPU-a, 1800, 3100, 499.5, 53, 97, 0x0000000000000001"),
        (1.4, "No devices were found"),
    ]
    samples = [x for t, line in lines if (x := envelope.parse_smi_line(line, fields, t))]
    assert len(samples) == 5
    got = envelope.gpu_window(samples, ["0"], 1.0, 1.3)
    assert got == {
        "gpu_samples": 3,
        "gpu_sm_mhz_mean": 1760.0,
        "gpu_sm_mhz_min": 1500.0,
        "gpu_mem_mhz_min": 3100.0,
        "gpu_power_w_mean": 500.0,
        "gpu_temp_c_max": 55.0,
        "gpu_util_mean": 98.0,
        "gpu_clock_reasons": ["0x0000000000000004"],
    }
    assert envelope.gpu_window(samples, ["GPU-b"], 1.0, 1.3)["gpu_sm_mhz_min"] == 500.0
    assert envelope.gpu_window(samples, ["2"], 0.0, 9.0) == {}


FAKE_SMI = """#!/usr/bin/env python3
import sys, time
query = next(a for a in sys.argv if a.startswith("--query-gpu="))
if "clocks_event_reasons" in query:  # a driver before 535
    sys.exit('Field "clocks_event_reasons.active" is not a valid field to query.')
line = "0, GPU-a, 1980, 3201, 500.0, 50, 99, 0x0000000000000000"
if not any(a.startswith("-lms=") for a in sys.argv):
    print(line)
    sys.exit(0)
while True:
    print(line, flush=True)
    time.sleep(0.02)
"""


def test_gpu_telemetry_reads_nvidia_smi_through_the_job_and_stops_with_it(tmp_path: Path) -> None:
    """One `nvidia-smi -lms` process read by a thread, started and stopped by its owner; a
    clock-reason field the driver refuses is swapped for the older name; no nvidia-smi at all
    records nothing and says why."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    began = time.time()
    with envelope.GpuTelemetry(["0"], every_ms=20, smi=str(smi)) as telemetry:
        time.sleep(0.5)
    ended = time.time()
    assert telemetry.fields[-1] == "clocks_throttle_reasons.active"
    assert telemetry._proc is not None and telemetry._proc.poll() is not None
    count = len(telemetry.samples)
    assert count >= 5
    time.sleep(0.1)
    assert len(telemetry.samples) == count  # stopped
    got = telemetry.between("0", began, ended)
    assert got["gpu_sm_mhz_mean"] == 1980.0 and got["gpu_samples"] == count
    assert "problem" not in telemetry.describe()
    with envelope.GpuTelemetry(["0"], smi=str(tmp_path / "missing")) as absent:
        pass
    assert absent.between("0", 0, 2 * time.time()) == {}
    assert "missing" in absent.describe()["problem"]


def test_a_window_counts_the_hosts_tcp_trouble(tmp_path: Path) -> None:
    """The TCP counters come from /proc/net/snmp and netstat's paired lines (names, then
    values); TIME_WAIT sockets are state 06 in /proc/net/tcp and tcp6."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    net = tmp_path / "net"
    net.mkdir()
    (net / "snmp").write_text(
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm ActiveOpens PassiveOpens AttemptFails EstabResets RetransSegs\n"
        "Tcp: 1 120 118 3 2 40\n"
    )
    (net / "netstat").write_text(
        "TcpExt: SyncookiesSent ListenOverflows ListenDrops TCPTimeouts\nTcpExt: 0 7 9 11\n"
    )
    assert envelope.tcp_counters(tmp_path) == {
        "ActiveOpens": 120,
        "PassiveOpens": 118,
        "AttemptFails": 3,
        "EstabResets": 2,
        "RetransSegs": 40,
        "ListenOverflows": 7,
        "ListenDrops": 9,
        "TCPTimeouts": 11,
    }
    head = "  sl  local_address rem_address   st tx_queue rx_queue\n"
    (net / "tcp").write_text(
        head + "   0: 0100007F:7A30 0100007F:D3B2 06 0:0\n"
        "   1: 0100007F:7A30 00000000:0000 0A 0:0\n"
        "   2: 0100007F:7A31 0100007F:D3B4 06 0:0\n"
    )
    assert envelope.time_wait_sockets(tmp_path) == 2  # no tcp6 file: counted as none
    assert envelope.tcp_counters(tmp_path / "nowhere") == {}


def test_a_window_measures_the_hosts_busy_and_stolen_cpu_time(tmp_path: Path) -> None:
    """/proc/stat's first line, all CPUs: the window's busy share and the share the hypervisor
    stole; nothing where it cannot be read or no time passed."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\nintr 5\n")
    before = envelope.cpu_times(tmp_path)
    assert before["idle"] == 800 and before["steal"] == 0
    stat.write_text("cpu  400 0 150 1100 50 0 0 300 0 0\n")
    after = envelope.cpu_times(tmp_path)
    # 1,000 ticks: 300 idle, 300 stolen.
    assert envelope.cpu_deltas(before, after) == {"host_cpu_busy": 0.7, "host_cpu_steal": 0.3}
    assert envelope.cpu_deltas(before, before) == {}
    assert envelope.cpu_times(tmp_path / "nowhere") == {}
    assert envelope.cpu_deltas({}, after) == {}


def test_a_persistent_client_keeps_its_connection_and_reopens_a_closed_one() -> None:
    """--client-keepalive: one connection for request after request; when the server drops
    it (as an idle keep-alive connection is dropped between windows), the next call opens a
    new one and succeeds."""
    import http.server
    import threading

    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    connections: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            connections.append(self.client_address[1])

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            answer = json.dumps({"echo": json.loads(body), "auth": self.headers["Authorization"]})
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer.encode())
            # The third request's connection is dropped without a word, as an idle one is.
            self.close_connection = len(connections) == 1 and body == b'{"n": 2}'

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = envelope.PersistentClient(server.server_address[1], timeout=10)
        for n in range(4):
            status, answer = client.call("/generate", {"n": n})
            assert status == 200 and answer["echo"] == {"n": n}
            assert answer["auth"] == "Bearer gputest-key"
        assert len(connections) == 2  # requests 0-2 on the first, 3 on a new one
        client.close()
    finally:
        server.shutdown()
        server.server_close()


def test_pinning_deals_whole_physical_cores(tmp_path: Path) -> None:
    """--pin-cpus: sibling hardware threads (as sysfs lists them) stay together, a run's share
    is whole cores, and its slices (benchmark process first, then each server) never meet."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    assert envelope.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    sysfs = tmp_path / "cpu"
    for cpu in range(16):  # 8 cores, siblings n and n + 8, as on many x86 hosts
        topology = sysfs / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(f"{cpu % 8},{cpu % 8 + 8}\n")
    cores = envelope.core_groups(range(16), sysfs)
    assert cores == [[n, n + 8] for n in range(8)]
    # A CPU sysfs does not describe is a core of its own; siblings outside the set drop out.
    assert envelope.core_groups([0, 1, 99], sysfs) == [[0], [1], [99]]
    first = envelope.pin_plan("1/2", range(16), servers=3, sysfs=sysfs)
    second = envelope.pin_plan("2/2", range(16), servers=3, sysfs=sysfs)
    assert first == [[0, 8], [1, 9], [2, 10], [3, 11]]
    assert second == [[4, 12], [5, 13], [6, 14], [7, 15]]
    assert envelope.cpu_slices(cores, 3) == [
        [0, 1, 2, 8, 9, 10],
        [3, 4, 5, 11, 12, 13],
        [6, 7, 14, 15],
    ]
    with pytest.raises(ValueError, match="8 physical cores cannot give 9 parts"):
        envelope.cpu_slices(cores, 9)
    with pytest.raises(ValueError, match="give K/N"):
        envelope.pin_plan("0/2", range(16), servers=1, sysfs=sysfs)


def test_a_pinned_server_and_its_children_run_on_their_cpus() -> None:
    """verify.start's preexec pin: set in the child before Python starts, so the processes a
    server spawns (SGLang's scheduler) inherit it."""
    import subprocess

    sys.path.insert(0, str(ROOT / "lab" / "gpu"))
    try:
        import verify
    finally:
        sys.path.pop(0)
    one = min(os.sched_getaffinity(0))
    code = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
        "subprocess.run([sys.executable, '-c', "
        "'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        preexec_fn=verify.pin_to([one]),
        timeout=60,
    )
    assert done.stdout.split() == [f"[{one}]", f"[{one}]"]


def test_threshold_changes_are_read_from_the_routers_own_log_lines() -> None:
    """gpu_envelope.threshold_changes reads what the router's JSON formatter writes: its
    threshold changes with their reasons, and nothing else (request lines, uvicorn's text)."""
    import logging

    from specgate.logs import JsonFormatter

    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    formatter = JsonFormatter()

    def line(logger: str, msg: str, *args: object, at: float) -> str:
        record = logging.LogRecord(logger, logging.INFO, __file__, 1, msg, args, None)
        record.created, record.msecs = at, (at % 1) * 1000
        return formatter.format(record)

    origin = 1_800_000_000.0
    log = "\n".join(
        [
            "INFO:     Started server process [7]",
            "42",
            line("specgate.router.access", "request done", at=origin + 3),
            line(
                "specgate.router",
                "threshold of %s: %s -> %s (%s)",
                "pod-0",
                8,
                4,
                "speculation does not pay at the threshold (from 4)",
                at=origin + 12.4,
            ),
            line("specgate.router", "configuration reloaded", at=origin + 13),
            line(
                "specgate.router",
                "threshold of %s: %s -> %s (%s)",
                "pod-0",
                4,
                10,
                "probe",
                at=origin + 95,
            ),
        ]
    )
    assert envelope.threshold_changes(log, origin) == [
        {
            "t": 12,
            "change": "threshold of pod-0: 8 -> 4 "
            "(speculation does not pay at the threshold (from 4))",
        },
        {"t": 95, "change": "threshold of pod-0: 4 -> 10 (probe)"},
    ]


def test_the_gc_probe_times_a_process_collections(tmp_path: Path) -> None:
    """lab/bench/gcstats/sitecustomize.py, first on PYTHONPATH, loads into a new interpreter and
    writes its collections per generation; a window's differences come from two reads. Without
    SPECGATE_GC_STATS_DIR it writes nothing."""
    import os
    import subprocess

    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    script = (
        "import gc, json, os, sys, time\n"
        "time.sleep(0.3)\n"
        "print(os.getpid(), flush=True)\n"
        "sys.stdin.readline()\n"
        "for _ in range(3): gc.collect()\n"
        "junk = [[i] for i in range(100000)]\n"
        "time.sleep(0.3)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(envelope.GC_STATS),
        "SPECGATE_GC_STATS_DIR": str(tmp_path),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdin is not None
    pid = int(child.stdout.readline())
    before = envelope.read_gc_stats(tmp_path, [pid, pid + 100_000])  # the second has no file
    assert [b["pid"] for b in before] == [pid]
    child.stdin.write("go\n")
    child.stdin.flush()
    time.sleep(0.5)  # the probe writes ten times a second; the child sleeps 0.3 s after
    after = envelope.read_gc_stats(tmp_path, [pid])
    assert child.wait(timeout=30) == 0
    deltas = envelope.gc_deltas(before, after)
    (collections,) = deltas["scheduler_gc_collections"]
    (ms,) = deltas["scheduler_gc_ms"]
    assert collections[2] >= 3  # the three explicit full collections
    assert collections[0] >= 100  # 100,000 lists allocated: one young collection per 700
    assert all(m >= 0 for m in ms) and sum(ms) > 0
    assert envelope.gc_deltas([], after) == {}
    assert envelope.gc_deltas(before, [{**after[0], "pid": pid + 1}]) == {}
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    env.pop("SPECGATE_GC_STATS_DIR")
    subprocess.run([sys.executable, "-c", "import gc; gc.collect()"], env=env, check=True)
    assert list(quiet.iterdir()) == [] and sorted(tmp_path.glob("gc-*.json")) == [
        tmp_path / f"gc-{pid}.json"
    ]


def test_windows_after_the_gc_freeze_run_last_at_every_level() -> None:
    """Freezing cannot be undone: every level's frozen repeats come after all unfrozen ones,
    each part in the sweep's order."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    windows = [(c, rep, name) for c in (16, 64) for rep in range(3) for name in ("a", "b")]
    assert envelope.frozen_last(windows, None) == windows
    assert envelope.frozen_last(windows, 2) == [
        (16, 0, "a"),
        (16, 0, "b"),
        (16, 1, "a"),
        (16, 1, "b"),
        (64, 0, "a"),
        (64, 0, "b"),
        (64, 1, "a"),
        (64, 1, "b"),
        (16, 2, "a"),
        (16, 2, "b"),
        (64, 2, "a"),
        (64, 2, "b"),
    ]


def report_of(report: ModuleType, tmp_path: Path, name: str, job: dict[str, Any]) -> str:
    """The report's Markdown for one job saved as `name`."""
    path = tmp_path / name
    path.write_text(json.dumps(job))
    assert report.main([str(path), "--out", str(tmp_path / "out")]) == 0
    return (tmp_path / "out" / "gpu_envelope.md").read_text()


def test_a_recorded_job_gets_its_own_section_and_frozen_windows_count_nowhere(
    report: ModuleType, tmp_path: Path
) -> None:
    """A job whose windows py-spy recorded ran on a perturbed host: its off-over-plain pairs
    go to a section of their own, never the sweep's. Windows after the GC freeze (job 45's,
    which measured the GC probe itself) are dropped before anything is computed."""
    windows = [
        window("plain", 16, 1000, rep=0, pyspy="a.txt"),
        window("patched-off", 16, 900, rep=0, pyspy="b.txt"),
        window("plain", 16, 1000, rep=1, pyspy="c.txt", gc_frozen=True),
        window("patched-off", 16, 100, rep=1, pyspy="d.txt", gc_frozen=True),
    ]
    job = {"tp": 1, "temperature": 0.9, "predicted_accept_length": 3.0, "windows": windows}
    assert report.workload(job) == "py-spy recording each window's scheduler"
    assert [w["rep"] for w in report.measured_windows(job)] == [0, 0]
    md = report_of(report, tmp_path, "gpu-envelope-45-host-time.json", job)
    sweep, recorded = md.split("## Another workload (py-spy recording each window's scheduler)")
    assert "45-host-time" not in sweep
    assert "| 45-host-time | 16 | patched-off | plain | 1 | 0.9 |" in recorded


def test_a_job_on_another_target_shape_gets_its_own_section(report: ModuleType) -> None:
    """The sweep's 3B-class target leaves an H200's decode step to the host; the 8B-class one
    (gpu_envelope.py --shape 8b) to the GPU. A job on it never fills the sweep's table."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    assert envelope.shape_name("3b") == report.SWEEP_SHAPE
    eight = envelope.shape_name("8b")
    assert eight == "Llama 8B-class (hidden 4096, 32 layers, GQA 32/8), synthetic pair, bf16"
    assert report.workload({"shape": envelope.shape_name("3b")}) == ""
    assert report.workload({"shape": eight, "flush_cache": True}) == (
        "target Llama 8B-class (hidden 4096, 32 layers, GQA 32/8), "
        "prefix caches emptied before each window"
    )


def test_a_job_whose_routed_engines_decode_several_tokens_an_off_step_pools_apart(
    report: ModuleType,
) -> None:
    """gpu_envelope.py --off-step-tokens K: the routed servers' off steps are another engine
    configuration, so such a job never fills the sweep's tables; K = 1 (the default, and what
    jobs before the option recorded by leaving it out) is the sweep's."""
    assert report.workload({"off_step_tokens": 1}) == report.workload({}) == ""
    assert report.workload({"off_step_tokens": 4, "flush_cache": True}) == (
        "prefix caches emptied before each window, "
        "off steps of 4 tokens a request (routed, patched-8)"
    )


def test_each_scheduler_gets_a_physical_core_of_its_own(tmp_path: Path) -> None:
    """--scheduler-cores: the host's last physical cores, one per server, siblings left idle;
    every thread of every process under a server goes to the rest, except its scheduler's main
    thread, alone on its core's first hardware thread."""
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    sysfs = tmp_path / "cpu"
    for cpu in range(16):  # 8 cores, siblings n and n + 8
        topology = sysfs / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(f"{cpu % 8},{cpu % 8 + 8}\n")
    cores, rest = envelope.scheduler_core_plan(range(16), 2, sysfs)
    assert cores == [[6, 14], [7, 15]]
    assert rest == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    with pytest.raises(ValueError, match="8 physical cores cannot give 8 schedulers"):
        envelope.scheduler_core_plan(range(16), 8, sysfs)

    proc = tmp_path / "proc"

    def process(pid: int, ppid: int, comm: str, tids: tuple[int, ...] = ()) -> None:
        entry = proc / str(pid)
        entry.mkdir(parents=True)
        (entry / "stat").write_text(f"{pid} ({comm[:15]}) S {ppid} {pid} 0 0 -1\n")
        for tid in (pid, *tids):
            (entry / "task" / str(tid)).mkdir(parents=True)

    process(100, 1, "python3", (101,))  # the server's HTTP process and a thread of it
    process(103, 100, "sglang::scheduler_TP0", (107, 108))
    process(104, 100, "sglang::detokenizer")
    process(200, 1, "sglang::scheduler_TP0")  # another server's: left alone
    calls: dict[int, list[int]] = {}

    def setaffinity(tid: int, cpus: list[int]) -> None:
        calls[tid] = list(cpus)

    done = envelope.pin_scheduler(100, [6, 14], rest, proc, setaffinity=setaffinity)
    assert calls == {100: rest, 101: rest, 103: [6], 104: rest, 107: rest, 108: rest}
    assert done == {"scheduler": {"pid": 103, "cpu": 6, "idle_siblings": [14]}, "threads_moved": 5}
    assert envelope.process_tree(100, proc) == [100, 103, 104]
    calls.clear()  # odd-reps frees them again: every thread on every CPU
    freed = envelope.pin_scheduler(100, None, list(range(16)), proc, setaffinity=setaffinity)
    assert calls == {tid: list(range(16)) for tid in (100, 101, 103, 104, 107, 108)}
    assert freed == {"scheduler": None, "threads_moved": 6}


def test_a_job_with_schedulers_on_cores_of_their_own_gets_its_own_section(
    report: ModuleType,
) -> None:
    job = {"scheduler_cores": {"plain": {"scheduler": {"pid": 1, "cpu": 7}}}, "windows": []}
    assert report.workload(job) == "each scheduler alone on a physical core"


def test_pinned_and_free_windows_of_one_job_are_reported_as_two_runs(
    report: ModuleType, tmp_path: Path
) -> None:
    """--scheduler-cores odd-reps (job 49): the free windows stay in the job's own run, with the
    recorded workload; the pinned ones become NAME-pinned, in the pinned workload's section.
    Neither mixes with the other's off-over-plain ratio."""
    windows = [
        window("plain", 16, 1000, rep=0, scheduler_pinned=False),
        window("patched-off", 16, 900, rep=0, scheduler_pinned=False),
        window("plain", 16, 1000, rep=1, scheduler_pinned=True),
        window("patched-off", 16, 500, rep=1, scheduler_pinned=True),
    ]
    job = {
        "tp": 1,
        "temperature": 0.9,
        "predicted_accept_length": 3.0,
        "windows": windows,
        "scheduler_cores": {"plain": {"scheduler": {"pid": 1, "cpu": 7}}},
    }
    split = report.split_by_pinning({"gpu-envelope-49-sc.json": job})
    free, pinned = split["gpu-envelope-49-sc.json"], split["gpu-envelope-49-sc-pinned.json"]
    assert [w["rep"] for w in free["windows"]] == [0, 0] and report.workload(free) == ""
    assert [w["rep"] for w in pinned["windows"]] == [1, 1]
    assert report.workload(pinned) == "each scheduler alone on a physical core"
    md = report_of(report, tmp_path, "gpu-envelope-49-sc.json", job)
    free_md, pinned_md = md.split("## Another workload (each scheduler alone on a physical core)")
    assert "| 49-sc | 16 | patched-off | plain | 1 | 0.9 |" in free_md
    assert "| 49-sc-pinned | 16 | patched-off | plain | 1 | 0.5 |" in pinned_md


def test_pinning_a_real_scheduler_moves_only_its_main_thread(tmp_path: Path) -> None:
    """The same against real processes: a child named like SGLang's scheduler (with a second
    thread) under a parent; its main thread ends on the core's CPU, everything else on the
    rest, as the kernel reports it."""
    import os
    import subprocess

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    envelope = load_module(ROOT / "lab" / "bench" / "gpu_envelope.py", "gpu_envelope")
    child = (
        "import threading, time\n"
        "open('/proc/self/comm', 'w').write('sglang::scheduler_TP0')\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "p.wait()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        done = envelope.pin_scheduler(server.pid, [cpus[0]], cpus[1:])
        scheduler = done["scheduler"]["pid"]
        assert envelope.scheduler_pids(server.pid) == [scheduler]

        def allowed(pid: int, tid: int) -> list[int]:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
            return envelope.parse_cpu_list(line.split(":")[1])

        assert allowed(scheduler, scheduler) == [cpus[0]]
        others = [
            (pid, int(t.name))
            for pid in (server.pid, scheduler)
            for t in Path(f"/proc/{pid}/task").iterdir()
            if int(t.name) != scheduler
        ]
        assert len(others) >= 2 and all(allowed(p, t) == cpus[1:] for p, t in others)
        assert done["threads_moved"] == len(others)
    finally:
        for pid in envelope.process_tree(server.pid)[::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        server.wait(timeout=10)


def test_the_patch_checksum_is_the_one_run_on_gpu_writes(
    report: ModuleType, tmp_path: Path
) -> None:
    import subprocess

    for name, text in (("0002-b.patch", "second\n"), ("0001-a.patch", "first\n")):
        (tmp_path / name).write_text(text)
    (tmp_path / "notes.txt").write_text("not a patch\n")
    shell = subprocess.run(
        f"cat {tmp_path}/*.patch | sha256sum",
        shell=True,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    assert report.patch_sha256(tmp_path) == shell
    (tmp_path / "0001-a.patch").write_text("first, changed\n")
    assert report.patch_sha256(tmp_path) != shell
    # The tree's own patch, as run-on-gpu.sh's marker holds it.
    tree = subprocess.run(
        "cat worker-image/patches/*.patch | sha256sum",
        shell=True,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    assert report.patch_sha256() == tree


def test_runs_before_checksums_count_only_while_the_patch_is_theirs(report: ModuleType) -> None:
    old = report.UNRECORDED_PATCH_SHA256
    assert report.ran_patch("gpu-envelope-65-x.json", {}, old)
    assert not report.ran_patch("gpu-envelope-65-x.json", {}, "another")
    assert not report.ran_patch("gpu-envelope-40-x.json", {}, old)
    assert report.ran_patch("gpu-envelope-90-x.json", {"patch_sha256": "abc"}, "abc")
    assert not report.ran_patch("gpu-envelope-65-x.json", {"patch_sha256": "abc"}, old)


def test_a_run_of_a_patch_with_the_same_steps_counts_as_the_later_one(
    report: ModuleType,
) -> None:
    """Jobs 77-81's patch computed every step they ran as the next one does, and that one as
    the product patch without its A/B switches: each mapping is one way, to that patch only,
    and they chain (a run of the first counts for the last). The patch in the tree samples the
    draft's proposal on off steps, other steps: no earlier run counts for it."""
    same = report.SAME_STEPS_PATCH_SHA256
    assert len(same) == 2
    for recorded, later in same.items():
        assert recorded != later
        run = {"patch_sha256": recorded}
        assert report.ran_patch("gpu-envelope-78-x.json", run, later)
        assert not report.ran_patch("gpu-envelope-78-x.json", run, "a later patch")
        assert not report.ran_patch("gpu-envelope-78-x.json", {"patch_sha256": later}, recorded)
        assert recorded not in report.SAME_SOURCE_PATCH_SHA256
    (first,) = set(same) - set(same.values())
    (last,) = set(same.values()) - set(same)
    assert report.ran_patch("gpu-envelope-78-x.json", {"patch_sha256": first}, last)
    assert report.patch_sha256() not in set(same) | set(same.values())
    assert not report.ran_patch("gpu-envelope-78-x.json", {"patch_sha256": last},
                                report.patch_sha256())  # fmt: skip


def test_a_run_of_a_patch_with_the_same_source_counts_as_the_later_one(
    report: ModuleType,
) -> None:
    """A recorded checksum maps to one later checksum only (the patch file that applies the same
    source), not to any patch after it."""
    ((recorded, same),) = report.SAME_SOURCE_PATCH_SHA256.items()
    run = {"patch_sha256": recorded}
    assert report.ran_patch("gpu-envelope-74-x.json", run, same)
    assert report.ran_patch("gpu-envelope-74-x.json", run, recorded)
    assert not report.ran_patch("gpu-envelope-74-x.json", run, "a later patch")
    assert not report.ran_patch("gpu-envelope-74-x.json", {"patch_sha256": same}, recorded)


def test_off_over_plain_pools_every_pair_of_the_patch_in_the_tree(report: ModuleType) -> None:
    def run(ratio_16: float, *, sha: str = "now", **extra: object) -> dict[str, object]:
        windows = []
        for rep in range(3):
            windows += [
                window("plain", 16, 1000.0, rep=rep),
                window("patched-off", 16, 1000.0 * ratio_16, rep=rep),
                window("plain", 64, 2000.0, rep=rep),
                window("patched-off", 64, 1800.0, rep=rep),
            ]
        windows.append(window("patched-off", 16, 10.0, rep=9))  # no plain beside it: unpaired
        return {"windows": windows, "patch_sha256": sha, **extra}

    results = {
        "gpu-envelope-91-a.json": run(0.9),
        "gpu-envelope-90-b.json": run(1.0),
        "gpu-envelope-92-old-patch.json": run(0.5, sha="before"),
        "gpu-envelope-93-tp2.json": run(0.5, tp=2),
        "gpu-envelope-94-pinned.json": run(0.5, scheduler_cores={"plain": {}}),
        "gpu-envelope-95-longer.json": run(0.5, new_tokens=[256, 512]),
    }
    rows = report.off_over_plain_pooled(results, "now")
    short = [r for r in rows if r["workload"] == ""]  # the sweep's, nothing different
    pooled = [(r["c"], r["jobs"], r["pairs"]) for r in short]
    assert pooled == [(16, [90, 91], 6), (64, [90, 91], 6)]
    assert short[0]["geomean"] == round((0.9 * 1.0) ** 0.5, 3)
    assert short[1]["geomean"] == 0.9
    longer = [r for r in rows if r["workload"] == "256-512 new tokens a request"]
    assert [(r["c"], r["jobs"], r["geomean"]) for r in longer] == [(16, [95], 0.5), (64, [95], 0.9)]
    # Pinned schedulers are another host setup: a pool of their own, never the sweep's.
    pinned = [r for r in rows if "scheduler alone" in r["workload"]]
    assert [(r["c"], r["jobs"]) for r in pinned] == [(16, [94]), (64, [94])]
    assert len(rows) == 6 and {r["server"] for r in rows} == {"patched-off"}
    assert report.off_over_plain_pooled(results, "unmeasured") == []
    # Another off server pools its own pairs: none here.
    assert report.off_over_plain_pooled(results, "now", "patched-off-4") == []
    assert "| patched-off | 256-512 new tokens a request | 64 | 95 |" in (
        report.off_over_plain_pooled_table(rows)
    )


def test_the_pooled_off_servers_are_plotted_side_by_side(
    report: ModuleType, tmp_path: Path
) -> None:
    rows = [
        {
            "server": server,
            "workload": "",
            "c": c,
            "geomean": mean,
            "p05": mean - 0.03,
            "p95": mean + 0.03,
        }
        for server, mean in (("patched-off", 0.9), ("patched-off-4", 1.3))
        for c in (16, 64)
    ]
    report.plot_off_over_plain_pooled(rows, tmp_path / "pooled.png")
    assert (tmp_path / "pooled.png").stat().st_size > 10_000


def test_the_pooled_interval_resamples_jobs_before_pairs(report: ModuleType) -> None:
    """Two jobs whose pairs agree within each job but not with each other: their pairs taken as
    independent give a narrow interval; resampling the jobs first gives one as wide as the
    jobs are apart. The point estimate is the same geometric mean of every pair."""
    groups = [[0.88, 0.90, 0.89, 0.91] * 3, [0.99, 1.01, 1.00, 1.02] * 3]
    every = groups[0] + groups[1]
    iid = report.geometric_summary(every)
    clustered = report.clustered_geometric_summary(groups)
    assert clustered["geomean"] == iid["geomean"] and clustered["pairs"] == 24
    assert clustered["p05"] < iid["p05"] - 0.02 and clustered["p95"] > iid["p95"] + 0.02
    assert 0.89 <= clustered["p05"] <= clustered["geomean"] <= clustered["p95"] <= 1.01
    # One job alone: the interval is its pairs' own.
    alone = report.clustered_geometric_summary([groups[0]])
    assert alone["p95"] - alone["p05"] < 0.02
    assert report.clustered_geometric_summary([[0.9], []])["pairs"] == 1


def test_the_target_verdict_needs_the_whole_interval(report: ModuleType) -> None:
    assert report.target_verdict({"p05": 0.95, "p95": 1.0}) == "yes"
    assert report.target_verdict({"p05": 0.90, "p95": 0.949}) == "no"
    assert report.target_verdict({"p05": 0.93, "p95": 0.99}) == "not resolved"
