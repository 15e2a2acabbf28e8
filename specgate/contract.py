"""The engine control contract: how specgate drives a (patched) SGLang engine.

One module that the simulator implements, the router uses, and the worker-image patch mirrors
(its pure functions have the same semantics and are tested against the same cases):

- set:  POST /set_internal_state {"server_args": {"speculative_disable_batch_threshold": N}}
        N: integer >= 0 (0 = never speculate) or null (= always speculate); a bad value gets
        HTTP 400 with a message and changes nothing (the accept-length counters included).
- read: GET /server_info -> "speculative_disable_batch_threshold";
        GET /metrics -> the gauges and counters named below;
        GET /v1/loads?include=core,spec -> live batch, queue and the `speculative` section.
- auth: every call but /health*, /metrics carries `Authorization: Bearer <engine API key>`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

THRESHOLD_KEY = "speculative_disable_batch_threshold"
MAX_THRESHOLD = 1 << 20

# Metric names (Prometheus text exposition; prometheus_client adds `_total` to counters).
METRIC_THRESHOLD = "sglang:spec_disable_batch_threshold"  # gauge; -1 means "always speculate"
METRIC_DECODE_STEPS = "sglang:spec_decode_steps_total"  # counter, label mode="on"|"off"
METRIC_ACCEPT_LENGTH = "sglang:spec_accept_length"  # gauge, over speculating steps only
METRIC_RUNNING = "sglang:num_running_reqs"
METRIC_QUEUED = "sglang:num_queue_reqs"
METRIC_GEN_TOKENS = "sglang:generation_tokens_total"  # counted when a request finishes

# SGLang 0.5.17's /v1/loads core section carries `decode_moments`, lifetime sums over decode
# steps (scheduler._accumulate_decode_moment), or null before the first one; a step's step_us
# is the launch interval from the previous decode step, prefills between them included. Unlike the
# generation-token counter, which grows only when a request finishes, these grow every step:
# the router's learning samples come from them.
DECODE_MOMENTS = ("steps", "batch", "step_us", "batch_sq", "batch_x_step_us", "generated")


# What an engine reports for the controller's prediction, in /v1/loads' `speculative` section
# (the simulator and the patched SGLang engine implement it; from an engine that does not, the
# router learns from samples alone):
# - "step_profile": {"on": [[batch, seconds], ...], "off": [[batch, seconds], ...]}, the
#   decode step time by batch with speculation on (the configured draft steps) and off (the
#   configured off-step tokens), ascending batches;
# - "num_steps", "off_step_tokens": the draft steps of a speculating step, the tokens a request
#   of an off step;
# - lifetime counters: "spec_request_steps" ((request, speculating step) pairs),
#   "spec_accepted_tokens" (accepted drafts over them), "spec_first_agreed" (pairs whose first
#   draft was accepted), "draft_first_proposed" and "draft_first_agreed" ((request, off step)
#   pairs where the draft proposed the next token, and those the target's token agreed with).
#   Counters, not gauges: the router reads acceptance over its own intervals, so a pod that
#   stopped speculating never reports a stale accept length.
STEP_PROFILE = "step_profile"
ACCEPTANCE_COUNTERS = (
    "spec_request_steps",
    "spec_accepted_tokens",
    "spec_first_agreed",
    "draft_first_proposed",
    "draft_first_agreed",
)
# - "uninterrupted_decode_steps", "uninterrupted_decode_us": lifetime counts of the decode
#   steps launched right after another decode step (no prefill between, under 2 s apart) and
#   the sum of those launch intervals in microseconds. What the profile predicts is a decode
#   step's own cost; SGLang's decode moments (step_us) also count the prefills run between two
#   decode steps, which cost the same in both modes and so do not move the crossover.
STEP_TIME_COUNTERS = ("uninterrupted_decode_steps", "uninterrupted_decode_us")
MAX_PROFILE_POINTS = 64
"""At most this many batch sizes per mode in a step profile (more are refused)."""


EngineOnlyField = Literal[
    "custom_logit_processor",  # serialized code the engine would run
    "custom_params",
    "lora_path",  # an adapter path on the engine's filesystem
    "session_id",  # engine-side sessions span requests, and so tenants
    "session_params",
    "bootstrap_host",  # disaggregation: where the engine connects
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
    "rid",  # request ids: another tenant's could be aborted
    "priority",  # the engine's queue order is the router's to set
    "return_hidden_states",
    "return_routed_experts",
    "custom_labels",  # metric labels: unbounded cardinality
]
ENGINE_ONLY_FIELDS: frozenset[str] = frozenset(get_args(EngineOnlyField))
"""SGLang request fields a client of the router may not set: each hands a tenant control of
the engine itself (code, files, connections, other requests, queue order, memory, metrics); a
resource may allow some (spec.router.allowedEngineFields), say lora_path for a deployment that
serves adapters."""


class ThresholdError(ValueError):
    """A threshold value the contract does not accept; the message says what would be."""


def parse_threshold(value: Any) -> int | None:
    """Validate a requested threshold: an int >= 0, or None for "always speculate".

    Booleans, floats (even 4.0), strings and negative numbers are refused: a silently coerced
    control value is worse than a clear 400.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ThresholdError(
            f"{THRESHOLD_KEY} must be an integer >= 0 or null, got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ThresholdError(
            f"{THRESHOLD_KEY} must be >= 0 (0 never speculates; null always does), got {value}"
        )
    if value > MAX_THRESHOLD:
        raise ThresholdError(f"{THRESHOLD_KEY} must be <= {MAX_THRESHOLD}, got {value}")
    return value


def parse_set_request(body: Any) -> int | None:
    """The threshold from a /set_internal_state body, or ThresholdError naming the problem."""
    if not isinstance(body, dict) or not isinstance(body.get("server_args"), dict):
        raise ThresholdError('body must be {"server_args": {"' + THRESHOLD_KEY + '": N}}')
    args = body["server_args"]
    unknown = sorted(set(args) - {THRESHOLD_KEY})
    if unknown:
        raise ThresholdError(f"unsupported server_args keys: {', '.join(unknown)}")
    if THRESHOLD_KEY not in args:
        raise ThresholdError(f"server_args must contain {THRESHOLD_KEY}")
    return parse_threshold(args[THRESHOLD_KEY])


def speculates(batch_size: int, threshold: int | None) -> bool:
    """The mode decision: speculate while the real decode batch is at or below the threshold."""
    return threshold is None or batch_size <= threshold


def threshold_gauge(threshold: int | None) -> float:
    return -1.0 if threshold is None else float(threshold)


def set_request(threshold: int | None) -> dict[str, Any]:
    return {"server_args": {THRESHOLD_KEY: threshold}}
