"""The rates the control law compares (router/specgate_router/control/model.py), the profile
it reads them from or fits from samples (profile.py), and how a trial's reading weighs against
them (correction.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from specgate_router import control
from specgate_router.control import RateModel, Sample, StepProfile, correction
from specgate_router.settings import ControlSettings
from specgate_sim import profile as profiles

WIRE = {"on": [[1, 0.010], [8, 0.012], [32, 0.020]], "off": [[1, 0.004], [8, 0.006], [32, 0.010]]}
H200 = profiles.load("h200-3b-synthetic-deployed")
RTX = profiles.load("rtx-pro-6000-x8")
TUNING = control.TUNING


def model(wire: object = WIRE, tau: float = 2.2, between: float = 0.0, **kw: int) -> RateModel:
    profile = StepProfile.from_wire(wire, **kw)
    assert profile is not None
    return RateModel(profile, tau, "measured", between)


def test_a_profile_keeps_both_modes_step_times_at_every_whole_batch() -> None:
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    assert len(profile.steps) == 33 and profile.steps[0] is None
    assert profile.steps[20] == pytest.approx((0.016, 0.008))
    assert profile.steps[8] == (profile.step_seconds(8, True), profile.step_seconds(8, False))


@pytest.mark.parametrize(("prof", "rate"), [(RTX, 0.5), (RTX, 0.8), (RTX, 0.99), (H200, 0.6)])
def test_the_threshold_is_the_profiles_crossover(prof: profiles.Profile, rate: float) -> None:
    """Against the simulator's own analytic rates: the largest batch where speculating gives
    each request at least what plain decoding does (no time between steps, no correction)."""
    tau = control.chain_accept_length(rate, prof.num_steps)
    rates = model(prof.step_profile(1, 128), tau, num_steps=prof.num_steps)
    expected = max(
        (b for b in range(1, 129) if tau / prof.step_time(b, True) >= 1 / prof.step_time(b, False)),
        default=0,
    )
    got = rates.threshold(None, low=0, high=128)
    # The profile samples CUDA-graph batch sizes: interpolation may move the crossover by
    # the gap between two of them.
    assert got is not None and abs(got - expected) <= max(2, expected // 4), (got, expected)


def test_bounds_and_the_profiles_top() -> None:
    rates = model(H200.step_profile(1, 32), 4.0)
    assert rates.threshold(16, low=0, high=64) == 32  # pays at the top: stops there
    assert model(H200.step_profile(1, 32), 1.0).threshold(16, low=2, high=64) == 2
    # The resource's default bounds leave the top to the profile: a maxThreshold of 64 ran a
    # pod plain at 128 requests where speculation delivered 2.5x (BENCHMARKS.md section 0c).
    defaults = ControlSettings()
    wide = model(H200.step_profile(1, 256), 4.0)
    assert wide.threshold(200, low=defaults.min_threshold, high=defaults.max_threshold) == 256


def test_where_speculation_pays_in_one_band_the_threshold_follows_the_load() -> None:
    """Four-token off steps on an engine whose fixed step costs dominate: plain decoding
    delivers more at small batches, speculation at large ones. A threshold keeps only the
    batches at or under it speculating, so the right one depends on the load: 0 at batch 1,
    the top at batch 48, and for an idle pod the largest batch where it pays."""
    wire = {"on": [[1, 0.0064], [8, 0.0071], [64, 0.0106]],
            "off": [[1, 0.0056], [8, 0.0084], [64, 0.0239]]}  # fmt: skip
    rates = model(wire, 3.46, off_step_tokens=4, num_steps=4)
    assert rates.ratio(1) is not None and rates.ratio(1) < 1  # type: ignore[operator]
    assert rates.threshold(1, low=0, high=256) == 0
    assert rates.threshold(3, low=0, high=256) == 0
    assert rates.threshold(48, low=0, high=256) == 64
    assert rates.threshold(None, low=0, high=256) == 64
    # WIRE at accept length 2.2 pays from batch 5 to 32: from batch 5 up, the threshold is 32.
    assert {model().threshold(b, low=0, high=64) for b in (None, 5, 16, 31, 32, 33, 64)} == {32}


def test_time_between_steps_brings_the_modes_together() -> None:
    """A request waits for the prefills of its whole batch, alike in both modes: where they
    take most of the pod's time, a decode step twice as fast per token is a small gain. The
    decode steps alone put speculation 1.97x ahead at batch 192 where prompts of a thousand
    tokens made it deliver 1.04x (a trial's half-second rates swung 30% there)."""
    wire = {"on": [[1, 0.010], [256, 0.040]], "off": [[1, 0.011], [256, 0.078]]}
    bare = model(wire, 2.8, off_step_tokens=4)
    t_on, t_off = 0.010 + 0.030 * 191 / 255, 0.011 + 0.067 * 191 / 255
    assert bare.ratio(192) == pytest.approx((t_off / 4) / (t_on / 2.8))  # 1.32
    # 93% of the speculating pod's time between steps: q from its samples.
    spent = bare.seconds_per_token(192, True)
    assert spent is not None
    q = 13.3 * spent / 192
    busy = model(wire, 2.8, between=q, off_step_tokens=4)
    ratio = busy.ratio(192)
    assert ratio is not None and 1.0 < ratio < 1.05
    assert busy.seconds_per_token(192, True) == pytest.approx(14.3 * spent)
    # Where speculation loses on decode steps, it loses less once prefills are counted.
    slow = model(wire, 1.2, off_step_tokens=4)
    slow_busy = model(wire, 1.2, between=q, off_step_tokens=4)
    assert slow.ratio(192) < slow_busy.ratio(192) < 1  # type: ignore[operator]


def test_the_correction_multiplies_speculations_rate() -> None:
    rates = model()
    assert rates.corrected(0.8).ratio(16) == pytest.approx(0.8 * rates.ratio(16))  # type: ignore[operator]
    assert rates.corrected(0.8).threshold(16, low=0, high=64) < 32  # type: ignore[operator]
    assert rates.corrected(1.0, between=0.001).between == 0.001


def _sample(at: float, batch: float, per_request: float, speculating: bool) -> Sample:
    return Sample(at, batch, batch * per_request, 1.0 if speculating else 0.0)


def test_a_profile_is_fitted_from_samples_where_the_engine_reports_none() -> None:
    """Each mode's delivered seconds per token per request, the median of each quarter octave
    of batches with `need` samples; interpolated only between batches at most twice apart."""
    samples = [_sample(i, 4, 100.0, True) for i in range(4)]
    samples += [_sample(i, 8, 80.0, True) for i in range(4)]
    samples += [_sample(i, 8, 60.0, False) for i in range(3)]  # one short of `need`
    assert control.fitted_from_samples([], now=10, need=4) is None
    one_mode = control.fitted_from_samples(samples, now=10, need=4)
    assert one_mode is not None and one_mode.off == () and one_mode.top() == 0
    assert RateModel(one_mode, 1.0, "samples").threshold(8, low=0, high=64) is None
    samples += [_sample(4, 8, 60.0, False)]
    samples += [_sample(i, 40, 50.0, True) for i in range(4)]
    fitted = control.fitted_from_samples(samples, now=10, need=4)
    assert fitted is not None and fitted.fitted
    assert fitted.step_seconds(8, True) == pytest.approx(1 / 80)
    assert fitted.step_seconds(6, True) == pytest.approx((1 / 100 + 1 / 80) / 2)
    assert fitted.step_seconds(20, True) is None  # 8 and 40 are more than twice apart
    rates = RateModel(fitted, 1.0, "samples")
    assert rates.ratio(8) == pytest.approx(80 / 60)
    assert rates.ratio(4) is None  # plain decoding never ran there
    assert rates.threshold(4, low=0, high=64) is None
    assert rates.threshold(8, low=0, high=64) == 8  # the top of what both modes cover


def _readings(trial: list[float], before: list[float], after: list[float]) -> control.Reading:
    """A trial of plain decoding at batch 16 (`trial`: its rates per request) against
    speculation before and after it, on `model()`."""
    rates = model()
    on = rates.seconds_per_token(16, True)
    off = rates.seconds_per_token(16, False)
    assert on is not None and off is not None

    def samples(values: list[float], speculating: bool, start: float) -> list[Sample]:
        return [
            Sample(start + i, 16, 16 * v, 1.0 if speculating else 0.0, accept_length=2.2)
            for i, v in enumerate(values)
        ]

    reading = correction.weigh(
        samples(trial, False, 10), [samples(before, True, 0), samples(after, True, 20)],
        model=rates, outside=0.0, batch=16, at=30, tuning=TUNING,
    )  # fmt: skip
    assert reading is not None
    return reading


def test_a_precise_reading_moves_the_correction_and_a_noisy_one_less() -> None:
    """Plain decoding delivers 10% more than the model has it against speculation's own: the
    correction reads 1/1.1. Scrapes that swing by 30% read the same mean but move the
    correction less (weighed against the model's own uncertainty)."""
    rates = model()
    on, off = 1 / rates.seconds_per_token(16, True), 1 / rates.seconds_per_token(16, False)  # type: ignore[operator]
    precise = _readings([1.1 * off] * 4, [on] * 4, [on] * 4)
    assert precise.measured == pytest.approx(1 / 1.1)
    assert precise.error == 0 and precise.correction == pytest.approx(1 / 1.1)
    swing = [1.3, 0.7, 1.3, 0.7]
    noisy = _readings([1.1 * off * s for s in swing], [on * s for s in swing], [on] * 4)
    assert noisy.error > 0.05
    assert 1 / 1.1 < noisy.correction < 1.0
    # A host that slowed by 20% during the trial moves both brackets alike: the trial is held
    # to their mean, and their difference counts as noise.
    drifted = _readings([1.1 * off * 0.9] * 4, [on] * 4, [on * 0.8] * 4)
    assert drifted.measured == pytest.approx(math.sqrt(0.8) / 0.99)
    assert drifted.error > 0


def test_a_trial_pays_where_the_other_mode_could_gain_more_than_the_trial_costs() -> None:
    """The law's uncertainty grows with the share of time between decode steps and with an
    estimated accept length's error. A trial pays where what the other mode could gain over
    the horizon, should it be faster, outweighs what the trial costs should it not: near
    level always; far from level only where the uncertainty is wide, and less the longer the
    trial's phase takes."""
    sigma = correction.prior_error(0.0, TUNING)
    assert sigma == TUNING.prior_sigma
    assert correction.prior_error(0.8, TUNING) > 2 * sigma  # prefills the profile cannot see
    assert correction.prior_error(0.0, TUNING, tau_error=0.25) > 1.9 * sigma

    def pays(ratio: float, sigma: float, seconds: float = 2.5) -> bool:
        # A pod that speculates: the other mode is plain decoding, 1 / ratio of it.
        return correction.worth_a_trial(ratio, True, sigma=sigma, seconds=seconds, horizon=60)

    assert pays(1.0, sigma) and pays(1.1, sigma)
    assert not pays(1.6, sigma)  # far from level
    assert pays(1.6, correction.prior_error(0.8, TUNING))  # unless prefills could hide it
    assert not pays(1.6, correction.prior_error(0.8, TUNING), seconds=30)  # a slow trial
    assert correction.worth_a_trial(0.9, False, sigma=sigma, seconds=2.5, horizon=60)
    assert math.isinf(correction.phase_noise([], model(), 4))


def _run(speculating: bool, scale: float, start: float, n: int, batch: float = 8) -> list[Sample]:
    """n samples of one mode whose steps took `scale` x what WIRE profiles at `batch`."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    step = profile.step_seconds(batch, speculating)
    assert step is not None
    return [
        Sample(start + 0.5 * i, batch, 500.0, float(speculating), step_seconds=step * scale)
        for i in range(n)
    ]


def test_the_running_modes_steps_scale_its_profile_and_a_mode_never_run_keeps_it() -> None:
    """A start-up profile taken on a quieter GPU: the pod's speculating steps take 1.2x what
    it says. The model predicts that mode from the steps; plain decoding, never run, stays
    as profiled."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    own = _run(True, 1.2, 0.0, 12)
    assert control.measured_scale(own, profile) == pytest.approx((1.2, 1.0))
    plain = model()
    scaled = replace(plain, scale=control.measured_scale(own, profile))
    on, off = plain.seconds_per_token(8, True), plain.seconds_per_token(8, False)
    assert on is not None and off is not None
    assert scaled.seconds_per_token(8, True) == pytest.approx(1.2 * on)
    assert scaled.seconds_per_token(8, False) == off
    assert scaled.ratio(8) == pytest.approx((plain.ratio(8) or 0) / 1.2)


def test_a_mode_left_is_scaled_against_the_running_one_so_a_slowing_host_moves_both() -> None:
    """Speculation ran at 0.9 of its profile, then plain decoding at 1.0 of its own; since,
    the host slowed by half: plain's steps read 1.5. Speculation, measured before the host
    slowed, is taken as slowed alike (0.9 x 1.5), not as 0.9: a mode measured first would
    otherwise read as the faster one whenever the host slows."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    own = _run(True, 0.9, 0.0, 12) + _run(False, 1.0, 6.0, 12) + _run(False, 1.5, 12.0, 12)
    on, off = control.measured_scale(own, profile)
    assert off == pytest.approx(1.5) and on == pytest.approx(0.9 * 1.5)


def test_a_run_counts_from_its_third_sample_without_the_one_that_spans_the_switch() -> None:
    """The first sample after a switch times the new mode's first step from the old mode's
    last (here 3x): left out. Until the new run holds three more, the scales stay as before
    the switch, so a switch alone never moves the model."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    before = _run(True, 1.1, 0.0, 12)
    expected = control.measured_scale(before, profile)
    spanning = _run(False, 3.0, 6.0, 1)
    for n in range(3):
        own = before + spanning + _run(False, 0.8, 6.5, n)
        assert control.measured_scale(own, profile) == pytest.approx(expected)
    own = before + spanning + _run(False, 0.8, 6.5, 4)
    assert control.measured_scale(own, profile) == pytest.approx((1.1 * 0.8 / 0.8, 0.8))


def test_a_scale_beyond_twice_the_profile_is_clipped_and_a_fitted_profile_is_not_scaled() -> None:
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    assert control.measured_scale(_run(True, 10.0, 0.0, 12), profile) == (2.0, 1.0)
    assert control.measured_scale([], profile) == (1.0, 1.0)
    untimed = [replace(s, step_seconds=None) for s in _run(True, 10.0, 0.0, 12)]
    assert control.measured_scale(untimed, profile) == (1.0, 1.0)
    fitted = control.fitted_from_samples(_run(True, 1.0, 0.0, 12), now=10.0, need=4)
    assert fitted is not None
    assert control.measured_scale(_run(True, 10.0, 0.0, 12), fitted) == (1.0, 1.0)
