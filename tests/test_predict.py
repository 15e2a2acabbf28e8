"""The predicted crossover (router/specgate_router/predict.py): the profile read from the wire
and refused when malformed, acceptance measured and estimated, residuals, and the threshold."""

from __future__ import annotations

import dataclasses
import math

import pytest

from specgate import contract
from specgate_router import control, predict
from specgate_router.pods import Scrape
from specgate_router.predict import AcceptanceTracker, Residuals, StepProfile
from specgate_router.settings import ControlSettings
from specgate_sim import profile as profiles

WIRE = {"on": [[1, 0.010], [8, 0.012], [32, 0.020]], "off": [[1, 0.004], [8, 0.006], [32, 0.010]]}


def wire_model(tau: float, source: str = "measured") -> predict.Prediction:
    """WIRE's prediction at accept length `tau` from `source`, bounds 0-64, no residuals."""
    profile = StepProfile.from_wire(WIRE)
    out = predict.predict(profile, (tau, source), None, min_threshold=0, max_threshold=64)
    assert out is not None
    return out


def test_the_chain_formula() -> None:
    assert predict.chain_accept_length(0.0, 3) == 1.0
    assert predict.chain_accept_length(1.0, 3) == 4.0
    assert predict.chain_accept_length(0.5, 3) == pytest.approx(1.875)


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
    assert predict.counters_from_wire(spec) is not None
    spec["draft_first_agreed"] = bad  # type: ignore[assignment]
    with pytest.raises(ValueError):
        predict.counters_from_wire(spec)
    assert predict.counters_from_wire({}) is None  # an engine that reports none


def test_the_decode_step_time_comes_from_the_uninterrupted_step_counters() -> None:
    steps, micros = contract.STEP_TIME_COUNTERS
    before, after = {steps: 10, micros: 50_000}, {steps: 30, micros: 250_000}
    assert predict.uninterrupted_step_seconds(before, after) == pytest.approx(0.010)
    assert predict.uninterrupted_step_seconds({}, after) is None  # an engine without them
    assert predict.uninterrupted_step_seconds(after, after) is None  # no such step ran
    assert predict.uninterrupted_step_seconds(after, before) is None  # counters went back
    for bad in (float("nan"), float("inf"), -1, "7", True):
        with pytest.raises(ValueError, match=micros):
            predict.uninterrupted_step_seconds(before, {steps: 30, micros: bad})


def _counters(**kw: float) -> dict[str, float]:
    return {name: kw.get(name, 0.0) for name in contract.ACCEPTANCE_COUNTERS}


def test_acceptance_is_measured_while_speculating_and_estimated_while_off() -> None:
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3)
    # Speculating: 100 request-steps accepted 150 drafts (tau 2.5); first drafts 70 of 100.
    tracker.update(
        _counters(spec_request_steps=100, spec_accepted_tokens=150, spec_first_agreed=70), 1.0, 3
    )
    assert tracker.current(1.0) == (2.5, "measured")
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
    tau, source = tracker.current(21.0)  # type: ignore[misc]
    assert source == "estimated while off (uncalibrated)"
    assert tau == pytest.approx(predict.chain_accept_length(0.5, 3))
    # Switched on right after: the measured accept length calibrates the estimate it followed.
    on = dict(spec_request_steps=200, spec_accepted_tokens=250, spec_first_agreed=140)
    tracker.update(_counters(**on, draft_first_proposed=200, draft_first_agreed=100), 23.0, 3)
    assert tracker.calibrated
    assert tracker.calibration == pytest.approx(2.0 / predict.chain_accept_length(0.5, 3))
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
    assert tracker.current(1.0) == (pytest.approx(2.0), "measured")
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
    tau, source = tracker.current(9.0)  # type: ignore[misc]
    assert source == "estimated while off (calibrated)"
    assert tau == pytest.approx(2.0, rel=0.01)
    assert predict.chain_accept_length(0.6, 3) == pytest.approx(2.176)


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
    assert tracker.calibration == pytest.approx(2.0 / predict.chain_accept_length(pooled, 3))
    tau, _ = tracker.current(6.5)  # type: ignore[misc]
    assert tau == pytest.approx(2.0, rel=0.08)
    assert 2.0 / predict.chain_accept_length(25 / 64, 3) * 2.176 > 2.7  # the first reading's


def test_an_interval_that_mixed_the_modes_measures_no_accept_length() -> None:
    """A load that straddles the threshold speculates a step here and there among off steps;
    those steps accept more than steady speculation would, and must not read as 'measured'."""
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3, 1.0)
    steady = dict(spec_request_steps=300, spec_accepted_tokens=165)  # tau 1.55
    tracker.update(_counters(**steady), 1.0, 3, 1.0)
    assert tracker.current(1.0) == (pytest.approx(1.55), "measured")
    # Then mostly off: a few speculating steps accepting 0.75 a step, agreement 40%.
    mixed = dict(spec_request_steps=310, spec_accepted_tokens=172.5)
    for i, at in enumerate((2.0, 3.0, 4.0, 7.0)):
        agreed = dict(draft_first_proposed=100.0 * (i + 1), draft_first_agreed=40.0 * (i + 1))
        tracker.update(_counters(**{**mixed, **agreed}), at, 3, 0.2)
        mixed["spec_request_steps"] += 10
        mixed["spec_accepted_tokens"] += 7.5
    assert tracker.tau == pytest.approx(1.55)  # the mixed intervals did not move it
    tau, source = tracker.current(7.0)  # type: ignore[misc]
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


H200 = profiles.load("h200-3b-synthetic-deployed")
RTX = profiles.load("rtx-pro-6000-x8")


@pytest.mark.parametrize(("prof", "rate"), [(RTX, 0.5), (RTX, 0.8), (RTX, 0.99), (H200, 0.6)])
def test_the_prediction_is_the_profile_crossover(prof: profiles.Profile, rate: float) -> None:
    """Against the simulator's own analytic rates: the largest batch where speculating gives
    each request at least what plain decoding does."""
    wire = prof.step_profile(1, 128)
    profile = StepProfile.from_wire(wire, num_steps=prof.num_steps)
    tau = predict.chain_accept_length(rate, prof.num_steps)
    got = predict.predict(profile, (tau, "measured"), None, min_threshold=0, max_threshold=128)
    assert got is not None and got.confident
    per_batch = [
        b
        for b in range(1, 129)
        if tau / prof.step_time(b, True) >= 1 / prof.step_time(b, False)
        and profile.step_seconds(b, True) is not None  # type: ignore[union-attr]
    ]
    # The profile samples CUDA-graph batch sizes: interpolation may move the crossover by
    # the gap between two of them.
    expected = max(per_batch, default=0)
    assert abs(got.threshold - expected) <= max(2, expected // 4), (got.threshold, expected)
    assert predict.predict(profile, None, None, min_threshold=0, max_threshold=64) is None


def test_bounds_and_the_profiles_top() -> None:
    profile = StepProfile.from_wire(H200.step_profile(1, 32))
    high = predict.predict(profile, (4.0, "measured"), None, min_threshold=0, max_threshold=64)
    assert high is not None and high.threshold == 32  # pays at the top: stops there
    assert "largest batch, 32" in high.why
    low = predict.predict(profile, (1.0, "measured"), None, min_threshold=2, max_threshold=64)
    assert low is not None and low.threshold == 2  # pays nowhere: the resource's minimum


def test_residuals_correct_a_steady_bias_and_flag_a_wrong_model() -> None:
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    slower = Residuals()
    for i in range(10):  # every step takes 10% longer than profiled, in both modes
        for mode in (True, False):
            seconds = profile.step_seconds(8, mode) * 1.1  # type: ignore[operator]
            slower.add(batch=8, speculating=mode, step_seconds=seconds, profile=profile, at=i)
    assert slower.modes[True].factor() == pytest.approx(1 / 1.1)
    got = predict.predict(profile, (2.0, "measured"), slower, min_threshold=0, max_threshold=32)
    assert got is not None and got.confident and got.correction[0] == pytest.approx(1 / 1.1)
    wrong = Residuals()
    for i in range(10):  # speculating steps three times the profile: the model is wrong
        seconds = profile.step_seconds(8, True) * 3  # type: ignore[operator]
        wrong.add(batch=8, speculating=True, step_seconds=seconds, profile=profile, at=i)
    got = predict.predict(profile, (2.0, "measured"), wrong, min_threshold=0, max_threshold=32)
    assert got is not None and not got.confident
    assert "samples disagree" in got.why


def test_a_mode_without_samples_takes_the_others_correction() -> None:
    """A busy host slows both modes: the prediction's ratio does not move on one mode's
    samples alone."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    residuals = Residuals()
    for i in range(5):
        seconds = profile.step_seconds(8, False) * 1.25  # type: ignore[operator]
        residuals.add(batch=8, speculating=False, step_seconds=seconds, profile=profile, at=i)
    got = predict.predict(profile, (2.0, "measured"), residuals, min_threshold=0, max_threshold=32)
    plain = predict.predict(profile, (2.0, "measured"), None, min_threshold=0, max_threshold=32)
    assert got is not None and plain is not None
    assert got.threshold == plain.threshold
    assert got.ratio(8) == pytest.approx(plain.ratio(8))  # type: ignore[arg-type]
    assert math.isclose(got.correction[0], got.correction[1])


# Speculating steps grow with the batch while off steps stay flat: with accept length 2, the
# modes cross between batch 14 (speculation 1.5% ahead) and 15 (plain 4% ahead).
NEAR = {
    "on": [[1, 0.012], [8, 0.015], [14, 0.0197], [15, 0.0208], [16, 0.0215], [32, 0.04]],
    "off": [[1, 0.010], [8, 0.010], [14, 0.010], [15, 0.010], [16, 0.010], [32, 0.010]],
}


def _follow(current: int, batch: float, moved: int = 0) -> control.Decision:
    profile = StepProfile.from_wire(NEAR)
    got = predict.predict(profile, (2.0, "measured"), None, min_threshold=0, max_threshold=64)
    assert got is not None and got.confident and got.threshold == 14
    params = ControlSettings(threshold=8, max_threshold=64, hysteresis=2, cooldown_seconds=30)
    previous = control.Decision(threshold=current, reason="", changed_at=0.0, moved=moved)
    own = [control.Sample(at=999.0, batch=batch, tokens_per_second=1.0, speculating_fraction=1.0)]
    return control.decide(
        samples=own, previous=previous, now=1000.0, fresh=True, params=params, own=own,
        prediction=got,
    )  # fmt: skip


def test_a_move_within_hysteresis_that_flips_the_mode_at_the_load_is_made() -> None:
    """The load sits at batch 16 and the crossover moves to 14 under a threshold of 16: the
    pod speculates where plain decoding is predicted 7% faster. Hysteresis (2) must not keep it
    there; the switch margin decides."""
    moved = _follow(current=16, batch=15.8)
    assert moved.threshold == 14, moved.reason


def test_a_move_within_hysteresis_that_changes_nothing_at_the_load_waits() -> None:
    """The same crossover with the load at batch 6: both thresholds speculate there, and the
    move would buy nothing now."""
    held = _follow(current=16, batch=6.0)
    assert held.threshold == 16 and "within hysteresis" in held.reason


def test_a_flip_at_the_load_smaller_than_the_margin_waits() -> None:
    """At batch 15 plain is predicted 4% ahead (past the 3% margin), at 14.6 about 1%: the
    second must not switch a stationary load on noise."""
    assert _follow(current=16, batch=15.0).threshold == 14
    held = _follow(current=16, batch=14.6)
    assert held.threshold == 16 and "differ by" in held.reason, held.reason


def test_a_placed_threshold_far_from_the_load_holds() -> None:
    """With the threshold placed by the model at 100 and the load at batch 6, a crossover
    moving to 14 changes no mode the pod runs: no push (on a GPU, step corrections wiggling
    by 3% moved a crossover near 100 five times in a minute at one request). The first
    placement still moves, and so does the same move once the load reaches the band."""
    held = _follow(current=100, batch=6.0, moved=1)
    assert held.threshold == 100 and "changes no mode" in held.reason, held.reason
    assert _follow(current=100, batch=6.0).threshold == 14
    assert _follow(current=100, batch=50.0, moved=1).threshold == 14


def _moments(at: float, steps: float, micros: float, tokens: float) -> Scrape:
    """A scrape of a pod at batch 8 whose decode moments read `steps` steps in `micros` of
    launch-to-launch cycles and `tokens` generated."""
    from specgate.engine_client import EngineLoad

    load = EngineLoad(running=8, waiting=0, max_running=64, decode_steps=steps,
                      decode_step_us=micros, decode_tokens=tokens)  # fmt: skip
    return Scrape(at, load)


def test_the_share_of_time_outside_decode_steps_comes_from_the_decode_moments() -> None:
    from specgate_router.pods import outside_steps

    def scrape(at: float, steps: float, micros: float) -> Scrape:
        return _moments(at, steps, micros, 8 * steps)

    # 100 decode cycles in 0.5 s, each step 2 ms on its own: 60% of the time is elsewhere.
    a, b = scrape(0.0, 1000, 5e6), scrape(1.0, 1100, 5.5e6)
    assert outside_steps(a, b, 0.002) == pytest.approx(0.6)
    assert outside_steps(a, b, 0.009) == 0.0  # steps slower than their cycles: none elsewhere
    assert outside_steps(b, a, 0.002) is None  # counters went back
    assert outside_steps(a, a, 0.002) is None  # no step ran


def test_time_between_steps_comes_from_the_decode_moments() -> None:
    from specgate_router.pods import between_steps

    scrape = _moments

    # 100 steps in 0.6 s of launch intervals, each step 4 ms on its own: 0.2 s between steps,
    # over 800 tokens.
    a, b = scrape(0.0, 1000, 5e6, 8000), scrape(1.0, 1100, 5.6e6, 8800)
    assert between_steps(a, b, 0.004) == pytest.approx(0.2 / 800)
    assert between_steps(a, b, 0.007) == 0.0  # steps slower than their intervals: none between
    assert between_steps(b, a, 0.004) is None  # counters went back
    # Never more than the interval itself (a stale moment spanning idle time).
    c = scrape(1.0, 1100, 5e6 + 3e6, 8800)
    assert between_steps(a, c, 0.004) == pytest.approx((1.0) / 800)
    # Shown per mode, as measured; hostile or broken figures are dropped.
    residuals = Residuals()
    for at in (1.0, 1.5, 2.0):
        residuals.add_between(speculating=True, seconds_per_token=60e-6, at=at)
    residuals.add_between(speculating=False, seconds_per_token=float("nan"), at=2.0)
    residuals.add_between(speculating=False, seconds_per_token=-1.0, at=2.0)
    assert residuals.between_view() == {"on": pytest.approx(60.0), "off": None}


def test_samples_of_another_workload_are_not_compared() -> None:
    """Delivered rates compare only at the accept length they were taken at (within 10%): the
    seconds after an acceptance step still run requests of the old workload."""
    samples = [
        control.Sample(1.0, 16, 16 * 200.0, 1.0, accept_length=1.9),  # just after the step
        control.Sample(2.0, 16, 16 * 150.0, 1.0, accept_length=1.6),
        control.Sample(3.0, 16, 16 * 190.0, 0.0, accept_length=1.62),
        control.Sample(4.0, 16, 16 * 190.0, 0.0, accept_length=None),  # unknown: not compared
    ]
    rates = control.rates_per_request(samples, batch=16, since=0.0, accept_length=1.6)
    assert rates[True] == (pytest.approx(150.0), 1)
    assert rates[False] == (pytest.approx(190.0), 1)
    everything = control.rates_per_request(samples, batch=16, since=0.0)
    assert everything[True] == (pytest.approx(175.0), 2) and everything[False][1] == 2


def test_a_pod_near_the_predicted_crossover_measures_the_other_mode_and_keeps_the_better() -> None:
    """WIRE at tau 2.2 predicts speculation 1.1x faster at batch 16 (threshold 32). The pod
    holds 16 speculating; it measures plain for a few scrapes, plain delivers 1.5x, it keeps
    plain, and the model's unchanged word does not take it back, even once the samples that
    showed it have aged out; another workload's model does."""
    params = ControlSettings()
    profile = StepProfile.from_wire(WIRE)
    prediction = predict.predict(
        profile, (2.2, "measured"), None, min_threshold=0, max_threshold=64
    )
    assert prediction is not None and prediction.threshold == 32
    assert prediction.ratio(16) == pytest.approx(1.1)
    own = [control.Sample(0.5 * i, 16, 1600.0, 1.0, accept_length=2.2) for i in range(1, 81)]
    previous = control.Decision(32, "predicted", 0.0)

    def decide(now: float, samples: list[control.Sample]) -> control.Decision:
        return control.decide(
            samples=samples,
            previous=previous,
            now=now,
            fresh=True,
            params=params,
            own=samples,
            prediction=prediction,
        )

    previous = decide(40.0, own)
    assert previous.probe is not None and previous.probe.measuring, previous.reason
    assert previous.threshold is not None and previous.threshold < 16
    assert "measuring plain decoding at batch 16" in previous.reason
    own += [control.Sample(40.0 + 0.5 * i, 16, 2400.0, 0.0, accept_length=2.2) for i in range(1, 7)]
    previous = decide(43.0, own)
    # Back to speculation to measure it again: the trial is judged against it either side.
    assert previous.probe is not None and previous.probe.returned == 43.0, previous.reason
    assert previous.threshold == 32 and "measuring speculation again" in previous.reason
    own += [control.Sample(43.0 + 0.5 * i, 16, 1600.0, 1.0, accept_length=2.2) for i in range(1, 8)]
    previous = decide(46.5, own)
    assert previous.probe is None and previous.threshold is not None and previous.threshold < 16
    assert "1.50x; keeping it" in previous.reason
    plain = [control.Sample(47.0 + 0.5 * i, 16, 2400.0, 0.0, accept_length=2.2) for i in range(75)]
    previous = decide(80.0, plain)  # the speculating samples are gone; the model still says 32
    assert previous.threshold is not None and previous.threshold < 16, previous.reason
    assert "measured at batch 16: plain decoding delivers 1.50x" in previous.reason
    assert previous.probe is None  # measured on this workload at this batch: no second probe
    # The batch reads a little higher: the threshold already runs plain across its band, and
    # following the reading to the band's new edge would change no mode.
    higher = [dataclasses.replace(s, batch=16.8) for s in plain]
    held = decide(85.0, higher)
    assert held.threshold == previous.threshold and "holding" in held.reason, held.reason
    # Another workload (accept length 3): the measurement no longer speaks for it.
    faster = predict.predict(profile, (3.0, "measured"), None, min_threshold=0, max_threshold=64)
    assert faster is not None
    moved = control.decide(
        samples=plain, previous=previous, now=80.0, fresh=True, params=params, own=plain,
        prediction=faster,
    )  # fmt: skip
    assert moved.threshold == faster.threshold, moved.reason


def test_a_margin_from_decode_steps_that_take_little_of_the_time_is_measured() -> None:
    """At accept length 3 the model puts speculation 1.5x ahead at batch 16: enough to hold
    without measuring where decode steps are the pod's time, not where prefills take a
    quarter of it, where the other mode could spend less of the rest (on the H200 at 128
    streams of short requests the profile alone put plain 1.7x ahead and speculation
    delivered 1.1-1.2x). Nor where the pod's rates swing too much for a probe to measure."""
    params = ControlSettings()
    prediction = wire_model(3.0)
    assert prediction.threshold == 32 and prediction.ratio(16) == pytest.approx(1.5)

    def decide(outside: float | None, swing: float = 0.0) -> control.Decision:
        own = [
            control.Sample(0.5 * i, 16, 1600.0 * (1 + swing * (-1) ** (i // 4)), 1.0,
                           accept_length=3.0, outside_steps=outside)
            for i in range(1, 81)
        ]  # fmt: skip
        return control.decide(
            samples=own, previous=control.Decision(32, "predicted", 0.0), now=40.0, fresh=True,
            params=params, own=own, prediction=prediction,
        )  # fmt: skip

    # 1.5 x (1 - s) + 0.5 x s: the other mode spends at least half as much outside its steps.
    for held in (decide(None), decide(0.05), decide(0.15)):
        assert held.probe is None and held.threshold == 32, held.reason
    measuring = decide(0.25)
    assert measuring.probe is not None and measuring.probe.measuring, measuring.reason
    assert measuring.threshold is not None and measuring.threshold < 16
    assert "1.50x faster there from decode steps that take 75% of the pod's time" in (
        measuring.reason
    )
    noisy = decide(0.6, swing=0.5)  # rates 800 and 2400 in runs of four scrapes
    assert noisy.probe is None and noisy.threshold == 32, noisy.reason


def test_a_probe_of_a_mode_that_yields_no_samples_ends_early_and_holds_nothing_back() -> None:
    """A prefill-bound pod measuring speculation whose decode steps then come further apart
    than its scrapes yields no samples of it: the probe ends after twice the scrapes a verdict
    needs (4 s), not after 20 s in a mode that may be the slower, and the model's cooldown
    runs from the pod's last change before the probe, not from the probe's switches."""
    params, prediction, own, started = _measuring_plain_at_16(changed_at=3.0)
    assert started.probe is not None and started.probe.held_since == 3.0

    def at(now: float) -> control.Decision:
        return control.decide(
            samples=own, previous=started, now=now, fresh=True, params=params, own=own,
            prediction=prediction,
        )  # fmt: skip

    waiting = at(42.0)
    assert waiting.probe is not None and "0 samples" in waiting.reason, waiting.reason
    ended = at(44.0)
    assert ended.probe is None and ended.threshold == 32, ended.reason
    assert "inconclusive" in ended.reason and ended.changed_at == 3.0


def test_a_probe_that_measures_the_accept_length_still_compares_with_the_samples_before() -> None:
    """A pod runs plain at batch 6 on an estimate while off of accept length 1.8 that is too
    low (the draft accepts less further along the chain than the first position implies, or
    more): WIRE predicts plain 1.17x faster there, so it measures speculation. The probe
    measures 2.6, and the estimate is calibrated to it; the plain samples before the probe
    carry 1.8 but are the same workload's, and the verdict compares with them (it once read
    "inconclusive, 0 before" and went back to plain for a cooldown)."""
    params = ControlSettings()
    model = wire_model

    guessed = model(1.8, "estimated while off (uncalibrated)")
    assert guessed.ratio(6) == pytest.approx(0.855, abs=0.01) and guessed.threshold < 6
    own = [control.Sample(0.5 * i, 6, 6 * 166.0, 0.0, accept_length=1.8) for i in range(1, 81)]
    previous = control.Decision(guessed.threshold, "predicted", 0.0)

    def decide(now: float, prediction: predict.Prediction) -> control.Decision:
        return control.decide(
            samples=own, previous=previous, now=now, fresh=True, params=params, own=own,
            prediction=prediction,
        )  # fmt: skip

    previous = decide(40.0, guessed)
    assert previous.probe is not None and previous.probe.measuring, previous.reason
    assert "measuring speculation at batch 6" in previous.reason
    own += [
        control.Sample(40.0 + 0.5 * i, 6, 6 * 250.0, 1.0, accept_length=2.6) for i in range(1, 7)
    ]
    measured = model(2.6, "measured")
    previous = decide(43.0, measured)
    assert "measuring plain decoding again" in previous.reason, previous.reason
    own += [
        control.Sample(43.0 + 0.5 * i, 6, 6 * 166.0, 0.0, accept_length=2.6) for i in range(1, 8)
    ]
    previous = decide(46.5, model(2.6, "estimated while off (calibrated)"))
    assert "measured speculation at batch 6: 1.51x; keeping it" in previous.reason, previous.reason
    assert previous.threshold is not None and previous.threshold >= 6


def test_a_host_that_slows_down_is_not_read_as_a_mode_gain() -> None:
    """A pod ran speculation, then plain, while its host slowed to half its speed: the earlier
    samples read faster though plain is 1.25x faster at any one moment. Only a comparison with the
    first mode again on both sides (a bracket) speaks, and it names plain."""

    def at(t: float, speculating: bool) -> control.Sample:
        speed = 1.0 - 0.5 * t / 60  # the host slows to half its speed over the minute
        rate = 150.0 * speed * (1.0 if speculating else 1.25)
        return control.Sample(t, 16, 16 * rate, float(speculating), accept_length=1.6)

    spec_then_plain = [at(t, True) for t in range(0, 15)] + [at(t, False) for t in range(15, 60)]
    naive = control.rates_per_request(spec_then_plain, batch=16, since=0.0, accept_length=1.6)
    assert naive[True][0] > naive[False][0]  # what an unbracketed comparison reads
    kw = {"batch": 16, "since": 0.0, "accept_length": 1.6, "need": 4}
    assert control.bracketed_gain(spec_then_plain, **kw) is None  # no bracket: no verdict
    bracket = spec_then_plain + [at(t, True) for t in range(60, 66)]
    better, gain = control.bracketed_gain(bracket, **kw) or (None, 0.0)
    assert better is False and gain > 1.1
    # Too few samples on one side, another workload's, or mixed intervals do not bracket.
    short = spec_then_plain + [at(t, True) for t in range(60, 62)]
    assert control.bracketed_gain(short, **kw) is None
    other = [dataclasses.replace(s, accept_length=2.4) for s in bracket[-6:]]
    assert control.bracketed_gain(spec_then_plain + other, **kw) is None
    mixed = [dataclasses.replace(s, speculating_fraction=0.5) for s in bracket[-6:]]
    assert control.bracketed_gain(spec_then_plain + mixed, **kw) is None


def test_bracketed_runs_within_their_own_noise_say_nothing() -> None:
    """Speculation, plain, speculation, four scrapes each: plain's scrapes swing 1000/2000
    (prompts of a thousand tokens landing in some half-seconds and not others), a mean 1.25x
    speculation's that two standard errors of those scrapes cover. It once moved a pod to plain
    on a prefill-bound load where neither mode led. Steady scrapes at the same mean speak."""

    def runs(plain: list[float]) -> list[control.Sample]:
        modes = [(True, [1200.0] * 4), (False, plain), (True, [1200.0] * 4)]
        rates = [(speculating, r) for speculating, rs in modes for r in rs]
        return [
            control.Sample(0.5 * i, 16, 16 * r, float(speculating), accept_length=2.0)
            for i, (speculating, r) in enumerate(rates)
        ]

    kw = {"batch": 16, "since": 0.0, "accept_length": 2.0, "need": 4}
    assert control.bracketed_gain(runs([1000.0, 2000.0] * 2), **kw) is None
    better, gain = control.bracketed_gain(runs([1500.0] * 4), **kw) or (None, 0.0)
    assert better is False and gain == pytest.approx(1.25)


def test_residuals_of_the_two_modes_compare_only_when_measured_together() -> None:
    """Speculating steps measured 20% slower than the profile, then a minute later plain ones
    30% slower (the host slowed meanwhile): the modes' difference is drift, so both take the
    newer factor; measured within seconds of each other, the difference stands."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None

    def corrections(off_at: float) -> tuple[float, float]:
        residuals = Residuals()
        for at in (0.0, 1.0, 2.0):
            residuals.add(batch=8, speculating=True, step_seconds=0.012 / 0.8, profile=profile,
                          at=at)  # fmt: skip
        for at in (off_at, off_at + 1, off_at + 2):
            residuals.add(batch=8, speculating=False, step_seconds=0.006 / 0.7, profile=profile,
                          at=at)  # fmt: skip
        model = predict.predict(
            profile, (2.0, "measured"), residuals, min_threshold=0, max_threshold=32
        )
        assert model is not None
        return model.correction

    assert corrections(60.0) == (pytest.approx(0.7), pytest.approx(0.7))
    assert corrections(3.0) == (pytest.approx(0.8), pytest.approx(0.7))


def test_a_difference_measured_together_outlasts_the_next_drift() -> None:
    """The profile errs between the modes (speculating steps 20% slower than it says, plain
    ones 30%, measured within seconds of each other). A minute later only plain steps are
    measured, on a host that has slowed further: the newer factor stands for both modes'
    speed, and the difference learnt together still stands between them. Taking the newer
    factor for both instead read the modes 14% closer than they are and moved the crossover
    (control_random.py found engines where that decided the mode)."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None

    def measured(
        residuals: Residuals, speculating: bool, speed: float, times: tuple[float, ...]
    ) -> Residuals:
        """Decode steps at batch 8 running at `speed` of the profile's, at `times`."""
        step = 0.012 if speculating else 0.006
        for at in times:
            residuals.add(batch=8, speculating=speculating, step_seconds=step / speed,
                          profile=profile, at=at)  # fmt: skip
        return residuals

    residuals = measured(Residuals(), True, 0.8, (0.0, 1.0, 2.0))
    measured(residuals, False, 0.7, (3.0, 4.0, 5.0))
    assert residuals.corrections() == (pytest.approx(0.8), pytest.approx(0.7))
    measured(residuals, False, 0.6, (60.0, 61.0, 62.0, 63.0))
    on_f, off_f = residuals.corrections()
    assert 0.6 <= off_f < 0.65  # mostly the new measurements
    assert on_f / off_f == pytest.approx(0.8 / 0.7)
    # Never measured together: no difference is known, both take the newer factor.
    apart = measured(Residuals(), True, 0.8, (0.0, 1.0, 2.0))
    measured(apart, False, 0.6, (60.0, 61.0, 62.0))
    assert apart.corrections() == (pytest.approx(0.6), pytest.approx(0.6))


def test_where_speculation_pays_in_one_band_the_threshold_follows_the_load() -> None:
    """Four-token off steps on an engine whose fixed step costs dominate: plain decoding
    delivers more at small batches, speculation at large ones. A threshold keeps only the
    batches at or under it speculating, so the right one depends on the load: 0 at batch 1
    (it once read "pays up to batch 64" there and ran the slower mode), the top at batch 48."""
    wire = {"on": [[1, 0.0064], [8, 0.0071], [64, 0.0106]],
            "off": [[1, 0.0056], [8, 0.0084], [64, 0.0239]]}  # fmt: skip
    profile = StepProfile.from_wire(wire, off_step_tokens=4, num_steps=4)
    assert profile is not None

    def threshold(batch: float | None) -> predict.Prediction:
        out = predict.predict(
            profile, (3.46, "measured"), None, min_threshold=0, max_threshold=256, batch=batch
        )
        assert out is not None
        return out

    small = threshold(1)
    assert small.ratio(1) is not None and small.ratio(1) < 1  # type: ignore[operator]
    assert small.threshold == 0 and "it pays from batch" in small.why, small.why
    assert threshold(3).threshold == 0
    large = threshold(48)
    assert large.threshold == 64 and "from batch" in large.why, large.why
    assert threshold(None).threshold == 64  # idle: the largest batch where it pays
    # WIRE at accept length 2.2 pays from batch 5 to 32: at any batch from 5 up, the
    # threshold is 32.
    plain = StepProfile.from_wire(WIRE)
    assert plain is not None
    crossover = {
        predict.predict(plain, (2.2, "measured"), None, min_threshold=0, max_threshold=64,
                        batch=b).threshold  # type: ignore[union-attr]
        for b in (None, 5, 16, 31, 32, 33, 64)
    }  # fmt: skip
    assert crossover == {32}


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
    tau = predict.chain_accept_length(0.7, 3)
    steps, accepted = 0.0, 0.0
    for t in (13.0, 14.0):  # a short measuring probe: 300 request-steps
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


def _measuring_plain_at_16(
    changed_at: float = 0.0,
    speculating_rate: float = 1600.0,
    tau: float = 2.2,
    outside: float | None = None,
) -> tuple[ControlSettings, predict.Prediction, list[control.Sample], control.Decision]:
    """WIRE at accept length `tau` (2.2: speculation 1.1x at batch 16), a pod that held 16
    speculating for 40 s at `speculating_rate` tok/s, spending a share `outside` of its time
    outside decode steps, and last changed mode at `changed_at`: it starts measuring plain
    decoding."""
    params = ControlSettings()
    prediction = wire_model(tau)
    own = [
        control.Sample(0.5 * i, 16, speculating_rate, 1.0, accept_length=tau, outside_steps=outside)
        for i in range(1, 81)
    ]
    started = control.decide(
        samples=own, previous=control.Decision(32, "predicted", changed_at), now=40.0,
        fresh=True, params=params, own=own, prediction=prediction,
    )  # fmt: skip
    assert started.probe is not None and started.probe.measuring, started.reason
    return params, prediction, own, started


def _run_measuring_plain_at_16(
    plain_rates: list[float],
    plain_batches: list[int] | None = None,
    speculating_before: float = 1600.0,
    then: float = 0.0,
    back_batches: list[int] | None = None,
    tau: float = 2.2,
    tau_after: float | None = None,
    outside: float | None = None,
) -> list[control.Decision]:
    """Drive `_measuring_plain_at_16` scrape by scrape until its probe ends, and `then`
    seconds more: speculation delivers 1600 tok/s at batch 16 (`speculating_before` until
    the probe; at the next of `back_batches` after it), plain decoding the next of
    `plain_rates` each scrape it runs plain (cycled), at the next of `plain_batches` (the
    last of either repeated; 16 without). With `tau_after`, the accept length moves there
    once the probe ended, and speculation's rate with it. `outside`: the share of the pod's
    time outside decode steps that every sample reports."""
    batches = plain_batches or [16]
    back = back_batches or [16]
    params, prediction, own, previous = _measuring_plain_at_16(
        speculating_rate=speculating_before, tau=tau, outside=outside
    )
    decisions = [previous]
    plain = 0
    now, ended = 40.0, math.inf
    while (previous.probe is not None and now < 80.0) or now < ended + then:
        now += params.scrape_interval_seconds
        speculating = previous.threshold is not None and previous.threshold >= 16
        rate = 1600.0 if speculating else plain_rates[plain % len(plain_rates)]
        n_back = len(decisions) - 1 - plain  # speculating scrapes since the probe started
        batch = (
            back[min(n_back, len(back) - 1)]
            if speculating
            else batches[min(plain, len(batches) - 1)]
        )
        plain += not speculating
        if tau_after is not None and not math.isinf(ended):
            prediction = wire_model(tau_after)
            rate *= tau_after / tau if speculating else 1.0
        accept = prediction.tau
        own.append(
            control.Sample(
                now, batch, rate, float(speculating), accept_length=accept, outside_steps=outside
            )
        )
        previous = control.decide(
            samples=own, previous=previous, now=now, fresh=True, params=params, own=own,
            prediction=prediction,
        )  # fmt: skip
        decisions.append(previous)
        if previous.probe is None and math.isinf(ended):
            ended = now
    assert previous.probe is None, previous.reason
    return decisions


def test_a_measuring_probe_within_its_scrapes_noise_runs_another_round() -> None:
    """Plain decoding reads 1.06x speculation over a trial whose scrapes swing 2200/1200 (on
    the H200 at 32 streams, three seconds of one mode's scrapes swing by 10%, and such a
    reading once kept the slower mode for the whole hold): not a verdict but another round,
    pooled with the first. Steady scrapes give one in a round."""
    noisy = _run_measuring_plain_at_16([2200.0, 1200.0, 2200.0, 1200.0] + [1500.0] * 20)
    reasons = [d.reason for d in noisy]
    again = [r for r in reasons if "within its scrapes' noise" in r]
    assert again and "1.06x" in again[0] and "measuring plain decoding again" in again[0], reasons
    # Round two reads 1500, level with speculation, but pooled with round one's swing the
    # reading (0.98x) still cannot tell the margin from noise: a third round, then back to
    # speculation, and no mode named.
    assert "0.98x over 3 rounds, within its scrapes' noise" in reasons[-1], reasons[-1]
    assert reasons[-1].endswith("back to 32") and noisy[-1].threshold == 32
    assert noisy[-1].measured is not None and noisy[-1].measured.better is None
    steady = _run_measuring_plain_at_16([1760.0])
    assert "1.10x; keeping it" in steady[-1].reason, [d.reason for d in steady]
    assert steady[-1].measured is not None and steady[-1].measured.better is False
    # Steady scrapes within the margin tell the modes level in one round.
    level = _run_measuring_plain_at_16([1616.0])
    assert level[-1].reason.endswith("1.01x; back to 32"), [d.reason for d in level]
    assert level[-1].measured is not None and level[-1].measured.better is None
    # Noise that no round settles: after the third, no mode is named, and the pod goes back to
    # the one the model chose.
    endless = _run_measuring_plain_at_16([2300.0, 1100.0, 2300.0, 1100.0, 2300.0])
    last = endless[-1]
    assert "over 3 rounds, within its scrapes' noise" in last.reason, last.reason
    assert last.reason.endswith("back to 32") and last.threshold == 32
    assert last.measured is not None and last.measured.better is None
    assert len([d for d in endless if "measuring plain decoding again" in d.reason]) == 2
    # Where the model's modes run within the margin of each other (accept length 2.05: 1.025x),
    # it names none either, and the reading decides by the margin.
    flat = _run_measuring_plain_at_16([2300.0, 1100.0, 2300.0, 1100.0, 2300.0], tau=2.05)[-1]
    within = f"where the model's modes run within {control.PROBE_MARGIN:.0%}; keeping it"
    assert within in flat.reason, flat.reason
    assert flat.measured is not None and flat.measured.better is False


def test_a_noisy_reading_names_no_mode_even_where_prefills_take_most_of_the_time() -> None:
    """The reading of `endless` above (plain decoding 1.12x over three rounds, within its
    scrapes' noise of 10%), where the pod spends 80% of its time outside decode steps: the
    model's 1.1x for speculation covers a fifth of the pod's time, yet a reading that noisy
    named the slower mode more often than the model did on engines nobody tuned for
    (BENCHMARKS.md, section 0). The pod goes back to speculation, and no mode is named."""
    rates = [2300.0, 1100.0, 2300.0, 1100.0, 2300.0]
    prefill_bound = _run_measuring_plain_at_16(rates, outside=0.8)[-1]
    assert "over 3 rounds, within its scrapes' noise" in prefill_bound.reason
    assert prefill_bound.reason.endswith("back to 32"), prefill_bound.reason
    assert prefill_bound.measured is not None and prefill_bound.measured.better is None


def test_a_verdict_holds_across_a_small_acceptance_move_scaled_by_it() -> None:
    """Plain decoding reads 1.02x speculation at batch 16, within the margin: no mode named,
    and the pod goes back to speculation, which the model prefers (1.1x). The accept length
    then falls 8%, within what counts as the same workload, so the verdict still holds there;
    speculation's rate falls with it, and plain now leads by 11%. The model, which puts
    speculation 1.01x ahead at the new accept length, would keep it: the verdict, scaled by
    the accept length's move beyond a steady workload's 3% swing (1.07x), names plain
    decoding. It once held the pod speculating at such a batch as long as the verdict stood."""
    decisions = _run_measuring_plain_at_16([1632.0], then=60.0, tau_after=2.03)
    reasons = [d.reason for d in decisions]
    verdict = next(i for i, r in enumerate(reasons) if "1.02x; back to 32" in r)
    assert decisions[verdict].measured is not None
    assert decisions[verdict].measured.better is None, reasons[verdict]
    moved = next(i for i, r in enumerate(reasons) if i > verdict and "measured at batch 16" in r)
    assert "plain decoding delivers 1.07x" in reasons[moved], reasons[verdict:]
    # And it stays there: a stationary load sees one switch.
    after = [d.threshold for d in decisions[moved:]]
    assert all(t is not None and t < 16 for t in after), reasons[moved:]
    # Without the move, the reading within the margin leaves the pod speculating.
    steady = _run_measuring_plain_at_16([1632.0], then=20.0)
    assert steady[-1].threshold == 32, steady[-1].reason


def test_a_verdict_is_scaled_only_from_an_accept_length_measured_on_its_workload() -> None:
    """Speculation measured level with plain decoding at accept length 2.0, measured, and 2.5
    estimated while off when the probe began (the estimate runs high on this workload)."""
    verdict = control.Measurement(100.0, 2.0, 16, 1.0, also=2.5, measured=(True, False))
    assert verdict.reading() == (None, 1.0)
    # Measured 9.5% higher: speculation's rate with it, beyond a steady workload's 3% swing.
    better, gain = verdict.read_at(2.19).reading()
    assert better is True and gain == pytest.approx(1.095 / 1.03)
    # Within the swing, nothing moves.
    assert verdict.read_at(2.05).reading() == (None, 1.0)
    # 2.6 matches only the estimate: a ratio of accept lengths from two sources says nothing.
    assert verdict.read_at(2.6).reading() == (None, 1.0)
    # Measured 10% lower: plain decoding.
    assert verdict.read_at(1.8).reading()[0] is False
    # A reading whose scrapes swung by 4% (standard error) names no mode it did not name as
    # measured within twice that.
    assert dataclasses.replace(verdict, noise=0.04).read_at(2.19).reading()[0] is None
    # A verdict whose accept lengths were all estimated is never scaled.
    estimated = control.Measurement(100.0, 2.0, 16, 1.0, measured=(False, False))
    assert estimated.read_at(2.15) is estimated


def test_a_verdict_holds_beyond_its_workload_only_where_the_move_favours_its_mode() -> None:
    """Speculation measured 1.04x plain decoding at batch 48, accept length 2.4 measured and
    2.6 estimated while off. A workload that accepts its drafts more (3.3) only widens that
    lead, so the verdict still holds there; one that accepts them less (2.0) may have turned
    it, and the verdict stands aside. A verdict for plain decoding holds the other way round;
    one that named no mode holds only on its own workload, and none holds at another batch or
    after its time."""
    faster = control.Measurement(100.0, 2.4, 48, 1.04, also=2.6, measured=(True, False))
    assert faster.holds(50.0, 2.5, 48)  # its own workload
    assert faster.holds(50.0, 3.3, 48) and not faster.holds(50.0, 2.0, 48)
    slower = dataclasses.replace(faster, ratio=0.9)
    assert slower.holds(50.0, 2.0, 48) and not slower.holds(50.0, 3.3, 48)
    level = dataclasses.replace(faster, ratio=1.01)
    assert not level.holds(50.0, 3.3, 48) and not level.holds(50.0, 2.0, 48)
    assert not faster.holds(50.0, 3.3, 96) and not faster.holds(100.0, 3.3, 48)


def test_a_verdict_reads_the_estimate_while_off_against_its_own() -> None:
    """Plain decoding measured faster at batch 16, at accept length 2.1 measured, with the
    estimate while off at 2.3 when the probe ended (its calibration leaves it 10% high on this
    workload). Back on plain decoding, the estimate swings 2.25-2.35 about the edge of the
    measured reading's 10%: read against the estimate the verdict kept, it holds throughout,
    and a move of the estimate beyond its own 10% still takes it away."""
    verdict = control.Measurement(
        100.0, 2.1, 16, 0.93, also=1.83, measured=(True, False), estimated=2.3
    )
    assert all(verdict.holds(50.0, tau, 16) for tau in (2.25, 2.3, 2.35, 2.1))
    assert not verdict.holds(50.0, 2.6, 16)
    assert not dataclasses.replace(verdict, estimated=None).holds(50.0, 2.35, 16)
    # The tracker keeps the estimate while a measured accept length is current.
    tracker = AcceptanceTracker()
    tracker.update(_counters(), 0.0, 3, 0.0)
    tracker.update(_counters(draft_first_proposed=300, draft_first_agreed=210), 1.0, 3, 0.0)
    counters = _counters(draft_first_proposed=300, draft_first_agreed=210,
                         spec_request_steps=150, spec_accepted_tokens=230)  # fmt: skip
    tracker.update(counters, 2.0, 3, 1.0)
    current = tracker.current(2.0)
    assert current is not None and current[1] == "measured"
    assert tracker.estimate(2.0) == pytest.approx(predict.chain_accept_length(0.7, 3), rel=1e-3)
    assert tracker.estimate(2.0 + predict.ESTIMATE_FRESH_SECONDS + 1.1) is None


def test_a_host_that_slows_as_the_trial_begins_is_measured_again() -> None:
    """The host runs a fifth slower from the moment the pod tries plain decoding (an H200's
    5-s windows swing by that much): speculation read 2000 before the trial and 1600 after
    it, plain 1700 in it. Held to the mean of the two, plain reads 0.94x, and the probe once
    named speculation the better mode, 1.06x, though on the slower host plain delivers 1.06x
    speculation. The brackets' drift counts as the reading's noise: another round, held
    mostly to the brackets after the trials, and no verdict for speculation."""
    slowed = _run_measuring_plain_at_16([1700.0], speculating_before=2000.0)
    reasons = [d.reason for d in slowed]
    first = next(r for r in reasons if r.startswith("measured plain decoding at batch 16:"))
    assert "0.94x, within its scrapes' noise" in first, reasons
    assert "over 3 rounds" in reasons[-1], reasons
    assert slowed[-1].measured is not None and slowed[-1].measured.better is not True


def test_a_probes_rounds_are_not_judged_again_on_the_newest_alone() -> None:
    """Plain decoding reads 0.88x speculation in round one (its scrapes swing 1000/1800), then
    1.12x in rounds two and three: 1.04x pooled, within the pooled scrapes' noise, and the pod
    goes back to speculation, which the model prefers. The newest three runs, read alone,
    would bracket plain at 1.12x, past the margin at which measured runs outrank the model,
    and once moved the pod to plain at once on the lesser part of what the probe had just
    judged."""
    decisions = _run_measuring_plain_at_16([1000.0, 1800.0] * 2 + [1800.0] * 20, then=10.0)
    reasons = [d.reason for d in decisions]
    verdict = next(i for i, r in enumerate(reasons) if "over 3 rounds" in r)
    assert "1.04x" in reasons[verdict] and reasons[verdict].endswith("back to 32"), reasons
    assert all(d.threshold == 32 for d in decisions[verdict:]), reasons[verdict:]


def test_a_round_the_load_starves_leaves_the_verdict_to_the_rounds_before_it() -> None:
    """Round one reads plain decoding 1.06x within its noise, round two 1.5x. Going back, the
    pod runs speculation at batch 20, outside batch 16's band but not far enough to count as
    a moved load, so that half of the round yields a sample where it needs four. The rounds'
    scrapes pooled decide (1.28x, past their noise): the probe once ended "inconclusive"
    there and dropped what it had measured."""
    starved = _run_measuring_plain_at_16(
        [2200.0, 1200.0] * 2 + [2400.0] * 20, back_batches=[16] * 5 + [20]
    )
    reasons = [d.reason for d in starved]
    assert any("within its scrapes' noise" in r for r in reasons), reasons
    assert "measuring speculation again at batch 16: 1 samples" in reasons[-2], reasons
    assert "1.28x over 2 rounds; keeping it" in reasons[-1], reasons
    assert starved[-1].threshold is not None and starved[-1].threshold < 16
    assert starved[-1].measured is not None and starved[-1].measured.better is False


def test_a_measuring_probe_ends_when_the_load_moves_away() -> None:
    """A pod measures plain decoding at batch 16 and its load moves to batch 48: nothing at 16
    is left to measure, so the probe ends at once (it once ran the slower mode 20 s waiting
    for samples that could not come)."""
    params, prediction, own, previous = _measuring_plain_at_16()
    own += [
        control.Sample(40.0 + 0.5 * i, 48, 48 * 60.0, 0.0, accept_length=2.2) for i in range(1, 5)
    ]
    ended = control.decide(
        samples=own, previous=previous, now=42.0, fresh=True, params=params, own=own,
        prediction=prediction,
    )  # fmt: skip
    assert ended.probe is None and ended.threshold == 32, ended.reason
    assert "ended: the load moved to batch 48" in ended.reason
    # The model's cooldown runs from the pod's last change before the probe, as after any
    # probe that goes back: the load that moved is not held a cooldown in the old mode.
    assert previous.probe is not None and ended.changed_at == previous.probe.held_since < 40.0


def test_a_move_on_an_estimate_that_speculation_measures_wrong_is_undone_at_once() -> None:
    """A pod runs plain at batch 16; the estimate while off says accept length 3.0 (a draft
    whose agreement on the first position flatters its chain), so the model turns speculation
    on. Speculating, the pod measures 1.8, at which plain delivers 1.1x: the move is undone
    once the measurement settles (5 s), not after a 30 s cooldown in the slower mode. A move
    that rested on a measured accept length keeps its cooldown."""
    params = ControlSettings()
    model = wire_model

    guessed = model(3.0, "estimated while off (uncalibrated)")
    assert not guessed.measured and guessed.threshold == 32
    own = [control.Sample(0.5 * i, 16, 16 * 150.0, 0.0, accept_length=3.0) for i in range(1, 81)]

    def decide(
        previous: control.Decision, now: float, prediction: predict.Prediction
    ) -> control.Decision:
        return control.decide(
            samples=own, previous=previous, now=now, fresh=True, params=params, own=own,
            prediction=prediction,
        )  # fmt: skip

    on = decide(control.Decision(8, "start", 0.0), 40.0, guessed)
    assert on.threshold == 32 and on.moved_on_estimate == 3.0, on.reason
    own += [
        control.Sample(40.0 + 0.5 * i, 16, 16 * 135.0, 1.0, accept_length=1.8) for i in range(1, 13)
    ]
    measured = model(1.8, "measured")
    assert measured.measured and measured.threshold == 0
    assert "cooling down" in decide(on, 43.0, measured).reason  # the measurement settles
    off = decide(on, 46.0, measured)
    assert off.threshold == 0 and "the last move assumed accept length 3.00" in off.reason
    # The same move made on a measured accept length waits out its cooldown.
    on_measured = dataclasses.replace(on, moved_on_estimate=None)
    assert decide(on_measured, 46.0, measured).threshold == 32


def test_the_default_bounds_leave_the_top_to_the_profile() -> None:
    """A resource that sets no bounds speculates wherever the profile says it pays: a default
    maxThreshold below the engine's batches ran a pod plain at 128 requests where speculation
    delivered 2.5x (BENCHMARKS.md section 0c)."""
    defaults = ControlSettings()
    profile = StepProfile.from_wire(H200.step_profile(1, 256))
    assert profile is not None and profile.top() == 256
    got = predict.predict(
        profile,
        (4.0, "measured"),
        None,
        min_threshold=defaults.min_threshold,
        max_threshold=defaults.max_threshold,
        batch=200,
    )
    assert got is not None and got.threshold == 256, got and got.why
    assert control.threshold_to_run(200, speculating=True, params=defaults) is not None


def test_a_standing_verdict_holds_while_the_batch_is_unsteady() -> None:
    """Speculation measured 1.19x at batch 16, where the model (accept length 1.6) puts plain
    decoding ahead at every batch. The pod's samples jump between 14 and 18 (prefills of many
    short requests drop scrapes and move the batch), so it holds no steady batch, the check
    that consults the verdict: the model's move once went through there unchecked and ran the
    pod plain for seconds at a time, twice a minute (BENCHMARKS.md section 0c, c = 128)."""
    params = ControlSettings()
    prediction = wire_model(1.6)
    assert prediction.threshold == 0, prediction.why
    own = [
        control.Sample(0.5 * i, 14 if i % 2 else 18, 1600.0, 1.0, accept_length=1.6)
        for i in range(1, 121)
    ]
    verdict = control.Measurement(1000.0, 1.6, 16, 1.19, taken=30.0, measured=(True, True))
    previous = control.Decision(32, "measured speculation: 1.19x", 0.0, measured=verdict)
    held = control.decide(
        samples=own, previous=previous, now=60.0, fresh=True, params=params, own=own,
        prediction=prediction,
    )  # fmt: skip
    assert held.threshold == 32, held.reason
    assert "holding 32: measured at batch 16 (speculation faster)" in held.reason
    # A verdict for another batch, or none, leaves the model's move as it was.
    for other in (None, dataclasses.replace(verdict, batch=64)):
        moved = control.decide(
            samples=own, previous=dataclasses.replace(previous, measured=other), now=60.0,
            fresh=True, params=params, own=own, prediction=prediction,
        )  # fmt: skip
        assert moved.threshold is not None and moved.threshold < 14, moved.reason
