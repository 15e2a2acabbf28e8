"""The control law (router/specgate_router/control/decision.py, fleet.py), rule by rule, on
samples made to order: each test asserts the rule a decision names and what it does."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import pytest

from specgate_router import control
from specgate_router.control import Decision, RateModel, Rule, Sample, StepProfile
from specgate_router.settings import ControlSettings

WIRE = {"on": [[1, 0.010], [8, 0.012], [32, 0.020]], "off": [[1, 0.004], [8, 0.006], [32, 0.010]]}
PARAMS = ControlSettings()
TUNING = control.TUNING


def wire_model(tau: float = 2.2, between: float = 0.0) -> RateModel:
    """WIRE at accept length `tau`: at 2.2 speculation pays from batch 5 to 32 (1.1x at 16)."""
    profile = StepProfile.from_wire(WIRE)
    assert profile is not None
    return RateModel(profile, tau, "measured", between)


def predicted(batch: float, speculating: bool, rates: RateModel | None = None) -> float:
    """The model's output tok/s per request at `batch` in one mode."""
    seconds = (rates or wire_model()).seconds_per_token(batch, speculating)
    assert seconds is not None
    return 1.0 / seconds


def held(batch: float, speculating: bool, seconds: float = 40.0, per_request: float | None = None,
         tau: float = 2.2) -> list[Sample]:  # fmt: skip
    """A pod that held `batch` in one mode for `seconds` (to t = `seconds`), delivering what
    the model predicts (or `per_request`)."""
    rate = per_request if per_request is not None else predicted(batch, speculating)
    return [
        Sample(0.5 * i, batch, batch * rate, 1.0 if speculating else 0.0, accept_length=tau)
        for i in range(1, int(seconds / 0.5) + 1)
    ]


def decide(previous: Decision, own: list[Sample], now: float, *, rates: RateModel | None = None,
           fresh: bool = True, may_trial: bool = True, params: ControlSettings = PARAMS,
           ) -> Decision:  # fmt: skip
    return control.decide(
        previous, own, rates if rates is not None else wire_model(), fresh=fresh, now=now,
        params=params, tuning=TUNING, may_trial=may_trial,
    )  # fmt: skip


def start(threshold: int | None, changed_at: float = -math.inf, moved: int = 0) -> Decision:
    return Decision(threshold, Rule.HOLD, "", changed_at, moved)


def test_fixed_modes_set_the_threshold_whatever_the_load() -> None:
    own = held(16, False)
    for mode, value in (("alwaysOn", None), ("off", 0)):
        params = PARAMS.model_copy(update={"mode": mode})
        got = decide(start(8), own, 40.0, params=params)
        assert (got.rule, got.threshold) == (Rule.FIXED, value)


def test_stale_metrics_and_a_missing_model_decide_nothing() -> None:
    own = held(16, False)
    stale = decide(start(8), own, 40.0, fresh=False)
    assert (stale.rule, stale.threshold) == (Rule.STALE, 8)
    none = control.decide(start(8), own, None, fresh=True, now=40.0, params=PARAMS,
                          tuning=TUNING, may_trial=True)  # fmt: skip
    assert (none.rule, none.threshold) == (Rule.NO_MODEL, 8)


def test_a_pod_that_runs_the_slower_mode_moves_to_the_crossover() -> None:
    got = decide(start(8), held(16, False), 40.0, may_trial=False)
    assert (got.rule, got.threshold, got.changed_at, got.moved) == (Rule.MOVE, 32, 40.0, 1)
    again = decide(got, held(16, True), 40.5, may_trial=False)
    assert (again.rule, again.threshold) == (Rule.HOLD, 32)


def test_a_move_that_switches_no_batch_the_pod_runs_is_not_pushed() -> None:
    """At batch 16 a threshold of 22 speculates as 32 would: moving it changes nothing there,
    and a load that later crosses 22 moves it at once."""
    got = decide(start(22), held(16, True), 40.0, may_trial=False)
    assert (got.rule, got.threshold) == (Rule.NO_GAIN, 22)
    assert decide(start(22), held(26, False), 40.0, may_trial=False).rule is Rule.MOVE
    # Within hysteresis of the target and not switching the pod's batch.
    near = decide(start(30), held(16, True), 40.0, may_trial=False)
    assert (near.rule, near.threshold) == (Rule.NO_GAIN, 30)


def test_a_move_that_gains_under_the_switch_margin_is_not_pushed() -> None:
    """At the crossover both modes deliver the same. Where speculation's lead fades slowly
    with the batch (0.2% a request here), a pod running plain at 28 would speculate from 22
    to 27 for under 3%: noise in the acceptance must not push such a move."""
    profile = StepProfile.from_wire({"on": [[1, 0.010], [64, 0.030]],
                                     "off": [[1, 0.005], [64, 0.013]]})  # fmt: skip
    assert profile is not None
    rates = RateModel(profile, 2.2, "measured")
    assert rates.threshold(28, low=0, high=64) == 27
    assert all(1.0 <= rates.ratio(b) < 1.03 for b in range(22, 28))  # type: ignore[operator]
    pod = held(28, False, per_request=predicted(28, False, rates))
    got = decide(start(22), pod, 40.0, rates=rates, may_trial=False)
    assert (got.rule, got.threshold) == (Rule.NO_GAIN, 22)
    # The same move where it buys more than the margin is pushed.
    faster = RateModel(profile, 2.5, "measured")
    assert decide(start(22), pod, 40.0, rates=faster, may_trial=False).rule is Rule.MOVE


def test_a_move_back_waits_for_the_cooldown_and_one_on_for_the_settle() -> None:
    down = start(32, changed_at=30.0, moved=1)
    rates = wire_model(1.5)  # speculation pays nowhere at 1.5
    wait = decide(down, held(16, True, tau=1.5), 40.0, rates=rates, may_trial=False)
    assert (wait.rule, wait.threshold) == (Rule.COOLDOWN, 32)
    gone = decide(down, held(16, True, tau=1.5), 60.5, rates=rates, may_trial=False)
    assert (gone.rule, gone.moved) == (Rule.MOVE, -1) and gone.threshold < 16  # type: ignore[operator]
    # A move on in the last one's direction waits only the settle.
    up = start(8, changed_at=38.0, moved=1)
    settling = decide(up, held(16, False), 40.0, may_trial=False)
    assert (settling.rule, settling.threshold) == (Rule.SETTLING, 8)
    assert decide(up, held(16, False), 43.5, may_trial=False).rule is Rule.MOVE


def test_a_reading_since_the_last_move_lifts_the_cooldown() -> None:
    """A trial measured the modes after the last move: a move back on its reading is no
    swing on noise, and waits no cooldown."""
    reading = control.Reading(0.5, 0.01, 0.5, 0.0, 16, 39.0)
    moved = dataclasses.replace(start(32, changed_at=30.0, moved=1), readings=(reading,))
    got = decide(moved, held(16, True), 40.0, may_trial=False)
    assert (got.rule, got.moved) == (Rule.MOVE, -1) and got.threshold < 16  # type: ignore[operator]


Rates = Callable[[float, bool], float]


def drive(previous: Decision, own: list[Sample], start_at: float, end: float, rates: Rates,
          *, batch: Callable[[float], float] = lambda t: 16.0, model: RateModel | None = None,
          ) -> list[tuple[float, Decision]]:  # fmt: skip
    """Scrape by scrape from `start_at` to `end`: the pod runs the mode its threshold gives at
    `batch(t)`, delivering `rates(batch, speculating)` per request; returns the decisions."""
    out = []
    now = start_at
    while now < end:
        now += 0.5
        b = batch(now)
        speculating = previous.threshold is None or b <= previous.threshold
        own.append(Sample(now, b, b * rates(b, speculating), float(speculating),
                          accept_length=2.2))  # fmt: skip
        previous = decide(previous, own, now, rates=model)
        out.append((now, previous))
    return out


def test_a_trial_reads_the_correction_and_the_law_follows_it() -> None:
    """WIRE at 2.2 puts speculation 1.1x ahead at 16, but plain decoding delivers 1.2x what
    speculation does (its prefills cost the speculating batch more, say): the pod, holding
    16 speculating, runs plain for a few scrapes, speculates again, and moves below 16 on
    the reading: one trial round, then the move."""
    own = held(16, True)

    def truth(b: float, speculating: bool) -> float:
        on = predicted(b, True)
        return on if speculating else 1.2 * on

    decisions = drive(start(32, changed_at=0.0), own, 40.0, 60.0, truth)
    rules = [d.rule for _, d in decisions]
    assert rules[0] is Rule.TRIAL and decisions[0][1].threshold < 16  # type: ignore[operator]
    assert Rule.TRIAL_RETURN in rules
    moved = next(d for _, d in decisions if d.rule is Rule.MOVE)
    assert moved.threshold is not None and moved.threshold < 16
    (reading,) = moved.readings
    expected = (predicted(16, False) / predicted(16, True)) / 1.2  # speculating over plain
    assert reading.measured == pytest.approx(expected, rel=0.01)
    assert decisions[-1][1].rule is Rule.HOLD and decisions[-1][1].threshold == moved.threshold
    # One trial: no second one while the reading is current.
    assert sum(1 for (_, a), (_, b) in itertools.pairwise(decisions)
               if b.trial is not None and a.trial is None) == 0  # fmt: skip


def test_a_trial_that_confirms_the_model_keeps_the_mode() -> None:
    own = held(16, True)
    decisions = drive(start(32, changed_at=0.0), own, 40.0, 60.0, predicted)
    final = decisions[-1][1]
    assert (final.rule, final.threshold) == (Rule.HOLD, 32)
    assert final.readings and final.readings[-1].correction == pytest.approx(1.0, abs=0.01)


def test_a_trial_whose_load_leaves_its_batch_ends_without_a_reading() -> None:
    own = held(16, True)
    decisions = drive(start(32, changed_at=0.0), own, 40.0, 50.0, predicted,
                      batch=lambda t: 16.0 if t < 41.0 else 30.0)  # fmt: skip
    ended = next(d for _, d in decisions if d.rule is Rule.TRIAL_ENDED)
    assert ended.threshold == 32 and not ended.readings and ended.trial is None


def test_a_reading_within_its_noise_runs_more_rounds_up_to_the_limit() -> None:
    """Scrapes that swing by 25% at random cannot name the faster mode in one round: the
    trial alternates the modes again, at most `max_rounds` times."""
    own = held(16, True)
    swing = [1.25, 0.75, 1.2, 0.8, 1.0, 1.3, 0.7]
    count = iter(range(10**6))

    def noisy(b: float, speculating: bool) -> float:
        return predicted(b, speculating) * swing[next(count) % len(swing)]

    decisions = drive(start(32, changed_at=0.0), own, 40.0, 80.0, noisy)
    rounds = max(len(d.trial.rounds) for _, d in decisions if d.trial is not None)
    assert 1 < rounds <= TUNING.max_rounds
    assert any(d.readings for _, d in decisions)


@pytest.mark.parametrize(
    ("why", "change"),
    [
        ("other pod trials", {"may_trial": False}),
        ("trials off", {"params": PARAMS.model_copy(update={"probe_interval_seconds": 0})}),
        ("far from level", {"rates": wire_model(4.0)}),
        ("load unsteady", {"own": "unsteady"}),
        ("noisy scrapes", {"own": "noisy"}),
    ],
)
def test_a_trial_starts_only_where_it_can_change_the_answer(why: str, change: dict) -> None:
    """Steady at 16, speculating 1.1x by the model: a trial. Not where another pod runs one
    (or the pod is in the latency pool, or its acceptance moves: the fleet's `may_trial`),
    trials are off, the model's margin is far beyond its uncertainty, the load moves, or
    the scrapes swing too widely for a few of them to tell."""
    own = held(16, True)
    assert decide(start(32, changed_at=0.0), own, 40.0).rule is Rule.TRIAL
    kw = dict(change)
    if kw.get("own") == "unsteady":
        kw["own"] = own[:-4] + held(16, True, 2.0)[:0] + [
            dataclasses.replace(s, at=38.0 + 0.5 * i, batch=16 + 6 * (i % 2)) for i, s in
            enumerate(own[-4:])
        ]  # fmt: skip
    elif kw.get("own") == "noisy":
        kw["own"] = [dataclasses.replace(s, tokens_per_second=s.tokens_per_second * (1.6 if i % 2
                     else 0.6)) for i, s in enumerate(own)]  # fmt: skip
    else:
        kw["own"] = own
    got = decide(start(32, changed_at=0.0), kw.pop("own"), 40.0, **kw)
    assert got.rule is not Rule.TRIAL and got.trial is None, why


def test_a_reading_corrects_the_model_at_other_batches_and_is_current_only_near_its_own() -> None:
    """A reading taken at batch 16 (plain 1.2x) corrects the model at batch 40 too (a better
    guess than none), but is not current there: a pod that holds 40 may run a trial."""
    reading = control.Reading(0.75, 0.01, 0.75, 0.0, 16, 39.0)
    previous = dataclasses.replace(start(12, changed_at=0.0), readings=(reading,))
    got = decide(previous, held(24, False), 40.0, may_trial=False)
    assert got.model is not None and got.model.correction == 0.75
    far = decide(previous, held(26, False), 40.0, rates=wire_model(3.2))
    assert far.rule is Rule.TRIAL
    near = decide(previous, held(20, False), 40.0, rates=wire_model(3.2))
    assert near.rule is not Rule.TRIAL


def test_one_pod_of_a_group_trials_at_a_time_and_none_in_the_latency_pool() -> None:
    profile = StepProfile.from_wire(WIRE)
    own = held(16, True)

    def pod(pool: str = "mixed", group: object = "h200") -> control.PodInput:
        return control.PodInput(
            start(32, changed_at=0.0), own, pool=pool, profile=profile,
            acceptance=control.Acceptance(2.2, "measured"), group=group,
        )  # fmt: skip

    decisions = control.step([pod(), pod(), pod(group="other")], now=40.0, params=PARAMS)
    assert [d.rule for d in decisions] == [Rule.TRIAL, Rule.HOLD, Rule.TRIAL]
    latency = control.step([pod("latency")], now=40.0, params=PARAMS)
    assert latency[0].rule is Rule.HOLD
    unsettled = control.step([pod()._replace(settled=False)], now=40.0, params=PARAMS)
    assert unsettled[0].rule is Rule.HOLD


def test_a_pod_without_a_profile_or_acceptance_borrows_its_siblings() -> None:
    profile = StepProfile.from_wire(WIRE)
    own = held(16, False)
    new = control.PodInput(start(8), own, group="h200")
    known = control.PodInput(
        start(8), own, profile=profile, acceptance=control.Acceptance(2.2, "measured"),
        group="h200",
    )  # fmt: skip
    models = list(control.models([new, known], now=40.0, params=PARAMS))
    assert models[0] is not None and models[0].profile is profile
    assert models[0].source == "siblings'" and models[0].tau == 2.2
    # Where no pod reports a profile, the rates come from the group's samples: with plain
    # decoding's alone they predict nothing yet (a trial fills the other mode in).
    (fitted,) = control.models([new], now=40.0, params=PARAMS)
    assert fitted is not None and fitted.ratio(16) is None
    both = own + held(4, True, 10.0)
    (model,) = control.models([new._replace(samples=both)], now=40.0, params=PARAMS)
    assert model is not None and model.profile.fitted


def test_a_trial_counts_as_started_then_read_or_ended() -> None:
    trial = control.Trial(16, False, 13, 32, ((40.0, None),), 0.0, 0.0)
    before, during = start(32), dataclasses.replace(start(13), trial=trial)
    assert control.trial_event(before, during) == ("plain", "started")
    assert control.trial_event(during, start(32)) == ("plain", "read")
    ended = dataclasses.replace(start(32), rule=Rule.TRIAL_ENDED)
    assert control.trial_event(during, ended) == ("plain", "ended")
    assert control.trial_event(before, start(32)) is None
