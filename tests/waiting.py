"""Waiting in tests: on events, with bounds in this machine's measured pace.

A test waits for something to happen (a record written, a counter moved, a log line, a
state published): :func:`wait_for` polls a condition until it holds. It fails early when
a process the test started has died unasked (a watched worker or gateway exits with an
error: its log's tail in the message), and late only as a safety net. Every bound is
given in the seconds of the reference machine (the 2-core VM this suite is written on,
with OpenBLAS) and stretched by :func:`pace`: how much slower this machine runs the same
small MLX-and-Python workload, measured once per test process (:func:`calibrate`) and
again before a wait gives up (a machine that slowed since still gets its time). A time
bound that is the point of a test (a recovery within seconds) is :func:`seconds` of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Protocol

#: Seconds the calibration workload takes on the reference machine, idle (its median).
REFERENCE_S = 0.08
#: The pace never goes below 1 (a faster machine keeps the reference bounds) nor above
#: this (a stalled machine still fails in the end).
MAX_PACE = 20.0

_pace: float | None = None


class Watched(Protocol):
    """A process a test depends on (``tests.conftest.WorkerProc``, a gateway)."""

    name: str
    expected_exit: bool

    def returncode(self) -> int | None: ...

    def tail(self) -> str: ...


_watched: list[Watched] = []


def _workload() -> float:
    """Seconds of a fixed mix like the tests': a tiny 4-layer llama decoding 24 tokens
    through mlx-lm with a KV cache, then a loop of plain Python."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_mod
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    start = time.perf_counter()
    cache = cache_mod.make_prompt_cache(model)
    token = mx.array([[1] * 16])
    for _ in range(24):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    total = 0
    for i in range(300_000):
        total += i % 7
    return time.perf_counter() - start


def calibrate() -> float:
    """Measure the pace now (the median of three runs of the workload) and keep it."""
    global _pace
    runs = [_workload() for _ in range(3)]
    _pace = min(MAX_PACE, max(1.0, statistics.median(runs) / REFERENCE_S))
    return _pace


def pace() -> float:
    """How many times slower than the reference machine this one runs (>= 1)."""
    return _pace if _pace is not None else calibrate()


def seconds(reference_s: float) -> float:
    """``reference_s`` seconds of the reference machine, in this machine's pace."""
    return reference_s * pace()


def watch(process: Watched) -> None:
    """Fail waits early if ``process`` exits with an error unasked (until :func:`clear`)."""
    _watched.append(process)


def clear() -> None:
    _watched.clear()


def _died() -> str | None:
    for p in _watched:
        code = p.returncode()
        if code not in (None, 0) and not p.expected_exit:
            return f"{p.name} exited with status {code} while the test waited:\n{p.tail()}"
    return None


def wait_for(
    cond: Callable[[], object],
    timeout: float = 60,
    every: float = 0.02,
    what: str | None = None,
) -> object:
    """Poll ``cond`` until it returns something true, and return that. Raises
    AssertionError if a watched process dies first, or after ``timeout`` reference
    seconds in this machine's pace (measured again before giving up)."""
    start = time.monotonic()
    bound = seconds(timeout)
    remeasured = False
    while True:
        value = cond()
        if value:
            return value
        if (why := _died()) is not None:
            raise AssertionError(why)
        waited = time.monotonic() - start
        if waited > bound:
            if not remeasured:  # the machine may have slowed since the last measure
                remeasured, bound = True, timeout * calibrate()
                continue
            name = what or getattr(cond, "__name__", "the condition")
            logs = "".join(f"\n--- {p.name}:\n{p.tail()}" for p in _watched)
            raise AssertionError(
                f"{name} not met within {waited:.0f} s ({timeout} s at the reference "
                f"pace x {pace():.2f} measured here){logs}"
            )
        time.sleep(every)
