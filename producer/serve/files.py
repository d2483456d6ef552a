"""The gateway's files: uploads kept in Redis (with a TTL), and the virtual output files of
batches, made from the batch's results whenever they are read.

Uploads live in Redis, not on a gateway's disk, so any gateway behind a load
balancer can serve any file and the gateways keep no state. A file is stored as
pieces of at most 1 MiB (a list), written before its metadata hash: a partial
upload is never visible, and its pieces expire with the TTL.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fastapi import UploadFile
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from producer.batches import iter_output_lines
from schemas import keys
from schemas.imagehead import ImageInvalid, image_format, inspect

PIECE = 1 << 20
_OUTPUT_RE = re.compile(r"file-(out|err)-([A-Za-z0-9_-]{1,64})")


class TooLarge(Exception):
    """The upload is larger than the gateway's limit."""


class NotAnImage(Exception):
    """A ``vision`` upload that is not an image of a format workers read."""


def owned(meta: dict[str, Any] | None, tenant: str | None) -> dict[str, Any] | None:
    """``meta`` if its file belongs to ``tenant`` (an upload's owner; a batch output's are
    checked by their batch; None: any tenant's, for an operator), else None: another
    tenant's file is not found."""
    if meta is None or (tenant is not None and meta.get("tenant", keys.DEFAULT_TENANT) != tenant):
        return None
    return meta


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def output_file_id(batch_id: str, errors: bool) -> str:
    """The id of a batch's output (succeeded lines) or error (failed lines) file."""
    return f"file-{'err' if errors else 'out'}-{batch_id}"


def parse_output_id(file_id: str) -> tuple[str, bool] | None:
    """(batch id, errors?) of an output file id, or None for an uploaded file's id."""
    m = _OUTPUT_RE.fullmatch(file_id)
    return (m.group(2), m.group(1) == "err") if m else None


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's File object."""
    return {
        "id": meta["id"],
        "object": "file",
        "bytes": int(meta["bytes"]),
        "created_at": int(float(meta["created_at"])),
        "filename": meta["filename"],
        "purpose": meta["purpose"],
        "status": "processed",
        "expires_at": int(float(meta["created_at"])) + int(meta.get("ttl", 0)),
    }


async def store_upload(
    conn: AsyncRedis,
    upload: UploadFile,
    purpose: str,
    limit: int,
    ttl: int,
    tenant: str = keys.DEFAULT_TENANT,
) -> dict[str, Any]:
    """Copy an upload into Redis piece by piece; :class:`TooLarge` past ``limit`` bytes,
    :class:`NotAnImage` for a ``vision`` file that is not a whole PNG, JPEG, WebP or GIF
    image (``schemas.imagehead``). The
    file belongs to ``tenant``: other tenants' keys do not see it."""
    file_id = new_file_id()
    data_key, size, image = keys.file_data_key(file_id), 0, []
    try:
        while piece := await upload.read(PIECE):
            size += len(piece)
            if size > limit:
                raise TooLarge(f"the file is larger than this gateway's limit of {limit} bytes")
            if purpose == "vision":  # (at most the image limit: checked whole below)
                image.append(piece)
            async with conn.pipeline(transaction=False) as pipe:
                pipe.rpush(data_key, piece).expire(data_key, ttl)
                await pipe.execute()
        if purpose == "vision":
            _check_image(b"".join(image))
    except BaseException:
        await conn.delete(data_key)
        raise
    meta = {
        "id": file_id,
        "filename": upload.filename or "upload.jsonl",
        "purpose": purpose,
        "bytes": size,
        "created_at": time.time(),
        "ttl": ttl,
        "tenant": tenant,
    }
    await conn.hset(keys.file_key(file_id), mapping=meta)
    await conn.expire(keys.file_key(file_id), ttl)
    return file_object(meta)


def _check_image(data: bytes) -> None:
    """Raise :class:`NotAnImage` unless ``data`` is a whole image workers read."""
    if image_format(data) is None:
        raise NotAnImage("a vision file must be a PNG, JPEG, WebP or GIF image")
    try:
        inspect(data)
    except ImageInvalid as e:
        raise NotAnImage(f"the vision file {e}") from None


async def file_meta(conn: AsyncRedis, file_id: str) -> dict[str, Any] | None:
    raw = await conn.hgetall(keys.file_key(file_id))
    return {k.decode(): v.decode() for k, v in raw.items()} if raw else None


async def iter_upload(conn: AsyncRedis, file_id: str) -> AsyncIterator[bytes]:
    """An uploaded file's bytes, a piece (one round trip) at a time."""
    key, i = keys.file_data_key(file_id), 0
    while (piece := await conn.lindex(key, i)) is not None:
        yield piece
        i += 1


def spool_upload(conn: Redis, file_id: str, path: Path) -> None:
    """Write an uploaded file to ``path`` (for the checking and enqueueing passes)."""
    key, i = keys.file_data_key(file_id), 0
    with open(path, "wb") as out:
        while (piece := conn.lindex(key, i)) is not None:
            out.write(piece)
            i += 1


def iter_output_file(conn: Redis, batch_id: str, errors: bool) -> Iterator[bytes]:
    """A batch's output file (lines of succeeded jobs) or error file (the others), in
    OpenAI's Batch output format, read from the results a page at a time."""
    for line in iter_output_lines(conn, batch_id):
        if isinstance(line, str):
            continue  # not ended yet
        if (line.error is not None or line.response is None) == errors:
            yield (line.model_dump_json() + "\n").encode()


async def delete_upload(conn: AsyncRedis, file_id: str) -> bool:
    return bool(await conn.delete(keys.file_key(file_id), keys.file_data_key(file_id)))
