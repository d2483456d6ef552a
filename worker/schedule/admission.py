"""Memory admission: what a batch of sequences will cost, in the bytes a model measured.

A model's KV bytes per sequence (a :class:`KVCost`) are measured by the engine
(``worker.engine.memory.kv_profile``): full-attention layers cost bytes per
token; sliding-window layers the same up to their window; recurrent layers a
fixed state per sequence. Pure Python from there.

A continuous batch keeps its sequences right-aligned in one buffer per layer
(``BatchKVCache``): every row is as long as the longest sequence in it, and the
buffer shrinks when the longest leaves. :func:`batch_peak_bytes` projects the
largest that buffer can get if no sequence stops before its ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

#: Batch KV buffers grow in steps of this many tokens (mlx-lm's ``BatchKVCache.step``).
KV_STEP = 256


class KVCost(Protocol):
    """A model's KV bytes per sequence as a function of its length (the engine measures
    it: ``worker.engine.memory.KVProfile``)."""

    def bytes_for(self, tokens: int) -> int: ...


def batch_peak_bytes(profile: KVCost, sequences: Sequence[tuple[int, int]]) -> int:
    """The largest a batch's KV buffers can get: ``sequences`` are (tokens held now,
    tokens still to come at most) each, all decoding one token per step.

    At ``t`` steps from now the rows are ``max(held) + t`` long (over the
    sequences still running) and there is one row per running sequence; the
    largest is reached just before a sequence leaves. Buffers grow a step at a
    time, so a row may have up to one step more room than it holds.

    Sequences sorted by what they have left (most first): just before the i-th
    leaves, the first i + 1 run. O(n log n): it runs at every step a job waits.
    """
    peak = longest = 0
    ordered = sorted(sequences, key=lambda s: s[1], reverse=True)
    for running, (held, left) in enumerate(ordered, start=1):
        longest = max(longest, held)
        peak = max(peak, running * profile.bytes_for(longest + left + KV_STEP))
    return peak


#: (tokens held now, tokens still to come at most) of one sequence.
Length = tuple[int, int]


@dataclass(frozen=True)
class Verdict:
    """Whether a job may join a running batch now; if not, by how much it would
    overflow (bytes) and the reason the batch publishes (``producer fleet``)."""

    join: bool
    over: int = 0
    reason: str = ""


def admit(
    peak: Callable[[Sequence[Length]], int],
    running: Sequence[Length],
    job: Length,
    room: int,
    n: int = 1,
) -> Verdict:
    """Memory admission of ``job`` (``n`` sequences: its choices) into a batch of
    ``running`` sequences: it joins if the batch's projected KV (``peak``:
    :func:`batch_peak_bytes` summed over the batch's models) with it fits in ``room``. A
    job that does not fit waits at the head of its queue, and the batch takes nothing past
    it until it does (first in, first out)."""
    over = peak([*running, *[job] * n]) - room
    if over <= 0:
        return Verdict(True)
    prompt, max_tokens = job
    times = f"{n} x " if n > 1 else ""
    return Verdict(
        False,
        over,
        f"memory: the next job ({times}{prompt} + {max_tokens} tokens) would take the "
        f"batch's KV cache {over / 1e6:.1f} MB past the {room / 1e6:.1f} MB left",
    )


def places(held: int, n: int, limit: int, why: str) -> Verdict:
    """Whether a lane holding ``held`` sequences of ``limit`` (``why``: what sets it) has
    places for a job of ``n`` sequences (its choices): an empty lane takes it whatever
    ``n`` (more than the cap then run once it is empty); a job of one is counted before it
    is taken (``worker.runner.lanes``), so only several need a verdict."""
    if n <= 1 or held == 0 or held + n <= limit:
        return Verdict(True)
    free = max(limit - held, 0)
    return Verdict(False, 0, f"places: the next job's {n} choices need {n}, {free} free ({why})")


def job_label(prompt: int, max_tokens: int) -> str:
    """How errors name a sequence's size."""
    return f"a prompt of {prompt} tokens with max_tokens {max_tokens}"
