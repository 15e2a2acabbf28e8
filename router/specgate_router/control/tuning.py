"""Every tuning value of the control law, in one place.

The resource sets the law's bounds and pace (`spec.speculative.control`: mode, threshold,
bounds, hysteresis, cooldown, how long a trial's reading stays current); the router its timing
(scrape interval, samples per trial phase). What remains is here: ten numbers, each with the
reason for its value. Tests and the lab may pass another `Tuning`; the router runs `TUNING`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    switch_margin: float = 0.03
    """A move must switch the mode, at a batch the pod ran within the last cooldown, to one the
    law predicts at least this much faster there. At the crossover both modes deliver the same,
    and noise in the acceptance would otherwise switch a stationary load back and forth; a pod
    kept in a mode slower by less loses less than the 3% the better-of-two target allows."""

    outside_spread: float = 0.5
    """How far (as a log ratio) the two modes' time between decode steps per token may differ:
    the model takes it to be the same (both prefill the same requests), but a speculating
    batch finishes several requests a step and prefills them together, paying a prefill's
    fixed cost once, and a speculating prefill adds the draft's. The law's uncertainty grows
    with the share of the pod's time spent there."""

    batch_band: float = 0.15
    """Batches within this fraction of each other (at least one request) count as one: the
    spread of a steady closed-loop load's batch between scrapes."""

    load_moved: float = 1.5
    """A reading speaks for batches within this factor of the one it was taken at (and two
    requests); a trial whose load leaves that range ends without one. Under an open-loop load
    the mode on trial moves the batch itself, by up to its speed-up over the other."""

    workload_band: float = 0.10
    """The acceptance holds still while the accept length measured now (or estimated from the
    agreement's latest reading) lies within this fraction of the smoothed one: a trial starts
    only then, since one taken while the workload moves reads the move."""

    settle_seconds: float = 5.0
    """A trial needs its load held this long (batch, mode and workload) and its phases to take
    at most twice this; a move in the direction of the last one (the same change still
    arriving, such as an accept length settling after a change of workload) waits this long
    rather than a cooldown."""

    max_rounds: int = 3
    """A trial alternates the modes (other, own) for at most this many rounds: more while its
    reading, pooled over the rounds so far, cannot name the faster mode beyond its noise."""

    trial_resolution: float = 0.10
    """A trial runs only where a phase of `minSamples` scrapes reads the pod's rate within this
    standard error (log ratio, from the spread of its recent scrapes). Where prompts of
    thousands of tokens swing half-second rates by 2x, a trial names the faster mode by chance
    and its reading biases the correction; the model, within its 10-15% error, is the better
    guess there."""

    confidence: float = 2.0
    """Standard errors a reading must lie from level (after the prior) to end its trial early."""

    prior_sigma: float = 0.15
    """How far (as a log ratio) the profile's decode steps may err between the modes: about
    what a start-up profile off by 10% per mode gives. With `outside_spread`, what a reading
    is weighed against: one within its scrapes' noise moves the correction less than one
    measured precisely."""


TUNING = Tuning()
"""The values the router runs."""
