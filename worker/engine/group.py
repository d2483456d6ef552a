"""One model across several machines: a worker group on ``mlx.distributed`` (``worker --shard``).

The worker is started on N ranks by mlx's own launcher (``mlx.launch --hosts mac1,mac2 --
worker --shard auto ...``). Each rank loads its part of each model (mlx-lm's ``shard``:
tensor parallel, each rank holds 1/N of every layer; or ``pipeline``: each rank holds a
run of layers), and every forward pass is one collective computation of all ranks: they
must run exactly the same model calls in the same order, or they wait on each other for
ever.

So rank 0 alone runs the worker (Redis, the lifecycle, scheduling, records) and tells
the other ranks, the followers, every step of what it does with a model, and they
repeat it on their own parts:

- ``load`` / ``evict``: a model enters or leaves the model cache (the followers load
  their part at the same time: loading ends in a collective);
- ``engine``: an engine is made (a job alone, or a continuous batch), then ``add`` (a
  sequence joins: its prompt and parameters; rank 0 gives every sequence a seed, so
  sampling draws the same tokens everywhere), ``remove``, ``step`` and ``close``,
  exactly as rank 0 calls them. Engines nest (a job run between a batch's steps);
- ``prefix`` / ``forget``: the prefix cache keeps (prefills) or drops an entry
  (:class:`PrefixTeller`); a sequence's ``add`` names the entry it starts from.

Messages go by ``all_sum`` of arrays that only rank 0 fills (mlx's own transport: no
home-made sockets): one collective for a step or a close, two for a message, each
after the forward passes mlx-lm dispatched ahead (so every rank pairs the same sums). Decoding
is deterministic given the same calls, so the followers reach the same tokens without
being sent them (``worker.engine.mirror``: the engines that tell and the followers'
loop). Pure MLX and mlx-lm; knows nothing of Redis.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from schemas import ModelLoadError

log = logging.getLogger(__name__)

#: ``--shard`` modes: ``auto`` takes tensor parallelism where the model has it.
MODES = ("auto", "tensor", "pipeline")
#: The second part of a model cache key for a draft rank 0 holds whole, for itself alone
#: (``ModelCache.get(..., local=True)``): the same name split across the group is another
#: entry, and no other rank hears of it.
RANK0 = "<rank 0>"
#: What a follower hears instead of a message: rank 0 steps, or closes, its engine, or
#: the group ends.
STEP, CLOSE, EXIT = -1, -2, -3
#: ``--group-timeout`` by default: seconds a call of rank 0 into the group (a step, a
#: message) may take before the group counts as hung; a model's load gets 10 times it.
DEFAULT_TIMEOUT_S = 60.0
#: The exit status of rank 0 when the group hung (after its jobs were handed back).
HUNG_EXIT = 70


class GroupLost(BaseException):
    """A rank of the group is gone (a collective failed): no rank can go on. A
    BaseException: it ends the worker (rank 0's held jobs go back to their queues),
    never just the job at hand."""


def _lost(message: str) -> GroupLost:
    """A :class:`GroupLost`, logged where it is found: ``mlx.launch`` terminates the other
    ranks as soon as one has died, maybe before the exception's own message is printed."""
    log.error("the worker group lost a rank: %s", message)
    return GroupLost(message)


#: How mlx's distributed backends begin the message of a transport failure (e.g.
#: ``[ring] connection to a peer was lost``), raised wherever the collective ran: in our
#: own message sums or inside a model's forward pass (its layers' all_sum).
_TRANSPORT = re.compile(r"^\[(ring|mpi|jaccl|nccl)\]")


def transport_failed(e: BaseException) -> bool:
    """``e`` says a collective failed (a peer is gone), not that a job's input was bad."""
    return isinstance(e, RuntimeError) and bool(_TRANSPORT.match(str(e)))


class Watchdog:
    """Rank 0's guard against a rank that stops answering: mlx's collectives have no
    timeout, so a call into the group that has not returned within its seconds ends the
    process from a thread of its own, after ``on_hang`` (the worker: hand its jobs back,
    no crash counted). Calls nest (a job run between a batch's steps); each has its own
    deadline."""

    def __init__(self, on_hang: Callable[[str], object], tick_s: float = 0.25) -> None:
        self.on_hang, self.tick_s = on_hang, tick_s
        self._armed: dict[int, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._next = 0
        threading.Thread(target=self._watch, name="group-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str, seconds: float) -> Iterator[None]:
        with self._lock:
            self._next += 1
            me = self._next
            self._armed[me] = (time.monotonic() + seconds, what)
        try:
            yield
        finally:
            with self._lock:
                self._armed.pop(me, None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.tick_s)
            now = time.monotonic()
            with self._lock:
                late = [what for deadline, what in self._armed.values() if now > deadline]
            if late:
                self._hung(late[0])

    def _hung(self, what: str) -> None:
        log.error("the worker group hung: %s did not return in time; handing jobs back", what)
        try:
            self.on_hang(what)
        except BaseException:
            log.exception("handing jobs back after the group hung failed")
        finally:
            logging.shutdown()
            os._exit(HUNG_EXIT)


@dataclass
class Group:
    """The ranks of a worker group and how they split each model."""

    comm: Any  # mx.distributed.Group
    mode: str = "auto"
    #: ``--group-timeout``: seconds rank 0 waits on one call into the group.
    timeout_s: float = DEFAULT_TIMEOUT_S
    watchdog: Watchdog | None = field(default=None, repr=False)
    lost: bool = False  # a collective failed: no rank can be reached any more

    def guard(self, on_hang: Callable[[str], object]) -> None:
        """Rank 0: from now on, a call into the group that hangs ends this process after
        ``on_hang`` (called again: the new ``on_hang`` replaces the old)."""
        if not self.leads:
            return
        if self.watchdog is None:
            self.watchdog = Watchdog(on_hang)
        self.watchdog.on_hang = on_hang

    def watch(self, what: str, factor: float = 1.0) -> contextlib.AbstractContextManager[None]:
        """Rank 0: a call into the group (``what``) that may take ``factor`` timeouts."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.watch(what, self.timeout_s * factor)

    @contextlib.contextmanager
    def call(self, what: str, factor: float = 1.0) -> Iterator[None]:
        """A call into the group (``what``: a model's step, a message): watched on rank 0,
        and a transport failure anywhere inside it (a model's own collectives too) is
        :class:`GroupLost`, never a job's error that would fail the jobs at hand."""
        with self.watch(what, factor):
            try:
                yield
            except Exception as e:
                if not transport_failed(e):
                    raise
                self.lost = True
                raise _lost(f"group rank {self.rank}: {what}: {e}") from e

    @property
    def rank(self) -> int:
        return int(self.comm.rank())

    @property
    def size(self) -> int:
        return int(self.comm.size())

    @property
    def leads(self) -> bool:
        """Rank 0: the one that talks to Redis and decides."""
        return self.rank == 0

    def _sum(self, a: mx.array) -> mx.array:
        if self.lost:  # (a lost ring may hang rather than fail: never call it again)
            raise _lost(f"group rank {self.rank}: the group was lost earlier")
        try:
            return self._all_sum(a)
        except Exception as e:  # the transport failed: a peer died
            self.lost = True
            raise _lost(f"group rank {self.rank}: {type(e).__name__}: {e}") from e

    def _all_sum(self, a: mx.array) -> mx.array:
        # mlx-lm dispatches the next step's forward pass asynchronously (``async_eval`` on
        # its generation stream): its collectives must be done before this one, or the
        # ranks would pair this sum with another rank's layer sums.
        from mlx_lm.generate import generation_stream

        mx.synchronize(generation_stream)
        out = mx.distributed.all_sum(a, group=self.comm, stream=mx.cpu)
        mx.eval(out)
        return out

    def _send(self, header: int, payload: bytes = b"") -> None:
        self._sum(mx.array([header], dtype=mx.int32))
        if header > 0:
            self._sum(mx.array(np.frombuffer(payload, dtype=np.uint8).astype(np.int32)))

    def _receive(self) -> tuple[int, bytes]:
        header = int(self._sum(mx.zeros((1,), dtype=mx.int32)).item())
        if header <= 0:
            return header, b""
        data = np.array(self._sum(mx.zeros((header,), dtype=mx.int32)))
        return header, data.astype(np.uint8).tobytes()

    def tell(self, message: dict[str, Any]) -> None:
        """Rank 0: send ``message`` (JSON) to every follower."""
        if self.leads and self.size > 1:
            self._send(*_packed(message))

    def step(self) -> None:
        if self.leads:
            self._send(STEP)

    def close(self) -> None:
        if self.leads:
            self._send(CLOSE)

    def exit(self) -> None:
        """Rank 0: end the group. Each follower confirms it heard (so no rank closes its
        connections while another still reads from them)."""
        if self.leads and self.size > 1 and not self.lost:
            with self.watch("the group's exit"):
                self._send(EXIT)
                self._sum(mx.zeros((1,), dtype=mx.int32))

    def confirm_exit(self) -> None:
        """A follower: heard :data:`EXIT` (rank 0 may close its connections now)."""
        if self.lost:  # (never call a lost ring again)
            return
        with contextlib.suppress(Exception):  # (rank 0 may be gone already: no loss now)
            self._all_sum(mx.ones((1,), dtype=mx.int32))

    def listen(self) -> dict[str, Any] | int:
        """A follower: the next message, or :data:`STEP` / :data:`CLOSE`."""
        header, payload = self._receive()
        return header if header <= 0 else json.loads(payload)

    def sync(self) -> None:
        """Every rank waits for every other (the end of a load)."""
        self._sum(mx.array([1.0]))


class PrefixTeller:
    """Rank 0's prefix cache telling the other ranks what it does with the entries of a
    split model (``worker.engine.prefix.Mirror``): they prefill the same entries (each
    prefill is a collective) and drop them when rank 0 does."""

    def __init__(self, group: Group) -> None:
        self.group = group

    @contextlib.contextmanager
    def prefilling(
        self, model: Any, tokens: Any, base: tuple[int, ...] | None, held: int
    ) -> Iterator[None]:
        if model[1] == RANK0:  # (rank 0's own draft)
            yield
            return
        message = {"op": "prefix", "model": list(model), "tokens": list(tokens), "held": held}
        with self.group.call("a kept prefix's prefill"):
            self.group.tell(message | {"base": list(base) if base is not None else None})
            yield

    def forgot(self, model: Any, tokens: tuple[int, ...]) -> None:
        if model[1] != RANK0:
            with self.group.call("a forgotten prefix"):
                self.group.tell({"op": "forget", "model": list(model), "tokens": list(tokens)})


def _packed(message: dict[str, Any]) -> tuple[int, bytes]:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return len(payload), payload


def init(mode: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
    """This process's group (``mlx.launch`` sets it up); a ValueError unless it has 2 or
    more ranks."""
    if mode not in MODES:
        raise ValueError(f"--shard must be one of {', '.join(MODES)}, not {mode!r}")
    comm = mx.distributed.init()
    if comm.size() < 2:
        raise ValueError(
            "--shard needs a group of 2 or more ranks: start the worker with mlx's launcher, "
            "e.g. mlx.launch --hosts mac1,mac2 -- worker --shard auto ..."
        )
    return Group(comm, mode, timeout_s)


# -- loading -------------------------------------------------------------------------
def how_to_split(model: nn.Module, mode: str, name: str) -> str:
    """ "tensor" or "pipeline" for ``model`` under ``--shard mode``, or ModelLoadError
    naming what the architecture lacks."""
    tensor = hasattr(model, "shard")
    pipeline = hasattr(getattr(model, "model", None), "pipeline")
    if mode == "auto":
        mode = "tensor" if tensor else "pipeline" if pipeline else "none"
    if (mode == "tensor" and tensor) or (mode == "pipeline" and pipeline):
        return mode
    can = [m for m, ok in (("tensor", tensor), ("pipeline", pipeline)) if ok]
    raise ModelLoadError(
        f"model {name!r} ({type(model).__module__.rsplit('.', 1)[-1]}) cannot be split by "
        f"{mode if mode != 'none' else 'tensor or pipeline'} parallelism in mlx-lm"
        + (f" (it can by {can[0]}: --shard {can[0]})" if can else "")
    )


def load_sharded(path: Path, group: Group, name: str) -> tuple[nn.Module, Any, dict[str, Any]]:
    """This rank's part of the model at ``path`` (mlx-lm's lazy load, then its ``shard``
    or ``pipeline``: only this rank's weights are read), its tokenizer and config. Every
    rank calls it at once: it ends in a collective."""
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(path, lazy=True, strict=False)
    how = how_to_split(model, group.mode, name)
    if how == "tensor":
        model.shard(group.comm)
    else:
        model.model.pipeline(group.comm)
    mx.eval(model.parameters())
    model.eval()
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    group.sync()
    log.info("%s: split by %s parallelism across %d ranks", name, how, group.size)
    return model, tokenizer, config
