"""Request preparation: a chat request meets a model's tokenizer, context and vocabulary.

One place turns a :class:`schemas.ChatRequest` into what every engine runs: the
prompt's token ids (through the model's chat template), the resolved generation
parameters (limits checked against the model's context, sampling fields, the
response_format grammar compiled for the tokenizer) and where the shared part of
the prompt ends (for the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from schemas import ChatRequest, ContextLengthError, InvalidRequestError
from worker.engine.constrain import Constraint, constraint_for
from worker.engine.lookup import DEFAULT_LOOKUP, Lookup, lookup_for
from worker.engine.prefix import common_prefix
from worker.engine.reasoning import Budget, budget_of, opens_in_reasoning, thinking_of
from worker.engine.toolcalls import check as check_tools
from worker.engine.toolcalls import grammar as call_grammar

if TYPE_CHECKING:
    from worker.engine.images import ImageSource
    from worker.engine.models import LoadedModel
    from worker.engine.vision import VisionInput

#: Completion limit when a request sets neither max_tokens nor max_completion_tokens.
DEFAULT_MAX_TOKENS = 512
#: Where a model without a chat template (a base model) starts the next turn of the plain
#: "role: content" transcript it is given: its answer ends there, not at max_tokens.
TRANSCRIPT_STOP = "\nuser:"


@dataclass(frozen=True)
class GenerationParams:
    """Everything that shapes one generation, resolved from a request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: none
    repetition_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_draft_tokens: int = 3
    constraint: Constraint | None = None  # response_format: the grammar the output follows
    logprobs: int | None = None  # None: no logprobs; else how many top alternatives (0-20)
    lookup: Lookup = DEFAULT_LOOKUP  # prompt lookup's settings, should it speculate that way
    in_reasoning: bool = False  # the prompt leaves the model inside a thinking block
    budget: Budget | None = None  # a cap on the thinking (``thinking_budget``)
    min_tokens: int = 0  # the end tokens are banned before this many completion tokens
    eos: tuple[int, ...] = ()  # the model's end tokens (what min_tokens bans)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special: tuple[int, ...] = ()  # tokens XTC never excludes: newline and the end tokens

    @property
    def penalty_window(self) -> int:
        """Trailing tokens (prompt and completion) the penalties look at; 0 without any."""
        window = self.max_tokens if (self.presence_penalty or self.frequency_penalty) else 0
        if self.repetition_penalty != 1.0:
            window = max(window, self.repetition_context_size)
        return window


@dataclass(frozen=True)
class Prepared:
    """A request ready for an engine: its prompt, its parameters, its shared prefix."""

    prompt: list[int]
    params: GenerationParams
    request: ChatRequest | None = None
    vision: VisionInput | None = None  # its images: prefilled first (``worker.engine.vision``)

    @property
    def label(self) -> str:
        """How errors and admission name this sequence's size."""
        return f"a prompt of {len(self.prompt)} tokens with max_tokens {self.params.max_tokens}"

    def length(self) -> tuple[int, int]:
        """(prompt tokens, tokens it may add): what memory admission projects from."""
        return len(self.prompt), self.params.max_tokens

    def with_params(self, **changes: object) -> Prepared:
        return replace(self, params=replace(self.params, **changes))


def prepare(
    request: ChatRequest,
    target: LoadedModel,
    default_num_draft_tokens: int = 3,
    images: ImageSource | None = None,
) -> Prepared:
    """``request`` on ``target``: prompt tokens, parameters (raises on a misfit), grammar.
    ``images``: where its stored images are (its batch's, ``worker.engine.images``)."""
    tokenizer = target.tokenizer
    family = check_tools(request, tokenizer, target.name)
    vision = None
    if request.images:
        prompt, vision = image_prompt(request, target, images)
    else:
        prompt = prompt_tokens(tokenizer, request)
    calls, trigger = call_grammar(request, tokenizer, family)
    in_reasoning = not request.raw_prompt and opens_in_reasoning(tokenizer, prompt)
    if in_reasoning and not trigger and (thinking := thinking_of(tokenizer)) is not None:
        trigger = thinking.end_ids  # a grammar applies to the answer, after the reasoning
    params = params_for(
        request,
        len(prompt),
        target.context_length,
        target.vocab_size,
        default_num_draft_tokens,
        constraint_for(request, tokenizer, target.vocab_size, calls, trigger),
    )
    transcript = not getattr(tokenizer, "has_chat_template", False) and not request.raw_prompt
    if transcript and TRANSCRIPT_STOP not in params.stop:
        params = replace(params, stop=(*params.stop, TRANSCRIPT_STOP))
    if in_reasoning:
        params = replace(params, in_reasoning=True)
    if (budget := budget_of(tokenizer, request.thinking_limit, in_reasoning)) is not None:
        params = replace(params, budget=budget)
    if request.xtc_probability > 0:  # (as mlx-lm's server: newline and EOS never excluded)
        special = (*tokenizer.encode("\n", add_special_tokens=False), *tokenizer.eos_token_ids)
        params = replace(
            params,
            xtc_probability=request.xtc_probability,
            xtc_threshold=request.xtc_threshold,
            xtc_special=tuple(sorted({int(t) for t in special})),
        )
    if request.min_tokens:
        eos = tuple(sorted(int(t) for t in tokenizer.eos_token_ids))
        params = replace(params, min_tokens=min(request.min_tokens, params.max_tokens), eos=eos)
    return Prepared(prompt, params, request, vision)


def image_prompt(
    request: ChatRequest, target: LoadedModel, source: ImageSource | None = None
) -> tuple[list[int], VisionInput]:
    """A request with images on ``target``: the prompt as its processor expands it, and the
    images' inputs; raises naming the model if it does not read images here."""
    if target.vision is None:
        why = target.no_vision or "reads no images"
        raise InvalidRequestError(f"model {target.name!r} {why}")
    if not getattr(target.tokenizer, "has_chat_template", False):
        raise InvalidRequestError(f"model {target.name!r} has no chat template to place images")
    images = target.vision.images.images(request.images, source)
    text = _render(
        target.tokenizer,
        [m.as_template_dict() for m in request.messages],
        prompt=True,
        tools=request.template_tools,
        template_kwargs=request.template_kwargs,
        tokenize=False,
    )
    return target.vision.prepare(text, images)


def _render(
    tokenizer: object,
    messages: list[dict[str, Any]],
    prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tokenize: bool = True,
) -> Any:
    """``messages`` through the model's chat template (a plain "role: content" transcript
    without one) as token ids (as text: ``tokenize=False``); ``prompt`` adds the
    assistant's turn to generate; ``tools`` are rendered by the template (Hugging Face's
    ``tools`` argument)."""
    if not getattr(tokenizer, "has_chat_template", False):
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return list(tokenizer.encode(text + "\nassistant:" if prompt else text))  # type: ignore[attr-defined]
    extra = ({"tools": tools} if tools else {}) | (template_kwargs or {})
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=prompt, tokenize=tokenize, **extra
        )
    except Exception as e:  # a template that raises on these messages or variables
        if not template_kwargs and tokenize:
            raise
        what = f"with chat_template_kwargs {sorted(template_kwargs)}" if template_kwargs else ""
        raise InvalidRequestError(
            f"the chat template failed {what or 'on these messages'}: {type(e).__name__}: {e}"
        ) from None
    if not tokenize:
        return ids
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def prompt_tokens(tokenizer: object, request: ChatRequest) -> list[int]:
    """The request's messages (and tools) through the model's chat template, as token ids;
    a ``raw_prompt`` request's text tokenized as is (the tokenizer's own BOS, no template)."""
    if request.raw_prompt:
        return [int(i) for i in tokenizer.encode(request.messages[0].content)]  # type: ignore[attr-defined]
    messages = [m.as_template_dict() for m in request.messages]
    return _render(
        tokenizer,
        messages,
        prompt=True,
        tools=request.template_tools,
        template_kwargs=request.template_kwargs,
    )


def message_boundary(tokenizer: object, request: ChatRequest, prompt: list[int]) -> int:
    """How many leading tokens of ``prompt`` render every message but the last: the part
    batch jobs share (a system prompt, few-shot turns). 0 for a single message.

    Tokens, not text: it is the common prefix of the two token sequences, so a chat
    template or tokenizer that renders the shorter conversation differently at its end
    only shortens it.
    """
    if len(request.messages) < 2:
        return 0
    head = [m.as_template_dict() for m in request.messages[:-1]]
    try:
        ids = _render(
            tokenizer,
            head,
            False,
            tools=request.template_tools,
            template_kwargs=request.template_kwargs,
        )
    except Exception:  # a template that refuses a conversation without a user turn
        return 0
    return min(common_prefix(ids, prompt), len(prompt) - 1)


def params_for(
    request: ChatRequest,
    n_prompt: int,
    context_length: int | None,
    vocab_size: int,
    default_num_draft_tokens: int = 3,
    constraint: Constraint | None = None,
) -> GenerationParams:
    """Resolve a request's sampling fields and limits against the model; raise on misfit.
    ``constraint``: the request's response_format compiled for the model's tokenizer."""
    limit = request.token_limit
    if context_length is not None:
        room = context_length - n_prompt
        if room < 1 or (limit is not None and limit > room):
            raise ContextLengthError(
                f"this model's maximum context length is {context_length} tokens; the prompt "
                f"has {n_prompt} tokens and {limit or 1} completion tokens were requested"
            )
        max_tokens = limit or min(DEFAULT_MAX_TOKENS, room)
    else:
        max_tokens = limit or DEFAULT_MAX_TOKENS
    bias = tuple(sorted((request.logit_bias or {}).items()))
    bad = [t for t, _ in bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias: token ids {bad} are outside the vocabulary")
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        stop=tuple(request.stop or ()),
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        repetition_penalty=request.repetition_penalty or 1.0,
        repetition_context_size=request.repetition_context_size,
        frequency_penalty=request.frequency_penalty,
        logit_bias=bias,
        num_draft_tokens=request.num_draft_tokens or default_num_draft_tokens,
        lookup=lookup_for(request.speculation),
        constraint=constraint,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
    )
