"""Speculative decoding inside a continuous batch.

Each round, for every live sequence at once: the draft proposes up to k tokens
(k batched draft passes), the target verifies all of them in one batched pass of
k + 1 tokens, each sequence accepts its own prefix under mlx-lm's rule (a draft
token is kept while it equals the token the target samples at its position:
greedy, exact match), and both models' caches are rewound per sequence. Rewinding
row by row uses mlx-lm's own ``BatchKVCache`` left padding: what every row rejects
is trimmed off the end, and the rest of a row's rejected tail is rolled round to
the left of its filled part, where the attention mask skips it. Sequences join
(all that joined since the last round prefilled together, then appended) and
leave between rounds, as in :class:`worker.engine.batch.BatchEngine`; under a prefill
budget (``prefill_budget``, as there) each joining row prefills a chunk per round on
its own caches, sized to the budget, and is appended once its prompt is in. Without a
draft model, each row proposes from its own text (prompt lookup,
``worker.engine.lookup``): rows with no match this round propose nothing (their
verify positions past their proposals are padding, dropped as rejected); with a drafter
(an EAGLE-3, MTP or DFlash drafter, ``worker.engine.heads``), from the target's hidden states,
recorded during its own prefill and verify passes. A model with
any layer that is not plain KV (sliding window, recurrent state) is rewound by
replay instead: its caches go back to a checkpoint taken before the pass, and the
target runs again over each row's kept tokens (right-padded; the draft sees its
rows' kept tokens at its next pass). This engine and ``BatchEngine`` are both
Engines (``worker.engine.protocol``), so a continuous batch runs either (how many
rows it holds is the caller's decision).

Pure MLX and mlx-lm; knows nothing of Redis or jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

from worker.engine import rewind
from worker.engine.batch import UNPADDED_PREFILL, budget_chunk
from worker.engine.drafters import Head, State
from worker.engine.kvquant import positions
from worker.engine.layers import count as cache_count
from worker.engine.layers import nbytes
from worker.engine.lookup import NgramIndex
from worker.engine.models import LoadedModel
from worker.engine.output import GenerationOutput
from worker.engine.prefill import PREFILL_STEP, prefill
from worker.engine.protocol import NO_START, CannotTake, DraftPlanner, Finished, Start, Step
from worker.engine.request import Prepared
from worker.engine.sampling import logits_processors, pick, sampler_for
from worker.engine.sequence import OnText, Sequence
from worker.engine.speculate import GiveUp, accepted, counted, draft_unseen

Cache = list[Any]


@dataclass
class _Row(Sequence):
    """One sequence of a speculative batch, plus its draft state."""

    processors: list[Any] = field(default_factory=list)
    sampler: Any = None
    history: list[int] = field(default_factory=list)  # prompt + generated
    pending: list[int] = field(default_factory=list)  # tokens the draft has not seen yet
    index: NgramIndex | None = None  # prompt lookup's, without a draft model


def _extend(batch: Cache | None, rows: Cache) -> Cache:
    """``rows`` (batch caches of joining sequences) appended to ``batch``."""
    if batch is None:
        return rows
    for b, r in zip(batch, rows, strict=True):
        b.extend(r)
    return batch


@dataclass
class _Joiner:
    """A row waiting to be prefilled: what is left of its prompt, its starting caches."""

    row: _Row
    rest: list[int]  # prompt tokens still to prefill (all but the cached ones and the last)
    target: Cache
    draft: Cache  # [] without a draft model
    fed: State | None = None  # a drafter's state for it, fed chunk by chunk under a budget


def _next(j: _Joiner) -> list[int]:
    """The token after each of ``j``'s prompt tokens still to prefill (a drafter pairs
    the state at p with the token at p + 1)."""
    return [*j.rest, j.row.history[-1]][1:]


def _listed(drafts: mx.array | None, rows: int) -> list[list[int]]:
    """A round's proposals per row (padded to the round's k), as lists."""
    return drafts.tolist() if drafts is not None else [[] for _ in range(rows)]


def _drop_tail(cache: Cache, tails: list[int]) -> None:
    """Remove the last ``tails[i]`` positions of row i: what all rows drop is cut off the
    end; the rest of each row's tail is rolled round to its left, where it is padding
    (the mask skips it). Only the filled part of the buffers moves."""
    cut = min(tails, default=0)
    extra = [t - cut for t in tails]
    for c in cache:
        if cut:
            c.trim(cut)
        if max(extra, default=0) <= 0:
            continue
        shift = mx.array(extra)
        n = c.size()
        for x in positions(c):  # keys and values (or their quantized triples)
            x[..., :n, :] = dynamic_roll(x[..., :n, :], shift[:, None], axis=2)
        c.offset = c.offset - shift
        c.left_padding = c.left_padding + shift


class SpecBatchEngine:
    """A continuous batch on (target, draft) that decodes speculatively: k draft tokens
    per round, or, with a ``planner``, each round the k in 0..k it chooses for the rows
    held (``worker.schedule.goodput``; k = 0 is a plain step). ``draft`` None: each row
    proposes up to k tokens by prompt lookup (its job's ``params.lookup``), or, with a
    ``drafter`` (an EAGLE-3, MTP or DFlash drafter, ``worker.engine.heads``), from the target's
    hidden states.

    ``solo``: one row on its own caches (a job alone); ``give_up_below`` (tokens/s,
    solo only): it stops proposing once it measures slower than that."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        k: int,
        planner: DraftPlanner | None = None,
        *,
        solo: bool = False,
        give_up_below: float | None = None,
        prefill_budget: int | None = None,
        drafter: Head | None = None,
    ) -> None:
        if drafter is not None and draft is not None:
            raise ValueError("a drafter proposes instead of a draft model, not beside one")
        self.target, self.draft, self.k, self.solo = target, draft, k, solo
        self.drafter = drafter
        #: A drafter's state for the rows held (None without a drafter).
        self.hidden: State | None = drafter.rows() if drafter is not None else None
        #: Prompt tokens one round may prefill (None: joiners prefill whole, together).
        self.prefill_budget = None if solo else prefill_budget
        #: Prompt tokens per second measured, both models (running; None before any).
        self.prefill_rate: float | None = None
        self.models = (target,) if draft is None else (target, draft)
        self.give_up = None
        if give_up_below is not None:
            if not solo or planner is not None:
                raise ValueError("give_up_below is a job alone's rule (solo, no planner)")
            self.give_up = planner = GiveUp(k, give_up_below)
        self.planner = planner
        self.eos = frozenset(int(t) for t in target.tokenizer.eos_token_ids)
        self.rows: list[_Row] = []
        self.joining: list[_Joiner] = []
        self.t_cache: Cache | None = None
        self.d_cache: Cache | None = None
        self.rounds = 0
        self.replays = 0  # target passes that re-ran kept tokens (recurrent state)
        self.verify_s = self.replay_s = 0.0  # seconds in verify passes and in replays
        # A batch rewinds layers that are not all plain KV by checkpoint and replay; a
        # solo row only recurrent ones (set as it joins).
        self.t_replay = not target.plain_kv
        self.d_replay = draft is not None and not draft.plain_kv
        #: A worker group's rank 0: each round's proposals, then what the rows kept, told
        #: to the other ranks, which verify the same (``worker.engine.mirror``).
        self.tell: Callable[[dict[str, Any]], None] | None = None

    # -- the Engine interface ------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        drafter = self.hidden.caches if self.hidden is not None else None
        return nbytes((self.t_cache or []) + (self.d_cache or []) + (drafter or []))

    @property
    def prefilling(self) -> int:
        """Prompt tokens of joining rows still to prefill."""
        return sum(len(j.rest) for j in self.joining)

    @property
    def prefill_steps(self) -> int:
        if not self.joining:
            return 0
        if self.prefill_budget is None:
            return 1  # (joiners prefill whole at the next step)
        return max(1, -(-max(len(j.rest) for j in self.joining) // self._chunk()))

    def _chunk(self) -> int:
        """Prompt tokens each joining row prefills at the next round under the budget."""
        assert self.prefill_budget is not None
        return budget_chunk(PREFILL_STEP, self.prefill_budget, len(self.joining))

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)

    def _all(self) -> list[_Row]:
        return self.rows + [j.row for j in self.joining]

    def lengths(self) -> dict[Hashable, tuple[int, int]]:
        return {r.tag: r.length() for r in self._all()}

    def first_token_at(self, tag: Hashable) -> float | None:
        return next((r.first_token_at for r in self._all() if r.tag == tag), None)

    def add(
        self,
        tag: Hashable,
        job: Prepared,
        start: Start = NO_START,
        on_text: OnText | None = None,
        first: bool = False,
    ) -> None:
        """Add ``job``'s prompt as a row: it is prefilled on both models at the next
        :meth:`step`, together with every other row that joined meanwhile (so ``first``
        changes nothing), then decodes.
        ``start.cache``: the target's layers then the draft's, holding the first
        ``start.cached`` prompt tokens."""
        if self.solo and len(self):
            raise CannotTake("a job alone is one sequence: this engine holds one already")
        prompt, params = job.prompt, job.params
        n_t = cache_count(self.target.model)
        if start.cache is None:
            t_layers, d_layers, cached = None, None, 0
        else:
            t_layers, d_layers, cached = start.cache[:n_t], start.cache[n_t:], start.cached
        t_layers = t_layers or self.target.new_cache()
        d_layers = (d_layers or self.draft.new_cache()) if self.draft else []
        why = rewind.unsupported(t_layers + d_layers, batch=not self.solo)
        for m in self.models:
            if not self.solo and m.config.get("model_type") in UNPADDED_PREFILL:
                why = f"{m.config['model_type']} cannot prefill padded rows exactly"
        if why:
            what = "this pair" if self.draft is not None else "this model"
            where = "speculation" if self.solo else "a speculative batch"
            raise CannotTake(f"{where} cannot hold {what}: {why}")
        if self.solo:  # (a seeded row draws from its own key: sampler_for)
            mx.reset_peak_memory()
        row = _Row(
            tag,
            len(prompt),
            params,
            self.target.tokenizer.detokenizer,
            start.reused,
            on_text,
            processors=logits_processors(params),
            sampler=sampler_for(params),
            history=list(prompt),
            pending=[prompt[-1]],
            index=NgramIndex(params.lookup, prompt) if self._looks_up(params) else None,
        )
        self.joining.append(_Joiner(row, prompt[cached:-1], t_layers, d_layers))

    def _looks_up(self, params: Any) -> bool:
        """Whether this engine's rows propose by prompt lookup (a group's follower's do
        not: it verifies what rank 0 proposed)."""
        return self.draft is None and self.drafter is None and params.lookup is not None

    def _prefill(self, tokens: Any, cache: Cache) -> mx.array | None:
        """The target prefills ``tokens`` into ``cache``; with a drafter, the hidden
        states it reads come back too."""
        if self.drafter is None:
            prefill(self.target.model, tokens, cache)
            return None
        with self.drafter.tap:
            prefill(self.target.model, tokens, cache)
        return self.drafter.tap.take()

    def _feed(self, joiners: list[_Joiner], states: mx.array | None) -> None:
        """A drafter's rows for ``joiners``, fed the pairs of their prompts the target just
        prefilled (``states``), appended to the batch's (a solo row's, its own)."""
        assert self.drafter is not None and self.hidden is not None
        if states is None:  # nothing prefilled now: as fed chunk by chunk, or not at all
            new = [j.fed if j.fed is not None else self.hidden.add(1) for j in joiners]
        else:
            rows = self.hidden.add(len(joiners))
            rows.feed(states, [_next(j) for j in joiners])
            new = [rows]
        if self.solo:
            self.close_drafter()
        assert self.hidden is not None
        for rows in new:
            self.hidden.extend(rows)

    def _join(self, joiners: list[_Joiner]) -> None:
        """Prefill what is left of ``joiners``' prompts (right-padded, one batched pass per
        chunk on each model) and append them to the batch; a solo row on its own caches."""
        if self.solo:
            (j,) = joiners
            states = self._prefill(j.rest, j.target)
            if self.drafter is not None:
                self._feed([j], states)
            self.t_cache, self.t_replay = j.target, rewind.needs_replay(j.target)
            if self.draft is not None:
                prefill(self.draft.model, j.rest, j.draft)
                self.d_cache, self.d_replay = j.draft, rewind.needs_replay(j.draft)
            self.rows = [j.row]
            return
        rests = [j.rest for j in joiners]
        width = max(len(r) for r in rests)
        pad = [width - len(r) for r in rests]
        tokens = mx.array([r + [0] * (width - len(r)) for r in rests]) if width else None
        batches: list[Cache] = []
        models = [(self.target.model, [j.target for j in joiners])]
        if self.draft is not None:  # (the same model may be both)
            models.append((self.draft.model, [j.draft for j in joiners]))
        states = None
        for model, layers in models:
            batch = [first.merge([row[i] for row in layers]) for i, first in enumerate(layers[0])]
            if tokens is not None:
                for c in batch:
                    c.prepare(lengths=[len(r) for r in rests], right_padding=pad)
                if model is self.target.model:
                    states = self._prefill(tokens, batch)
                else:
                    prefill(model, tokens, batch)
                for c in batch:
                    c.finalize()
            batches.append(batch)
        if self.drafter is not None:
            self._feed(joiners, states)
        self.t_cache = _extend(self.t_cache, batches[0])
        if self.draft is not None:
            self.d_cache = _extend(self.d_cache, batches[1])
        self.rows.extend(j.row for j in joiners)

    def remove(self, tag: Hashable) -> GenerationOutput | None:
        held = next((r for r in self._all() if r.tag == tag), None)
        self.joining = [j for j in self.joining if j.row.tag != tag]
        keep = [i for i, r in enumerate(self.rows) if r.tag != tag]
        if len(keep) < len(self.rows):
            self._keep(keep)
        return held.cut_short() if held is not None else None

    def close(self) -> None:
        self.rows, self.joining, self.t_cache, self.d_cache = [], [], None, None
        self.close_drafter()

    def close_drafter(self) -> None:
        """A drafter's state for no rows (nothing without a drafter)."""
        self.hidden = self.drafter.rows() if self.drafter is not None else None

    # -- one round ------------------------------------------------------------
    def step(self) -> Step:
        """One speculative round for every row: draft, verify, accept, rewind (after
        prefilling the rows that joined since the last round)."""
        joined = self._joined()
        rows = self.rows
        if not rows:
            return Step(0, [], joined, decoding=0)
        assert self.t_cache is not None
        now = time.perf_counter()
        left = [r.left for r in rows]
        tags = [r.tag for r in rows]
        k = self.planner.plan(tags, left) if self.planner else self.k
        ks = [min(k, n) for n in left]
        d_mark, caps = None, ks
        if self.hidden is not None:  # the drafter's, from the target's states
            kr = max(ks)
            drafts = self.hidden.propose(kr) if kr else None
        elif self.draft is None:  # each row's own lookup; padded to the longest
            found, ks = self._lookup(ks)
            kr = max(ks)
            drafts = mx.array(found, mx.uint32) if kr else None
        else:
            kr = max(ks)
            drafts, d_mark = self._draft(kr) if kr else (None, None)  # (B, kr)
        if drafts is not None and (self.planner is not None or self.tell is not None):
            mx.eval(drafts)  # (lazy otherwise: the planner is told the draft's own time)
        if self.tell is not None:
            self.tell({"op": "proposed", "drafts": _listed(drafts, len(rows))})
        drafted = time.perf_counter()
        verify_in, t_mark = self._verify_input(drafts, kr)
        if self.drafter is not None:
            with self.drafter.tap:
                logits = self.target.model(verify_in, cache=self.t_cache)
            states = self.drafter.tap.take()
        else:
            logits = self.target.model(verify_in, cache=self.t_cache)  # (B, kr + 1, V)
        chosen, vectors = self._sample_verify(logits, drafts, ks)
        proposed = _listed(drafts, len(rows))
        verified = time.perf_counter()
        done: list[Finished] = []
        t_tail, keep, emitted, accepts = [], [], 0, []
        for i, row in enumerate(rows):
            a = accepted(chosen[i], proposed[i], ks[i])
            accepts.append(a)
            t_tail.append(kr - a)
            finish = None
            for j in range(a + 1):
                token = chosen[i][j]
                row.history.append(token)
                emitted += 1
                p, kept, r = counted(j, a, ks[i])
                row.draft_proposed += p
                row.draft_accepted += kept
                row.draft_rejections += r
                finish = row.emit(token, self.eos, vectors(i, j))
                if finish is not None:
                    break
            row.idle_rounds += caps[i] > 0 and ks[i] == 0  # (a lookup that found nothing)
            if finish is None:
                keep.append(i)
            else:
                done.append((row.tag, self._finish(row, finish)))
        if self.tell is not None:
            last = [r.history[-1] for r in rows]
            self.tell({"op": "kept", "accepts": accepts, "last": last, "keep": keep})
        self._rewind_target(t_mark, t_tail, verify_in, accepts)
        if self.hidden is not None:  # each row's kept tokens, with the states before them
            self.hidden.feed(states, [chosen[i][: a + 1] for i, a in enumerate(accepts)])
        if self.d_cache is not None:
            restored = self._rewind_draft(d_mark, kr, accepts)
            for i, row in enumerate(rows):
                row.pending = draft_unseen(
                    proposed[i], chosen[i], accepts[i], restored, row.pending
                )
        if len(keep) < len(rows):
            self._keep(keep)
        self.rounds += 1
        self.verify_s += verified - drafted
        if self.planner:
            total = time.perf_counter() - now
            times = (drafted - now, verified - drafted, total)
            self.planner.observe(tags, accepts, ks, kr, times, emitted)
        return Step(emitted, done, joined, decoding=len(rows))

    def _joined(self) -> bool:
        """Prefill the rows that joined since the last round (under a budget, a chunk of
        each; those whose prompt is in are appended); whether any prefilled."""
        if not self.joining:
            return False
        if self.prefill_budget is None:
            joiners, self.joining = self.joining, []
            self._join(joiners)
            return True
        chunk, fed, t = self._chunk(), 0, time.perf_counter()
        for j in self.joining:
            n = min(chunk, len(j.rest))
            if n:
                states = self._prefill(j.rest[:n], j.target)
                if self.hidden is not None:
                    j.fed = self.hidden.add(1) if j.fed is None else j.fed
                    j.fed.feed(states, [_next(j)[:n]])
                if self.draft is not None:
                    prefill(self.draft.model, j.rest[:n], j.draft)
                j.rest, fed = j.rest[n:], fed + n
        if fed:
            rate, old = fed / max(time.perf_counter() - t, 1e-9), self.prefill_rate
            self.prefill_rate = rate if old is None else (old + rate) / 2
        ready = [j for j in self.joining if not j.rest]
        if ready:
            self.joining = [j for j in self.joining if j.rest]
            self._join(ready)
        return True

    def _finish(self, row: _Row, reason: str) -> Any:
        if self.give_up is not None:  # what it measured while speculating
            row.speculated = (self.give_up.spec_tokens, self.give_up.spec_s)
            row.gave_up = self.give_up.gave_up
        return row.finish(reason)

    def _verify_input(self, drafts: mx.array | None, kr: int) -> tuple[mx.array, Any]:
        """What the target verifies, (B, kr + 1): each row's last token, then its
        proposals; and the target's checkpoint where it rewinds by replay."""
        ys = mx.array([[r.history[-1]] for r in self.rows], mx.uint32)
        verify_in = ys if drafts is None else mx.concatenate([ys, drafts], axis=1)
        assert self.t_cache is not None
        return verify_in, self._checkpoint(self.t_cache) if self.t_replay and kr else None

    # -- rewinding: a batch's caches, or a solo row's own -------------------
    def _checkpoint(self, cache: Cache, copy: bool = False) -> list[Any]:
        fn = rewind.checkpoint if self.solo else rewind.batch_checkpoint
        return fn(cache, copy=copy)

    def _restore(self, cache: Cache, mark: list[Any]) -> None:
        (rewind.restore if self.solo else rewind.batch_restore)(cache, mark)

    def _rewind_target(
        self, mark: list[Any] | None, tails: list[int], verify_in: mx.array, accepts: list[int]
    ) -> None:
        """The target's cache as if it had seen only each row's kept tokens."""
        assert self.t_cache is not None
        if mark is not None:
            if max(tails) > 0:
                self._replay(mark, verify_in, accepts)
        elif self.solo:
            rewind.cut(self.t_cache, tails[0])
        else:
            _drop_tail(self.t_cache, tails)

    def _rewind_draft(self, mark: list[Any] | None, kr: int, accepts: list[int]) -> bool:
        """The draft's cache past what it proposed and the rows rejected; True if it went
        back to its checkpoint after its first pass (the kept tokens are then unseen)."""
        assert self.d_cache is not None
        if self.solo:
            a = accepts[0]
            if mark is not None and a < kr:
                rewind.restore(self.d_cache, mark)
                return True
            if a < kr:
                rewind.trim(self.d_cache, kr - 1 - a)  # (it never saw its last token)
            return False
        if mark is not None:
            rewind.batch_restore(self.d_cache, mark)  # (all rows: kept tokens are pending)
            return kr > 0
        _drop_tail(self.d_cache, [kr - 1 - a if a < kr else 0 for a in accepts])
        return False

    def _replay(self, mark: list[Any], verify_in: mx.array, accepts: list[int]) -> None:
        """Target layers rewound by replay: back to before verification, then the target
        runs again over each row's kept tokens only (its input token and accepted drafts;
        shorter rows right-padded, as when prefilling)."""
        assert self.t_cache is not None
        began = time.perf_counter()
        self._restore(self.t_cache, mark)
        lens = [a + 1 for a in accepts]
        width = max(lens)
        if width > min(lens):
            for c in self.t_cache:
                c.prepare(lengths=lens, right_padding=[width - n for n in lens])
        self.target.model(verify_in[:, :width], cache=self.t_cache)
        if width > min(lens):
            for c in self.t_cache:
                c.finalize()
        mx.eval([c.state for c in self.t_cache])
        self.replays += 1
        self.replay_s += time.perf_counter() - began

    # -- proposing and sampling ----------------------------------------------
    def _lookup(self, ks: list[int]) -> tuple[list[list[int]], list[int]]:
        """Each row's prompt-lookup proposal (up to ``ks[i]`` tokens), padded to the longest,
        and each one's length."""
        found = []
        for row, n in zip(self.rows, ks, strict=True):
            assert row.index is not None
            row.index.sync(row.history)
            found.append(row.index.propose(n))
        width = max((len(f) for f in found), default=0)
        return [f + [0] * (width - len(f)) for f in found], [len(f) for f in found]

    def _draft(self, kr: int) -> tuple[mx.array, list[Any] | None]:
        """``kr`` draft tokens for every row, (B, kr), evaluated lazily (the draft's passes
        batched), and, for a draft rewound by restoring, its checkpoint after the first
        pass (which takes what the rows' drafts had not seen yet, for good)."""
        rows = self.rows
        assert self.d_cache is not None and self.draft is not None
        lens = [len(r.pending) for r in rows]
        width = max(lens)
        if self.solo:  # a window its next passes would wrap is restored, not trimmed
            wraps = rewind.wraps(self.d_cache, width + kr)
            restore = kr > 1 and (self.d_replay or wraps)
        else:
            restore = self.d_replay
        if width > min(lens):
            for c in self.d_cache:  # rows with fewer pending tokens are right-padded
                c.prepare(lengths=lens, right_padding=[width - n for n in lens])
        first = mx.array([r.pending + [0] * (width - len(r.pending)) for r in rows], mx.uint32)
        logits = self.draft.model(first, cache=self.d_cache)
        if width > min(lens):
            for c in self.d_cache:
                c.finalize()
        last = logits[mx.arange(len(rows)), mx.array(lens) - 1]
        mark = self._checkpoint(self.d_cache, copy=True) if restore else None
        steps: list[mx.array] = []  # (B,) each
        for step in range(kr):
            tokens = self._sample_rows(last, steps)
            mx.async_eval(tokens)
            steps.append(tokens)
            if step + 1 < kr:
                last = self.draft.model(tokens[:, None], cache=self.d_cache)[:, -1]
        return mx.stack(steps, axis=1), mark

    def _plain(self) -> bool:
        """Every row greedy without processors: one argmax samples them all."""
        return all(not r.processors and r.params.temperature == 0 for r in self.rows)

    def _sample_rows(self, logits: mx.array, steps: list[mx.array]) -> mx.array:
        """One token per row from ``logits`` (B, V), each through its row's processors and
        sampler (seeing its history and its drafts so far, ``steps``), lazily."""
        if self._plain():
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        picked = []
        for i, row in enumerate(self.rows):
            context: Any = []  # (what processors see: history, then this round's drafts)
            if row.processors:
                context = mx.concatenate(
                    [mx.array(row.history, mx.uint32), *(s[i : i + 1] for s in steps)]
                )
            token, _ = pick(logits[i : i + 1], context, row.processors, row.sampler)
            picked.append(token.astype(mx.uint32))
        return mx.concatenate(picked)

    def _sample_verify(
        self, logits: mx.array, drafts: mx.array | None, ks: list[int]
    ) -> tuple[list[list[int]], Any]:
        """The target's token at every verified position of every row, and a function
        giving the log-probability vector of row i, position j (for logprobs). A row's
        positions are sampled at once, or, with processors, each seeing the drafts
        before it (the target's own tokens wherever they are kept)."""
        if self._plain():
            chosen = mx.argmax(logits, axis=-1)
            mx.eval(chosen, *([] if drafts is None else [drafts]))

            def vectors(i: int, j: int) -> mx.array:
                v = logits[i, j]
                return v - mx.logsumexp(v, keepdims=True)

            return chosen.tolist(), vectors
        tokens, lps = [], []
        for i, row in enumerate(self.rows):
            n = ks[i] + 1
            if not row.processors:
                token, lp = pick(logits[i, :n], [], [], row.sampler)
                tokens.append(token)
                lps.append(lp)
                continue
            context = mx.array(row.history, mx.uint32)
            picks = [
                pick(
                    logits[i, j : j + 1],
                    mx.concatenate([context, drafts[i, :j]]) if j else context,
                    row.processors,
                    row.sampler,
                )
                for j in range(n)
            ]
            tokens.append(mx.concatenate([t for t, _ in picks]))
            lps.append(mx.concatenate([lp for _, lp in picks]))
        mx.eval(*tokens, *([] if drafts is None else [drafts]))
        return [t.tolist() for t in tokens], lambda i, j: lps[i][j]

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if self.hidden is not None:
            if keep:
                self.hidden.filter(keep)
            else:
                self.close_drafter()
        if not self.rows:
            self.t_cache = self.d_cache = None
            return
        idx = mx.array(keep)
        for c in (self.t_cache or []) + (self.d_cache or []):
            c.filter(idx)
