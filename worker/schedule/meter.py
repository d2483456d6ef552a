"""What a running batch measures of itself, fed back to the speculation policy.

Decoding steps are pooled per batch size (a step that prefilled, and the one after
it, are left out: their time is not decoding) and reported every
:data:`MEASURE_STEPS` steps; the whole batch (every step, joins and its tail
included) is reported once it ends.
"""

from __future__ import annotations

from worker.schedule.grouping import BatchKey
from worker.schedule.policy import SpeculationPolicy

#: Steps pooled per batch size before the measured speed goes to the policy.
MEASURE_STEPS = 16


class BatchMeter:
    """Measures one batch's steps and reports them to ``policy`` under ``key``."""

    def __init__(self, policy: SpeculationPolicy, key: BatchKey) -> None:
        self.policy, self.key = policy, key
        self.tokens, self.seconds = 0, 0.0  # of every step (whole-batch speed)
        self.peak_size = 0
        self._speeds: dict[int, list[float]] = {}  # batch size -> [seconds, steps, tokens]
        self._prefilled = True  # whether the last step prefilled

    def step(self, sequences: int, tokens: int, seconds: float, prefilled: bool) -> None:
        """One step of ``sequences`` decoding ``tokens`` in ``seconds``."""
        self.tokens += tokens
        self.seconds += seconds
        if not (prefilled or self._prefilled) and sequences >= 1:
            pooled = self._speeds.setdefault(sequences, [0.0, 0, 0])
            pooled[0] += seconds
            pooled[1] += 1
            pooled[2] += tokens
            if pooled[1] >= MEASURE_STEPS:
                self._report(sequences)
        self._prefilled = prefilled

    def held(self, size: int) -> None:
        """The batch holds ``size`` jobs now."""
        self.peak_size = max(self.peak_size, size)

    def close(self) -> None:
        """The batch has ended: report what is pooled, and the whole batch's speed."""
        for size in list(self._speeds):
            self._report(size)
        if self.peak_size > 1:
            model, adapter, draft, k, adaptive = self.key
            self.policy.sizes.record_whole(
                model, adapter, self.tokens, self.seconds, draft, k, adaptive
            )

    def _report(self, size: int) -> None:
        seconds, _, tokens = self._speeds.pop(size)
        model, adapter, draft, k, adaptive = self.key
        self.policy.sizes.record(model, adapter, size, int(tokens), seconds, draft, k, adaptive)
