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
from dataclasses import dataclass
from typing import Any, Protocol

from schemas import InvalidRequestError
from schemas.imagehead import MAX_PIXELS
from schemas.imagehead import image_format as format_of
from schemas.images import digest_of
from schemas.request import MAX_IMAGE_BYTES


class ImageSource(Protocol):
    """Where a job's images that are not inline come from (``worker.runner.images``): a
    stored image's reference (``mlxq-image:<sha256>``, its batch's), an uploaded file
    (``mlxq-file:<id>``, its tenant's) or an http(s) URL (an allowed host's)."""

    def check(self, url: str, where: str) -> None:
        """Raise (naming ``where``) unless this job may see ``url``: asked every time, the
        decoded image cached or not."""

    def fetch(self, url: str, max_bytes: int, where: str) -> bytes:
        """The bytes ``url`` names (at most about ``max_bytes``); raises naming ``where``."""


@dataclass(frozen=True)
class Image:
    """A decoded RGB image and the SHA-256 of its bytes (its identity)."""

    digest: str
    pixels: Any  # PIL.Image.Image, RGB

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.size  # type: ignore[no-any-return]


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

    def get(self, url: str, where: str, source: ImageSource | None = None) -> Image:
        """The image ``url`` names: inline (a data URL), or from ``source`` (a stored
        image's reference, checked against its SHA-256; an uploaded file; an http(s) URL),
        which is asked first whether this job may see it. Decoded once while it stays
        here; a URL or file is fetched once while this cache remembers it."""
        data, digest = None, digest_of(url)
        if url.startswith("data:"):
            data = payload(url, where, self.max_bytes)
            digest = hashlib.sha256(data).hexdigest()
        else:
            if source is None:
                raise InvalidRequestError(f"{where}: this worker reads inline images only")
            source.check(url, where)  # this job's to see (its batch's, its tenant's, allowed)
            if digest is None:
                with self._lock:
                    digest = self._urls.get(url)
        with self._lock:
            if digest is not None and (hit := self._items.get(digest)) is not None:
                self._items.move_to_end(digest)
                return hit
        if data is None:
            assert source is not None
            data = _fetched(url, digest, where, source, self.max_bytes)
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

    def images(self, urls: list[str], source: ImageSource | None = None) -> list[Image]:
        """Every image of a request, named "image 1", "image 2"... in errors."""
        return [self.get(url, f"image {i + 1}", source) for i, url in enumerate(urls)]


def _fetched(url: str, digest: str | None, where: str, source: ImageSource, limit: int) -> bytes:
    """The bytes ``url`` names, from ``source``; a stored image's checked against the
    SHA-256 that names them. Raises naming ``where``."""
    data = source.fetch(url, limit, where)
    if len(data) > limit:
        raise InvalidRequestError(
            f"{where} is {len(data) / 2**20:.1f} MB; the limit is {limit / 2**20:g} MB"
        )
    stored = digest is not None and url.startswith("mlxq-image:")
    if stored and hashlib.sha256(data).hexdigest() != digest:
        raise InvalidRequestError(f"{where}: the stored bytes do not match their SHA-256")
    return data
