"""One pod's next threshold: the control law, a pure function of (samples, model, previous
decision, now).

Every scrape interval, for a pod whose metrics are fresh:

1. Rates. The model (`model.RateModel`) gives each mode's output rate per request at every
   batch, corrected by the pod's current reading (`correction.Reading`), if it has one for
   the batch it runs.
2. Threshold. The top of the band of batches where speculation pays that holds the pod's
   batch (its samples' median over the last few seconds), within the resource's bounds.
3. Trial. Where the pod has no current reading, its load has held one batch, mode and
   workload for `settle_seconds`, and within the law's uncertainty the faster mode at that
   batch could be the other one, it runs the other mode for `minSamples` scrapes and its own
   again for as many (a round; up to `max_rounds` while the reading cannot name the faster
   mode beyond its noise). One pod of a deployment at a time, never in the latency pool, and
   not at all with `probeIntervalSeconds: 0`. The reading then stays current for
   `probeIntervalSeconds` at batches within `load_moved` of its own.
4. Push. A new threshold is pushed when it switches the mode, at a batch the pod ran within
   the last cooldown, to one predicted `switch_margin` faster there, and moves more than
   `hysteresis` requests or switches the mode at the pod's batch. A move back the way the
   last one came waits `cooldownSeconds` unless a reading came since; a move on in the same
   direction waits `settle_seconds`.

Each decision names its rule (`Rule`) and gives the figures behind it (`detail`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from specgate_router.control import correction, samples
from specgate_router.control.correction import Reading
from specgate_router.control.model import RateModel
from specgate_router.control.samples import Sample
from specgate_router.control.tuning import Tuning
from specgate_router.settings import ControlSettings

MAX_READINGS = 4
"""Readings a pod keeps, at different batches: a load that moves between a few levels finds
each level's reading current when it comes back."""
RECENT_BATCH_SECONDS = 3.0
"""The pod's batch is its samples' median over this long."""


class Rule(StrEnum):
    """Why a decision is what it is: a closed set, shown in /specgate/pods, the log and the
    `rule` label of specgate_threshold_changes_total."""

    FIXED = "fixed"
    """control.mode alwaysOn or off: the resource sets the threshold."""
    STALE = "stale"
    """The pod's metrics are stale: nothing is decided on them."""
    NO_MODEL = "no-model"
    """Nothing predicts the pod's rates at its batch yet (no step profile or acceptance, or
    samples that cover too few batches in both modes)."""
    HOLD = "hold"
    """The threshold already sits where the law puts it."""
    NO_GAIN = "no-gain"
    """The law's threshold differs, but would switch no batch the pod runs to a mode
    `switch_margin` faster, or moves within `hysteresis` without switching the pod's batch."""
    COOLDOWN = "cooldown"
    """A move back the way the last one came waits for the cooldown."""
    SETTLING = "settling"
    """A move on in the last one's direction waits `settle_seconds`."""
    MOVE = "move"
    """The law's threshold, to be pushed."""
    TRIAL = "trial"
    """Running the other mode at the pod's batch, to read the correction."""
    TRIAL_RETURN = "trial-return"
    """Back in its own mode after a trial round, reading it on the trial's other side."""
    TRIAL_ENDED = "trial-ended"
    """The trial's load moved away or gave no samples: back to the threshold before it,
    without a reading."""


@dataclass(frozen=True)
class Trial:
    """A pod running the other mode for a while at the batch it holds, to read the correction."""

    batch: float
    speculating: bool
    """The mode on trial."""
    threshold: int
    """The threshold that runs it at `batch`."""
    back: int | None
    """The pod's threshold before the trial, which runs its own mode there."""
    rounds: tuple[tuple[float, float | None], ...]
    """(started, returned) per round; returned is None while the round runs the other mode."""
    outside: float
    """The share of the pod's time outside decode steps when the trial began."""
    between: float
    """The model's q when the trial began: the reading is taken against rates with it."""
    seconds: float = 0.0
    """How long a phase was expected to take (its samples and the one that spans the switch,
    at the pod's pace): one that takes twice as long gives up."""
    need: int = 0
    """Samples a phase takes: minSamples, more where the pod's rates swing (0: minSamples)."""

    @property
    def began(self) -> float:
        return self.rounds[0][0]


@dataclass(frozen=True)
class Decision:
    threshold: int | None
    """None: always speculate."""
    rule: Rule
    detail: str
    changed_at: float = -math.inf
    """When the law last moved the threshold (trials are not moves)."""
    moved: int = 0
    """The direction of that move: +1 up, -1 down, 0 none yet."""
    trial: Trial | None = None
    readings: tuple[Reading, ...] = ()
    model: RateModel | None = None
    """The corrected model this decision was made with (None: none), for views and pools."""

    @property
    def reason(self) -> str:
        return f"{self.rule}: {self.detail}" if self.detail else str(self.rule)


def initial_decision(params: ControlSettings, now: float = -math.inf) -> Decision:
    """A pod's first decision: the resource's threshold (or its fixed mode's)."""
    del now  # a new pod's first decision comes with its first scrape
    value: int | None = {"alwaysOn": None, "off": 0}.get(params.mode, params.threshold)
    rule = Rule.FIXED if params.mode != "dynamic" else Rule.HOLD
    return Decision(value, rule, "the resource's threshold")


def decide(
    previous: Decision,
    own: Sequence[Sample],
    model: RateModel | None,
    *,
    fresh: bool,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
    may_trial: bool,
) -> Decision:
    """The next decision for one pod from its own samples (in time order) and its model.
    `may_trial`: no other pod of its deployment runs a trial, it is not in the latency pool,
    and its acceptance holds still (a trial taken while the workload moves reads the move)."""
    if params.mode != "dynamic":
        value = None if params.mode == "alwaysOn" else 0
        changed = previous.changed_at if previous.threshold == value else now
        return Decision(value, Rule.FIXED, f"control.mode {params.mode}", changed)
    if not fresh:
        return replace(previous, rule=Rule.STALE, detail="no decision on stale metrics")
    if previous.trial is not None:
        return _continue_trial(previous, previous.trial, own, model, now, params, tuning)
    return _follow(previous, own, model, now, params, tuning, may_trial=may_trial)


def _follow(
    previous: Decision,
    own: Sequence[Sample],
    model: RateModel | None,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
    *,
    may_trial: bool,
) -> Decision:
    """Steps 1-4 of the law for a pod that runs no trial."""
    if model is None:
        return replace(previous, rule=Rule.NO_MODEL, detail="no step profile or acceptance yet")
    batch = samples.median_batch(own, now=now, seconds=RECENT_BATCH_SECONDS)
    reading, current = _reading_for(previous.readings, batch, model, now, params, tuning)
    corrected = model if reading is None else model.corrected(reading.correction, reading.between)
    target = corrected.threshold(batch, low=params.min_threshold, high=params.max_threshold)
    if may_trial and not current and params.probe_interval_seconds > 0:
        outcome = _trial_or_not(previous, own, corrected, now, params, tuning)
        if isinstance(outcome, Decision):
            return outcome
        if outcome is not None:  # decided once for this batch: no trial here
            previous = replace(previous, readings=_keep(previous.readings, outcome, tuning))
            reading = outcome
    if target is None:
        return replace(
            previous, rule=Rule.NO_MODEL, detail=f"nothing predicts batch {batch:.0f}",
            model=corrected,
        )  # fmt: skip
    return _move(previous, own, corrected, target, batch, reading, now, params, tuning)


def _keep(readings: Sequence[Reading], new: Reading, tuning: Tuning) -> tuple[Reading, ...]:
    """`readings` with `new` in place of those it speaks for (at most MAX_READINGS)."""
    kept = [r for r in readings if not samples.near(r.batch, new.batch, tuning.load_moved)]
    return (*kept[-(MAX_READINGS - 1) :], new)


def _reading_for(
    readings: Sequence[Reading],
    batch: float | None,
    model: RateModel,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
) -> tuple[Reading | None, bool]:
    """The reading that corrects `model` (uncorrected) at `batch`: the one taken nearest it,
    within its lifetime (a correction read at another batch is a better guess than none); and
    whether it is current there (taken near `batch`, on a model that has not moved since: no
    trial needed)."""
    lifetime = params.probe_interval_seconds
    alive = [r for r in readings if now - r.at <= lifetime]
    if not alive:
        return None, False
    if batch is None or batch <= 0:
        return alive[-1], True
    nearest = min(alive, key=lambda r: abs(math.log(max(r.batch, 0.5) / batch)))
    ratio_now = model.corrected(1.0, nearest.between).ratio(nearest.batch)
    return nearest, nearest.current(batch, now, lifetime, tuning, ratio_now)


def _describe(model: RateModel, target: int, reading: Reading | None) -> str:
    what = f"speculation pays up to batch {target}" if target > 0 else "speculation pays nowhere"
    if model.profile.fitted:
        return f"{what} (rates from samples)"
    why = f"{what} (accept length {model.tau:.2f}, {model.source}"
    if reading is not None:
        why += f"; correction x{reading.correction:.2f} read at batch {reading.batch:.0f}"
    return why + ")"


def _move(
    previous: Decision,
    own: Sequence[Sample],
    model: RateModel,
    target: int,
    batch: float | None,
    reading: Reading | None,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
) -> Decision:
    """Step 4: push `target`, or hold and say why."""
    current = previous.threshold if previous.threshold is not None else params.max_threshold
    why = _describe(model, target, reading)
    held = replace(previous, model=model)
    if target == current:
        return replace(held, rule=Rule.HOLD, detail=why)
    direction = 1 if target > current else -1
    # The batch the pod holds, not one a load passes on its way to another: a crossover that
    # wanders by a request with the accept length's noise would otherwise move the threshold
    # each time a swinging load passes it.
    steady = samples.held(
        own, now=now, seconds=tuning.settle_seconds, need=params.min_samples,
        batch_band=tuning.batch_band,
    )  # fmt: skip
    at = None if steady is None else round(steady[0])
    switches_here = at is not None and (at <= current) != (at <= target)
    if abs(target - current) <= params.hysteresis and not switches_here:
        return replace(held, rule=Rule.NO_GAIN, detail=f"{why}; within hysteresis of {current}")
    gain = _best_gain(own, model, current, target, now, params, tuning)
    # The margin guards against noise in the accept length and the profile, which move the
    # rates only through the decode steps' share of the pod's time.
    margin = tuning.switch_margin * (1.0 - _outside_share(own, now, tuning))
    if gain < 1 + margin:
        return replace(
            held, rule=Rule.NO_GAIN,
            detail=f"{why}; {current} -> {target} gains {gain - 1:+.1%} where the pod runs",
        )  # fmt: skip
    waited = now - previous.changed_at
    measured_since = reading is not None and reading.tried and reading.at > previous.changed_at
    if direction == -previous.moved and waited < params.cooldown_seconds and not measured_since:
        left = params.cooldown_seconds - waited
        return replace(held, rule=Rule.COOLDOWN, detail=f"{why}; cooling down {left:.0f}s")
    if direction == previous.moved and waited < tuning.settle_seconds:
        return replace(held, rule=Rule.SETTLING, detail=f"{why}; settling")
    return Decision(
        target, Rule.MOVE, f"{why}; {gain - 1:+.1%} where the pod runs", now, direction,
        readings=previous.readings, model=model,
    )  # fmt: skip


def _best_gain(
    own: Sequence[Sample],
    model: RateModel,
    current: int,
    target: int,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
) -> float:
    """The largest factor by which the mode `target` runs beats the one `current` runs, over
    the batches whose mode the move switches and that the pod ran within the last cooldown
    (give or take `batch_band`); 1.0 where there are none."""
    window = max(params.cooldown_seconds, 2 * params.min_samples * params.scrape_interval_seconds)
    ran = [s.batch for s in samples.newest_within(own, now=now, seconds=window) if s.batch > 0]
    if not ran:
        return 1.0
    low, high = min(ran), max(ran)
    first = max(min(current, target) + 1, math.ceil(low - samples.band(low, tuning.batch_band)))
    last = min(max(current, target), math.floor(high + samples.band(high, tuning.batch_band)))
    up = target > current
    gains = [
        r if up else 1 / r
        for b in range(first, last + 1)
        if (r := model.ratio(b)) is not None and r > 0
    ]
    return max(gains, default=1.0)


def _threshold_to_run(
    batch: float, speculating: bool, params: ControlSettings, tuning: Tuning
) -> int | None:
    """The threshold closest to running `batch` (and its band) in one mode, within the
    resource's bounds; None where they allow none."""
    width = samples.band(batch, tuning.batch_band)
    if speculating:
        value = math.ceil(batch + width)
        return value if value <= params.max_threshold else None
    value = max(0, math.ceil(batch - width) - 1)
    return value if value >= params.min_threshold else None


def _trial_or_not(
    previous: Decision,
    own: Sequence[Sample],
    model: RateModel,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
) -> Decision | Reading | None:
    """Step 3, once the pod's load holds: a trial of the other mode where one is worth it,
    else a reading that says none was (decided once per batch and lifetime: inputs that
    drift, such as an estimate while off converging, would otherwise start one late, after
    the load has run a while in the mode the trial would question). None until the load
    holds, or where the profile does not reach the pod's batch."""
    steady = samples.held(
        own,
        now=now,
        seconds=tuning.settle_seconds,
        need=params.min_samples,
        batch_band=tuning.batch_band,
    )
    if steady is None:
        return None
    batch, speculating = steady
    outside = 0.0 if model.profile.fitted else _outside_share(own, now, tuning)
    ratio = model.ratio(batch)
    # The spread of the mode it runs at this batch since the load and the workload came
    # there (within a cooldown), past its first settle_seconds: the load's arrival swings the
    # rates by more than its steady scrapes do, and a change of acceptance is a step in what
    # the model gets wrong, which a trial reads, not noise. Until that holds 2 x minSamples,
    # the pod waits to decide.
    window = max(params.cooldown_seconds, 2 * tuning.settle_seconds)
    newest = list(samples.newest_within(own, now=now, seconds=window))
    workload = samples.accept_length_now(newest) if speculating else None
    run = list(
        itertools.takewhile(
            lambda s: (
                s.speculating == speculating
                and samples.near(s.batch, batch, tuning.load_moved)
                and samples.same_workload(s, workload, tuning.workload_band)
            ),
            newest,
        )
    )[::-1]
    recent = [s for s in run if s.at > run[0].at + tuning.settle_seconds] if run else []
    if len(recent) < 2 * params.min_samples:
        return None
    noise = correction.phase_noise(recent, model, params.min_samples)
    need = params.min_samples
    # A phase holds minSamples samples after the one that spans the switch; a long prefill can
    # stretch a sample over several scrapes.
    spacing = max(params.scrape_interval_seconds, _spacing(recent))
    if ratio is None and not model.profile.fitted:
        return None  # beyond the engine's profile: a reading would correct nothing
    other = _threshold_to_run(batch, not speculating, params, tuning)
    horizon = _horizon(params, tuning)
    sigma = correction.prior_error(outside, tuning, model.tau_error)
    phase = (need + 1) * spacing
    # A trial is short and must be able to tell: a phase read within trial_resolution, ending
    # within twice the settle (a prefill-bound load whose samples swing or come seconds apart
    # reads the load's drift as much as the modes, and names the faster mode by chance).
    if other is None or (
        ratio is not None
        and (
            noise > tuning.trial_resolution
            or phase > 2 * tuning.settle_seconds
            or not correction.worth_a_trial(
                ratio, speculating, sigma=sigma, seconds=phase, horizon=horizon
            )
        )
    ):  # fmt: skip
        ratio_then = model.corrected(1.0).ratio(batch)
        return Reading(
            model.correction, sigma, model.correction, model.between, batch, now,
            tried=False, ratio=ratio_then,
        )  # fmt: skip
    trial = Trial(
        batch, not speculating, other, previous.threshold, ((now, None),), outside,
        model.between, phase, need,
    )  # fmt: skip
    mode = "speculation" if trial.speculating else "plain decoding"
    if ratio is None:
        why = f"{mode} at batch {batch:.0f}: never measured there"
    else:
        why = f"{mode} at batch {batch:.0f}: predicted {ratio:.2f}x speculating over plain"
        why += f", {outside:.0%} of the time outside decode steps"
    return replace(previous, threshold=other, rule=Rule.TRIAL, detail=why, trial=trial, model=model)


def _horizon(params: ControlSettings, tuning: Tuning) -> float:
    """How long a trial's gain is counted over: two cooldowns, the time a move and its
    reversal take, so a trial must pay for itself well within a minute at the defaults."""
    return max(2 * params.cooldown_seconds, tuning.settle_seconds)


def _spacing(recent: Sequence[Sample]) -> float:
    """The median time between consecutive samples of `recent` (in time order; 0: too few)."""
    gaps = sorted(b.at - a.at for a, b in itertools.pairwise(recent))
    return gaps[len(gaps) // 2] if gaps else 0.0


def _outside_share(own: Sequence[Sample], now: float, tuning: Tuning) -> float:
    """The median share of the pod's time outside decode steps over its recent samples."""
    shares = sorted(
        s.outside_steps
        for s in samples.newest_within(own, now=now, seconds=tuning.settle_seconds)
        if s.outside_steps is not None
    )
    return shares[len(shares) // 2] if shares else 0.0


def _phase_samples(
    own: Sequence[Sample],
    trial: Trial,
    speculating: bool,
    start: float,
    end: float,
    tuning: Tuning,
    *,
    switched: bool = True,
) -> list[Sample]:
    """One mode's samples taken in (start, end] at the trial's batch (within `load_moved`).
    Where the pod `switched` mode at `start`, its first sample after is left out: it holds
    the old mode's step in flight and times the new mode's first step from that step's
    launch, which read a phase of a few scrapes several percent off its steady rate."""
    taken = samples.since(own, start)
    return [
        s
        for s in (taken[1:] if switched else taken)
        if s.at <= end
        and s.speculating == speculating
        and samples.near(s.batch, trial.batch, tuning.load_moved)
    ]


def _continue_trial(
    previous: Decision,
    trial: Trial,
    own: Sequence[Sample],
    model: RateModel | None,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
) -> Decision:
    """Hold each phase of a trial until it has its samples at the trial's batch (`Trial.need`),
    then go to the next: the other mode, back to the pod's own, and after each round the
    reading."""
    started, returned = trial.rounds[-1]
    on_trial = returned is None
    phase_start = started if returned is None else returned
    if model is None:
        return _end_trial(previous, trial, f"nothing predicts the pod; back to {trial.back}")
    if _load_left(trial, own, phase_start, params.min_samples, tuning):
        return _end_trial(previous, trial, f"the load left its batch; back to {trial.back}")
    mode = trial.speculating if on_trial else not trial.speculating
    have = len(_phase_samples(own, trial, mode, phase_start, now, tuning))
    need = trial.need or params.min_samples
    give_up = 2 * max(trial.seconds, need * params.scrape_interval_seconds)
    if have < need and now - phase_start < give_up:
        rule = Rule.TRIAL if on_trial else Rule.TRIAL_RETURN
        return replace(
            previous, rule=rule, detail=f"{have} of {need} samples at batch {trial.batch:.0f}"
        )
    if not on_trial:
        return _read_trial(previous, trial, own, model, now, params, tuning, complete=have >= need)
    if have < need:
        return _end_trial(
            previous, trial, f"{have} samples in {give_up:.0f}s; back to {trial.back}"
        )
    return replace(
        previous, threshold=trial.back, rule=Rule.TRIAL_RETURN,
        detail=f"{have} samples of the trial; reading the pod's own mode again",
        trial=replace(trial, rounds=(*trial.rounds[:-1], (started, now))),
    )  # fmt: skip


def _load_left(
    trial: Trial, own: Sequence[Sample], since: float, need: int, tuning: Tuning
) -> bool:
    """Whether the pod's newest `need` samples since `since` all ran away from the trial's
    batch (beyond `load_moved`): nothing left to measure there."""
    newest = samples.since(own, since)[-need:]
    return len(newest) == need and not any(
        samples.near(s.batch, trial.batch, tuning.load_moved) for s in newest
    )


def _read_trial(
    previous: Decision,
    trial: Trial,
    own: Sequence[Sample],
    model: RateModel,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
    *,
    complete: bool,
) -> Decision:
    """A round's end: the reading over every round so far, and another round where it can
    name neither mode (and the round that ended got its samples), else the law on it. Done
    once the reading names the faster mode beyond its noise, or puts the modes within the
    switch margin of each other beyond it: a reading within its noise of level can hide a
    gain of twice the margin."""
    reading = _weigh(trial, own, model, now, params, tuning)
    if reading is None:
        return _end_trial(previous, trial, f"no usable samples; back to {trial.back}")
    ratio = model.corrected(reading.correction, reading.between).ratio(trial.batch) or 1.0
    spread = tuning.confidence * reading.error
    decided = abs(math.log(ratio)) >= spread
    level = abs(math.log(ratio)) + spread <= math.log(1 + tuning.switch_margin)
    started, returned = trial.rounds[-1]
    # Another round must pay for itself as the first did, the reading so far as the model.
    pays = correction.worth_a_trial(
        ratio, not trial.speculating, sigma=reading.error,
        seconds=(returned if returned is not None else now) - started,
        horizon=_horizon(params, tuning),
    )  # fmt: skip
    if not (level or decided) and len(trial.rounds) < tuning.max_rounds and complete and pays:
        again = replace(trial, rounds=(*trial.rounds, (now, None)))
        return replace(
            previous, threshold=trial.threshold, rule=Rule.TRIAL,
            detail=f"round {len(again.rounds)}: {ratio:.2f}x within +/-{reading.error:.0%}",
            trial=again,
        )  # fmt: skip
    after = replace(
        previous, threshold=trial.back, trial=None,
        readings=_keep(previous.readings, reading, tuning),
    )  # fmt: skip
    return _follow(after, own, model, now, params, tuning, may_trial=False)


def _weigh(
    trial: Trial,
    own: Sequence[Sample],
    model: RateModel,
    now: float,
    params: ControlSettings,
    tuning: Tuning,
) -> Reading | None:
    """The trial's reading over every round: the mode on trial against the pod's own mode
    before the first round and after each."""
    tried: list[Sample] = []
    brackets = [
        _phase_samples(own, trial, not trial.speculating, trial.began - tuning.settle_seconds,
                       trial.began, tuning, switched=False)
    ]  # fmt: skip
    rounds = trial.rounds
    for i, (started, returned) in enumerate(rounds):
        end = returned if returned is not None else now
        tried += _phase_samples(own, trial, trial.speculating, started, end, tuning)
        if returned is not None:
            until = rounds[i + 1][0] if i + 1 < len(rounds) else now
            brackets.append(
                _phase_samples(own, trial, not trial.speculating, returned, until, tuning)
            )
    return correction.weigh(
        tried, brackets, model=model.corrected(1.0, trial.between), outside=trial.outside,
        batch=trial.batch,
        at=now, tuning=tuning,
    )  # fmt: skip


def _end_trial(previous: Decision, trial: Trial, why: str) -> Decision:
    return replace(previous, threshold=trial.back, rule=Rule.TRIAL_ENDED, detail=why, trial=None)


def trial_event(previous: Decision, new: Decision) -> tuple[str, str] | None:
    """(mode tried: "speculation" | "plain", "started" | "read" | "ended") when `new` starts
    or ends a trial, else None: what the router counts in specgate_trials_total."""
    if new.trial is not None and previous.trial is None:
        return ("speculation" if new.trial.speculating else "plain"), "started"
    if previous.trial is not None and new.trial is None:
        mode = "speculation" if previous.trial.speculating else "plain"
        return mode, ("ended" if new.rule is Rule.TRIAL_ENDED else "read")
    return None
