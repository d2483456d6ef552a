"""When to speculate: measure each (target, draft) pair and run what is fastest.

``--speculative auto`` (the default) treats plain decoding and each draft
length k as arms of a bandit per (target, draft) pair. It measures plain
decoding and the default k, then climbs: it tries the lengths next to the
fastest measured one until none is faster, and runs the fastest. Every
``probe_every``-th job re-measures plain or a neighbour (the one measured
longest ago), so a pair whose draft stopped (or started) paying can win its
place back. Speed is generated tokens per second of decoding
(time to first token excluded), smoothed over jobs. A job that fixes
``num_draft_tokens`` gets exactly that. Greedy output is identical whichever
arm runs: speculative decoding never changes it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from worker.engine import GenerationOutput

PLAIN = 0
DEFAULT_KS = (1, 2, 3, 4, 5, 6, 8)
MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class Decision:
    """What a job runs: k draft tokens per round, or plain decoding (k == 0), and why."""

    k: int
    reason: str

    @property
    def speculative(self) -> bool:
        return self.k > 0


@dataclass
class Arm:
    runs: int = 0
    tokens_per_s: float = 0.0
    measured_at: int = -1  # the pair's job counter at the last measurement

    def update(self, value: float, at: int, weight: float = 0.3) -> None:
        self.tokens_per_s = (
            value if self.runs == 0 else ((1 - weight) * self.tokens_per_s + weight * value)
        )
        self.runs += 1
        self.measured_at = at


@dataclass
class PairStats:
    arms: dict[int, Arm] = field(default_factory=dict)
    jobs: int = 0


class SpeculationPolicy:
    """Chooses plain or speculative decoding (and k) per job, from measurements."""

    def __init__(
        self,
        mode: str = "auto",
        default_k: int = 3,
        ks: tuple[int, ...] = DEFAULT_KS,
        probe_every: int = 10,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"speculative mode must be one of {MODES}, not {mode!r}")
        self.mode, self.default_k, self.ks, self.probe_every = mode, default_k, ks, probe_every
        self.pairs: dict[tuple[str, str], PairStats] = {}
        self._lock = threading.Lock()

    def choose(self, target: str, draft: str, fixed_k: int | None = None) -> Decision:
        if self.mode == "never":
            return Decision(PLAIN, "policy never: draft ignored")
        if fixed_k is not None:
            return Decision(fixed_k, "num_draft_tokens fixed by the job")
        if self.mode == "always":
            return Decision(self.default_k, "policy always: worker default k")
        with self._lock:
            pair = self.pairs.setdefault((target, draft), PairStats())
            pair.jobs += 1
            measured = {k: a for k, a in pair.arms.items() if a.runs}
            for k in (PLAIN, self.default_k):
                if k not in measured:
                    return Decision(k, f"auto: measuring {_name(k)}")
            best = max(measured, key=lambda k: measured[k].tokens_per_s)
            near = self._neighbours(best)
            for k in near:
                # One job is a noisy reading: a neighbour that looked slower gets a
                # second look before the climb stops at it.
                if k not in measured or measured[k].runs < 2:
                    return Decision(k, f"auto: trying {_name(k)}, next to the best ({_name(best)})")
            if pair.jobs % self.probe_every == 0:
                probe = min((*near, PLAIN), key=lambda k: measured[k].measured_at)
                if probe != best:
                    return Decision(probe, f"auto: re-measuring {_name(probe)}")
            speed, plain = measured[best].tokens_per_s, measured[PLAIN].tokens_per_s
            return Decision(
                best,
                f"auto: {_name(best)} fastest measured ({speed:.1f} tok/s; plain {plain:.1f})",
            )

    def _neighbours(self, k: int) -> tuple[int, ...]:
        """Draft lengths next to ``k`` (hill climbing instead of trying every length)."""
        if k == PLAIN:
            return (min(self.ks),)
        i = self.ks.index(k) if k in self.ks else 0
        return tuple(self.ks[j] for j in (i - 1, i + 1) if 0 <= j < len(self.ks))

    def record(self, target: str, draft: str, decision: Decision, out: GenerationOutput) -> None:
        """Feed back a finished job's decoding speed."""
        decode_s = out.total_time_s - out.time_to_first_token_s
        if out.completion_tokens < 2 or decode_s <= 0:
            return
        speed = (out.completion_tokens - 1) / decode_s
        with self._lock:
            pair = self.pairs.setdefault((target, draft), PairStats())
            pair.arms.setdefault(decision.k, Arm()).update(speed, pair.jobs)

    def summary(self) -> dict[str, dict[str, float]]:
        """Measured tokens/s per arm, per pair (for the fleet registry and logs)."""
        return {
            f"{t} + {d}": {_name(k): round(a.tokens_per_s, 2) for k, a in sorted(p.arms.items())}
            for (t, d), p in self.pairs.items()
        }


def _name(k: int) -> str:
    return "plain decoding" if k == PLAIN else f"k={k}"
