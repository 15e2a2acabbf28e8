"""The speculation controller: where each pod's speculation-disable threshold goes.

One law (`decision`): each mode's output rate per request at every batch, from the engine's
step profile and acceptance (`model`, `acceptance`, `profile`), times one measured correction
(`correction`); the threshold is the top of the band of batches where speculation pays that
holds the pod's batch; a short trial of the other mode reads the correction where it is stale
and could change the answer; pushes wait for a gain, a cooldown or a settle. `samples` turns
scrapes into what the law reads, `fleet` runs one step for every pod, `pools` sizes the latency
pool, `tuning` holds every tuning value. All pure: time is an argument.
"""

from specgate_router.control.acceptance import (
    Acceptance,
    AcceptanceTracker,
    chain_accept_length,
    counters_from_wire,
    uninterrupted_step_seconds,
)
from specgate_router.control.correction import Reading
from specgate_router.control.decision import (
    Decision,
    Rule,
    Trial,
    decide,
    initial_decision,
    trial_event,
)
from specgate_router.control.fleet import PodInput, each_decision, models, step
from specgate_router.control.model import RateModel, measured_scale
from specgate_router.control.profile import StepProfile, fitted_from_samples
from specgate_router.control.samples import (
    STEADY_MODE_FRACTION,
    Sample,
    median_batch,
    pool_samples,
    sample_between,
)
from specgate_router.control.tuning import TUNING, Tuning

__all__ = [
    "STEADY_MODE_FRACTION",
    "TUNING",
    "Acceptance",
    "AcceptanceTracker",
    "Decision",
    "PodInput",
    "RateModel",
    "Reading",
    "Rule",
    "Sample",
    "StepProfile",
    "Trial",
    "Tuning",
    "chain_accept_length",
    "counters_from_wire",
    "decide",
    "each_decision",
    "fitted_from_samples",
    "initial_decision",
    "measured_scale",
    "median_batch",
    "models",
    "pool_samples",
    "sample_between",
    "step",
    "trial_event",
    "uninterrupted_step_seconds",
]
