"""lab/bench/policy_at_scale.py on a small fleet. It runs in virtual time, so its figures do not
depend on this machine's speed and can be asserted; the full 64-pod run is the benchmark
(lab/NOTEBOOK.md)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT, load_module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_module(ROOT / "lab" / "bench" / "policy_at_scale.py", "policy_at_scale")


def test_small_fleet_run_writes_its_report_and_meets_the_policy_targets(
    bench: ModuleType, tmp_path: Path
) -> None:
    assert (
        bench.main(
            ["--pods", "4", "--minutes", "4", "--stationary-minutes", "4", "--out", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "policy_at_scale.json").read_text())
    assert (tmp_path / "policy_at_scale.png").stat().st_size > 10_000
    assert "per-window oracle" in (tmp_path / "policy_at_scale.md").read_text()
    diurnal = result["diurnal"]["policies"]
    # Static baselines behave as their names say.
    assert diurnal["always-on"]["speculating_step_share"] == 1.0
    assert diurnal["always-off"]["speculating_step_share"] == 0.0
    assert diurnal["always-off"]["tokens"] > diurnal["always-on"]["tokens"]  # the peak is loaded
    assert result["diurnal"]["specgate_over_oracle"] >= 0.95
    assert result["stationary"]["pushes_per_pod_per_10min_after_settle"] <= 2
    assert result["mixed"]["specgate_goodput_over_best_static"] >= 1.05


def test_oracle_takes_the_best_static_policy_per_window(bench: ModuleType) -> None:
    def outcome(name: str, windows: list[float]) -> object:
        o = bench.Outcome(name, 60.0, 1)
        o.tokens_by_window = windows
        return o

    outcomes = {
        "always-on": outcome("always-on", [10, 1]),
        "always-off": outcome("always-off", [2, 8]),
        "fixed-8": outcome("fixed-8", [5, 5]),
        "specgate": outcome("specgate", [9, 7]),
    }
    ratio, oracle = bench.oracle_ratio(outcomes, "specgate")
    assert oracle == [10, 8]
    assert ratio == pytest.approx(16 / 18)


def test_diurnal_load_has_a_night_and_a_peak(bench: ModuleType) -> None:
    load_at = bench.diurnal(pods=10, seconds=600)
    night, peak = load_at(0), load_at(300)
    assert sum(night.values()) <= 10  # about half a client per pod
    assert sum(peak.values()) >= 250  # about 26 per pod
    assert night["latency"] / sum(night.values()) > peak["latency"] / sum(peak.values())


def test_a_steady_fleet_does_not_swing_its_thresholds(bench: ModuleType) -> None:
    """Two pods at a steady batch of 14 after a ramp (no latency pool at this setting). Lines
    extrapolated from the ramp's stale samples once swung the threshold 8 -> 16 -> 8 every
    30 s, 20 pushes per pod per 10 minutes."""
    from specgate_router.settings import PoolSettings
    from specgate_sim.profile import load

    steady = PoolSettings(throughput_batch_per_pod=20)
    outcome = bench.run(
        load(bench.PROFILE),
        bench.POLICIES[3],
        bench.constant(4, 24),
        pods=2,
        seconds=600,
        seed=9,
        pools=steady,
    )
    # Learning moves it once or twice in the first 90 s (8 -> 11 -> 6: the fit widens past the
    # ramp's few plain batch sizes, then settles at the crossover); after that it holds.
    assert len(outcome.pushes) <= 2 * 2, outcome.pushes
    assert outcome.pushes_per_pod_per_10min(after=90) == 0, outcome.pushes


def test_noisy_host_bench_runs_both_hosts_and_the_controller_keeps_its_modes(
    bench: ModuleType, tmp_path: Path
) -> None:
    """lab/bench/noisy_host.py on two pods: slow spells cost the static policies tokens at every
    load, and far from the crossover specgate still runs the better mode on the noisy host as
    on the calm one. (Near it, a short run's learning phase can take another course on either
    host: at eight clients a pod the calm run speculated half its steps.)"""
    noisy = load_module(ROOT / "lab" / "bench" / "noisy_host.py", "noisy_host")
    assert noisy.main(["--pods", "2", "--minutes", "6", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "noisy_host.json").read_text())
    assert "specgate / better static" in (tmp_path / "noisy_host.md").read_text()
    rows = {(r["host"], r["clients_per_pod"]): r for r in result["rows"]}
    assert set(rows) == {(h, c) for h in ("calm", "noisy") for c in noisy.CLIENTS_PER_POD}
    for c in noisy.CLIENTS_PER_POD:
        for policy in ("always-on", "always-off"):
            assert rows["noisy", c]["tokens"][policy] < rows["calm", c]["tokens"][policy]
    for host in ("calm", "noisy"):
        low, high = rows[host, 2], rows[host, 24]
        assert low["better_static"] == "always-on" and high["better_static"] == "always-off"
        assert low["specgate_speculating_step_share"] >= 0.95
        assert high["specgate_speculating_step_share"] <= 0.05
        assert low["specgate_over_better_static"] >= 0.97
        assert high["specgate_over_better_static"] >= 0.97
