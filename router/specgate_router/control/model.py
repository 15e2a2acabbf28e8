"""The rates the law compares: each mode's expected output per request at every batch.

From what the engine reports, a request at decode batch b spends per output token

    speculating   t_on(b) / tau + q * b        off   t_off(b) / k + q * b

(t_*: the step profile; tau: the accept length; k: the off-step tokens; q: the seconds the pod
spends between decode steps per token it generates, mostly prefills, measured from its own
samples and taken to be the same in both modes, since both prefill the same requests; a
request waits for the prefills of a whole batch). One measured correction, rho, multiplies the
speculating rate: what the trials read between the two modes' delivered-over-predicted
(`correction.Reading`). Speculation pays at b where

    ratio(b) = rho * (t_off(b) / k + q b) / (t_on(b) / tau + q b) >= 1

and the threshold is the top of the band of batches where it pays that holds the pod's batch.
For a profile fitted from samples tau = k = 1 and q = 0: its step times are delivered seconds
per token, prefills included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specgate_router.control.profile import StepProfile


@dataclass(frozen=True)
class RateModel:
    profile: StepProfile
    tau: float
    """The accept length the speculating rate is predicted with (1 for a fitted profile)."""
    source: str
    """Where `tau` comes from: "measured", "estimated while off (calibrated)", "siblings'"..."""
    between: float = 0.0
    """q: seconds between decode steps per generated token, the pod's own (0: none measured)."""
    correction: float = 1.0
    """rho: the modes' delivered-over-predicted, speculating over off (1: none measured)."""
    tau_error: float = 0.0
    """How far (as a share) `tau` may be from what speculation would measure (0: measured)."""

    def corrected(self, correction: float, between: float | None = None) -> RateModel:
        """This model with the correction `correction`, and `between` where given (a reading's:
        its correction was read against the rates with that q)."""
        return replace(
            self, correction=correction, between=self.between if between is None else between
        )

    def seconds_per_token(
        self, batch: float, speculating: bool, tau: float | None = None
    ) -> float | None:
        """Uncorrected seconds per output token of one request at `batch` in one mode, its
        decode step's share plus its wait between steps (None: not profiled there), with
        accept length `tau` where given (a sample's own) instead of the model's."""
        step = self.profile.step_seconds(batch, speculating)
        if step is None:
            return None
        if self.profile.fitted:
            return step
        tokens = (self.tau if tau is None else tau) if speculating else self.profile.off_step_tokens
        return step / tokens + self.between * batch

    def ratio(self, batch: float) -> float | None:
        """Corrected speculating over off rate per request at `batch` (None: not profiled)."""
        steps = self.profile.steps
        b = round(batch)
        if not 0 <= b < len(steps) or (pair := steps[b]) is None:
            return None
        return self._ratio(b, pair)

    def _ratio(self, b: int, pair: tuple[float, float]) -> float:
        on, off = pair
        if self.profile.fitted:
            return self.correction * off / on
        wait = self.between * b
        return (
            self.correction * (off / self.profile.off_step_tokens + wait) / (on / self.tau + wait)
        )

    def threshold(self, batch: float | None, *, low: int, high: int) -> int | None:
        """The top of the band of batches where speculation pays that holds `batch` (or, where
        it does not pay at `batch`, the top of the nearest such band below it: plain decoding
        from there up), within [low, high]; for an idle pod (`batch` None), the largest batch
        where it pays. Where the profile stops first, the threshold stops at its top: beyond
        it the model cannot say. None where the profile does not cover `batch`."""
        steps = self.profile.steps
        top = min(high, len(steps) - 1)

        def pays(b: int) -> bool:
            pair = steps[b]
            return pair is not None and self._ratio(b, pair) >= 1.0

        if batch is None or batch < 1:
            best = next((b for b in range(top, 0, -1) if pays(b)), 0)
        else:
            at = min(top, max(1, round(batch)))
            if steps[at] is None:
                return None
            if pays(at):
                best = at
                while best < top and pays(best + 1):
                    best += 1
            else:
                best = at - 1
                while best > 0 and not pays(best):
                    best -= 1
        return min(max(best, low), high)
