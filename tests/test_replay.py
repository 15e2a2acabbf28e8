"""The controller replayed over recorded samples (specgate_router.replay) and its command line
(lab/bench/replay_control.py). The router's export of the samples is tested over HTTP in
test_router_http.py, and a GPU envelope job keeping it in test_envelope_report.py."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from specgate import contract
from specgate_router import control, replay
from specgate_router.settings import ControlSettings
from specgate_sim import profile as profiles

from .conftest import ROOT, load_module

PROFILE = profiles.load("rtx-pro-6000-x8")  # speculation pays up to batch 6
PARAMS = ControlSettings(
    threshold=2,
    max_threshold=64,
    hysteresis=0,
    cooldown_seconds=1,
    scrape_interval_seconds=0.5,
    stale_after_seconds=2,
    min_samples=3,
    probe_interval_seconds=6,
)
LOAD = [(0, 1), (12, 4), (26, 8), (40, 3), (54, 16)]
"""(from second, batch): loads that hold long enough for a trial each; the pod's samples are
all the law has (an engine without a step profile, as a replay sees every engine)."""


def batch_at(t: float) -> int:
    return next(b for start, b in reversed(LOAD) if t >= start)


def step(decision: control.Decision, samples: list[control.Sample], now: float,
         fresh: bool = True) -> control.Decision:  # fmt: skip
    (new,) = control.step([control.PodInput(decision, samples, fresh=fresh)], now=now,
                          params=PARAMS)  # fmt: skip
    return new


def live_run(seconds: float = 70.0) -> tuple[list[control.Sample], list[replay.Change]]:
    """The router's loop in miniature: each scrape interval one sample of a pod running its
    current threshold's mode at the load's batch (host noise of a few percent, no sample while
    the batch moves), then a control step over every sample so far."""
    noise = random.Random(7)
    samples: list[control.Sample] = []
    decision = control.initial_decision(PARAMS, 0.0)
    changes = [replay.Change(0.0, decision.threshold, decision.reason)]
    for i in range(int(seconds / PARAMS.scrape_interval_seconds) + 1):
        now = i * PARAMS.scrape_interval_seconds
        batch = batch_at(now)
        if i == 0 or batch == batch_at(now - PARAMS.scrape_interval_seconds):
            on = contract.speculates(batch, decision.threshold)
            tok_s = PROFILE.steady_throughput(batch, on) * noise.uniform(0.99, 1.01)
            samples.append(control.Sample(now, batch, tok_s, 1.0 if on else 0.0))
        decision = step(decision, samples, now)
        if decision.threshold != changes[-1].threshold:
            changes.append(replay.Change(now, decision.threshold, decision.reason))
    return samples, changes


def test_a_replay_takes_the_live_controllers_every_decision() -> None:
    """Over the samples a live loop recorded, with its settings, the replay moves the
    threshold at the same steps to the same values for the same reasons: trials and moves."""
    samples, live = live_run()
    rules = {c.reason.split(":")[0] for c in live}
    assert {"trial", "trial-return", "move"} <= rules, live
    assert replay.replay(samples, params=PARAMS, until=70.0) == live


def test_a_replay_under_other_settings_decides_otherwise() -> None:
    samples, live = live_run()
    strict = PARAMS.model_copy(update={"min_samples": 1000, "probe_interval_seconds": 0})
    assert replay.replay(samples, params=strict) == live[:1]  # never enough to move
    assert replay.replay([], params=PARAMS) == []


def test_a_pod_whose_samples_stop_goes_stale_and_keeps_its_threshold() -> None:
    """Samples of both modes at batch 4 until 8.5 s say speculation pays there (threshold 2
    runs it plain), but the last move (down, at 5 s) cools down until 15 s: by then the
    replayed pod is stale and keeps 2. Were its metrics still fresh it would move."""
    samples = [
        control.Sample(5 + 0.25 * i, 4, PROFILE.steady_throughput(4, on), 1.0 if on else 0.0)
        for i, on in enumerate([True, False] * 7)
    ]
    params = PARAMS.model_copy(update={"cooldown_seconds": 10, "probe_interval_seconds": 0})
    start = control.Decision(2, control.Rule.MOVE, "moved here", changed_at=5.0, moved=-1)
    assert replay.replay(samples, params=params, start=start, until=30.0) == [
        replay.Change(5.0, 2, start.reason)
    ]
    fresh = params.model_copy(update={"stale_after_seconds": 100})
    moved = replay.replay(samples, params=fresh, start=start, until=30.0)
    assert [(c.at, c.threshold) for c in moved] == [(5.0, 2), (15.0, 4)]


def test_a_replay_skips_stale_stretches_without_changing_a_decision() -> None:
    """Two busy spells ten minutes apart: the replay jumps over the idle stretch (a day of
    it would otherwise be 170k control steps) and decides as a replay stepping through it."""
    spell = live_run(30.0)[0]
    samples = spell + [replace(s, at=s.at + 600) for s in spell]
    expected, decision = [], control.initial_decision(PARAMS, 0.0)
    for i in range(int(samples[-1].at / PARAMS.scrape_interval_seconds) + 1):
        now = i * PARAMS.scrape_interval_seconds
        visible = [s for s in samples if s.at <= now]
        fresh = now - visible[-1].at <= PARAMS.stale_after_seconds
        decision = step(decision, visible, now, fresh)
        if not expected or decision.threshold != expected[-1].threshold:
            expected.append(replay.Change(now, decision.threshold, decision.reason))
    got = replay.replay(samples, params=PARAMS)
    assert [(c.at, c.threshold) for c in got[1:]] == [(c.at, c.threshold) for c in expected[1:]]
    assert any(c.at > 600 for c in got)  # the second spell moved it too


def test_sample_rows_round_trip_and_bad_rows_are_named() -> None:
    samples = live_run(10.0)[0]
    rows = replay.sample_rows(samples)
    back = replay.samples_from_rows(rows)
    assert [(s.at, s.batch) for s in back] == [(s.at, s.batch) for s in samples]
    assert all(
        math.isclose(a.tokens_per_second, b.tokens_per_second, abs_tol=0.05)
        for a, b in zip(back, samples, strict=True)
    )
    with pytest.raises(ValueError, match=r"sample row 1: \[1, 2\] is not \[at, batch"):
        replay.samples_from_rows([[0, 1, 2, 1], [1, 2]])


def export(*names: str) -> dict[str, object]:
    samples = replay.sample_rows(live_run()[0])
    return {
        "now": 70.0,
        "fields": list(replay.SAMPLE_FIELDS),
        "control": PARAMS.model_dump(by_alias=True),
        "pods": [{"name": n, "threshold": 2, "samples": samples} for n in names],
    }


def test_an_export_names_the_pod_to_replay() -> None:
    assert replay.pod_samples(export("a"))[0] == "a"
    assert replay.pod_samples(export("a", "b"), "b")[0] == "b"
    with pytest.raises(ValueError, match="2 pods in the export \\(a, b\\): pick one"):
        replay.pod_samples(export("a", "b"))
    with pytest.raises(ValueError, match="no pod 'c' in the export; it has a, b"):
        replay.pod_samples(export("a", "b"), "c")
    with pytest.raises(ValueError, match="no pods in the samples export"):
        replay.pod_samples({"pods": []})


@pytest.fixture(scope="module")
def cli() -> ModuleType:
    return load_module(ROOT / "lab" / "bench" / "replay_control.py", "replay_control")


def test_the_command_line_replays_a_job_under_its_settings_and_others(
    cli: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = {
        "router_samples": export("127.0.0.1:30302"),
        "router_changes": [{"t": 191.0, "change": "threshold of x: 2 -> 6 (...)"}],
    }
    path = tmp_path / "gpu-envelope-99-x.json"
    path.write_text(json.dumps(job))
    png = tmp_path / "replay.png"
    assert (
        cli.main(
            [
                str(path),
                "--set",
                "minSamples=1000",
                "--set",
                "probeIntervalSeconds=0",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    recorded, strict = out.split("replay, minSamples=1000, probeIntervalSeconds=0: ")
    assert "replay, the recorded settings (threshold 2 (0-64), hysteresis 0" in recorded
    moves = len(live_run()[1]) - 1
    assert f"{moves} changes" in recorded and "trial" in recorded
    assert strict.startswith("0 changes")
    assert "threshold of x: 2 -> 6" in out  # the live router's own changes, beside
    assert png.stat().st_size > 20_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "minSamples"], "expected name=value, e.g. minSamples=6"),
        (["--set", "minSample=6"], "no control setting 'minSample'; there are"),
        (["--set", "minSamples=1"], "minSamples: Input should be greater than or equal to 2"),
        (["--pod", "nope"], "no pod 'nope' in the export"),
    ],
)
def test_the_command_line_names_what_is_wrong(
    cli: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(export("a")))
    with pytest.raises(SystemExit) as exited:
        cli.main([str(path), *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
