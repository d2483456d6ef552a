"""Images of a request: data URLs checked and decoded, once per image per worker.

A job's image is untrusted bytes. Before Pillow decodes anything: the base64 must be
valid, the bytes at most ``max_bytes`` (``worker --max-image-mb``), the format one of
PNG, JPEG, WebP and GIF by its magic bytes (SVG, TIFF, BMP... refused by name), and the
size its header declares at most :data:`MAX_PIXELS` (a 30,000 x 30,000 PNG of a few
hundred bytes is refused before a pixel is allocated). A GIF gives its first frame.
Every failure is an :class:`schemas.InvalidRequestError` naming the image (its place in
the request): that job fails with 400, its batch runs on.

Decoded images are kept by content hash in a small LRU (:class:`ImageCache`): 50
questions over one image decode it once, and fetch it once when the producer stored it
with its batch (``schemas.images``). Needs Pillow (``mlxq[vision]``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas import InvalidRequestError
from schemas.images import digest_of
from schemas.request import MAX_IMAGE_BYTES

#: An image's bytes by its reference (``mlxq-image:<sha256>``, from its job's batch) or
#: http(s) URL, at most so many bytes; None: not there. Raises to refuse (naming ``where``).
Fetch = Callable[[str, int, str], bytes | None]

#: The most pixels an image may declare (a 36-megapixel photo passes).
MAX_PIXELS = 40_000_000
#: Magic bytes of the formats read, and their names.
FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
)


@dataclass(frozen=True)
class Image:
    """A decoded RGB image and the SHA-256 of its bytes (its identity)."""

    digest: str
    pixels: Any  # PIL.Image.Image, RGB

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.size  # type: ignore[no-any-return]


def format_of(data: bytes) -> str | None:
    """PNG, JPEG, WEBP or GIF from the magic bytes; None for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in FORMATS if data.startswith(magic)), None)


def payload(url: str, where: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL; raises naming ``where``."""
    head, _, body = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise InvalidRequestError(f"{where}: not a data:image/...;base64 URL")
    if len(body) > (max_bytes + 2) // 3 * 4 + 4096:  # before decoding it
        raise InvalidRequestError(f"{where} is over the {max_bytes / 2**20:g} MB image limit")
    try:
        data = base64.b64decode("".join(body.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise InvalidRequestError(
            f"{where} is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB"
        )
    return data


def decode(data: bytes, where: str) -> Image:
    """``data`` checked and decoded to RGB (see the module's rules); raises naming ``where``."""
    from PIL import Image as PILImage

    kind = format_of(data)
    if kind is None:
        raise InvalidRequestError(
            f"{where} is not a PNG, JPEG, WebP or GIF image (other formats, SVG among them, "
            "are not read)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            im = PILImage.open(io.BytesIO(data), formats=[kind])
            width, height = im.size  # from the header: nothing decoded yet
            if width * height > MAX_PIXELS:
                raise PILImage.DecompressionBombError(f"{width} x {height}")
            im.seek(0)  # a GIF's first frame
            rgb = im.convert("RGB")  # decodes: a truncated file fails here
    except InvalidRequestError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        raise InvalidRequestError(
            f"{where} declares more pixels than the {MAX_PIXELS:,} decoded at most"
        ) from None
    except Exception as e:  # Pillow's many ways of finding a broken file
        raise InvalidRequestError(f"{where} ({kind}) could not be decoded: {e}") from None
    return Image(hashlib.sha256(data).hexdigest(), rgb)


class ImageCache:
    """Decoded images by the SHA-256 of their bytes, least recently used first out."""

    def __init__(self, size: int = 64, max_bytes: int = MAX_IMAGE_BYTES) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.decoded = 0  # images decoded (not found here)
        self._items: OrderedDict[str, Image] = OrderedDict()
        self._urls: OrderedDict[str, str] = OrderedDict()  # http(s) URL -> its bytes' digest
        self._lock = threading.Lock()

    def get(self, url: str, where: str, fetch: Fetch | None = None) -> Image:
        """The image of data URL ``url``, of a stored image's reference (its bytes from
        ``fetch``, checked against their SHA-256) or of an http(s) URL (from ``fetch``,
        once while this cache remembers the URL), decoded once while it stays here."""
        data, digest = None, digest_of(url)
        if url.startswith("data:"):
            data = payload(url, where, self.max_bytes)
            digest = hashlib.sha256(data).hexdigest()
        elif digest is None:
            with self._lock:
                digest = self._urls.get(url)
        with self._lock:
            if digest is not None and (hit := self._items.get(digest)) is not None:
                self._items.move_to_end(digest)
                return hit
        if data is None:
            data = _fetched(url, digest, where, fetch, self.max_bytes)
            digest = hashlib.sha256(data).hexdigest()
        image = decode(data, where)
        with self._lock:
            self.decoded += 1
            self._items[digest] = image
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            if not url.startswith(("data:", "mlxq-image:")):
                self._urls[url] = digest
                while len(self._urls) > self.size:
                    self._urls.popitem(last=False)
        return image

    def images(self, urls: list[str], fetch: Fetch | None = None) -> list[Image]:
        """Every image of a request, named "image 1", "image 2"... in errors."""
        return [self.get(url, f"image {i + 1}", fetch) for i, url in enumerate(urls)]


def _fetched(url: str, digest: str | None, where: str, fetch: Fetch | None, limit: int) -> bytes:
    """The bytes of a stored image (checked against the SHA-256 that names them) or of an
    http(s) URL; raises naming ``where``."""
    data = fetch(url, limit, where) if fetch is not None else None
    if data is None and digest is None:
        raise InvalidRequestError(f"{where}: this worker fetches no image URLs")
    if data is None:
        raise InvalidRequestError(
            f"{where}: image {digest[:12]}... is not stored with this job's batch (its "
            "batch expired, or the reference was not made by the producer)"
        )
    if len(data) > limit:
        raise InvalidRequestError(
            f"{where} is {len(data) / 2**20:.1f} MB; the limit is {limit / 2**20:g} MB"
        )
    stored = digest is not None and url.startswith("mlxq-image:")
    if stored and hashlib.sha256(data).hexdigest() != digest:
        raise InvalidRequestError(f"{where}: the stored bytes do not match their SHA-256")
    return data
