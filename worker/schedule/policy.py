"""When to speculate: measure each (target, draft) pair and run what is fastest.

``--speculative auto`` (the default) decides per pair from measurements on real jobs:
plain decoding speed; the draft's acceptance p, pooled over the pair's speculative jobs
(``worker.schedule.estimators.Acceptance``); a speculative round's time, fitted as a line
in k. It measures plain, the default k and twice that, predicts each k's speed as
(1 - p^(k+1)) / (1 - p) tokens per round over the round's time, and runs the fastest.
While plain wins, the draft is tried again at k=1 after ``probe_every`` jobs, backing off
up to 16x; while a draft wins, every ``10 * probe_every``-th job measures plain again. A
job that fixes ``num_draft_tokens`` gets exactly that; greedy output is the same
whichever runs.

Batching or speculating: when more jobs wait in its queue, auto compares the pair's best
single-stream speed with the measured aggregate speeds, at about that many jobs, of a
plain batch and of a speculative batch that picks each round's k
(``worker.schedule.goodput``), and runs the fastest (a speculative batch must beat the
plain one by :data:`SPEC_BATCH_MARGIN`); a deep queue that meets a measured pair first
batches once each way, to measure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas import ChatRequest
from worker.schedule.batchsize import PLAIN, BatchMemory
from worker.schedule.estimators import Acceptance, AffineCost, Running, expected_tokens

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 8)
MODES = ("auto", "always", "never")
#: The "draft" of jobs that speculate by prompt lookup (``worker.engine.lookup``), in the
#: policy's measurements and a batch's key: measured per target like any draft.
LOOKUP = "<prompt lookup>"
#: What ``--lookup`` does for jobs that name no draft: ``never`` (prompt lookup only for
#: jobs that ask for it), ``auto`` (prompt lookup, run as ``--speculative`` decides),
#: ``always`` (prompt lookup speculates whenever it is used).
LOOKUP_MODES = ("never", "auto", "always")
#: Proposal lengths auto predicts for prompt lookup (its proposals cost no draft pass).
LOOKUP_KS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class Decision:
    """What a job runs: k draft tokens per round, or plain decoding (k == 0), and why."""

    k: int
    reason: str
    probe: bool = False  # a re-measurement of an arm that is not winning
    adaptive: bool = False  # a speculative batch choosing each round's k, up to k
    # A measuring job stops speculating once it measures slower than this (plain's
    # tokens/s, known by then): what loses need not be paid to the job's end.
    give_up_below: float | None = None

    @property
    def speculative(self) -> bool:
        return self.k > 0


@dataclass(frozen=True)
class JobSpeed:
    """What a finished job tells the policy: its completion tokens, the seconds after
    its first (decoding), and (speculative) draft tokens accepted and rejections
    (rounds that stopped before their last proposal)."""

    tokens: int
    decode_s: float
    accepted: int = 0
    rejections: int = 0


@dataclass
class PairStats:
    arms: dict[int, Running] = field(default_factory=dict)
    accept: Acceptance = field(default_factory=Acceptance)  # pooled over its jobs
    jobs: int = 0
    last_probe: int = 0  # the job counter at the last re-measurement
    probe_interval: int = 0  # jobs between draft probes while plain wins (0: not yet set)
    own_spec_jobs: int = 0  # speculative jobs measured here (behind ``accept``'s own part)
    fleet_jobs: int = 0  # job measurements taken from the fleet's figures (0: none)

    @property
    def acceptance(self) -> float:
        """p: the chance the target agrees with the next draft token."""
        return self.accept.rate(0.0, weight=0.0)

    def round_seconds(self, k: int) -> float:
        """Seconds per round at draft length k: a line fitted to the lengths measured."""
        cost = AffineCost({j: a.value for j, a in self.arms.items() if j != PLAIN and a.runs})
        return max(cost.predict(k), 1e-6)

    def predicted(self, ks: tuple[int, ...]) -> dict[int, float]:
        """Predicted tokens/s for each draft length in ``ks``."""
        p = self.acceptance
        return {k: expected_tokens(p, k) / self.round_seconds(k) for k in ks}


#: How much faster (tokens/s of whole batches, else at about the queue's depth) a
#: speculative batch must measure than a plain batch for auto to choose it: what a
#: draft costs besides its passes (its weights and KV cache in memory) must buy something.
SPEC_BATCH_MARGIN = 1.05


class SpeculationPolicy:
    """Chooses plain or speculative decoding (and k) per job, from measurements."""

    def __init__(
        self,
        mode: str = "auto",
        default_k: int = 3,
        ks: tuple[int, ...] = DEFAULT_KS,
        probe_every: int = 10,
        lookup: str = "never",
        lookup_k: int = 4,
        sizes: BatchMemory | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"speculative mode must be one of {MODES}, not {mode!r}")
        if lookup not in LOOKUP_MODES:
            raise ValueError(f"lookup mode must be one of {LOOKUP_MODES}, not {lookup!r}")
        self.mode, self.default_k, self.ks, self.probe_every = mode, default_k, ks, probe_every
        self.lookup, self.lookup_k = lookup, lookup_k
        self.pairs: dict[tuple[str, str], PairStats] = {}
        # what batches measured (fed by the runner's meters; read to choose batching)
        self.sizes = sizes if sizes is not None else BatchMemory()
        # (target, draft) pairs a speculative batch cannot hold, and why
        self.no_spec_batch: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        #: Called before the first decision on (target, adapter, proposer) in this process
        #: (``worker.runner.figures``: the fleet's figures are read then); False: call
        #: again before the next one (a model was not on this machine yet).
        self.on_first_use: Callable[[str, str | None, str | None], bool] | None = None
        self._used: set[tuple[str, str | None, str | None]] = set()

    @property
    def lock(self) -> threading.Lock:
        """Held while the pairs' figures change (``worker.schedule.shared`` reads them)."""
        return self._lock

    def first_use(self, target: str, adapter: str | None, proposer: str | None) -> None:
        """Before deciding for a (target, adapter, proposer): the first time, call
        :attr:`on_first_use` (which may seed measurements); then nothing."""
        key = (target, adapter, proposer)
        if key in self._used:
            return
        if self.on_first_use is None or self.on_first_use(target, adapter, proposer):
            self._used.add(key)

    def proposer(self, req: ChatRequest) -> str | None:
        """What proposes a job's speculative tokens, as the policy names it: the draft it
        names, :data:`LOOKUP`, or None (it never speculates)."""
        method = req.speculation_method
        if method == "draft":
            return req.draft_model
        if method == "prompt_lookup" or (method is None and self.lookup != "never"):
            return LOOKUP
        return None

    def fixed_k(self, req: ChatRequest) -> int | None:
        """The k a job fixes for itself (``num_draft_tokens``, or prompt lookup's
        ``num_tokens``), if it does."""
        if req.speculation is not None and req.speculation.num_tokens is not None:
            return req.speculation.num_tokens
        return req.num_draft_tokens

    def _mode(self, draft: str) -> str:
        """``--speculative`` for this proposer (``--lookup always`` makes prompt lookup's
        always, unless speculation is off)."""
        if draft == LOOKUP and self.lookup == "always" and self.mode != "never":
            return "always"
        return self.mode

    def _k(self, draft: str) -> int:
        return self.lookup_k if draft == LOOKUP else self.default_k

    def _ks(self, draft: str) -> tuple[int, ...]:
        return LOOKUP_KS if draft == LOOKUP else self.ks

    def refuse_spec_batch(self, target: str, draft: str, reason: str) -> None:
        """A speculative batch could not take a job of this pair (``reason``): its jobs
        run alone or in plain batches from now on."""
        with self._lock:
            self.no_spec_batch[(target, draft)] = reason

    def batch_instead(
        self,
        target: str,
        draft: str,
        adapter: str | None,
        depth: int,
        fixed_k: int | None = None,
    ) -> Decision | None:
        """How a draft job with ``depth`` jobs waiting runs in a batch, or None.

        A decision with k == 0 batches it without the draft, k > 0 in a speculative
        batch at that k (``adaptive``: each round's k chosen by the batch, up to k);
        None means: run it alone, as :meth:`choose` decides. ``always`` (or a job that
        fixes its k) batches speculatively at that k; ``never`` batches plainly;
        ``auto`` measures one at a time, a plain batch and an adaptive speculative
        batch (up to twice the default k), and runs the fastest.
        """
        if depth < 2:
            return None
        mode = self._mode(draft)
        if mode == "never":
            return Decision(PLAIN, "policy never: draft ignored, batched")
        refused = self.no_spec_batch.get((target, draft))
        if refused is not None and (fixed_k is not None or mode == "always"):
            return None  # speculative, then, but alone
        if fixed_k is not None:
            return Decision(fixed_k, f"{_fixed(draft)} fixed by the job: batched at k={fixed_k}")
        if mode == "always":
            k = self._k(draft)
            return Decision(k, f"policy always: speculative batch at k={k}")
        with self._lock:
            pair = self.pairs.get((target, draft))
            if pair is None or self._to_measure(pair, draft) is not None:
                return None  # measure the pair one job at a time first
            alone = max(pair.arms[PLAIN].value, *pair.predicted(self._ks(draft)).values())
            batched = self.sizes.rate(target, adapter, depth)
            if batched is None:
                return Decision(PLAIN, f"auto: measuring batching ({depth} jobs waiting)")
            if refused is not None:
                if batched >= alone:
                    return Decision(PLAIN, f"auto: {refused}; batched without the draft")
                return None
            cap = self._explore(draft)[-1]
            spec_rate = self.sizes.rate(target, adapter, depth, draft)
            if spec_rate is None:
                reason = f"auto: measuring speculative batching (k per round, up to {cap})"
                return Decision(cap, reason, adaptive=True)
            # Which kind of batch: by what whole batches of each kind delivered, once
            # known (a speculative batch's rows end unevenly, each at its own acceptance,
            # so a finite queue ends in a tail its per-size rates do not show).
            plain_whole = self.sizes.whole_rate(target, adapter, None)
            spec_whole = self.sizes.whole_rate(target, adapter, draft)
            if plain_whole is not None and spec_whole is not None:
                spec_vs, plain_vs = spec_whole, plain_whole
            else:
                spec_vs, plain_vs = spec_rate, batched
            over_batched = spec_vs >= SPEC_BATCH_MARGIN * plain_vs or batched < alone
            if spec_rate >= alone and over_batched:
                return Decision(
                    cap,
                    f"auto: a speculative batch (k per round, up to {cap}; {spec_vs:.1f} tok/s) "
                    f"beats batching without the draft ({plain_vs:.1f}) and one at a time "
                    f"({alone:.1f})",
                    adaptive=True,
                )
            if batched >= alone:
                return Decision(
                    PLAIN,
                    f"auto: batching about {depth} jobs ({batched:.1f} tok/s) beats "
                    f"one at a time ({alone:.1f} tok/s), and without the draft "
                    f"({plain_vs:.1f}) a speculative batch ({spec_vs:.1f})",
                )
            return None

    def _explore(self, draft: str) -> tuple[int, ...]:
        ks, k = self._ks(draft), self._k(draft)
        second = min((j for j in ks if j >= 2 * k), default=max(ks))
        return (PLAIN, k, second)

    def _to_measure(self, pair: PairStats, draft: str) -> int | None:
        """The next arm auto measures for ``pair`` (plain, k, then 2k), or None when done.
        An arm its own measurements already say loses is skipped: a round at k costs at
        least what a measured round at a smaller k did, so k can emit at most
        ``expected_tokens(p, k)`` tokens in that time; below plain's speed, it loses."""
        for k in self._explore(draft):
            if pair.arms.get(k, Running()).runs:
                continue
            shorter = [j for j, a in pair.arms.items() if PLAIN < j < k and a.runs]
            if k != PLAIN and shorter and PLAIN in pair.arms:
                fastest = expected_tokens(pair.acceptance, k) / pair.arms[max(shorter)].value
                if fastest < pair.arms[PLAIN].value:
                    continue
            return k
        return None

    def choose(self, target: str, draft: str, fixed_k: int | None = None) -> Decision:
        mode = self._mode(draft)
        if mode == "never":
            return Decision(PLAIN, "policy never: draft ignored")
        alone = f"; alone: {r}" if (r := self.no_spec_batch.get((target, draft))) else ""
        if fixed_k is not None:
            return Decision(fixed_k, f"{_fixed(draft)} fixed by the job{alone}")
        if mode == "always":
            return Decision(self._k(draft), f"policy always: worker default k{alone}")
        with self._lock:
            pair = self.pairs.setdefault((target, draft), PairStats())
            pair.jobs += 1
            k = self._to_measure(pair, draft)
            plain_arm = pair.arms.get(PLAIN)
            plain_tps = plain_arm.value if plain_arm is not None and plain_arm.runs else None
            if k is not None:
                return Decision(k, f"auto: measuring {_name(k)}", give_up_below=plain_tps)
            plain = pair.arms[PLAIN].value
            predicted = pair.predicted(self._ks(draft))
            best_k = max(predicted, key=predicted.__getitem__)
            best = best_k if predicted[best_k] > plain else PLAIN
            # Re-measure what is not running. While plain wins: the draft at the
            # cheapest length (k=1 measures acceptance as well as any), after
            # probe_every jobs, then twice as long after each probe that changes
            # nothing, up to 16x (a draft that loses costs ever less; one that
            # starts paying is found within 16 * probe_every jobs). While a draft
            # wins: plain every 10 * probe_every jobs (plain speed hardly drifts,
            # and each speculative job keeps measuring acceptance).
            if best == PLAIN:
                probe, every = min(self._ks(draft)), pair.probe_interval or self.probe_every
            else:
                probe, every = PLAIN, 10 * self.probe_every
                pair.probe_interval = self.probe_every
            if pair.jobs - pair.last_probe >= every:
                pair.last_probe = pair.jobs
                if best == PLAIN:
                    pair.probe_interval = min(2 * every, 16 * self.probe_every)
                return Decision(
                    probe,
                    f"auto: re-measuring {_name(probe)}",
                    probe=True,
                    give_up_below=plain_tps if probe != PLAIN else None,
                )
            return Decision(
                best,
                f"auto: {_name(best)} fastest (predicted k={best_k} "
                f"{predicted[best_k]:.1f} tok/s at acceptance {pair.acceptance:.2f}; "
                f"plain {plain:.1f} tok/s measured{_fleet(pair)})",
            )

    def record(self, target: str, draft: str, decision: Decision, job: JobSpeed) -> None:
        """Feed back a finished job's speed, acceptance and round time."""
        if job.tokens < 2 or job.decode_s <= 0:
            return
        with self._lock:
            pair = self.pairs.setdefault((target, draft), PairStats())
            arm = pair.arms.setdefault(decision.k, Running())
            if decision.k == PLAIN:
                arm.update((job.tokens - 1) / job.decode_s, pair.jobs)
                return
            rounds = job.tokens - job.accepted
            if rounds <= 0:
                return
            arm.update(job.decode_s / rounds, pair.jobs)
            pair.own_spec_jobs += 1
            # Older evidence fades; a probe after a long plain stretch is a fresh
            # look at today's workload, so it mostly replaces what came before.
            pair.accept.add(job.accepted, job.rejections, fade=0.1 if decision.probe else 0.9)

    def acceptance(self, target: str, draft: str) -> float | None:
        """The pair's measured acceptance (speculating one job at a time), if any."""
        with self._lock:
            pair = self.pairs.get((target, draft))
            if pair is None or not pair.accept.seen:
                return None
            return pair.acceptance

    def summary(self) -> dict[str, dict[str, float]]:
        """Per pair: plain tok/s, acceptance, and predicted tok/s per k (registry, logs)."""
        out: dict[str, dict[str, float]] = {}
        for (t, d), p in self.pairs.items():
            row: dict[str, float] = {}
            if PLAIN in p.arms:
                row["plain decoding"] = round(p.arms[PLAIN].value, 2)
            if any(k != PLAIN for k in p.arms):
                row["acceptance"] = round(p.acceptance, 3)
                row |= {f"k={k}": round(v, 2) for k, v in p.predicted(self._ks(d)).items()}
            out[f"{t} + {d}"] = row
        return out


def _fixed(draft: str) -> str:
    """What a job fixes its k with, for this proposer."""
    return "speculation.num_tokens" if draft == LOOKUP else "num_draft_tokens"


def _fleet(pair: PairStats) -> str:
    """Where figures came from the fleet (``worker.schedule.shared``): how many jobs."""
    return f"; fleet figures of {pair.fleet_jobs} job(s) included" if pair.fleet_jobs else ""


def _name(k: int) -> str:
    return "plain decoding" if k == PLAIN else f"k={k}"
