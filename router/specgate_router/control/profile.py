"""Decode step seconds by batch in both modes: as an engine reports them, or as a pod's samples
show them where its engine reports none.

The law asks, for every pod on every control step, at which batches speculation pays. A
profile keeps both modes' step times at every whole batch it covers, interpolated once per
profile (`steps`), so that question costs a few multiplications a batch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from specgate import contract
from specgate_router.control.samples import Sample

FITTED_BINS_PER_OCTAVE = 4
"""A profile fitted from samples groups their batches in quarter octaves (19% wide, about the
spread of a steady load's batch between scrapes)."""


def finite_number(value: Any) -> float:
    """`value` as a float, or ValueError when it is not a finite number (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StepProfile:
    """Decode step seconds by batch, speculating (`on`) and not (`off`).

    `fitted`: made from samples (`fitted_from_samples`): its "steps" are seconds per output
    token of one request, delivered, so the law takes one token a step in both modes and
    interpolates only between batches at most twice apart."""

    on: tuple[tuple[float, float], ...]
    off: tuple[tuple[float, float], ...]
    off_step_tokens: int = 1
    num_steps: int = 3
    fitted: bool = False

    @classmethod
    def from_wire(
        cls, data: Any, *, off_step_tokens: Any = 1, num_steps: Any = 3
    ) -> StepProfile | None:
        """The profile from /v1/loads, or None when absent; ValueError when malformed (a
        hostile or broken engine's numbers never reach the controller)."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise ValueError(f"{contract.STEP_PROFILE} must be an object with 'on' and 'off'")
        modes = {}
        for mode in ("on", "off"):
            points = data.get(mode)
            if not isinstance(points, list) or not 1 <= len(points) <= contract.MAX_PROFILE_POINTS:
                raise ValueError(
                    f"{contract.STEP_PROFILE}.{mode} must list 1-{contract.MAX_PROFILE_POINTS}"
                    " [batch, seconds] pairs"
                )
            parsed = []
            for point in points:
                if not (isinstance(point, list | tuple) and len(point) == 2):
                    raise ValueError(f"{contract.STEP_PROFILE}.{mode}: [batch, seconds] pairs")
                batch, seconds = (finite_number(v) for v in point)
                if not (1 <= batch <= contract.MAX_THRESHOLD and 0 < seconds <= 60):
                    raise ValueError(
                        f"{contract.STEP_PROFILE}.{mode}: batch {batch} or {seconds} s out of range"
                    )
                parsed.append((batch, seconds))
            parsed.sort()
            if len({b for b, _ in parsed}) != len(parsed):
                raise ValueError(f"{contract.STEP_PROFILE}.{mode}: a batch size appears twice")
            modes[mode] = tuple(parsed)
        k, n = finite_number(off_step_tokens), finite_number(num_steps)
        if not (k == int(k) and 1 <= k <= 256 and n == int(n) and 1 <= n <= 16):
            raise ValueError(f"off_step_tokens {k} or num_steps {n} out of range")
        return cls(modes["on"], modes["off"], int(k), int(n))

    def step_seconds(self, batch: float, speculating: bool) -> float | None:
        """Interpolated linearly between profiled batches; None beyond them (no guessing), and
        in a fitted profile between batches more than twice apart."""
        points = self.on if speculating else self.off
        if not points or batch < points[0][0] or batch > points[-1][0]:
            return None
        i = bisect.bisect_left(points, (batch, -math.inf))
        if points[i][0] == batch or i == 0:
            return points[i][1]
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        if self.fitted and b1 > 2 * b0:
            return None
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    @property
    def lowest(self) -> int:
        """The smallest whole batch both modes are profiled at (1 where one mode has none)."""
        return math.ceil(max(self.on[0][0], self.off[0][0])) if self.on and self.off else 1

    def top(self) -> float:
        """The largest batch both modes are profiled at (0 where one mode has none)."""
        return min(self.on[-1][0], self.off[-1][0]) if self.on and self.off else 0.0

    @cached_property
    def steps(self) -> tuple[tuple[float, float] | None, ...]:
        """(t_on(b), t_off(b)) at every whole batch b from 0 to `top` (None where either mode
        is not profiled)."""
        out: list[tuple[float, float] | None] = [None] * (math.floor(self.top()) + 1)
        for b in range(self.lowest, len(out)):
            on, off = self.step_seconds(b, True), self.step_seconds(b, False)
            out[b] = None if on is None or off is None else (on, off)
        return tuple(out)


def fitted_from_samples(samples: Sequence[Sample], *, now: float, need: int) -> StepProfile | None:
    """Each mode's seconds per output token of one request by batch, from `samples` (a pod
    keeps its last ten minutes'): the median of each quarter octave of batches that holds
    `need` or more. None where neither mode has such a batch; where one has none, a profile
    that predicts nothing yet (a trial fills it in)."""
    bins: dict[tuple[bool, int], list[Sample]] = {}
    for s in samples:
        if s.at <= now and s.batch >= 1 and s.tokens_per_second > 0:
            key = (s.speculating, round(FITTED_BINS_PER_OCTAVE * math.log2(s.batch)))
            bins.setdefault(key, []).append(s)
    modes: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for (speculating, _), members in sorted(bins.items()):
        if len(members) < need:
            continue
        batches = sorted(s.batch for s in members)
        seconds = sorted(1.0 / s.per_request for s in members)
        modes[speculating].append((batches[len(batches) // 2], seconds[len(seconds) // 2]))
    if not modes[True] and not modes[False]:
        return None
    return StepProfile(
        tuple(modes[True]), tuple(modes[False]), off_step_tokens=1, num_steps=1, fitted=True
    )
