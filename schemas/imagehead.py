"""An image's structure read without decoding a pixel: format, declared size, completeness.

The producer and the gateway check each inline image at the door with :func:`inspect`
(pure Python: they never import Pillow or MLX): the magic bytes name one of the formats
workers read, the header's declared size is at most :data:`MAX_PIXELS`, and the file's
own structure is whole (PNG: every chunk's CRC and an IEND; JPEG: a frame header, a scan
and the end marker; GIF: its blocks up to the trailer; WebP: the RIFF length and the
bitstream header). A broken, truncated or bomb-shaped image is refused there, naming
it, before it is queued. The worker still decodes with Pillow under the same limits
(``worker.engine.images``): a job written to Redis by other means meets the same rules.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

#: The most pixels an image may declare (a 36-megapixel photo passes).
MAX_PIXELS = 40_000_000

#: Magic bytes of the image formats read, and their names.
FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
)


class ImageInvalid(ValueError):
    """The bytes are not a whole image of a format read, or declare too many pixels."""


@dataclass(frozen=True)
class ImageHead:
    """What an image's header says: its format and declared size."""

    format: str
    width: int
    height: int


def image_format(data: bytes) -> str | None:
    """PNG, JPEG, WEBP or GIF from the magic bytes; None for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in FORMATS if data.startswith(magic)), None)


def inspect(data: bytes, max_pixels: int = MAX_PIXELS) -> ImageHead:
    """``data``'s format and declared size, its structure checked; raises
    :class:`ImageInvalid` saying what is wrong (the caller names the image)."""
    kind = image_format(data)
    if kind is None:
        raise ImageInvalid(
            "is not a PNG, JPEG, WebP or GIF image (other formats, SVG among them, are not read)"
        )
    try:
        width, height = _READERS[kind](data, max_pixels)
    except (struct.error, IndexError):
        raise ImageInvalid(f"is a truncated {kind} file") from None
    if width <= 0 or height <= 0:
        raise ImageInvalid(f"({kind}) declares an empty {width} x {height} image")
    if width * height > max_pixels:
        raise ImageInvalid(
            f"declares {width} x {height} pixels, more than the {max_pixels:,} decoded at most"
        )
    return ImageHead(kind, width, height)


def _png(data: bytes, _: int) -> tuple[int, int]:
    at, size, seen = 8, (0, 0), set()
    while True:
        length, kind = struct.unpack_from(">I4s", data, at)
        end = at + 8 + length
        if end + 4 > len(data):
            raise IndexError
        (crc,) = struct.unpack_from(">I", data, end)
        if zlib.crc32(memoryview(data)[at + 4 : end]) != crc:
            raise ImageInvalid(f"is a broken PNG file (chunk {kind!r}: bad CRC)")
        if not seen and kind != b"IHDR":
            raise ImageInvalid("is a broken PNG file (no IHDR chunk first)")
        if kind == b"IHDR":
            size = struct.unpack_from(">II", data, at + 8)
        seen.add(kind)
        if kind == b"IEND":
            if b"IDAT" not in seen:
                raise ImageInvalid("is a broken PNG file (no image data)")
            return size
        at = end + 4


#: JPEG start-of-frame markers (SOF0-15 but DHT, JPG and DAC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(data: bytes, _: int) -> tuple[int, int]:
    at, size = 2, None
    while True:
        if data[at] != 0xFF:
            raise ImageInvalid("is a broken JPEG file (no marker where one belongs)")
        marker = data[at + 1]
        if marker == 0xFF:  # fill bytes
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            at += 2
            continue
        if marker == 0xD9:
            raise ImageInvalid("is a broken JPEG file (it ends before a scan)")
        (length,) = struct.unpack_from(">H", data, at + 2)
        if marker in _SOF:
            height, width = struct.unpack_from(">HH", data, at + 5)
            size = (width, height)
        if marker == 0xDA:  # start of scan: entropy-coded data up to the end marker
            if size is None:
                raise ImageInvalid("is a broken JPEG file (a scan before any frame header)")
            if not data.endswith(b"\xff\xd9") and data.rfind(b"\xff\xd9", at + 2 + length) < 0:
                raise IndexError  # cut off: no end-of-image marker
            return size
        at += 2 + length
        if at >= len(data):
            raise IndexError


def _gif(data: bytes, max_pixels: int) -> tuple[int, int]:
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    frames = 0
    while True:
        block = data[at]
        if block == 0x3B:  # trailer
            if not frames:
                raise ImageInvalid("is a broken GIF file (no image in it)")
            return width, height
        if block == 0x21:  # extension: label, then sub-blocks
            at = _sub_blocks(data, at + 2)
        elif block == 0x2C:  # image descriptor, its own color table, LZW data
            w, h, local = struct.unpack_from("<HHB", data, at + 5)
            if w * h > max_pixels:
                raise ImageInvalid(f"declares a {w} x {h} GIF frame")
            at += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
            at = _sub_blocks(data, at + 1)  # (after the LZW minimum code size)
            frames += 1
        else:
            raise ImageInvalid(f"is a broken GIF file (block 0x{block:02x})")


def _sub_blocks(data: bytes, at: int) -> int:
    """Where the sub-blocks starting at ``at`` end (past their zero terminator)."""
    while (n := data[at]) != 0:
        at += 1 + n
    return at + 1


def _webp(data: bytes, _: int) -> tuple[int, int]:
    (riff,) = struct.unpack_from("<I", data, 4)
    if riff + 8 > len(data):
        raise IndexError
    kind = data[12:16]
    if kind == b"VP8X":
        w, h = (int.from_bytes(data[i : i + 3], "little") + 1 for i in (24, 27))
        if len(data) < 30:
            raise IndexError
        return w, h
    if kind == b"VP8L":
        if data[20] != 0x2F:
            raise ImageInvalid("is a broken WebP file (bad VP8L signature)")
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise ImageInvalid("is a broken WebP file (bad VP8 start code)")
        w, h = struct.unpack_from("<HH", data, 26)
        return w & 0x3FFF, h & 0x3FFF
    raise ImageInvalid(f"is a broken WebP file (chunk {kind!r})")


_READERS = {"PNG": _png, "JPEG": _jpeg, "GIF": _gif, "WEBP": _webp}
