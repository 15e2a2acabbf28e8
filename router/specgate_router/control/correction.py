"""The law's one measured correction, and how sure of its rates the law is.

The step profile times decode steps. What runs between them (prefills, and the draft's share
of a speculating prefill), a start-up profile taken on a busier GPU and a draft's acceptance
that varies along its chain all move what a pod delivers away from what its profile predicts,
and not alike in both modes. One factor carries all of it:

    rho = (delivered / predicted while speculating) / (delivered / predicted while off)

read in a trial: the pod runs the other mode for a few scrapes and its own again, and each
sample's delivered rate is divided by what the model predicts at that sample's own batch and
accept length. The mode the pod left is read on both sides of the trial, so a host whose speed
drifts moves both alike (a bracket).

Before any reading the law trusts its rates to within a log-normal spread: `prior_sigma`,
widened by `outside_spread` times the share of the pod's time spent between decode steps. The
same spread decides whether a trial is worth running (what the other mode could gain, should
it be faster, against what the trial costs should it not, and scrapes steady enough to tell)
and how far a reading moves the correction (a reading within its scrapes' noise moves it less
than one measured precisely).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from specgate_router.control.model import RateModel
from specgate_router.control.samples import Sample, mean_and_error, near
from specgate_router.control.tuning import Tuning


@dataclass(frozen=True)
class Reading:
    """The correction at `batch` as of `at`: a trial's verdict, or (`tried` False) the law's
    decision that no trial was worth running there, which stands as long as a verdict would."""

    correction: float
    """rho after weighing the trial against the prior (1: the modes as the profile has them)."""
    error: float
    """Its standard error, as a log ratio."""
    measured: float
    """rho as the trial's samples read it, before weighing."""
    between: float
    """The model's q when the trial began: the correction was read against rates with it."""
    batch: float
    at: float
    tried: bool = True
    ratio: float | None = None
    """The uncorrected model's speculating over off rate at `batch` when taken (with q at
    `between`): where the model has since moved (the workload's acceptance, say), the reading
    no longer speaks for the pod."""

    def current(
        self,
        batch: float | None,
        now: float,
        lifetime: float,
        tuning: Tuning,
        ratio_now: float | None = None,
    ) -> bool:
        """Whether it still speaks for a pod at `batch` (None: idle) at `now`, where the
        uncorrected model puts speculating over off at `ratio_now` at this reading's batch:
        within `lifetime` of being taken, at a batch within `tuning.load_moved` of its own,
        and the model within `tuning.workload_band` of where it was."""
        if now - self.at > lifetime:
            return False
        moved = (
            self.ratio is not None
            and ratio_now is not None
            and ratio_now > 0
            and abs(math.log(ratio_now / self.ratio)) > math.log(1 + tuning.workload_band)
        )
        if moved:
            return False
        return batch is None or near(batch, self.batch, tuning.load_moved)


def prior_error(outside: float, tuning: Tuning, tau_error: float = 0.0) -> float:
    """How far (log ratio) the uncorrected rates may be off between the modes, for a pod that
    spends a share `outside` of its time between decode steps, where its accept length may be
    off by `tau_error` (a share: an estimate while off), which moves the speculating rate's
    decode share."""
    share = min(1.0, max(0.0, outside))
    return math.hypot(tuning.prior_sigma, tuning.outside_spread * share, (1.0 - share) * tau_error)


def worth_a_trial(
    ratio: float,
    speculating: bool,
    *,
    sigma: float,
    seconds: float,
    horizon: float,
) -> bool:
    """Whether a trial of the other mode (or another round of one) pays: a pod running
    speculation (or not) where the law puts speculating over off at `ratio`, within a
    log-normal spread `sigma`. The other mode may be faster; what switching to it on the
    trial's word would then gain over `horizon` seconds (the expected gain, zero where it is
    slower) must outweigh what running it for `seconds` costs where the law is right."""
    if ratio <= 0 or sigma <= 0:
        return False
    ahead = -math.log(ratio) if speculating else math.log(ratio)  # the other mode's log lead
    z = ahead / sigma
    gain = sigma * _normal_pdf(z) + ahead * _normal_cdf(z)
    return gain * horizon >= max(0.0, -ahead) * seconds


def _normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def log_corrections(samples: Sequence[Sample], model: RateModel) -> list[float]:
    """log(delivered / predicted) of each sample that has what its prediction needs (a batch,
    tokens, and while speculating an accept length), in order."""
    out = []
    for s in samples:
        if s.batch <= 0 or s.tokens_per_second <= 0:
            continue
        tau = s.accept_length if s.speculating else None
        if s.speculating and tau is None and not model.profile.fitted:
            continue
        seconds = model.seconds_per_token(s.batch, s.speculating, tau)
        if seconds is not None and seconds > 0:
            out.append(math.log(s.per_request * seconds))
    return out


def phase_noise(samples: Sequence[Sample], model: RateModel, need: int) -> float:
    """The standard error (log) of a trial phase of `need` scrapes, from the spread of
    `samples` (the pod's recent ones, past the load's arrival) about their mean; inf with
    fewer than three."""
    values = log_corrections(samples, model)
    _, error = mean_and_error(values)
    if not math.isfinite(error):
        return math.inf
    return error * math.sqrt(len(values) / need)


def weigh(
    trial: Sequence[Sample],
    brackets: Sequence[Sequence[Sample]],
    *,
    model: RateModel,
    outside: float,
    batch: float,
    at: float,
    tuning: Tuning,
) -> Reading | None:
    """The reading of a trial: `trial`, the samples of the mode on trial (all rounds), against
    `brackets`, the mode the pod left, read before the first round and after each (in time
    order). Each trial round is held to the brackets either side of it, so the ends count
    half (trapezoid weights); the drift between neighbouring brackets counts as noise. None
    when the trial or its brackets hold no usable sample."""
    tried = log_corrections(trial, model)
    parts = [c for c in (log_corrections(b, model) for b in brackets) if c]
    if not tried or not parts:
        return None
    speculating = trial[0].speculating
    weights = (
        [1.0]
        if len(parts) == 1
        else [0.5 if i in (0, len(parts) - 1) else 1.0 for i in range(len(parts))]
    )
    total = sum(weights)
    stats = [mean_and_error(p) for p in parts]
    reference = sum(w * m for w, (m, _) in zip(weights, stats, strict=True)) / total
    tried_mean, tried_error = mean_and_error(tried)
    errors = [tried_error, *(e for _, e in stats)]
    if all(math.isfinite(e) for e in errors):
        bracket_error = math.sqrt(
            sum((w * e) ** 2 for w, (_, e) in zip(weights, stats, strict=True))
        )
        drift = [abs(a - b) / 2 for (a, _), (b, _) in itertools.pairwise(stats)]
        drift_error = math.sqrt(sum(d * d for d in drift)) / len(drift) if drift else 0.0
        noise = math.sqrt(tried_error**2 + (bracket_error / total) ** 2 + drift_error**2)
    else:
        noise = prior_error(outside, tuning)  # too few scrapes to tell their spread
    measured = tried_mean - reference if speculating else reference - tried_mean
    prior = prior_error(outside, tuning)
    weight = prior**2 / (prior**2 + noise**2) if noise > 0 else 1.0
    return Reading(
        correction=math.exp(weight * measured),
        error=math.sqrt(weight) * noise,
        measured=math.exp(measured),
        between=model.between,
        batch=batch,
        at=at,
        ratio=model.ratio(batch),
    )
