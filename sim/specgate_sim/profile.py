"""Calibration profiles: how long an engine step takes and how many drafted tokens are accepted.

A profile is a data file (`profiles/*.json`) naming its source figures; `targets` are those
figures, and a test checks that the simulator reproduces each within 10%.

Step-time model (a roofline: a step costs its fixed overhead plus the larger of reading the
weights and KV cache, or computing every verified token), with B = b ** batchExponent:

    verify(b, n) = overhead + max(weights + B * kv, n * B * compute)
    on(b)        = verify(b, numSteps + 1) + numSteps * (draftOverhead + B * draftPerRequest)
    off(b)       = verify(b, 1) + b * syncPerRequest     (the patched engine's plain step, which
                                                           also extends the draft KV cache)
    off(b, K)    = overhead + K * (verify(b, 1) - overhead + b * syncPerRequest)

An off step of K tokens a request (`--speculative-off-step-tokens K`) runs K plain forwards for
one step's overhead. The fitted overhead lumps the host's work with the GPU's fixed costs, so
where that is large the model reads a K-token step's saving high (BENCHMARKS.md, "Simulator
calibration", compares it with the GPU).

A speculating step gives each request 1 + accepted tokens, accepted drawn from a chain of
`numSteps` Bernoulli trials at `perTokenRate`, times `positionDecay` for each position after
the first (the first rejection ends the chain).
"""

from __future__ import annotations

import json
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

PROFILE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Batch sizes of an engine's step-cost profile (SGLang's CUDA-graph sizes, thinned)."""


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class StepCosts(_Model):
    overhead_s: float = Field(ge=0)
    weights_s: float = Field(ge=0)
    kv_s_per_request: float = Field(ge=0)
    compute_s_per_token: float = Field(gt=0)
    draft_overhead_s: float = Field(ge=0)
    draft_s_per_request: float = Field(ge=0)
    sync_s_per_request: float = Field(default=0.0, ge=0)
    batch_exponent: float = Field(default=1.0, gt=0, le=1)
    """1: per-request costs grow linearly with the batch. Below 1 they grow sub-linearly, as
    the host work of a small model's step does (its per-request share amortises)."""


class PrefillCosts(_Model):
    overhead_s: float = Field(ge=0)
    s_per_token: float = Field(ge=0)
    draft_overhead_s: float = Field(default=0.0, ge=0)
    """What a prefill costs more when the batch it joins speculates: the draft's own prefill
    and first proposals, where the patched engine's off mode only writes the draft's KV. It
    makes the modes differ in what they spend between decode steps, which the step profile
    does not see."""
    draft_s_per_token: float = Field(default=0.0, ge=0)


class Acceptance(_Model):
    per_token_rate: float = Field(ge=0, le=1)
    position_decay: float = Field(default=1.0, ge=0, le=1)
    """The draft's acceptance at chain position j is per_token_rate * position_decay^(j-1): real
    drafts accept less the further they guess (1: every position alike)."""


class Target(_Model):
    what: str
    speculating: bool
    concurrency: int = Field(ge=1)
    tok_s: float = Field(gt=0)
    prompt_tokens: int = Field(default=128, ge=1)
    output_tokens: int = Field(default=256, ge=1)
    """The closed-loop requests the figure was measured with."""


class Profile(_Model):
    name: str
    description: str
    source: str
    max_running_requests: int = Field(ge=1)
    max_total_tokens: int = Field(ge=1)
    context_length: int = Field(ge=1)
    num_steps: int = Field(ge=1, le=16)
    step: StepCosts
    prefill: PrefillCosts
    acceptance: Acceptance
    targets: list[Target] = Field(default_factory=list)

    def verify_time(self, batch: int, tokens_per_request: int) -> float:
        s = self.step
        scaled: float = float(batch) ** s.batch_exponent
        memory = s.weights_s + scaled * s.kv_s_per_request
        compute = tokens_per_request * scaled * s.compute_s_per_token
        return s.overhead_s + max(memory, compute)

    def step_time(self, batch: int, speculating: bool, off_step_tokens: int = 1) -> float:
        """Seconds one decode step of `batch` running requests takes; an off step decodes
        `off_step_tokens` tokens a request."""
        s = self.step
        if speculating:
            scaled: float = float(batch) ** s.batch_exponent
            draft = self.num_steps * (s.draft_overhead_s + scaled * s.draft_s_per_request)
            return self.verify_time(batch, self.num_steps + 1) + draft
        plain = self.verify_time(batch, 1) + batch * s.sync_s_per_request
        # overhead + K * (plain - overhead), written so that K = 1 is `plain` to the bit: a
        # rounding difference moves the fleet simulations' event order.
        return plain + (off_step_tokens - 1) * (plain - s.overhead_s)

    def host_time(self, speculating: bool) -> float:
        """The part of a decode step's time the host sets, as the model splits it: the step's
        fixed overhead, and each draft step's where it speculates (an off step of K tokens
        pays one overhead). What a slow spell of a shared host stretches (`HostSpells`)."""
        s = self.step
        return s.overhead_s + (self.num_steps * s.draft_overhead_s if speculating else 0.0)

    def prefill_time(self, prompt_tokens: int, speculating: bool = False) -> float:
        p = self.prefill
        seconds = p.overhead_s + prompt_tokens * p.s_per_token
        if speculating:
            seconds += p.draft_overhead_s + prompt_tokens * p.draft_s_per_token
        return seconds

    def mean_accept_length(self) -> float:
        """Expected tokens per request per speculating step (accepted drafts + the bonus token)."""
        return chain_accept_length(
            self.acceptance.per_token_rate, self.acceptance.position_decay, self.num_steps
        )

    def steady_throughput(self, batch: int, speculating: bool, off_step_tokens: int = 1) -> float:
        """Analytic output tok/s with `batch` requests always running (no prefill)."""
        per_step = batch * (self.mean_accept_length() if speculating else off_step_tokens)
        return per_step / self.step_time(batch, speculating, off_step_tokens)

    def step_profile(
        self, off_step_tokens: int = 1, max_batch: int | None = None
    ) -> dict[str, list[list[float]]]:
        """Decode step seconds by batch in both modes, as the patched engine exports its
        start-up profile (`contract.STEP_PROFILE`): at the batch sizes it captures CUDA graphs
        for, up to its running limit."""
        top = max_batch or self.max_running_requests
        batches = sorted({b for b in PROFILE_BATCHES if b <= top} | {top})
        return {
            "on": [[b, self.step_time(b, True)] for b in batches],
            "off": [[b, self.step_time(b, False, off_step_tokens)] for b in batches],
        }

    def crossover_batch(self) -> int:
        """Largest batch at which speculating delivers more tokens/s than not."""
        best = 0
        for b in range(1, self.max_running_requests + 1):
            if self.steady_throughput(b, True) > self.steady_throughput(b, False):
                best = b
        return best


def chain_accept_length(rate: float, decay: float, steps: int) -> float:
    """1 + the expected accepted drafts of a chain of `steps` whose position j accepts at
    rate * decay^(j-1)."""
    total, reach = 1.0, 1.0
    for j in range(steps):
        reach *= rate * decay**j
        total += reach
    return total


def available() -> list[str]:
    folder = resources.files("specgate_sim") / "profiles"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


MAX_PROFILE_BYTES = 1024 * 1024


def load(name: str) -> Profile:
    """A packaged profile by name, or a path to a profile JSON file; ValueError in one line
    (the file, the field, what is wrong) for an unknown name or a malformed file."""
    if name.endswith(".json"):
        try:
            with open(name, "rb") as f:
                raw = f.read(MAX_PROFILE_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"{name}: {exc.strerror or exc}") from None
        if len(raw) > MAX_PROFILE_BYTES:
            raise ValueError(f"{name}: larger than {MAX_PROFILE_BYTES} bytes")
        source = name
    else:
        path = resources.files("specgate_sim") / "profiles" / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"unknown profile {name!r}; available: {', '.join(available())}")
        raw, source = path.read_bytes(), name
    try:
        return Profile.model_validate(json.loads(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ValueError(f"{source}: {where}: {first['msg']}{more}") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{source}: not a JSON profile ({type(exc).__name__})") from None
