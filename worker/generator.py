"""ChatGenerator: a target model, an optional draft, and generation, in the seed system's terms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from schemas import ChatRequest
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
from worker.prefix import starting_cache

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
