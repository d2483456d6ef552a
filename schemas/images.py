"""Images stored once per batch: a submitted job's data URLs become references.

``producer submit`` (and the Batch API) takes each image out of a job's body, keys its
bytes by their SHA-256 and leaves ``mlxq-image:<sha256>`` in the part
(:data:`schemas.request.IMAGE_REF`); the bytes go once into the batch's image hash
(``schemas.keys.batch_images_key``), however many jobs show the image. A worker reads an
image from its job's own batch only, once per image (``worker.engine.images``). A data URL
whose base64 does not decode stays inline: the worker fails that job with a 400 naming
the image, and the rest of the batch runs.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from typing import Any

from schemas.request import FILE_REF, IMAGE_REF

__all__ = ["FILE_REF", "IMAGE_REF", "digest_of", "image_format", "image_ref", "stored_images"]

_HEAD = "data:image/"


#: Magic bytes of the image formats read, and their names.
FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
)


def image_format(data: bytes) -> str | None:
    """PNG, JPEG, WEBP or GIF from the magic bytes; None for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in FORMATS if data.startswith(magic)), None)


def image_ref(digest: str) -> str:
    return f"mlxq-image:{digest}"


def stored_images(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``body`` with its image data URLs replaced by references, and the images' bytes by
    SHA-256 (hex). A body without images comes back as is (not copied)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not any(_has_image(m) for m in messages):
        return body, {}
    images: dict[str, bytes] = {}
    out = []
    for message in messages:
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


def _stored(part: Any, images: dict[str, bytes]) -> Any:
    image = part.get("image_url") if isinstance(part, dict) else None
    url = image.get("url") if isinstance(image, dict) else None
    if not isinstance(url, str) or not url.startswith(_HEAD):
        return part
    found = _decoded(url)
    if found is None:
        return part  # the worker names it (a 400 for this job alone)
    digest, data = found
    images[digest] = data
    return {**part, "image_url": {**image, "url": image_ref(digest)}}


@functools.lru_cache(maxsize=8)  # a file's lines repeat an image: decoded once in a row
def _decoded(url: str) -> tuple[str, bytes] | None:
    """(SHA-256, bytes) of a data URL; None if its base64 does not decode."""
    _, _, b64 = url.partition(",")
    try:
        data = base64.b64decode("".join(b64.split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    return hashlib.sha256(data).hexdigest(), data
