"""What a streamed job sends as it goes: its reasoning, its answer, its tool calls.

The text a sequence writes goes through the job's output parser
(``worker.engine.parser``), the one the record is made with, so the streamed pieces
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

from redis import Redis

from schemas import ChatRequest, ResultRecord
from worker.engine.constrain import token_bytes
from worker.engine.logprobs import LogprobEntry, render
from worker.engine.models import LoadedModel
from worker.engine.parser import OutputParser
from worker.engine.reasoning import Thinking, thinking_of
from worker.engine.request import Prepared
from worker.engine.toolcalls import Family, family_of
from worker.engine.toolcalls import call_id as call_id_of
from worker.lifecycle.held import Job
from worker.lifecycle.streaming import ChunkWriter
from worker.runner.records import new_completion_id

REASONING, CONTENT = "reasoning_content", "content"


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
        self.writer = writer
        self.parser = OutputParser(thinking, in_reasoning, family)
        self.completion_id = str(writer.base["id"])
        self.calls: list[tuple[str, str]] = []  # per call streamed: (name, arguments so far)
        self.bytes_of = token_bytes(target.tokenizer, target.vocab_size) if logprobs else None
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
        thinking = None if req is not None and req.raw_prompt else thinking_of(tok)
        return cls(writer, target, logprobs, family, thinking, opened)

    def __call__(self, delta: str, entries: Sequence[LogprobEntry]) -> None:
        if not delta and not entries:
            return
        self.parser.feed(delta)
        self.entries.extend(entries)
        live = self.parser.live()
        if live.reasoning is not None:
            self._emit(REASONING, live.reasoning)
        if live.content is not None:
            self._emit(CONTENT, live.content)
        for n, (name, arguments) in enumerate(live.calls):
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


class JobStream:
    """A streamed job's chunks while it runs in a lane (``worker.runner.lane``): its
    stream opened (a job run again starts it over) as it joins, its :class:`Streamer`
    fed by the engine, its end written by :func:`stream_ended` once its record is."""

    def __init__(self, conn: Redis, job: Job, target: LoadedModel, prepared: Prepared) -> None:
        req = job.envelope.request
        assert isinstance(req, ChatRequest)
        self.completion_id = new_completion_id()
        writer = ChunkWriter(conn, job.id, self.completion_id, req.model, job.envelope.result_ttl)
        self.streamer = Streamer.for_job(writer, target, prepared, bool(req.logprobs))
        writer.start()


def stream_ended(conn: Redis, job: Job, record: ResultRecord, stream: JobStream | None) -> None:
    """Once a job's record is stored: a streamed job's final chunks (a reader that sees
    the stream end can read the record), or its error chunk when it failed or stopped,
    whether or not its stream had begun."""
    req = job.envelope.request
    if not (isinstance(req, ChatRequest) and req.stream):
        return
    if record.error is None and stream is not None:
        stream.streamer.end(record)
    elif record.error is not None:
        cid = stream.completion_id if stream is not None else new_completion_id()
        writer = ChunkWriter(conn, job.id, cid, req.model, job.envelope.result_ttl)
        writer.error(record.error.model_dump(mode="json"))
