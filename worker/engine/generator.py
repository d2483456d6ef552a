"""ChatGenerator: a target model, an optional draft, and generation on them.

Runs a request alone (mlx-lm's loop, plain or speculative, streamed or not) or as
n choices of one prompt (one shared prefill, then a batch of its own), starting
from a kept prompt prefix where one applies. Every path prepares its request the
same way (``worker.engine.request.prepare``); the runner reserves its KV memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from schemas import ChatRequest, IncompatibleDraftError, ModelKindError
from worker.engine.batch import BatchEngine
from worker.engine.drafters import MTP, Head, drafter_type
from worker.engine.heads import bind as bind_head
from worker.engine.heads import why_not
from worker.engine.images import ImageSource
from worker.engine.layers import restore, snapshot
from worker.engine.lookup import Lookup
from worker.engine.mirror import GroupEngine
from worker.engine.models import MTP_OF, LoadedModel, ModelCache
from worker.engine.output import GenerationOutput
from worker.engine.prefill import prefill
from worker.engine.prefix import MIN_TOKENS, common_prefix, image_key, starting_cache
from worker.engine.protocol import (
    NO_START,
    Engine,
    Start,
    Steps,
    Stop,
    drive,
    run_to_end,
    steps_to_end,
)
from worker.engine.request import Prepared, message_boundary, prepare, prompt_tokens
from worker.engine.sequence import OnText
from worker.engine.single import SingleEngine
from worker.engine.specbatch import SpecBatchEngine


@dataclass
class ChatGenerator:
    """A target (with optional adapter) and optional draft, both held by a :class:`ModelCache`.

    ``get_or_create`` shares models through the cache: a target used with
    draft A, with draft B and alone is one loaded model.
    """

    target: LoadedModel
    draft: LoadedModel | None  # a draft model (None with a drafter)
    models: ModelCache  # where they live, and kept prompt prefixes (which count)
    target_was_warm: bool = False
    draft_was_warm: bool = False
    #: A drafter named as the draft (an EAGLE-3 head, a DFlash drafter, or "mtp": the
    #: target's own MTP head), bound to the target (``draft`` is None).
    drafter: Head | None = None
    drafter_entry: LoadedModel | None = None

    @classmethod
    def get_or_create(
        cls,
        model_id: str,
        draft_model_id: str | None = None,
        adapter_path: str | None = None,
        *,
        cache: ModelCache,
    ) -> ChatGenerator:
        """A generator over ``cache``'s models, loading what is not warm yet."""
        target, t_hit = cache.get(model_id, adapter_path)
        _chat_model(target, "model")
        draft, d_hit = None, False
        if draft_model_id is None:
            return cls(target, None, cache, t_hit)
        keep = (target.key, (model_id, None))
        if draft_model_id == MTP:  # (its own heads, in its own checkpoint)
            draft_model_id = model_id + MTP_OF
        draft, d_hit = cache.get(draft_model_id, None, keep=keep, local=True)
        if draft.kind == "drafter":
            return cls(target, None, cache, t_hit, d_hit, bind(cache, target, draft), draft)
        _chat_model(draft, "draft model")
        cache.check_draft(target, draft)
        return cls(target, draft, cache, t_hit, d_hit)

    def has_draft_model(self) -> bool:
        return self.draft is not None or self.drafter is not None

    @property
    def proposer(self) -> LoadedModel | None:
        """What proposes for the target: the draft model or the drafter (None: neither)."""
        return self.draft if self.draft is not None else self.drafter_entry

    @property
    def load_time_s(self) -> float:
        """Seconds spent loading for this generator (0 when everything was warm)."""
        t = 0.0 if self.target_was_warm else self.target.load_time_s
        if self.proposer is not None and not self.draft_was_warm:
            t += self.proposer.load_time_s
        return t

    @property
    def cache_hit(self) -> bool:
        return self.target_was_warm and (self.proposer is None or self.draft_was_warm)

    def prepare(
        self,
        request: ChatRequest,
        default_num_draft_tokens: int = 3,
        images: ImageSource | None = None,
    ) -> Prepared:
        """``request`` on the target (see :func:`worker.engine.request.prepare`); ``images``:
        where its stored images are."""
        return prepare(request, self.target, default_num_draft_tokens, images)

    def _job(self, request: ChatRequest | Prepared, default_k: int = 3) -> Prepared:
        return request if isinstance(request, Prepared) else self.prepare(request, default_k)

    def generate(self, request: ChatRequest | Prepared, *args: Any, **kw: Any) -> GenerationOutput:
        """Run ``request`` to its end (:meth:`generate_steps`, which takes the same arguments)."""
        return drive(self.generate_steps(request, *args, **kw))

    def generate_steps(
        self,
        request: ChatRequest | Prepared,
        default_num_draft_tokens: int = 3,
        on_text: OnText | None = None,
        *,
        num_draft_tokens: int | None = None,
        use_draft: bool = True,
        stop: Stop | None = None,
        lookup: Lookup | None = None,
        give_up_below: float | None = None,
        company: Sequence[Sequence[int]] = (),
    ) -> Steps[GenerationOutput]:
        """Run ``request`` (its messages and sampling fields; or prepared) on these models,
        a step at a time (``worker.engine.protocol.steps_to_end``).

        ``use_draft=False`` decodes plainly even with a draft loaded; ``lookup``
        speculates with prompt lookup instead (the draft is not used); ``give_up_below``
        (tokens/s): stop speculating once it measures slower (a measuring job's rule);
        ``num_draft_tokens`` overrides the request's draft length. What ``stop`` raises
        (checked at each step) ends it as :class:`~worker.engine.protocol.Stopped`.
        ``company``: prompts of jobs queued after it (see :meth:`starting_cache`).
        """
        job = self._job(request, default_num_draft_tokens)
        if num_draft_tokens is not None:
            job = job.with_params(num_draft_tokens=num_draft_tokens)
        draft = self.draft if self.draft is not None and use_draft and not lookup else None
        drafter = self.drafter if use_draft and not lookup else None
        if lookup is not None:
            job = job.with_params(lookup=lookup)
        speculative = draft is not None or drafter is not None or lookup is not None
        # stream_generate's penalties see only what is prefilled: leave them their window.
        limit = len(job.prompt) - max(1, job.params.penalty_window)
        start = self.starting_cache(job, limit, draft, company)
        engine: Engine = SingleEngine(self.target)
        if speculative:  # a speculative engine holding one row, on its own caches
            k = job.params.num_draft_tokens
            engine = SpecBatchEngine(
                self.target, draft, k, solo=True, give_up_below=give_up_below, drafter=drafter
            )
        if (group := self.models.group) is not None:  # (rank 0 proposes, every rank verifies)
            engine = GroupEngine(group, engine, self.target)
        try:
            engine.add(0, job, start, on_text)
        except BaseException:
            engine.close()  # (a group's followers made the engine too)
            raise
        return (yield from steps_to_end(engine, stop))[0]

    def generate_choices(
        self, request: ChatRequest | Prepared, stop: Stop | None = None
    ) -> GenerationOutput:
        """``request.n`` choices of one prompt: one prefill, then the n sequences decode
        together as one batch (each with its own sampler, processors, stops and limit;
        with a ``seed``, choice i draws from seed + i). Choice 0 is the output, the others
        in ``others``; ``completion_tokens`` counts every choice's tokens."""
        job = self._job(request)
        n = job.request.n if job.request is not None else 1
        engine: Engine = BatchEngine(self.target, n)
        if self.models.group is not None:  # every rank runs the choices
            engine = GroupEngine(self.models.group, engine, self.target)
        start_at = time.perf_counter()
        try:
            starts, held = self.choice_starts(job, n)
            for i, choice in enumerate(choices_of(job, n)):
                engine.add(i, choice, starts[i])
            held()
        except BaseException:
            engine.close()
            raise
        outs = run_to_end(engine, stop, tags=range(n))
        return with_choices([outs[i] for i in range(n)], time.perf_counter() - start_at)

    def choice_starts(self, job: Prepared, n: int) -> tuple[list[Start], Callable[[], None]]:
        """Where each of ``n`` choices of ``job`` starts: all of its prompt but the last
        token prefilled once (from a kept prefix, if any), each choice from its own copy;
        and what to call once every choice holds its copy (in a worker group, whose ranks
        hold it as a kept entry, that entry goes unless it was kept before)."""
        if self.models.group is not None:
            starts, transient = self._kept_choices(job, n)
            key, store = self.target.key, self.models.prefixes
            if transient is None:
                return starts, lambda: None
            return starts, lambda: store.forget(key, transient)
        layers, held, reused = self._shared_prefill(job)
        starts = [
            Start(restore(layers, held), held, reused) if layers else NO_START for _ in range(n)
        ]
        return starts, lambda: None

    def _shared_prefill(self, job: Prepared) -> tuple[list[Any] | None, int, int]:
        """The KV state of all of ``prompt`` but its last token, computed once for every
        choice (starting from a kept prefix, if any): (layers, tokens held, tokens reused).
        (None, 0, 0) if the model's caches cannot be copied that way. (The batch's
        penalties still see the whole prompt: it is handed to each sequence.)"""
        prompt = job.prompt
        held = len(prompt) - 1
        if held < 1:
            return None, 0, 0
        start = self.starting_cache(job, held)
        cache, cached = start.cache, start.cached
        if cache is None:
            cache, cached = self.target.new_cache(), 0
        prefill(self.target.model, prompt, cache, cached, held)
        layers = snapshot(cache, held)
        return (layers, held, start.reused) if layers is not None else (None, 0, 0)

    def _kept_choices(self, job: Prepared, n: int) -> tuple[list[Start], tuple[int, ...] | None]:
        """A worker group's shared prefill of ``n`` choices: all of the prompt but its last
        token kept as a prefix entry (a told prefill: every rank runs it once), each choice
        starting from its own copy; and the entry to drop once they hold it (None: it was
        kept before, or is another job's). Each from nothing where it cannot be kept."""
        store, prompt = self.models.prefixes, job.prompt
        held = len(prompt) - 1
        if not store.enabled or job.request is None or held < MIN_TOKENS:
            return [NO_START] * n, None
        key, mine = self.target.key, tuple(prompt[:held])
        known = store.layers(key, mine) is not None
        first = self._kept_start(job, prompt, held, boundary=held)
        layers = store.layers(key, first.source) if first.cache is not None else None
        if layers is None:
            return [NO_START] * n, None
        copies = [
            Start(restore(layers, first.cached), first.cached, first.reused, first.source)
            for _ in range(n - 1)
        ]
        return [first, *copies], None if known or first.source != mine else mine

    def shares(self, job: Prepared) -> bool:
        """Whether ``job``'s prompt has a prefix worth keeping that is known already: kept,
        begun by a recent prompt, or a message boundary (a hint). A job without one may
        look at the jobs queued after it (``company``): the first of a group then keeps
        what the group shares."""
        store = self.models.prefixes
        if not store.enabled or job.request is None:
            return True  # nothing to look for
        key, prompt = self.target.key, job.prompt
        matched = store.match(key, prompt)
        return (
            max(
                store.shared(key, prompt),
                matched[1] if matched is not None else 0,
                message_boundary(self.target.tokenizer, job.request, prompt),
            )
            >= MIN_TOKENS
        )

    def prompt_of(self, request: ChatRequest) -> list[int]:
        """``request``'s prompt tokens on the target (no other checks)."""
        return prompt_tokens(self.target.tokenizer, request)

    def starting_cache(
        self,
        job: Prepared,
        limit: int,
        draft: LoadedModel | None = None,
        company: Sequence[Sequence[int]] = (),
        between: Callable[[], None] | None = None,
    ) -> Start:
        """Where ``job``'s prompt starts (see :func:`worker.engine.prefix.starting_cache`):
        the target's layers, then ``draft``'s; tokens they hold; tokens reused. Its first
        ``limit`` tokens at most. ``company``: prompts of jobs queued after it;
        ``between``: called between two chunks of a shared prefix prefilled to keep."""
        if job.vision is not None:
            return self._image_start(job, draft)
        return self._kept_start(job, job.prompt, limit, draft, company, between=between)

    def _kept_start(
        self,
        job: Prepared,
        prompt: list[int],
        limit: int,
        draft: LoadedModel | None = None,
        company: Sequence[Sequence[int]] = (),
        boundary: int | None = None,
        between: Callable[[], None] | None = None,
    ) -> Start:
        """:meth:`starting_cache` on token ids: ``prompt`` (the job's, or the text before
        its first image and that image's first token); ``boundary``: what to keep, if the
        caller knows (else what other jobs share)."""
        if not self.models.prefixes.enabled or job.request is None:
            return NO_START
        store = self.models.prefixes
        # What other jobs' prompts share with it (on tokens: recent ones and its company),
        # or its last message boundary (a hint).
        if boundary is None:
            boundary = max(
                store.shared(self.target.key, prompt),
                message_boundary(self.target.tokenizer, job.request, prompt),
                *(common_prefix(prompt, other) for other in company),
            )
        store.remember(self.target.key, prompt)
        pairs = [(m.key, m) for m in (self.target, draft) if m is not None]
        cache, cached, reused, source = starting_cache(
            store, self.models.prefix_room, pairs, prompt, boundary, limit, between
        )
        return Start(cache, cached, reused, source) if cache is not None else NO_START

    def _image_start(self, job: Prepared, draft: LoadedModel | None) -> Start:
        """A job with images starts from its prompt through its last image token,
        prefilled from the input embeddings (``worker.engine.vision``): kept in the prefix
        cache under the images' identity, so jobs on the same images (and the same text
        before them) prefill them once. ``draft`` prefills the same tokens (it sees the
        image placeholders as tokens: a proposer only)."""
        vision, target, store = job.vision, self.target, self.models.prefixes
        assert vision is not None and target.vision is not None
        key, head, end = image_key(target.key, vision.digest), job.prompt[: vision.end], vision.end
        matched = store.match(key, head) if store.enabled else None
        if matched is not None and matched[1] == end:
            layers, reused = restore(matched[0].layers, end), end
            store.stats.hits += 1
            store.stats.tokens_reused += end
        else:
            text = self._text_start(job, vision.first)  # the text before its first image
            cache, held, reused = text.cache or target.new_cache(), text.cached, text.reused
            layers = target.vision.prefill(target.model, job.prompt, vision, cache, held)
            kept = snapshot(layers, end) if store.enabled else None
            if kept is not None and store.put(key, head, kept, self.models.prefix_room()):
                layers = restore(kept, end)
        if draft is not None:
            layers = [*layers, *prefill(draft.model, job.prompt, draft.new_cache(), 0, end)]
        return Start(layers, end, reused)

    def _text_start(self, job: Prepared, first: int) -> Start:
        """Where the text before an image job's first image starts: a kept prefix shared
        with other jobs (a system prompt), kept as any text job's, at most ``first`` tokens
        (the prompt is cut after the image's first token, which is never kept). The image
        prefill continues from it."""
        return self._kept_start(job, job.prompt[: first + 1], first)


def bind(cache: ModelCache, target: LoadedModel, entry: LoadedModel) -> Head:
    """The drafter loaded as ``entry`` bound to ``target`` (once per pair), or an
    :class:`IncompatibleDraftError` saying why it cannot draft for it."""
    kind = drafter_type(entry.config) or entry.config["model_type"]  # (DFlash says qwen3)
    what = f"draft model {entry.name!r} ({kind})"
    if cache.group is not None:
        raise IncompatibleDraftError(
            f"{what}: a worker group does not run drafters yet (name a draft model or "
            "prompt lookup)"
        )
    why = why_not(entry.model, target.model, target.vocab_size)
    if why is not None:
        raise IncompatibleDraftError(f"{what} cannot draft for {target.name!r}: {why}")
    if entry.name not in target.drafters:  # (gone with the target when it is evicted)
        target.drafters[entry.name] = bind_head(entry.model, target.model)
    return target.drafters[entry.name]


def _chat_model(entry: LoadedModel, what: str) -> None:
    if entry.kind == "drafter":
        raise ModelKindError(
            f"{what} {entry.name!r} is a drafter ({entry.config['model_type']}), not a chat "
            "model: name it as the draft_model of a target it was trained for"
        )
    if entry.kind != "chat":
        embeds = entry.kind == "embeddings"
        kind, route = (
            ("embedding", "/v1/embeddings") if embeds else ("audio", "/v1/audio/transcriptions")
        )
        raise ModelKindError(
            f"{what} {entry.name!r} is an {kind} model, not a chat model: send it {route} requests"
        )


def choices_of(job: Prepared, n: int) -> list[Prepared]:
    """The ``n`` choices of ``job``: with a ``seed``, choice i draws from seed + i."""
    seed = job.params.seed
    return [job.with_params(seed=seed + i) if seed is not None else job for i in range(n)]


def with_choices(outs: Sequence[GenerationOutput], elapsed: float) -> GenerationOutput:
    """One output of a job's choices (``outs``, choice 0 first) that took ``elapsed``
    seconds: choice 0's, the others in ``others``, ``completion_tokens`` counting all."""
    first, others = outs[0], tuple(outs[1:])
    total = sum(o.completion_tokens for o in outs)
    decode = max(elapsed - first.time_to_first_token_s, 1e-9)
    return replace(
        first,
        completion_tokens=total,
        generation_tokens_per_s=total / decode,
        total_time_s=elapsed,
        others=others,
    )
