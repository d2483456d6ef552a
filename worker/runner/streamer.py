"""What a streamed job sends as it goes: its reasoning, its answer, its tool calls.

The text a sequence writes is split as the final record splits it
(``worker.engine.reasoning``, ``worker.engine.toolcalls``), so the streamed pieces
of each field concatenate to exactly that field of the record:

- a reasoning model's thinking goes out as ``delta.reasoning_content`` (text that
  could begin the end marker, and trailing whitespace, wait until they cannot);
- the answer as ``delta.content``; with tools, from the call marker on the text is
  held (and a suffix that could begin the marker) and the calls go out as
  ``delta.tool_calls``: a call's id and name once its name is written, then its
  arguments in fragments as the model writes them (for families whose arguments
  are JSON; others when the answer ends). Held text that was no call is sent at
  the end. The record's calls carry the same ids and the same argument text.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas import ResultRecord
from worker.engine.constrain import token_bytes
from worker.engine.logprobs import LogprobEntry, render
from worker.engine.models import LoadedModel
from worker.engine.reasoning import Thinking, thinking_of
from worker.engine.request import Prepared
from worker.engine.toolcalls import Family, family_of, live_calls
from worker.engine.toolcalls import call_id as call_id_of
from worker.lifecycle.streaming import ChunkWriter

REASONING, CONTENT = "reasoning_content", "content"


def shown_until(text: str, marker: str) -> int:
    """How much of ``text`` can be shown: up to ``marker``, or to a suffix that could
    begin it."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class Streamer:
    """Receives a sequence's text pieces (an ``OnText``) and writes the job's chunks."""

    def __init__(
        self,
        writer: ChunkWriter,
        target: LoadedModel,
        logprobs: bool,
        family: Family | None = None,
        thinking: Thinking | None = None,
        in_reasoning: bool = False,
    ) -> None:
        self.writer, self.family = writer, family
        self.marker = family.start if family is not None else None
        self.completion_id = str(writer.base["id"])
        self.calls: list[tuple[str, str]] = []  # per call streamed: (name, arguments so far)
        self.thinking, self.in_reasoning = thinking, in_reasoning
        self.bytes_of = token_bytes(target.tokenizer, target.vocab_size) if logprobs else None
        self.text = ""  # everything the sequence wrote
        self.sent = {REASONING: "", CONTENT: ""}  # what each field streamed so far
        self.entries: list[LogprobEntry] = []  # logprobs not sent yet

    @classmethod
    def for_job(
        cls, writer: ChunkWriter, target: LoadedModel, prepared: Prepared, logprobs: bool
    ) -> Streamer:
        req = prepared.request
        tok = target.tokenizer
        family = family_of(tok) if req is not None and req.uses_tools else None
        opened = prepared.params.in_reasoning
        return cls(writer, target, logprobs, family, thinking_of(tok), opened)

    def __call__(self, delta: str, entries: Sequence[LogprobEntry]) -> None:
        if not delta and not entries:
            return
        self.text += delta
        self.entries.extend(entries)
        reasoning, answer = self._parts()
        if reasoning is not None:
            self._emit(REASONING, reasoning)
        if answer is None:
            return
        if self.marker is None:
            self._emit(CONTENT, answer)
            return
        self._emit(CONTENT, answer[: shown_until(answer, self.marker)])
        if (at := answer.find(self.marker)) >= 0:
            self._stream_calls(answer[at:])

    def _parts(self) -> tuple[str | None, str | None]:
        """What can be shown now of the reasoning, and the answer so far (None: none yet)."""
        text, t = self.text, self.thinking
        if t is None:
            return None, text
        if not self.in_reasoning:
            stripped = text.lstrip()
            if len(stripped) < len(t.start) and t.start.startswith(stripped):
                return None, None  # it may be opening a thinking block
            if not stripped.startswith(t.start):
                return None, text
            text = stripped[len(t.start) :]
        at = text.find(t.end)
        if at < 0:
            return text[: shown_until(text, t.end)].strip(), None
        return text[:at].strip(), text[at + len(t.end) :].lstrip()

    def _stream_calls(self, text: str) -> None:
        """The calls in ``text`` (from the first call marker on) as far as written."""
        family = self.family
        assert family is not None
        live: list[tuple[str, str, bool]] = []
        for part in text.split(family.start)[1:]:
            body = part
            if family.end:
                at = part.find(family.end)
                body = part[:at] if at >= 0 else part[: shown_until(part, family.end)]
            live.extend(live_calls(family, body))
        for n, (name, arguments, _) in enumerate(live):
            self._call(n, name, arguments)

    def _call(self, n: int, name: str, arguments: str) -> None:
        """Send the ``n``-th call's id and name (once) and its arguments not sent yet."""
        if n == len(self.calls):
            call_id = call_id_of(self.completion_id, 0, n)
            first = {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
            self.writer.tool_call(n, first)
            self.calls.append((name, ""))
        if n >= len(self.calls) or self.calls[n][0] != name:
            return
        sent = self.calls[n][1]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            self.writer.tool_call(n, {"function": {"arguments": arguments[len(sent) :]}})
            self.calls[n] = (name, arguments)

    def _emit(self, field: str, shown: str) -> None:
        sent = self.sent[field]
        if len(shown) <= len(sent) or not shown.startswith(sent):
            return
        rendered = None
        if self.bytes_of and self.entries:
            rendered = render(self.entries, self.bytes_of).model_dump(mode="json")
        self.entries = []
        self.writer.text(shown[len(sent) :], rendered, field)
        self.sent[field] = shown

    def end(self, record: ResultRecord) -> None:
        """The final chunks: what each field has not streamed yet, the calls, then the
        finish reason and usage."""
        if record.response is None:
            return
        choice = record.response.choices[0]
        self._emit(REASONING, choice.message.reasoning_content or "")
        self._emit(CONTENT, choice.message.content or "")
        for n, call in enumerate(choice.message.tool_calls or ()):
            self._call(n, call.function.name, call.function.arguments)
        self.writer.finish(choice.finish_reason, record.response.usage.model_dump())
