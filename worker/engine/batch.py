"""The batched engine: sequences on one model decode together (continuous batching).

Pure MLX and mlx-lm (``BatchGenerator``); knows nothing of Redis or jobs. Each
sequence has its own sampler, logits processors, stop strings and max_tokens;
sequences join between steps and leave as they finish. Which jobs may share a
batch, and taking them off the queue, is the runner's business.

Prefill goes in chunks of :data:`~worker.engine.prefill.PREFILL_STEP` tokens per
sequence, up to :data:`PREFILL_BATCH` sequences a step. With ``prefill_budget`` set (prompt
tokens a step may prefill, all sequences together: the step plan's token budget,
``worker.schedule.step.prefill_budget``, sized from :attr:`BatchEngine.prefill_rate`, the
prompt tokens per second measured here), the chunks shrink to fit it (never under
:data:`MIN_CHUNK` tokens a sequence): on a device where 8 chunks of 512 tokens take a
minute (a CPU), a step then takes a second or two, so a job waiting for the next step
does not wait for minutes of other prompts. Where prefill is fast (a GPU), the chunks
stay whole.
"""

from __future__ import annotations

from collections.abc import Hashable

from mlx_lm.generate import BatchGenerator

from worker.engine.models import LoadedModel
from worker.engine.output import GenerationOutput
from worker.engine.prefill import PREFILL_STEP
from worker.engine.protocol import NO_START, Finished, Start, Step
from worker.engine.request import Prepared
from worker.engine.sampling import logits_processors, sampler_for
from worker.engine.sequence import OnText, Sequence

#: Sequences prefilled together (their chunks are one forward pass).
PREFILL_BATCH = 8
#: Architectures whose padded batch prefill is not exact in mlx-lm 0.32 (their SSM
#: update ignores ``ArraysCache.lengths``, so the padding enters the state): their
#: sequences are prefilled one at a time (they still decode together).
UNPADDED_PREFILL = frozenset({"nemotron_h"})
#: The fewest prompt tokens a sequence prefills in a step under a prefill budget (a CPU
#: prefills 8 rows of 8 tokens at about the speed of 8 of 512: measured here).
MIN_CHUNK = 8


def budget_chunk(whole: int, budget: int, together: int) -> int:
    """Prompt tokens a sequence prefills in a step of ``together`` prefilling sequences
    under a budget of ``budget`` tokens for them all: between :data:`MIN_CHUNK` and
    ``whole``."""
    return max(MIN_CHUNK, min(whole, budget // max(1, together)))


class BatchEngine:
    """A continuous batch on one loaded model: :meth:`add` sequences, :meth:`step` them.

    The engine takes every sequence it is given (up to ``max_batch``); how many
    to give it is the caller's decision.
    """

    def __init__(
        self,
        target: LoadedModel,
        max_batch: int,
        prefill_step: int = PREFILL_STEP,
        prefill_budget: int | None = None,
    ) -> None:
        self.target, self.max_batch = target, max_batch
        self.prefill_step = prefill_step
        #: Prompt tokens one step may prefill (None: whole chunks, however long).
        self.prefill_budget = prefill_budget
        self.models = (target,)
        tok = target.tokenizer
        together = 1 if target.config.get("model_type") in UNPADDED_PREFILL else PREFILL_BATCH
        self.gen = BatchGenerator(
            target.model,
            stop_tokens=[[t] for t in tok.eos_token_ids],
            completion_batch_size=max_batch,
            prefill_batch_size=min(max_batch, together),
            prefill_step_size=prefill_step,
        )
        self._seqs: dict[int, Sequence] = {}
        self._left: dict[int, int] = {}  # prompt tokens still to prefill, by uid
        #: Prompt tokens per second measured in this batch (running; None before any).
        self.prefill_rate: float | None = None

    @property
    def prefilling(self) -> int:
        """Prompt tokens still to prefill."""
        return sum(self._left.values())

    @property
    def prefill_steps(self) -> int:
        if not self._left:
            return 0
        together = min(len(self._left), self.gen.prefill_batch_size)
        return -(-self.prefilling // (together * self._chunk()))

    @property
    def kv_bytes(self) -> int:
        """Bytes the batch's KV caches hold now (sequences decoding and prefilling)."""
        return self.gen.prompt_cache_nbytes

    def __len__(self) -> int:
        return len(self._seqs)

    def add(
        self,
        tag: Hashable,
        job: Prepared,
        start: Start = NO_START,
        on_text: OnText | None = None,
        first: bool = False,
    ) -> None:
        """Start decoding ``job``'s prompt (it joins at the next step).

        ``start.cache`` holds the KV state of the first ``start.cached`` prompt tokens
        (a kept prefix): only the rest is prefilled, and the penalties still see the
        whole prompt. ``first``: its prompt is prefilled before those of sequences
        added earlier and still waiting (an interactive job's).
        """
        prompt, params, cached = job.prompt, job.params, start.cached
        # Always given: mlx-lm would make an unquantized one (``--kv-bits``).
        cache = start.cache if start.cache is not None else self.target.new_cache()
        (uid,) = self.gen.insert(
            [prompt[cached:]],
            [params.max_tokens],
            caches=[cache],
            all_tokens=[prompt[:cached]],
            samplers=[sampler_for(params)],
            logits_processors=[logits_processors(params)],
        )
        # mlx-lm's BatchGenerator has no priority on insert: its private FIFO of prompts
        # still to prefill is reordered (absent in another version: a no-op, and
        # tests/test_interactive.py's prefill-order test fails).
        waiting = getattr(self.gen, "_unprocessed_sequences", None)
        if first and waiting and len(waiting) > 1 and waiting[-1][0] == uid:
            waiting.appendleft(waiting.pop())
        detok = self.target.tokenizer.detokenizer  # a fresh one per access
        self._seqs[uid] = Sequence(tag, len(prompt), params, detok, start.reused, on_text)
        self._left[uid] = len(prompt) - cached

    def lengths(self) -> dict[Hashable, tuple[int, int]]:
        return {s.tag: s.length() for s in self._seqs.values()}

    def first_token_at(self, tag: Hashable) -> float | None:
        return next((s.first_token_at for s in self._seqs.values() if s.tag == tag), None)

    def remove(self, tag: Hashable) -> GenerationOutput | None:
        for uid, seq in list(self._seqs.items()):
            if seq.tag == tag:
                self.gen.remove([uid])
                del self._seqs[uid]
                self._left.pop(uid, None)
                return seq.cut_short()
        return None

    def step(self) -> Step:
        """One decoding step (and a chunk of prefill for sequences joining)."""
        self.gen.prefill_step_size = self._chunk()
        with self.gen.stats() as work:
            prompts, responses = self.gen.next()
        for p in prompts:
            done_tokens, total = p.progress
            if p.end_of_prompt:
                self._left.pop(p.uid, None)
            elif p.uid in self._left:
                self._left[p.uid] = total - done_tokens
        if work.prompt_tokens and work.prompt_time > 0:
            rate = work.prompt_tokens / work.prompt_time
            old = self.prefill_rate
            self.prefill_rate = rate if old is None else (old + rate) / 2
        done: list[Finished] = []
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            finish = seq.advance(int(r.token), r.finish_reason, r.logprobs)
            if finish is not None:
                if finish == "stop" and r.finish_reason is None:
                    self.gen.remove([r.uid])  # a stop string: the generator would go on
                del self._seqs[r.uid]
                self._left.pop(r.uid, None)
                done.append((seq.tag, seq.finish(finish)))
        return Step(len(responses), done, bool(prompts))

    def _chunk(self) -> int:
        """The next step's chunk per prefilling sequence: whole, or under a budget its
        share of it (the sequences prefilled together share the budget)."""
        if self.prefill_budget is None or not self._left:
            return self.prefill_step
        together = min(len(self._left), self.gen.prefill_batch_size)
        return budget_chunk(self.prefill_step, self.prefill_budget, together)

    def close(self) -> None:
        self.gen.close()
