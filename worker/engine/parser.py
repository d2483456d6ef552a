"""One output parser: a job's text as reasoning, answer and tool calls, while it grows and
once it is done.

The streamer (``worker.runner.streamer``) feeds it each piece of text a sequence
writes and sends what :meth:`OutputParser.live` can show; the record
(``worker.runner.records``) is :meth:`OutputParser.message` of the whole text. Both
views come from the same split (:func:`split_reasoning`) and the same call
segmentation, so the streamed fields concatenate to the record's:

- reasoning: the thinking block of a reasoning model (``worker.engine.reasoning``'s
  markers); while it grows, text that could begin the end marker (and whitespace a
  marker may strip) waits until it cannot;
- answer: the rest; with tools, from the call marker on the text is held (and a suffix
  that could begin the marker), and the calls come out as ``(name, arguments so far)``
  (``worker.engine.toolcalls.live_calls``); the finished text is parsed by the model's
  own parser (``worker.engine.toolcalls.parse``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas import AssistantMessage
from worker.engine.reasoning import Thinking
from worker.engine.toolcalls import Family, live_calls, parse


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


def split_reasoning(
    text: str, thinking: Thinking, in_reasoning: bool, final: bool = True
) -> tuple[str | None, str | None]:
    """``text`` as (reasoning, answer); reasoning None when there is none. ``final``: the
    text is complete (a block cut short, ``max_tokens`` inside the reasoning, is all
    reasoning, and the answer is ""). While it grows (not ``final``): what can be shown
    now, the answer None until it begins."""
    if not in_reasoning:
        stripped = text.lstrip()
        opening = len(stripped) < len(thinking.start) and thinking.start.startswith(stripped)
        if opening and not final:
            return None, None  # it may be opening a thinking block
        if not stripped.startswith(thinking.start):
            return None, text
        text = stripped[len(thinking.start) :]
    at = text.find(thinking.end)
    if at < 0:
        if final:
            return text.strip() or None, ""
        return text[: shown_until(text, thinking.end)].strip() or None, None
    return text[:at].strip() or None, text[at + len(thinking.end) :].lstrip()


@dataclass
class Live:
    """What can be shown of a growing output now."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments so far)


@dataclass
class OutputParser:
    """One sequence's output: fed piece by piece (:meth:`feed`), read live (:meth:`live`)
    or whole (:meth:`message`)."""

    thinking: Thinking | None = None
    in_reasoning: bool = False  # the prompt left the model inside a thinking block
    family: Family | None = None  # the tool-call format, when the job has tools
    text: str = ""

    def feed(self, delta: str) -> None:
        self.text += delta

    def _split(self, final: bool) -> tuple[str | None, str | None]:
        if self.thinking is None:
            return None, self.text
        return split_reasoning(self.text, self.thinking, self.in_reasoning, final)

    def live(self) -> Live:
        reasoning, answer = self._split(final=False)
        if answer is None or self.family is None:
            return Live(reasoning, answer)
        marker, end = self.family.start, self.family.end
        out = Live(reasoning, answer[: shown_until(answer, marker)])
        if (at := answer.find(marker)) >= 0:
            for part in answer[at:].split(marker)[1:]:
                body = part
                if end:
                    stop = part.find(end)
                    body = part[:stop] if stop >= 0 else part[: shown_until(part, end)]
                out.calls.extend((name, args) for name, args, _ in live_calls(self.family, body))
        return out

    def message(
        self, finish_reason: str, tools: Any = None, ids: Callable[[int], str] | None = None
    ) -> tuple[AssistantMessage, str]:
        """The finished message and its finish reason ("tool_calls" when it made calls
        and stopped by itself); ``ids`` names the n-th call."""
        reasoning, answer = self._split(final=True)
        msg = AssistantMessage(content=answer or "", reasoning_content=reasoning)
        if self.family is None:
            return msg, finish_reason
        content, calls = parse(answer or "", self.family, tools, ids)
        if not calls:
            return msg, finish_reason
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return msg.model_copy(update={"content": content, "tool_calls": calls}), reason
