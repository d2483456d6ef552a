"""A worker group's engines: rank 0's tell every call, the followers repeat them.

See ``worker.engine.group`` for the group and why every rank must make the same model
calls in the same order. Plain decoding is deterministic given the same calls, so the
followers sample for themselves. Speculation is not: rank 0 alone holds the draft
(whole: a small model, run with no collective per draft token) and samples (a seeded
sequence's draws, a grammar's state), so each round it tells the proposals before the
target's pass and what each row kept after it; a follower verifies the same tokens on
its part of the target and rewinds as rank 0 does, sampling nothing. Pure MLX and
mlx-lm; knows nothing of Redis.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Hashable
from dataclasses import fields
from typing import Any

import mlx.core as mx

from schemas import ChatRequest
from worker.engine.batch import BatchEngine
from worker.engine.group import CLOSE, EXIT, STEP, Group, GroupLost, transport_failed
from worker.engine.layers import restore, snapshot
from worker.engine.models import CacheKey, LoadedModel, ModelCache
from worker.engine.output import GenerationOutput
from worker.engine.prefill import prefill
from worker.engine.protocol import NO_START, CannotTake, Engine, Start, Step
from worker.engine.request import GenerationParams, Prepared, prepare
from worker.engine.sequence import OnText
from worker.engine.single import SingleEngine
from worker.engine.specbatch import SpecBatchEngine

log = logging.getLogger(__name__)

#: What rank 0 sends of a sequence's parameters; the rest each rank makes from the request
#: with its own tokenizer, alike (the grammar, lookup, thinking budget, end and XTC tokens).
_MADE = ("constraint", "lookup", "budget", "eos", "xtc_special")
_SENT = [f.name for f in fields(GenerationParams) if f.name not in _MADE]


# -- rank 0: engines that tell --------------------------------------------------------
class GroupEngine:
    """An engine on rank 0 of a group: every call is told to the followers first (or,
    for ``add``, once it is known to be taken), who make the same call on their parts."""

    def __init__(self, group: Group, inner: Engine, target: LoadedModel) -> None:
        self.group, self.inner = group, inner
        self.models = inner.models
        spec: dict[str, Any] = {"kind": "single"}
        if isinstance(inner, BatchEngine):
            spec = {"kind": "batch", "max_batch": inner.max_batch}
        elif isinstance(inner, SpecBatchEngine):  # (rank 0 proposes, every rank verifies)
            spec = {"kind": "spec", "k": inner.k, "solo": inner.solo}
            inner.tell = group.tell
        with group.call("a new engine"):
            group.tell({"op": "engine", "model": target.name, "adapter": target.adapter} | spec)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # lengths(), first_token_at(), ...
        return getattr(self.inner, name)

    @property
    def kv_bytes(self) -> int:
        return self.inner.kv_bytes

    @property
    def prefill_steps(self) -> int:
        return self.inner.prefill_steps

    def add(
        self,
        tag: Hashable,
        job: Prepared,
        start: Start = NO_START,
        on_text: OnText | None = None,
        first: bool = False,
    ) -> None:
        if start.cache is not None and not start.source:
            raise CannotTake("a worker group starts a sequence only from a kept prefix")
        if job.params.seed is None:  # the same draws on every rank
            job = job.with_params(seed=secrets.randbelow(2**31))
        if job.request is None:
            raise CannotTake("a worker group sequence needs its request")
        message = {  # made first: what cannot be sent is never added
            "op": "add",
            "tag": tag,
            "first": first,
            "prompt": job.prompt,
            "params": {k: getattr(job.params, k) for k in _SENT},
            "request": job.request.model_dump(mode="json"),
            "start": [list(start.source), start.cached, start.reused] if start.source else None,
        }
        with self.group.call("an added sequence"):
            self.inner.add(tag, job, start, on_text, first)
            self.group.tell(message)

    def remove(self, tag: Hashable) -> GenerationOutput | None:
        with self.group.call("a removed sequence"):
            self.group.tell({"op": "remove", "tag": tag})
            return self.inner.remove(tag)

    def step(self) -> Step:
        with self.group.call("a step"):  # (its forward passes are collectives too)
            self.group.step()
            return self.inner.step()

    def close(self) -> None:
        with self.group.call("an engine's close"):
            self.group.close()
            self.inner.close()


# -- the followers ---------------------------------------------------------------------
class _Exit(BaseException):
    """Rank 0 ended the group."""


#: A follower's kept prefixes, its part of each: (model key, tokens) -> layers.
Kept = dict[tuple[CacheKey, tuple[int, ...]], list[Any]]


def follow(group: Group, cache: ModelCache) -> None:
    """A follower's life: repeat what rank 0 tells, until it says ``exit`` (raises
    :class:`~worker.engine.group.GroupLost` if a rank is gone)."""
    kept: Kept = {}
    try:
        while True:
            msg = group.listen()
            if msg == EXIT:
                raise _Exit
            if not isinstance(msg, dict):
                raise RuntimeError(f"a worker group follower was told {msg} outside an engine")
            _obey(group, cache, kept, msg)
    except _Exit:
        group.confirm_exit()


def _obey(group: Group, cache: ModelCache, kept: Kept, msg: dict[str, Any]) -> None:
    op = msg["op"]
    try:
        if op == "load":
            cache.get(msg["name"], msg["adapter"])
        elif op == "evict":
            key = (msg["name"], msg["adapter"])
            cache.evict(key)
            for k in [k for k in kept if k[0] == key]:
                del kept[k]
        elif op == "engine":
            _run_engine(group, cache, kept, msg)
        elif op == "prefix":
            _prefill(cache, kept, msg)
        elif op == "forget":
            kept.pop((tuple(msg["model"]), tuple(msg["tokens"])), None)
        else:
            raise RuntimeError(f"a worker group follower was told {op!r} outside an engine")
    except Exception as e:  # rank 0 met the same (the same code on the same input)
        if transport_failed(e):  # (not the input: a peer is gone)
            group.lost = True
            raise GroupLost(f"group rank {group.rank}: {op}: {e}") from e
        log.warning("group rank %d: %s failed: %s: %s", group.rank, op, type(e).__name__, e)


def _prefill(cache: ModelCache, kept: Kept, msg: dict[str, Any]) -> None:
    """Rank 0 keeps a prefix: this rank's part of it, prefilled from the same entry."""
    target, _ = cache.get(*msg["model"])
    tokens, held, base = tuple(msg["tokens"]), int(msg["held"]), msg["base"]
    layers = target.new_cache() if base is None else restore(kept[(target.key, tuple(base))], held)
    part = snapshot(prefill(target.model, list(tokens), layers, held, len(tokens)), len(tokens))
    if part is not None:
        kept[(target.key, tokens)] = part


def _run_engine(group: Group, cache: ModelCache, kept: Kept, spec: dict[str, Any]) -> None:
    target, _ = cache.get(spec["model"], spec["adapter"])
    engine: Engine
    if spec["kind"] == "batch":
        engine = BatchEngine(target, int(spec["max_batch"]))
    elif spec["kind"] == "spec":
        engine = Verifier(target, int(spec["k"]), bool(spec["solo"]), group.listen)
    else:
        engine = SingleEngine(target)
    while True:
        msg = group.listen()
        if msg == EXIT:
            raise _Exit
        if msg == STEP:
            engine.step()
        elif msg == CLOSE:
            engine.close()
            return
        elif isinstance(msg, dict) and msg["op"] == "add":
            req = ChatRequest.model_validate(msg["request"])
            params = msg["params"] | {
                "stop": tuple(msg["params"]["stop"]),
                "logit_bias": tuple(tuple(p) for p in msg["params"]["logit_bias"]),
            }
            job = Prepared(msg["prompt"], prepare(req, target).params, req).with_params(**params)
            start = NO_START
            if msg["start"] is not None:  # rank 0's kept prefix: this rank's part of it
                source, cached, reused = msg["start"]
                layers = restore(kept[(target.key, tuple(source))], cached)
                start = Start(layers, cached, reused, tuple(source))
            engine.add(_tag(msg["tag"]), job, start, None, msg["first"])
        elif isinstance(msg, dict) and msg["op"] == "remove":
            engine.remove(_tag(msg["tag"]))
        elif isinstance(msg, dict):
            _obey(group, cache, kept, msg)  # a job run between this batch's steps
        else:
            raise RuntimeError(f"a worker group follower was told {msg}")


class Verifier(SpecBatchEngine):
    """A follower's speculative engine: each round it verifies what rank 0 proposed, on
    its part of the target, and keeps what rank 0 kept. No draft, no sampling: rank 0's
    proposals and choices are the group's."""

    def __init__(
        self, target: LoadedModel, k: int, solo: bool, listen: Callable[[], dict[str, Any] | int]
    ) -> None:
        super().__init__(target, None, k, solo=solo)
        self.listen = listen

    def _looks_up(self, params: Any) -> bool:
        return False

    def _heard(self, op: str) -> dict[str, Any]:
        msg = self.listen()
        if not isinstance(msg, dict) or msg.get("op") != op:
            raise RuntimeError(f"a worker group follower expected {op!r} and was told {msg}")
        return msg

    def step(self) -> Step:
        joined = self._joined()
        rows = self.rows
        if not rows:
            return Step(0, [], joined, decoding=0)
        proposed = self._heard("proposed")["drafts"]
        kr = len(proposed[0])
        drafts = mx.array(proposed, mx.uint32) if kr else None
        verify_in, mark = self._verify_input(drafts, kr)
        mx.eval(self.target.model(verify_in, cache=self.t_cache))  # (its collectives, now)
        kept = self._heard("kept")
        accepts = kept["accepts"]
        for row, token in zip(rows, kept["last"], strict=True):
            row.history.append(token)
        self._rewind_target(mark, [kr - a for a in accepts], verify_in, accepts)
        if len(kept["keep"]) < len(rows):
            self._keep(kept["keep"])
        self.rounds += 1
        return Step(0, [], joined, decoding=len(rows))


def _tag(value: Any) -> Hashable:
    return tuple(_tag(v) for v in value) if isinstance(value, list) else value
