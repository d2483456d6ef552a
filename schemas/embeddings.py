"""Embedding jobs: OpenAI's ``/v1/embeddings`` request body and its ``list`` response.

A job's request is an embedding request when it has ``input`` (and no ``messages``);
:data:`JobRequest` tells the two kinds apart for the job envelope. The limits are
OpenAI's: at most :data:`MAX_INPUTS` inputs, no empty string, no empty token list.
Inputs longer than the model's context are refused by the worker (it knows the
model), unless the job asks for ``truncate`` (an mlxq extension).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    field_validator,
)

from schemas.audio import AUDIO_URLS, TranscriptionRequest, is_audio_body
from schemas.request import ChatRequest

#: OpenAI's limit on inputs per request.
MAX_INPUTS = 2048
#: The longest input text, in characters (a token list is bounded by the model's context).
MAX_INPUT_CHARS = 1_000_000
EMBEDDINGS_URL = "/v1/embeddings"
CHAT_URL = "/v1/chat/completions"

TokenIds = list[Annotated[StrictInt, Field(ge=0, lt=2**31)]]
SHAPES = "must be a string, a list of strings, a list of token ids or a list of token-id lists"


def _is_id(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**31


class EmbeddingRequest(BaseModel):
    """An OpenAI embeddings request body, as a worker will run it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=512)
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=512)
    #: mlxq: cut inputs longer than the model's context instead of refusing them.
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        """One clear message per wrong shape (a union's errors name every branch)."""
        if isinstance(value, str):
            items: list[Any] = [value]
        elif isinstance(value, list) and value and all(_is_id(v) for v in value):
            items = [value]  # one token list
        elif isinstance(value, list):
            items = value
        else:
            raise ValueError(SHAPES)
        if not items:
            raise ValueError("must not be empty")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"{len(items)} inputs: at most {MAX_INPUTS} per request")
        if all(type(v) is int for v in items):
            raise ValueError(f"token ids are integers from 0 to {2**31 - 1}")
        texts = all(isinstance(v, str) for v in items)
        if not texts and not all(isinstance(v, list) for v in items):
            raise ValueError(f"{SHAPES}; not a mix")
        for i, item in enumerate(items):
            if len(item) == 0:
                what = "an empty string" if texts else "an empty token list"
                raise ValueError(f"input {i} is {what}: every input needs at least one token")
            if texts and len(item) > MAX_INPUT_CHARS:
                raise ValueError(f"input {i}: {len(item)} characters, at most {MAX_INPUT_CHARS}")
            if not texts and not all(_is_id(t) for t in item):
                raise ValueError(f"input {i}: token ids are integers from 0 to {2**31 - 1}")
        return value

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: texts, or token lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]


class Embedding(BaseModel):
    """One vector of an embeddings response: floats, or their float32 bytes in base64."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """An OpenAI embeddings response (``object: "list"``)."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encode_base64(vector: list[float]) -> str:
    """``encoding_format: base64``: the vector's little-endian float32 bytes, as OpenAI."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def decode_base64(text: str) -> list[float]:
    """The floats of a base64 embedding (what OpenAI's SDK does with it)."""
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _kind(value: Any) -> str:
    if isinstance(value, BaseModel):
        if isinstance(value, TranscriptionRequest):
            return "[audio]"
        return "[embeddings]" if isinstance(value, EmbeddingRequest) else "[chat]"
    if is_audio_body(value):
        return "[audio]"
    if isinstance(value, dict) and "input" in value and "messages" not in value:
        return "[embeddings]"
    return "[chat]"


#: A job's request: chat, embeddings (told apart by ``input``) or a transcription (``file``).
JobRequest = Annotated[
    Annotated[ChatRequest, Tag("[chat]")]
    | Annotated[EmbeddingRequest, Tag("[embeddings]")]
    | Annotated[TranscriptionRequest, Tag("[audio]")],
    Discriminator(_kind),
]


_REQUEST = TypeAdapter(JobRequest)
_BY_URL: dict[str, type[BaseModel]] = {
    CHAT_URL: ChatRequest,
    EMBEDDINGS_URL: EmbeddingRequest,
    **dict.fromkeys(AUDIO_URLS, TranscriptionRequest),
}
AnyRequest = ChatRequest | EmbeddingRequest | TranscriptionRequest


def parse_request(body: Any, url: str | None = None) -> AnyRequest:
    """Validate a job's request: as ``url``'s body (a Batch line's endpoint), or, without
    one, as chat, embeddings or audio by its shape. Raises pydantic's ValidationError."""
    if url is not None:
        return _BY_URL[url].model_validate(body)  # type: ignore[return-value]
    return _REQUEST.validate_python(body)
