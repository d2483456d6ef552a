"""The chat request: an OpenAI chat.completions body plus mlxq's draft/adapter fields."""

from __future__ import annotations

import json
import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.structured import (
    ANY_OBJECT,
    DEFAULT_LAYOUT,
    SchemaError,
    grammar_for,
    grammar_of_choice,
    grammar_of_lark,
    grammar_of_regex,
)
from schemas.tools import FunctionDef, Tool, ToolCall, ToolChoice, called, check_tools

#: Fields of the OpenAI API that mlxq does not implement yet. A request that
#: sets one to a non-default value is rejected (never silently ignored).
UNSUPPORTED: dict[str, str] = {
    "functions": "the legacy form of tools: give tools (type function) instead",
    "function_call": "the legacy form of tool_choice: give tool_choice instead",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "service_tier": "service_tier is not supported",
    "store": "store is not supported",
}

#: Content parts other than text and images, and why each is refused.
NON_TEXT: dict[str, str] = {
    "input_image": "input_image is a Responses API part: give image_url parts here",
    "input_audio": "audio input is not supported: this worker serves text only",
    "refusal": "a refusal part is not read: give the assistant's text as a text part",
}

#: Values of unsupported fields that mean "feature off" and are accepted.
_HARMLESS = (None, False, [], {}, "auto", "default", "none")

_UNSUPPORTED_KEYS = frozenset(UNSUPPORTED)

#: The most choices a request may ask for; a worker's ``--max-n`` (default 16) may allow fewer.
MAX_N = 128
#: The longest ``time_limit_s`` a request may ask (a week).
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0

_EXTRA_PARAM_FIELDS = (
    "draft_model",
    "num_draft_tokens",
    "adapter",
    "speculation",
    "json_whitespace",
    "time_limit_s",
)
#: ``chat_template_kwargs``: its limits, and the names mlxq passes to templates itself.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 4096
_TEMPLATE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "chat_template",
        "tokenizer_kwargs",
        "reasoning_effort",
        "bos_token",
        "eos_token",
    }
)
#: Thinking budgets (tokens) for OpenAI's ``reasoning_effort``, where a request sets no
#: ``thinking_budget`` (``none``: the thinking block is closed at once).
EFFORT_BUDGETS: dict[str, int] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
}
#: The largest ``thinking_budget`` a request may ask.
MAX_THINKING_BUDGET = 1_000_000
#: Prompt lookup's limits: n-gram sizes 1..MAX_NGRAM, proposals of MAX_PROPOSAL at most.
MAX_NGRAM = 16
MAX_PROPOSAL = 64
#: Images: the most one request carries, and the largest (decoded; OpenAI's limit).
MAX_IMAGES = 16
MAX_IMAGE_BYTES = 20 * 2**20
_MAX_IMAGE_URL = 64 + (MAX_IMAGE_BYTES + 2) // 3 * 4
#: The longest http(s) image URL.
MAX_IMAGE_URL_CHARS = 2048
#: An image the producer stored once with its batch (``schemas.keys.batch_images_key``),
#: by the SHA-256 of its bytes: what a submitted job's data URL becomes.
IMAGE_REF = re.compile(r"mlxq-image:([0-9a-f]{64})", re.ASCII)
#: An uploaded image file a job names (a ``file`` part), as its images list says it.
FILE_REF = re.compile(r"mlxq-file:(file-[A-Za-z0-9_-]{1,64})", re.ASCII)
#: A data URL's head; its base64 is checked where it is decoded (the worker: a 400 naming
#: the image), not matched here (1.8 ms per MB, three times per job).
_DATA_URL = re.compile(r"data:image/[a-z0-9.+-]{1,32};base64,", re.ASCII)


class TextPart(BaseModel):
    """A text part of a message's content list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """An ``image_url`` part's image: a ``data:`` URL (base64 PNG, JPEG, WebP or GIF).
    ``detail`` is accepted; the model's own processor decides the resolution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(max_length=_MAX_IMAGE_URL)
    detail: Literal["auto", "low", "high"] = "auto"


def _check_image_part(i: int, part: dict[str, Any]) -> None:
    """One clear line for an image part that is not an inline data URL."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else None
    if not isinstance(url, str):
        raise ValueError(f'part {i}: image_url needs {{"url": "data:image/...;base64,..."}}')
    if len(url) > _MAX_IMAGE_URL:
        raise ValueError(f"part {i}: the image is over {MAX_IMAGE_BYTES >> 20} MB")
    if IMAGE_REF.fullmatch(url):  # stored with its batch by the producer
        return
    if url.startswith(("https://", "http://")):  # fetched by a worker that allows the host
        if len(url) > MAX_IMAGE_URL_CHARS or not urlsplit(url).hostname:
            raise ValueError(
                f"part {i}: an image URL of at most {MAX_IMAGE_URL_CHARS} characters, with a host"
            )
        return
    head = _DATA_URL.match(url)
    if head is not None and head.end() == len(url):
        raise ValueError(f"part {i}: the data URL holds no image")
    if head is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url[:17] else "bare"
        raise ValueError(
            f"part {i}: a {scheme!r} image URL is not read: give an https URL, or the image "
            "inline as data:image/<png|jpeg|webp|gif>;base64,<bytes>"
        )


class FileRef(BaseModel):
    """A ``file`` part's file: an image uploaded through the gateway (purpose ``vision``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file_id: str = Field(pattern=r"^file-[A-Za-z0-9_-]{1,64}$")


class FilePart(BaseModel):
    """A ``file`` part of a user message: an uploaded image, by its ``file_id``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["file"]
    file: FileRef


class ImagePart(BaseModel):
    """An image part of a user message's content list (OpenAI's ``image_url``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["image_url"]
    image_url: ImageURL


class StreamOptions(BaseModel):
    """OpenAI's stream_options. Usage is always sent on the final chunk."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    include_usage: bool = True


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``response_format.json_schema``. mlxq always enforces the schema
    (``strict`` true or not): constrained decoding, never a hint."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format: type {self.type} takes no json_schema")
        if (schema := self.schema_or_none) is not None:
            try:
                grammar_for(schema)
            except SchemaError as e:
                where = "json_schema.schema" if self.type == "json_schema" else "json_object"
                raise ValueError(f"response_format.{where} cannot be enforced: {e}") from None
        return self

    @property
    def schema_or_none(self) -> dict[str, Any] | bool | None:
        """The JSON schema the output must match; None for plain text."""
        if self.type == "json_object":
            return ANY_OBJECT
        return self.json_schema.json_schema if self.json_schema is not None else None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: the output matches a ``regex`` whole, is one of the
    ``choice`` strings, follows a lark ``grammar`` (llguidance's), or a ``json`` schema.
    One of them."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="json")

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [
            k for k in ("regex", "choice", "grammar", "json_schema") if getattr(self, k) is not None
        ]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of regex, choice, grammar, json")
        return self


#: A request's constraint on its output: (the field that sets it, kind, what); kind one of
#: json, regex, choice, grammar.
Constraint = tuple[str, str, Any]


def compile_constraint(kind: str, value: Any, layout: str = DEFAULT_LAYOUT) -> str:
    """The llguidance grammar of a constraint (:class:`SchemaError` naming what is wrong)."""
    if kind == "json":
        return grammar_for(value, layout)
    if kind == "regex":
        return grammar_of_regex(value)
    if kind == "choice":
        return grammar_of_choice(value)
    return grammar_of_lark(value)


class Speculation(BaseModel):
    """mlxq's ``speculation``: where a job's speculative tokens come from.

    ``draft``: the ``draft_model`` it names (the default when it names one);
    ``prompt_lookup``: copied from its own prompt and output, no draft model (n-gram
    sizes tried longest first, at most ``num_tokens`` per round; the worker chooses
    per round up to that when unset); ``none``: never speculate. Whether and how far
    to speculate is the worker's ``--speculative`` policy, as for a draft.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["draft", "prompt_lookup", "none"]
    ngram_min: int | None = Field(default=None, ge=1, le=MAX_NGRAM)
    ngram_max: int | None = Field(default=None, ge=1, le=MAX_NGRAM)
    num_tokens: int | None = Field(default=None, ge=1, le=MAX_PROPOSAL)

    @model_validator(mode="after")
    def _check(self) -> Speculation:
        tuned = [f for f in ("ngram_min", "ngram_max", "num_tokens") if getattr(self, f)]
        if tuned and self.method != "prompt_lookup":
            raise ValueError(
                f"speculation: {', '.join(tuned)} apply to method prompt_lookup only "
                "(a draft's length is num_draft_tokens)"
            )
        lo, hi = self.ngram_min, self.ngram_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"speculation: ngram_min {lo} is larger than ngram_max {hi}")
        return self


class Message(BaseModel):
    """One chat message. ``developer`` is OpenAI's newer name for ``system``. An
    assistant message may carry the ``tool_calls`` it made (its content then may be
    null); a ``tool`` message answers one of them by ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart | FilePart] | None = None  # (None beside tool_calls)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=128)
    name: str | None = Field(default=None, max_length=64)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in ("text", "image_url", "file"):
                    raise ValueError(
                        f"part {i} is {kind!r}: {NON_TEXT.get(kind, 'only text parts are read')}"
                    )
                if kind == "image_url":
                    _check_image_part(i, part)
                if kind == "file" and set(part.get("file") or {}) - {"file_id"}:
                    raise ValueError(
                        f"part {i}: a file part names an image uploaded with purpose 'vision' "
                        "by its file_id alone (no file_data or filename)"
                    )
        return value

    @model_validator(mode="after")
    def _check_roles(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages make calls, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id: only tool messages answer calls, not {self.role}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: a {self.role} message needs content")
        if self.images and self.role != "user":
            raise ValueError(f"content: images go in user messages, not in a {self.role} message")
        return self

    @property
    def images(self) -> list[str]:
        """Its images in order: image parts' URLs, file parts as ``mlxq-file:<file_id>``."""
        if not isinstance(self.content, list):
            return []
        return [
            p.image_url.url if isinstance(p, ImagePart) else f"mlxq-file:{p.file.file_id}"
            for p in self.content
            if isinstance(p, ImagePart | FilePart)
        ]

    @property
    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def as_template_dict(self) -> dict[str, Any]:
        """The form chat templates expect: ``{"role", "content"}``, with Hugging Face's
        ``tool_calls`` (arguments as objects) and ``tool_call_id`` where present."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text}
        if self.images:  # Hugging Face's multimodal form: the template places each image
            out["content"] = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in self.content or ()
            ]
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.parsed_arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            out["name"] = self.name
        return out


class ChatRequest(BaseModel):
    """An OpenAI chat.completions request body, as a worker will run it.

    Unknown fields are rejected by name; OpenAI fields mlxq cannot honour yet
    are rejected with the reason. ``draft_model`` names a small model for
    speculative decoding; ``extra_params: {"draft_model": ...}`` is accepted too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=512)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    #: mlx-lm's (and vLLM's) multiplicative penalty on tokens in the last
    #: ``repetition_context_size`` tokens (1.0: none).
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    repetition_context_size: int = Field(default=20, ge=1, le=4096)
    #: vLLM's: the end tokens are banned until the completion holds this many tokens.
    min_tokens: int = Field(default=0, ge=0)
    #: mlx-lm's XTC ("exclude top choices"): with this probability per token, every token
    #: above ``xtc_threshold`` but the least likely of them is excluded (not with speculation).
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=0.5)
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    #: vLLM's constrained outputs beyond JSON (and its older ``guided_*`` fields).
    structured_outputs: StructuredOutputs | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    #: mlxq (oMLX's name): the most tokens a reasoning model may think before its thinking
    #: block is closed for it (``reasoning_effort`` maps to :data:`EFFORT_BUDGETS`).
    thinking_budget: int | None = Field(default=None, ge=0, le=MAX_THINKING_BUDGET)
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    draft_model: str | None = Field(default=None, min_length=1, max_length=512)
    num_draft_tokens: int | None = Field(default=None, ge=1, le=32)
    adapter: str | None = Field(default=None, min_length=1, max_length=512)
    speculation: Speculation | None = None
    json_whitespace: Literal["compact", "indented"] | None = None
    #: mlxq: seconds the job may run once a worker has begun it; past them it stops and
    #: fails with ``timeout``, its text so far in the record (the least of this, the
    #: batch's job timeout and the worker's ``--time-limit`` applies).
    time_limit_s: float | None = Field(default=None, gt=0, le=MAX_TIME_LIMIT_S)
    #: mlxq: the one user message's text is the whole prompt, tokenized as is (no chat
    #: template): what legacy ``/v1/completions`` runs as.
    raw_prompt: bool = False

    @property
    def images(self) -> list[str]:
        """The data URLs of every image part, in message order."""
        return [url for m in self.messages for url in m.images]

    @model_validator(mode="after")
    def _check_raw_prompt(self) -> ChatRequest:
        if len(self.images) > MAX_IMAGES:
            raise ValueError(f"messages: {len(self.images)} images; at most {MAX_IMAGES}")
        if not self.raw_prompt:
            return self
        if len(self.messages) != 1 or self.messages[0].role != "user":
            raise ValueError("raw_prompt: needs exactly one user message (the prompt)")
        if not isinstance(self.messages[0].content, str):
            raise ValueError("raw_prompt: the prompt must be a string")
        if self.tools or self.chat_template_kwargs:
            raise ValueError("raw_prompt: no chat template runs, so no tools or its kwargs")
        return self

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported_and_merge_extra(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unsupported = data.keys() & _UNSUPPORTED_KEYS
        if not unsupported and "extra_params" not in data:
            return data
        data = dict(data)
        for name in sorted(unsupported):
            if data[name] not in _HARMLESS:
                raise ValueError(f"{name}: {UNSUPPORTED[name]}")
            del data[name]
        extra = data.pop("extra_params", None)
        if extra is not None:
            if not isinstance(extra, dict):
                raise ValueError("extra_params: must be an object")
            unknown = sorted(set(extra) - set(_EXTRA_PARAM_FIELDS))
            if unknown:
                raise ValueError(
                    f"extra_params: unknown keys {unknown} "
                    f"(allowed: {', '.join(_EXTRA_PARAM_FIELDS)})"
                )
            for key, value in extra.items():
                if key in data and data[key] != value:
                    raise ValueError(f"{key} is given both at top level and in extra_params")
                data[key] = value
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value or None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if not value:
            return None
        if len(value) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} keys, not {len(value)}")
        for key in value:
            if not _TEMPLATE_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a template variable name")
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"{key!r} is set by mlxq itself (give it as its request field)")
        size = len(json.dumps(value))
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValueError(f"{size} bytes as JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100.0 <= v <= 100.0 for v in value.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        return value or None

    @model_validator(mode="after")
    def _check_limits(self) -> ChatRequest:
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens differ; give only one")
        if self.min_tokens and self.token_limit is not None and self.min_tokens > self.token_limit:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is more than max_tokens ({self.token_limit})"
            )
        if self.num_draft_tokens is not None and self.draft_model is None:
            raise ValueError("num_draft_tokens is set but no draft_model is named")
        method = self.speculation.method if self.speculation is not None else None
        if method == "draft" and self.draft_model is None:
            raise ValueError("speculation.method is draft but no draft_model is named")
        if method in ("prompt_lookup", "none") and self.draft_model is not None:
            raise ValueError(
                f"speculation.method {method} and draft_model {self.draft_model!r} "
                "contradict each other: name one way to speculate"
            )
        if self.xtc_probability > 0 and self.speculation_method in ("draft", "prompt_lookup"):
            raise ValueError(
                "xtc_probability cannot be combined with speculation (draft_model or prompt "
                "lookup): its random exclusions are not the distribution drafts are verified "
                "against; drop one"
            )
        if self.n > 1 and self.stream:
            raise ValueError("n > 1 cannot be streamed yet: drop stream, or submit n jobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        constraint = self.constraint  # (at most one way to constrain the output)
        if self.json_whitespace is not None and (constraint is None or constraint[1] != "json"):
            raise ValueError(
                "json_whitespace lays out a JSON response_format; this request has none "
                "(tool call arguments are always compact)"
            )
        if constraint is not None:
            try:
                compile_constraint(*constraint[1:], self.json_whitespace or DEFAULT_LAYOUT)
            except SchemaError as e:
                raise ValueError(f"{constraint[0]}: cannot be enforced: {e}") from None
            if self.stop:
                raise ValueError(
                    "stop cannot be combined with a constrained output (a JSON response_format, "
                    "structured_outputs): a stop string would cut it short (the output ends "
                    "when it is complete)"
                )
        check_tools(self.tools, self.tool_choice)
        if self.forced_call is not None:
            if constraint is not None:
                raise ValueError(
                    f"{constraint[0]} and a required tool call both shape the output: give one"
                )
            if self.stop:
                raise ValueError(
                    "stop cannot be combined with a required tool call: a stop string would "
                    "cut the call short"
                )
        return self

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given besides the messages and tools."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out

    @property
    def uses_tools(self) -> bool:
        """Whether the model is offered tools (rendered, and its calls parsed)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates (and mlx-lm's parsers) take them; None if none
        are offered."""
        if not self.uses_tools or self.tools is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forced_call(self) -> list[FunctionDef] | None:
        """The functions a call must be made to (decoded under a grammar); None: free."""
        return called(self.tools, self.tool_choice) if self.tools else None

    @property
    def parallel_calls(self) -> bool:
        """Whether a forced ``required`` call may be several calls (OpenAI's default)."""
        return self.parallel_tool_calls is not False

    @property
    def constraint(self) -> Constraint | None:
        """How the output is constrained: (the field that says so, kind, what); None for
        free text. ValueError if the request names more than one way."""
        found: list[Constraint] = []
        fmt = self.response_format
        if fmt is not None and (schema := fmt.schema_or_none) is not None:
            found.append(("response_format", "json", schema))
        so = self.structured_outputs
        for kind in ("regex", "choice", "grammar", "json"):
            value = getattr(so, "json_schema" if kind == "json" else kind) if so else None
            if value is not None:
                found.append((f"structured_outputs.{kind}", kind, value))
            if (value := getattr(self, f"guided_{kind}")) is not None:
                found.append((f"guided_{kind}", kind, value))
        if len(found) > 1:
            raise ValueError(
                f"{', '.join(f for f, _, _ in found)}: each constrains the output; give one"
            )
        return found[0] if found else None

    @property
    def grammar(self) -> str | None:
        """The llguidance grammar the output must follow (cached per constraint and
        layout); None for free text."""
        constraint = self.constraint
        if constraint is None:
            return None
        return compile_constraint(*constraint[1:], self.json_whitespace or DEFAULT_LAYOUT)

    @property
    def speculation_method(self) -> str | None:
        """How this job asks to speculate: "draft", "prompt_lookup", "none", or None (it
        does not say: the worker's ``--lookup`` decides for a job without a draft)."""
        if self.speculation is not None:
            return self.speculation.method
        if self.draft_model is not None:
            return "draft"
        return "none" if self.xtc_probability > 0 else None  # (XTC never speculates)

    @property
    def thinking_limit(self) -> int | None:
        """The thinking budget: ``thinking_budget``, else ``reasoning_effort``'s; None: no cap."""
        if self.thinking_budget is not None:
            return self.thinking_budget
        return EFFORT_BUDGETS[self.reasoning_effort] if self.reasoning_effort else None

    @property
    def token_limit(self) -> int | None:
        """The completion token limit (``max_completion_tokens`` or ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens
