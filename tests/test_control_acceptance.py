"""What the control law reads from an engine: its step profile (refused when malformed), its
decode step time, and its acceptance, measured while speculating and estimated while off
(router/specgate_router/control/acceptance.py, profile.py)."""

from __future__ import annotations

import pytest

from specgate import contract
from specgate_router import control
from specgate_router.control import AcceptanceTracker, StepProfile

WIRE = {"on": [[1, 0.010], [8, 0.012], [32, 0.020]], "off": [[1, 0.004], [8, 0.006], [32, 0.010]]}


def test_the_chain_formula() -> None:
    assert control.chain_accept_length(0.0, 3) == 1.0
    assert control.chain_accept_length(1.0, 3) == 4.0
    assert control.chain_accept_length(0.5, 3) == pytest.approx(1.875)


def test_a_profile_is_read_and_interpolated() -> None:
    profile = StepProfile.from_wire(WIRE, off_step_tokens=2, num_steps=3)
    assert profile is not None and profile.off_step_tokens == 2
    assert profile.step_seconds(8, True) == pytest.approx(0.012)
    assert profile.step_seconds(20, False) == pytest.approx(0.008)
    assert profile.step_seconds(33, True) is None  # no guessing beyond the profile
    assert profile.top() == 32
    assert StepProfile.from_wire(None) is None


@pytest.mark.parametrize(
    "wire",
    [
        [1, 2],
        {"on": WIRE["on"]},
        {"on": [[1, float("nan")]], "off": WIRE["off"]},
        {"on": [[1, float("inf")]], "off": WIRE["off"]},
        {"on": [[1, -0.01]], "off": WIRE["off"]},
        {"on": [[0, 0.01]], "off": WIRE["off"]},
        {"on": [[1, 0.01], [1, 0.02]], "off": WIRE["off"]},
        {"on": [[1, "0.01"]], "off": WIRE["off"]},
        {"on": [[1, True]], "off": WIRE["off"]},
        {"on": [[b, 0.01] for b in range(1, contract.MAX_PROFILE_POINTS + 2)], "off": WIRE["off"]},
    ],
)
def test_a_malformed_profile_is_refused(wire: object) -> None:
    with pytest.raises(ValueError):
        StepProfile.from_wire(wire)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, "7", None])
def test_malformed_counters_are_refused(bad: object) -> None:
    spec = dict.fromkeys(contract.ACCEPTANCE_COUNTERS, 10.0)
    assert control.counters_from_wire(spec) is not None
    spec["draft_first_agreed"] = bad  # type: ignore[assignment]
    with pytest.raises(ValueError):
        control.counters_from_wire(spec)
    assert control.counters_from_wire({}) is None  # an engine that reports none


def test_the_decode_step_time_comes_from_the_uninterrupted_step_counters() -> None:
    steps, micros = contract.STEP_TIME_COUNTERS
    before, after = {steps: 10, micros: 50_000}, {steps: 30, micros: 250_000}
    assert control.uninterrupted_step_seconds(before, after) == pytest.approx(0.010)
    assert control.uninterrupted_step_seconds({}, after) is None  # an engine without them
    assert control.uninterrupted_step_seconds(after, after) is None  # no such step ran
    assert control.uninterrupted_step_seconds(after, before) is None  # counters went back
    for bad in (float("nan"), float("inf"), -1, "7", True):
        with pytest.raises(ValueError, match=micros):
            control.uninterrupted_step_seconds(before, {steps: 30, micros: bad})


def _counters(**kw: float) -> dict[str, float]:
    return {name: kw.get(name, 0.0) for name in contract.ACCEPTANCE_COUNTERS}


def test_acceptance_is_measured_while_speculating_and_estimated_while_off() -> None:
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3)
    # Speculating: 100 request-steps accepted 150 drafts (tau 2.5); first drafts 70 of 100.
    tracker.update(
        _counters(spec_request_steps=100, spec_accepted_tokens=150, spec_first_agreed=70), 1.0, 3
    )
    assert tracker.current(1.0)[:2] == (2.5, "measured")
    # Speculating alone calibrates nothing: its first-draft rate is not an off step's.
    assert not tracker.calibrated and tracker.calibration == 1.0
    # Off for a while: no measured figure after MEASURED_FRESH_SECONDS, and none estimated
    # before enough proposals (the first of them 19 s after the last speculating step: too late
    # to calibrate against it).
    assert tracker.current(7.0) is None
    base = dict(spec_request_steps=100, spec_accepted_tokens=150, spec_first_agreed=70)
    tracker.update(_counters(**base, draft_first_proposed=40, draft_first_agreed=20), 20.0, 3)
    assert tracker.current(20.0) is None
    tracker.update(_counters(**base, draft_first_proposed=200, draft_first_agreed=100), 21.0, 3)
    tau, source, error = tracker.current(21.0)  # type: ignore[misc]
    assert source == "estimated while off (uncalibrated)" and error == 0.25
    assert tau == pytest.approx(control.chain_accept_length(0.5, 3))
    # Switched on right after: the measured accept length calibrates the estimate it followed.
    on = dict(spec_request_steps=200, spec_accepted_tokens=250, spec_first_agreed=140)
    tracker.update(_counters(**on, draft_first_proposed=200, draft_first_agreed=100), 23.0, 3)
    assert tracker.calibrated
    assert tracker.calibration == pytest.approx(2.0 / control.chain_accept_length(0.5, 3))
    # Much later, a speculating period no longer calibrates against that old estimate.
    before = tracker.calibration
    later = dict(spec_request_steps=400, spec_accepted_tokens=850, spec_first_agreed=300)
    tracker.update(_counters(**later, draft_first_proposed=200, draft_first_agreed=100), 80.0, 3)
    assert tracker.calibration == before


def test_the_estimate_is_calibrated_across_a_switch_from_speculating_to_off() -> None:
    """A real chain accepts less at later positions than the first-position agreement implies:
    speculating at accept length 2.0, then taken off, the agreement while off (0.6) would read
    2.18 uncalibrated. Compared with the accept length measured just before the switch, the
    estimate says 2.0 from the first reading off, not only after the next switch on."""
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3, 1.0)
    tracker.update(_counters(spec_request_steps=100, spec_accepted_tokens=100), 1.0, 3, 1.0)
    assert tracker.current(1.0)[:2] == (pytest.approx(2.0), "measured")
    # 100 request-steps are too few to calibrate with: a pod taken off right after its start.
    early = AcceptanceTracker()
    early.update(_counters(), 0.0, 3, 1.0)
    early.update(_counters(spec_request_steps=100, spec_accepted_tokens=100), 1.0, 3, 1.0)
    agreed = _counters(spec_request_steps=100, spec_accepted_tokens=100,
                       draft_first_proposed=100, draft_first_agreed=60)  # fmt: skip
    early.update(agreed, 3.0, 3, 0.0)
    assert not early.calibrated
    tracker.update(_counters(spec_request_steps=300, spec_accepted_tokens=300), 2.0, 3, 1.0)
    off = dict(spec_request_steps=300, spec_accepted_tokens=300)
    tracker.update(_counters(**off, draft_first_proposed=300, draft_first_agreed=180), 3.0, 3, 0.0)
    assert tracker.calibrated
    tracker.update(_counters(**off, draft_first_proposed=400, draft_first_agreed=240), 9.0, 3, 0.0)
    tau, source, _ = tracker.current(9.0)  # type: ignore[misc]
    assert source == "estimated while off (calibrated)"
    assert tau == pytest.approx(2.0, rel=0.01)
    assert control.chain_accept_length(0.6, 3) == pytest.approx(2.176)


def test_a_switch_off_calibrates_against_the_agreement_pooled_since_it() -> None:
    """The first scrape after a switch off holds a few dozen proposals: 25 of 64 agreed (0.39)
    where the draft agrees 60% of the time. Calibrated against that reading alone, the
    estimate read 2.71 for a workload measured at 2.0, and held it for minutes (the
    calibration's half-life is two minutes): the model then took the pod back to speculation
    every cooldown. The switch off calibrates once CALIBRATING_PROPOSALS have been pooled."""
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3, 1.0)
    tracker.update(_counters(spec_request_steps=300, spec_accepted_tokens=300), 2.0, 3, 1.0)
    off = dict(spec_request_steps=300, spec_accepted_tokens=300)
    tracker.update(_counters(**off, draft_first_proposed=64, draft_first_agreed=25), 2.5, 3, 0.0)
    assert not tracker.calibrated
    proposed, agreed = 64.0, 25.0
    for at in (3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5):
        proposed, agreed = proposed + 64, agreed + 64 * 0.6
        counters = _counters(**off, draft_first_proposed=proposed, draft_first_agreed=agreed)
        tracker.update(counters, at, 3, 0.0)
    pooled = (25 + 3 * 64 * 0.6) / 256  # the first 256 proposals since the switch
    assert tracker.calibrated
    assert tracker.calibration == pytest.approx(2.0 / control.chain_accept_length(pooled, 3))
    tau, _, _ = tracker.current(6.5)  # type: ignore[misc]
    assert tau == pytest.approx(2.0, rel=0.08)
    assert 2.0 / control.chain_accept_length(25 / 64, 3) * 2.176 > 2.7  # the first reading's


def test_an_interval_that_mixed_the_modes_measures_no_accept_length() -> None:
    """A load that straddles the threshold speculates a step here and there among off steps;
    those steps accept more than steady speculation would, and must not read as 'measured'."""
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3, 1.0)
    steady = dict(spec_request_steps=300, spec_accepted_tokens=165)  # tau 1.55
    tracker.update(_counters(**steady), 1.0, 3, 1.0)
    assert tracker.current(1.0)[:2] == (pytest.approx(1.55), "measured")
    # Then mostly off: a few speculating steps accepting 0.75 a step, agreement 40%.
    mixed = dict(spec_request_steps=310, spec_accepted_tokens=172.5)
    for i, at in enumerate((2.0, 3.0, 4.0, 7.0)):
        agreed = dict(draft_first_proposed=100.0 * (i + 1), draft_first_agreed=40.0 * (i + 1))
        tracker.update(_counters(**{**mixed, **agreed}), at, 3, 0.2)
        mixed["spec_request_steps"] += 10
        mixed["spec_accepted_tokens"] += 7.5
    assert tracker.tau == pytest.approx(1.55)  # the mixed intervals did not move it
    tau, source, _ = tracker.current(7.0)  # type: ignore[misc]
    # The agreement while off, calibrated against the steady 1.55 measured just before.
    assert source == "estimated while off (calibrated)"
    assert tau == pytest.approx(1.55)
    # Unknown fractions (an engine that does not count steps per mode) read as steady.
    tracker.update(
        _counters(**mixed, draft_first_proposed=400, draft_first_agreed=160), 8.0, 3, None
    )
    assert tracker.current(8.0)[1] == "measured"  # type: ignore[index]


def test_counters_that_go_backwards_start_over() -> None:
    tracker = AcceptanceTracker()
    tracker.update(_counters(spec_request_steps=100, spec_accepted_tokens=200), 0.0, 3)
    tracker.update(_counters(spec_request_steps=10, spec_accepted_tokens=30), 1.0, 3)
    assert tracker.current(1.0) is None  # a restart: nothing read across it


def test_calibration_waits_for_an_agreement_that_has_settled() -> None:
    """The workload changed a couple of seconds before the pod switched on: the agreement
    readings moved from 0.4 to 0.7 and the smoothed figure still lags. Calibrating the accept
    length measured after the switch against either read the draft 1.35x better (or worse)
    than its chain and kept that for minutes. The switch on does not calibrate; the switch
    back off does, against the first reading after it: the true map (1.0 for a draft that
    accepts alike at every position)."""
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3, 0.0)
    proposed, agreed = 0.0, 0.0
    for t, rate in [(float(t), 0.4) for t in range(1, 11)] + [(11.0, 0.7), (12.0, 0.7)]:
        proposed, agreed = proposed + 300, agreed + 300 * rate
        counters = _counters(draft_first_proposed=proposed, draft_first_agreed=agreed)
        tracker.update(counters, t, 3, 0.0)
    assert tracker.p1_off is not None and tracker.p1_off < 0.65  # lagging
    tau = control.chain_accept_length(0.7, 3)
    steps, accepted = 0.0, 0.0
    for t in (13.0, 14.0):  # a short trial: 300 request-steps
        steps, accepted = steps + 150, accepted + 150 * (tau - 1)
        counters = _counters(draft_first_proposed=proposed, draft_first_agreed=agreed,
                             spec_request_steps=steps, spec_accepted_tokens=accepted)  # fmt: skip
        tracker.update(counters, t, 3, 1.0)
    assert not tracker.calibrated
    proposed, agreed = proposed + 300, agreed + 300 * 0.7
    counters = _counters(draft_first_proposed=proposed, draft_first_agreed=agreed,
                         spec_request_steps=steps, spec_accepted_tokens=accepted)  # fmt: skip
    tracker.update(counters, 15.0, 3, 0.0)
    assert tracker.calibrated and tracker.calibration == pytest.approx(1.0, abs=0.01)


def _speculate(tracker: AcceptanceTracker, start: float, end: float, tau: float,
               counters: dict[str, float]) -> None:  # fmt: skip
    """Steady speculation from `start` to `end`, 128 request-steps a half-second at `tau`."""
    t = start
    while t < end:
        t += 0.5
        counters["spec_request_steps"] += 128
        counters["spec_accepted_tokens"] += 128 * (tau - 1)
        tracker.update(counters, t, 3, 1.0)


def _agree(tracker: AcceptanceTracker, start: float, end: float, p1: float,
           counters: dict[str, float]) -> None:  # fmt: skip
    """Off from `start` to `end`: 128 proposals a half-second, `p1` of them agreeing."""
    t = start
    while t < end:
        t += 0.5
        counters["draft_first_proposed"] += 128
        counters["draft_first_agreed"] += 128 * p1
        tracker.update(counters, t, 3, 0.0)


def test_a_switch_off_calibrates_against_the_accept_length_measured_now() -> None:
    """A minute at accept length 3.5, then the workload's acceptance falls to 2.1 a second
    before the pod is taken off. The smoothed accept length still reads about 3.2; a
    calibration against it read the estimate 50% high for minutes (the calibration's
    half-life is two minutes), and the law took the pod back to speculation every cooldown.
    The switch off calibrates against the accept length of the newest intervals."""
    counters = _counters()
    tracker = AcceptanceTracker()
    tracker.update(counters, 0.0, 3, 1.0)
    _speculate(tracker, 0.0, 60.0, 3.5, counters)
    _speculate(tracker, 60.0, 61.0, 2.1, counters)
    assert tracker.tau is not None and tracker.tau > 3.0  # lagging
    assert tracker.recent_measured()[0] == pytest.approx(2.1)
    _agree(tracker, 61.0, 64.0, 0.55, counters)
    assert tracker.calibrated
    assert tracker.calibration == pytest.approx(2.1 / control.chain_accept_length(0.55, 3))
    _agree(tracker, 64.0, 67.0, 0.55, counters)
    tau, source, _ = tracker.current(67.0)  # type: ignore[misc]
    assert source == "estimated while off (calibrated)" and tau == pytest.approx(2.1, rel=0.03)


def test_the_acceptance_settles_some_seconds_after_a_change_of_workload() -> None:
    """A trial taken while the workload moves reads the move: `settled` holds while the
    accept length measured now lies within the band of the smoothed one, speculating or off,
    and for an engine that reports no acceptance at all."""
    assert AcceptanceTracker().settled(0.0, 0.1)  # nothing reported: nothing moves
    counters = _counters()
    tracker = AcceptanceTracker()
    tracker.update(counters, 0.0, 3, 1.0)
    _speculate(tracker, 0.0, 30.0, 3.5, counters)
    assert tracker.settled(30.0, 0.1)
    _speculate(tracker, 30.0, 32.0, 2.1, counters)
    assert not tracker.settled(32.0, 0.1)
    _speculate(tracker, 32.0, 50.0, 2.1, counters)
    assert tracker.settled(50.0, 0.1)
    # Off: the agreement's latest reading against the smoothed one.
    _agree(tracker, 50.0, 70.0, 0.6, counters)
    assert tracker.settled(70.0, 0.1)
    _agree(tracker, 70.0, 71.0, 0.3, counters)
    assert not tracker.settled(71.0, 0.1)
    assert not tracker.settled(90.0, 0.1)  # nothing recent: not known to hold still


def test_a_calibration_follows_the_comparisons_around_the_last_switch() -> None:
    """Each comparison across a switch counts once, halved every two minutes: the few seconds
    of them around one switch outweigh one made a minute before on another workload, where a
    half-life in time alone let a second-long run of them move the calibration by 1%."""
    tracker = AcceptanceTracker()
    tracker._calibrate(3.0, 0.9, 0.0)  # one comparison: the map read 3.0 / chain(0.9)
    first = tracker.calibration
    assert first == pytest.approx(3.0 / control.chain_accept_length(0.9, 3))
    for i in range(10):  # a minute later, ten scrape intervals of another workload
        tracker._calibrate(2.0, 0.7, 60.0 + 0.5 * i)
    later = 2.0 / control.chain_accept_length(0.7, 3)
    assert abs(tracker.calibration - later) < 0.1 * abs(first - later)


def test_a_comparison_on_another_workload_starts_the_calibration_over() -> None:
    """Comparisons on one workload (agreement 0.95) average; the map from agreement to accept
    length belongs to the workload, so one across a switch on another (agreement 0.70, its
    chain accepting less at later positions) replaces them instead of being outweighed by
    them for minutes: the pod would otherwise flip back to speculation on an estimate 25%
    high after each switch off."""
    tracker = AcceptanceTracker(num_steps=6)
    for at in (0.0, 10.0, 20.0, 30.0):
        tracker._calibrate(5.6, 0.95, at)
    old = 5.6 / control.chain_accept_length(0.95, 6)
    assert tracker.calibration == pytest.approx(old)
    tracker._calibrate(5.9, 0.96, 40.0)  # the same workload, read again: averaged in
    assert old < tracker.calibration < 5.9 / control.chain_accept_length(0.96, 6)
    tracker._calibrate(2.4, 0.70, 70.0)
    assert tracker.calibration == pytest.approx(2.4 / control.chain_accept_length(0.70, 6))
