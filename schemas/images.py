"""Images stored once per batch: a submitted job's data URLs become references.

``producer submit`` (and the Batch API) takes each image out of a job's body, keys its
bytes by their SHA-256 and leaves ``mlxq-image:<sha256>`` in the part
(:data:`schemas.request.IMAGE_REF`); the bytes go once into the batch's image hash
(``schemas.keys.batch_images_key``), however many jobs show the image. A worker reads an
image from its job's own batch only, once per image (``worker.engine.images``). A data URL
whose base64 does not decode stays inline (only a job written past the door has one): the
worker fails that job with a 400 naming the image, and the rest of the batch runs.

:func:`check_images` is the door: the producer's checking pass and the gateway refuse a
request whose inline image is not valid base64, over :data:`MAX_IMAGE_BYTES`, not an
image of a format read, truncated or declaring too many pixels
(:func:`schemas.imagehead.inspect`), naming the part, before anything is queued.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from typing import Any

from schemas.imagehead import ImageInvalid, image_format, inspect
from schemas.request import FILE_REF, IMAGE_REF, MAX_IMAGE_BYTES

__all__ = [
    "FILE_REF",
    "IMAGE_REF",
    "ImageInvalid",
    "check_images",
    "digest_of",
    "has_images",
    "image_format",
    "image_ref",
    "stored_images",
]

_HEAD = "data:image/"


def has_images(body: dict[str, Any]) -> bool:
    """Whether a chat body has image parts (cheap: no URL is read)."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(_has_image(m) for m in messages)


def check_images(body: dict[str, Any], max_bytes: int = MAX_IMAGE_BYTES) -> None:
    """Raise :class:`ImageInvalid` for the first inline image of a chat body that no worker
    would read, naming its place: ``messages.0.content.1: image 1 is a truncated PNG
    file``. URLs and references are the worker's to check (hosts, batches, tenants)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    n = 0
    for i, message in enumerate(messages):
        if not _has_image(message):
            continue
        for j, part in enumerate(message["content"]):
            url = _url_of(part)
            if url is None:
                continue
            n += 1
            if url.startswith(_HEAD):
                _check(url, f"messages.{i}.content.{j}: image {n}", max_bytes)


def _check(url: str, where: str, max_bytes: int) -> None:
    found = _decoded(url)
    if found is None:
        raise ImageInvalid(f"{where}: the data URL is not valid base64")
    data = found[1]
    if len(data) > max_bytes:
        raise ImageInvalid(
            f"{where} is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB"
        )
    try:
        inspect(data)
    except ImageInvalid as e:
        raise ImageInvalid(f"{where} {e}") from None


def image_ref(digest: str) -> str:
    return f"mlxq-image:{digest}"


def stored_images(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``body`` with its image data URLs replaced by references, and the images' bytes by
    SHA-256 (hex). A body without images comes back as is (not copied)."""
    if not has_images(body):
        return body, {}
    images: dict[str, bytes] = {}
    out = []
    for message in body["messages"]:
        if not _has_image(message):
            out.append(message)
            continue
        parts = [_stored(part, images) for part in message["content"]]
        out.append({**message, "content": parts})
    return {**body, "messages": out}, images


def digest_of(url: str) -> str | None:
    """The SHA-256 an image reference names (None: not a reference)."""
    found = IMAGE_REF.fullmatch(url)
    return found.group(1) if found else None


def _has_image(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in content
    )


def _url_of(part: Any) -> str | None:
    """An ``image_url`` part's URL (None: not such a part, or no URL string)."""
    image = part.get("image_url") if isinstance(part, dict) else None
    url = image.get("url") if isinstance(image, dict) else None
    return url if isinstance(url, str) else None


def _stored(part: Any, images: dict[str, bytes]) -> Any:
    url = _url_of(part)
    if url is None or not url.startswith(_HEAD):
        return part
    found = _decoded(url)
    if found is None:
        return part  # the worker names it (a 400 for this job alone)
    digest, data = found
    images[digest] = data
    return {**part, "image_url": {**part["image_url"], "url": image_ref(digest)}}


@functools.lru_cache(maxsize=8)  # a file's lines repeat an image: decoded once in a row
def _decoded(url: str) -> tuple[str, bytes] | None:
    """(SHA-256, bytes) of a data URL; None if its base64 does not decode."""
    _, _, b64 = url.partition(",")
    try:
        data = base64.b64decode("".join(b64.split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    return hashlib.sha256(data).hexdigest(), data
