"""Submitting a JSONL jobs file in bounded memory: a checking pass, then an enqueueing pass.

The first pass validates every line and keeps only 28 bytes per line (the job
id's digest and the line number, to find duplicate custom_ids), never the lines
themselves; the second reads the file again and enqueues it in chunks. Nothing
is enqueued until every line has been checked. Standard input is first copied
to a temporary file (:func:`spool`), never to memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from redis import Redis

from producer.enqueue import DEFAULT_CHUNK, Prepared
from producer.lines import Defaults, LineInvalid, parse_line
from producer.submit import SubmitSummary, enqueue_batch, queue_of
from schemas import job_data, keys
from schemas.audio import stored_audio
from schemas.images import stored_images

#: Called with (line number, message, the line's text) for each bad line.
OnError = Callable[[int, str, str], None]


class FileChangedError(Exception):
    """The file changed between the checking pass and the enqueueing pass."""


@dataclass(frozen=True)
class Checked:
    """What the checking pass found in a file."""

    path: Path
    valid: int
    invalid: int
    #: Lines left out because an earlier line has the same custom_id.
    duplicates: frozenset[int] = field(default_factory=frozenset)
    identity: tuple[int, int, int] = (0, 0, 0)


def _identity(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _lines(f: BinaryIO) -> Iterator[tuple[int, int, str | None, bytes]]:
    """(line number, bytes read, text or None if not UTF-8, raw) of every non-blank line."""
    for lineno, raw in enumerate(f, start=1):
        stripped = raw.rstrip(b"\r\n")
        if not stripped.strip():
            continue
        try:
            text: str | None = stripped.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        yield lineno, len(raw), text, stripped


def check_file(
    path: Path,
    defaults: Defaults,
    on_error: OnError,
    progress: Callable[[int], None] | None = None,
) -> Checked:
    """Validate every line of ``path``; report each bad one through ``on_error``.

    Duplicate custom_ids are found after the pass (by sorting the digests) and
    reported then, each naming the line that used it first.
    """
    identity = _identity(path)
    digests, linenos = bytearray(), array("Q")
    valid = invalid = 0
    with open(path, "rb") as f:
        for lineno, size, text, raw in _lines(f):
            if progress:
                progress(size)
            try:
                if text is None:
                    raise LineInvalid("not UTF-8 text")
                custom_id = parse_line(text, lineno, defaults)[0]
            except LineInvalid as e:
                invalid += 1
                on_error(
                    lineno, str(e), text if text is not None else raw.decode("utf-8", "replace")
                )
                continue
            digests += hashlib.sha256(custom_id.encode()).hexdigest()[:20].encode()
            linenos.append(lineno)
            valid += 1
    duplicates = _duplicates(np.frombuffer(bytes(digests), dtype="S20"), linenos)
    if duplicates:
        _report_duplicates(path, duplicates, defaults, on_error)
    return Checked(
        path, valid - len(duplicates), invalid + len(duplicates), frozenset(duplicates), identity
    )


def _duplicates(digests: np.ndarray, linenos: array) -> dict[int, int]:
    """{line: first line with the same digest} for every line that repeats an earlier one."""
    if len(digests) < 2:
        return {}
    order = np.argsort(digests, kind="stable")
    ranked = digests[order]
    repeat = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1
    if not len(repeat):
        return {}
    lines = np.frombuffer(linenos, dtype=np.uint64)[order]
    # The first line of each run of equal digests: the previous position that starts a run.
    starts = np.ones(len(ranked), dtype=bool)
    starts[repeat] = False
    first_of = np.maximum.accumulate(np.where(starts, np.arange(len(ranked)), 0))
    return {int(lines[i]): int(lines[first_of[i]]) for i in repeat}


def _report_duplicates(
    path: Path, duplicates: dict[int, int], defaults: Defaults, on_error: OnError
) -> None:
    with open(path, "rb") as f:
        for lineno, _, text, _ in _lines(f):
            if lineno in duplicates and text is not None:
                custom_id = parse_line(text, lineno, defaults)[0]
                message = (
                    f"duplicate custom_id {custom_id!r} (first used on line {duplicates[lineno]})"
                )
                on_error(lineno, message, text)


def enqueue_file(
    conn: Redis,
    checked: Checked,
    defaults: Defaults,
    *,
    batch_id: str,
    queue: str,
    job_timeout: int,
    result_ttl: int,
    route: str = "queue",
    source: str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
    wait_replicas: int = 0,
) -> SubmitSummary:
    """Enqueue the valid lines of a checked file (reading it again) as one batch.

    Raises :class:`FileChangedError`, before enqueueing anything, if the file is
    not the one that was checked.
    """
    if _identity(checked.path) != checked.identity:
        raise FileChangedError(f"{checked.path} changed after it was checked; nothing enqueued")
    return enqueue_batch(
        conn,
        _prepared(checked, defaults, batch_id, queue, route, result_ttl),
        batch_id=batch_id,
        queue=queue,
        route=route,
        job_timeout=job_timeout,
        result_ttl=result_ttl,
        source=source,
        chunk_size=chunk_size,
        progress=progress,
        wait_replicas=wait_replicas,
    )


def _prepared(
    checked: Checked, defaults: Defaults, batch_id: str, queue: str, route: str, result_ttl: int
) -> Iterator[Prepared]:
    """The valid lines of a checked file as jobs, read again from the file."""
    now = time.time()
    with open(checked.path, "rb") as f:
        for lineno, _, text, _ in _lines(f):
            if text is None or lineno in checked.duplicates:
                continue
            try:
                custom_id, request, body, shape = parse_line(text, lineno, defaults)
            except LineInvalid:
                continue
            job_id = keys.job_id_for(batch_id, custom_id)
            body, images = stored_images(body)  # each image once, with the batch
            body, audio = stored_audio(body)  # and each recording
            images = images | audio
            data = job_data(custom_id, now, body, result_ttl)
            to = queue_of(route, queue, request.model)
            shown = json.dumps(shape) if shape else None
            yield Prepared(job_id, to, data, custom_id, shown, images or None, request.model)


def spool(stream: BinaryIO, directory: str | None = None) -> Path:
    """Copy ``stream`` (standard input) to a temporary file, in 1 MiB pieces; its path."""
    fd, name = tempfile.mkstemp(prefix="mlxq-stdin-", suffix=".jsonl", dir=directory)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(stream, out, 1 << 20)
    return Path(name)
