"""ChatGenerator: a target model, an optional draft, and generation, in the seed system's terms."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from schemas import ChatRequest, MlxqError
from worker.batching import BatchEngine
from worker.cache import LoadedModel, ModelCache
from worker.constrain import constraint_for
from worker.engine import (
    Deadline,
    GenerationOutput,
    generate,
    message_boundary,
    params_for,
    prompt_tokens,
)
from worker.memory import batch_peak_bytes, job_label
from worker.prefix import PREFILL_STEP, restore, snapshot, starting_cache

_default_cache: ModelCache | None = None


def default_cache() -> ModelCache:
    """The process-wide model cache (the worker installs its own budgeted one)."""
    global _default_cache
    if _default_cache is None:
        _default_cache = ModelCache()
    return _default_cache


def set_default_cache(cache: ModelCache) -> None:
    global _default_cache
    _default_cache = cache


@dataclass
class ChatGenerator:
    """A target (with optional adapter) and optional draft, both held by a :class:`ModelCache`.

    ``get_or_create`` shares models through the cache: a target used with
    draft A, with draft B and alone is one loaded model.
    """

    target: LoadedModel
    draft: LoadedModel | None = None
    target_was_warm: bool = False
    draft_was_warm: bool = False
    models: ModelCache | None = None  # where kept prompt prefixes live (and count)

    @classmethod
    def get_or_create(
        cls,
        model_id: str,
        draft_model_id: str | None = None,
        adapter_path: str | None = None,
        cache: ModelCache | None = None,
    ) -> ChatGenerator:
        """A generator over cached models, loading what is not warm yet."""
        cache = cache or default_cache()
        target, t_hit = cache.get(model_id, adapter_path)
        draft, d_hit = None, False
        if draft_model_id is not None:
            keep = (target.key, (model_id, None))
            draft, d_hit = cache.get(draft_model_id, None, keep=keep)
            cache.check_draft(target, draft)
        return cls(target, draft, t_hit, d_hit, cache)

    @classmethod
    def create(
        cls, model_id: str, draft_model_id: str | None = None, adapter_path: str | None = None
    ) -> ChatGenerator:
        """A generator with its own freshly loaded models (not shared with the cache)."""
        return cls.get_or_create(model_id, draft_model_id, adapter_path, cache=ModelCache())

    def has_draft_model(self) -> bool:
        return self.draft is not None

    @property
    def load_time_s(self) -> float:
        """Seconds spent loading for this generator (0 when everything was warm)."""
        t = 0.0 if self.target_was_warm else self.target.load_time_s
        if self.draft is not None and not self.draft_was_warm:
            t += self.draft.load_time_s
        return t

    @property
    def cache_hit(self) -> bool:
        return self.target_was_warm and (self.draft is None or self.draft_was_warm)

    def generate(
        self,
        request: ChatRequest,
        default_num_draft_tokens: int = 3,
        on_text: Callable[[str], None] | None = None,
        *,
        num_draft_tokens: int | None = None,
        use_draft: bool = True,
        deadline: Deadline | None = None,
    ) -> GenerationOutput:
        """Run ``request`` (its messages and sampling fields) on these models.

        ``use_draft=False`` decodes plainly even with a draft loaded;
        ``num_draft_tokens`` overrides the request's draft length. Past
        ``deadline`` it raises :class:`schemas.JobTimeoutError`.
        """
        tokenizer = self.target.tokenizer
        prompt = prompt_tokens(tokenizer, request)
        params = params_for(
            request,
            len(prompt),
            self.target.context_length,
            self.target.vocab_size,
            default_num_draft_tokens,
            constraint_for(request, tokenizer, self.target.vocab_size),
        )
        if num_draft_tokens is not None:
            params = replace(params, num_draft_tokens=num_draft_tokens)
        draft = self.draft if self.draft is not None and use_draft else None
        if self.models is not None:  # its KV caches must fit, or it fails naming the numbers
            length = [(len(prompt), params.max_tokens)]
            need = sum(batch_peak_bytes(m.kv, length) for m in (self.target, draft) if m)
            self.models.make_kv_room(need, job_label(len(prompt), params.max_tokens))
            self.models.kv_reserved = need
        try:
            # stream_generate's penalties see only what is prefilled: leave them their window.
            limit = len(prompt) - max(1, params.penalty_window)
            cache, cached, reused = self.starting_cache(request, prompt, limit, draft)
            out = generate(
                self.target.model,
                tokenizer,
                prompt,
                params,
                draft_model=draft.model if draft else None,
                on_text=on_text,
                deadline=deadline,
                cache=cache,
                cached=cached,
            )
        finally:
            if self.models is not None:
                self.models.kv_reserved = 0
        return replace(out, cached_tokens=reused)

    def generate_choices(
        self, request: ChatRequest, deadline: Deadline | None = None
    ) -> GenerationOutput:
        """``request.n`` choices of one prompt: one prefill, then the n sequences decode
        together as one batch (each with its own sampler, processors, stops and limit;
        with a ``seed``, choice i draws from seed + i). Choice 0 is the output, the others
        in ``others``; ``completion_tokens`` counts every choice's tokens."""
        target, n = self.target, request.n
        prompt = prompt_tokens(target.tokenizer, request)
        constraint = constraint_for(request, target.tokenizer, target.vocab_size)
        params = params_for(
            request, len(prompt), target.context_length, target.vocab_size, constraint=constraint
        )
        if self.models is not None:
            need = batch_peak_bytes(target.kv, [(len(prompt), params.max_tokens)] * n)
            self.models.make_kv_room(need, f"{n} x {job_label(len(prompt), params.max_tokens)}")
            self.models.kv_reserved = need
        engine = BatchEngine(target, n)
        start = time.perf_counter()
        try:
            layers, held, reused = self._shared_prefill(request, prompt)
            seed = params.seed
            for i in range(n):
                choice = replace(params, seed=seed + i) if seed is not None else params
                cache = restore(layers, held) if layers is not None else None
                engine.add(i, prompt, choice, cache, held if layers is not None else 0, reused)
            outs: dict[Hashable, GenerationOutput] = {}
            while len(engine):
                for tag, out in engine.step().done:
                    if isinstance(out, MlxqError):
                        raise out
                    outs[tag] = out
                if deadline is not None:
                    deadline.check()
        finally:
            engine.close()
            if self.models is not None:
                self.models.kv_reserved = 0
        first, others = outs[0], tuple(outs[i] for i in range(1, n))
        total = sum(o.completion_tokens for o in outs.values())
        elapsed = time.perf_counter() - start
        decode = max(elapsed - first.time_to_first_token_s, 1e-9)
        return replace(
            first,
            completion_tokens=total,
            generation_tokens_per_s=total / decode,
            total_time_s=elapsed,
            others=others,
        )

    def _shared_prefill(
        self, request: ChatRequest, prompt: list[int]
    ) -> tuple[list[Any] | None, int, int]:
        """The KV state of all of ``prompt`` but its last token, computed once for every
        choice (starting from a kept prefix, if any): (layers, tokens held, tokens reused).
        (None, 0, 0) if the model's caches cannot be copied that way. (The batch's
        penalties still see the whole prompt: it is handed to each sequence.)"""
        held = len(prompt) - 1
        if held < 1:
            return None, 0, 0
        cache, cached, reused = self.starting_cache(request, prompt, held)
        if cache is None:
            cache, cached = make_prompt_cache(self.target.model), 0
        model = self.target.model
        for i in range(cached, held, PREFILL_STEP):
            model(mx.array(prompt[i : min(i + PREFILL_STEP, held)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        layers = snapshot(cache, held)
        return (layers, held, reused) if layers is not None else (None, 0, 0)

    def starting_cache(
        self,
        request: ChatRequest,
        prompt: list[int],
        limit: int,
        draft: LoadedModel | None = None,
    ) -> tuple[list[Any] | None, int, int]:
        """The KV cache ``prompt`` starts from (see :func:`worker.prefix.starting_cache`):
        the target's layers, then ``draft``'s; tokens it holds; tokens reused."""
        if self.models is None or not self.models.prefixes.enabled:
            return None, 0, 0
        boundary = message_boundary(self.target.tokenizer, request, prompt)
        pairs = [(m.key, m.model) for m in (self.target, draft) if m is not None]
        store = self.models.prefixes
        return starting_cache(store, self.models.prefix_room, pairs, prompt, boundary, limit)
