"""Images checked at the door: ``schemas.imagehead`` (structure without decoding) and
``schemas.images.check_images`` (a chat body's inline images), as ``producer submit`` and the
Python client use them. The gateway's 400s are in tests/test_gateway.py."""

from __future__ import annotations

import base64
import contextlib
import io
import random
import struct
import zlib

import pytest
from click.testing import CliRunner
from PIL import Image

from producer import Client
from producer.cli import main
from schemas import keys
from schemas.imagehead import MAX_PIXELS, ImageInvalid, inspect
from schemas.images import check_images
from tests.conftest import chat, write_jsonl


def picture(fmt: str, mode: str = "RGB", size: tuple[int, int] = (37, 23), **kw) -> bytes:
    im = Image.new("RGB", size, (200, 10, 10)).convert(mode)
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (37, 23), (i * 60, 0, 0)) for i in range(3)]
    out = io.BytesIO()
    frames[0].save(out, fmt, save_all=True, append_images=frames[1:])
    return out.getvalue()


#: Every flavour of each format Pillow writes (what a client sends).
GOOD = {
    "png": lambda: picture("PNG"),
    "png-rgba": lambda: picture("PNG", "RGBA"),
    "png-palette": lambda: picture("PNG", "P"),
    "jpeg": lambda: picture("JPEG"),
    "jpeg-progressive": lambda: picture("JPEG", progressive=True),
    "jpeg-gray": lambda: picture("JPEG", "L"),
    "gif": lambda: picture("GIF"),
    "gif-animated": lambda: animated("GIF"),
    "webp-lossy": lambda: picture("WEBP"),
    "webp-lossless": lambda: picture("WEBP", lossless=True),
    "webp-alpha": lambda: picture("WEBP", "RGBA"),
    "webp-animated": lambda: animated("WEBP"),
}


def png_declaring(width: int, height: int) -> bytes:
    """A whole PNG whose header declares ``width`` x ``height``: a bomb's shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def image_chat(*urls: str) -> dict:
    parts = [{"type": "text", "text": "what is it?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_every_flavour_reads_its_size_as_pillow_does_and_every_cut_is_refused(name):
    data = GOOD[name]()
    head = inspect(data)
    with Image.open(io.BytesIO(data)) as im:
        assert (head.width, head.height) == im.size == (37, 23)
        assert head.format == im.format
    for cut in sorted({12, 20, 30, len(data) // 2, len(data) - 1}):
        with pytest.raises(ImageInvalid):
            inspect(data[:cut])


def test_bombs_foreign_formats_and_broken_structure_are_named():
    cases = {
        png_declaring(30_000, 30_000): "declares 30000 x 30000 pixels, more than the 40,000,000",
        png_declaring(0, 10): "declares an empty 0 x 10 image",
        b'<svg xmlns="http://www.w3.org/2000/svg"/>': "is not a PNG, JPEG, WebP or GIF image",
        b"\x00\x00\x00": "is not a PNG, JPEG, WebP or GIF image",
        b"BM" + b"\x00" * 60: "is not a PNG, JPEG, WebP or GIF image",  # BMP
        b"\x89PNG\r\n\x1a\n": "is a truncated PNG file",
    }
    png = bytearray(picture("PNG"))
    png[40] ^= 0xFF  # a flipped bit inside the IDAT chunk
    cases[bytes(png)] = "bad CRC"
    for data, words in cases.items():
        with pytest.raises(ImageInvalid, match=words.replace("(", r"\(")):
            inspect(data)
    assert inspect(png_declaring(8000, 5000)).width == 8000  # 40 MP: at the limit, read
    assert MAX_PIXELS == 8000 * 5000


def test_random_damage_is_refused_or_read_never_an_unnamed_crash():
    rng = random.Random(7)
    for name, make in sorted(GOOD.items()):
        data = make()
        for _ in range(200):
            broken = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                broken[rng.randrange(len(broken))] = rng.randrange(256)
            # anything but ImageInvalid (IndexError, struct.error...) fails the test
            with contextlib.suppress(ImageInvalid):
                inspect(bytes(broken))
        assert inspect(data).format == name.split("-")[0].upper().replace("JPG", "JPEG")


def test_check_images_names_the_part_and_passes_what_workers_read():
    good = data_url(GOOD["png"]())
    check_images(image_chat(good, "https://example.com/a.png", "mlxq-image:" + "0" * 64))
    refusals = {
        "data:image/png;base64,AAAA": "messages.0.content.2: image 2 is not a PNG, JPEG",
        "data:image/png;base64,@@@": "image 2: the data URL is not valid base64",
        data_url(GOOD["jpeg"]()[:-30], "jpeg"): "image 2 is a truncated JPEG file",
        data_url(png_declaring(50_000, 50_000)): "image 2 declares 50000 x 50000 pixels",
    }
    for url, words in refusals.items():
        with pytest.raises(ImageInvalid) as e:
            check_images(image_chat(good, url))
        assert words in str(e.value), str(e.value)
    noise = Image.frombytes("RGB", (500, 400), random.Random(1).randbytes(600_000))
    out = io.BytesIO()
    noise.save(out, "PNG")
    with pytest.raises(ImageInvalid, match=r"image 1 is 0\.6 MB; the limit is 0\.5 MB"):
        check_images(image_chat(data_url(out.getvalue())), max_bytes=2**19)


def test_submit_refuses_broken_images_by_file_and_line_and_enqueues_nothing(
    tmp_path, conn, redis_url
):
    good = data_url(GOOD["webp-lossy"](), "webp")
    lines = [
        image_chat(good),
        image_chat("data:image/png;base64,AAAA"),
        {
            "custom_id": "api",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": image_chat(good, data_url(GOOD["gif"]()[:30], "gif")),
        },
        image_chat(data_url(png_declaring(100_000, 100_000))),
        image_chat(data_url(b"\x89PNG" + b"\x00" * (21 * 2**20), "png")),
        chat("m"),
    ]
    path = write_jsonl(tmp_path / "jobs.jsonl", lines)
    result = CliRunner().invoke(
        main, ["submit", str(path), "--redis-url", redis_url], catch_exceptions=False
    )
    assert result.exit_code == 2, result.output
    out = result.output
    assert f"{path}:2: messages.0.content.1: image 1 is not a PNG, JPEG, WebP or GIF" in out
    assert f"{path}:3: body.messages.0.content.2: image 2 is a truncated GIF file" in out
    assert f"{path}:4: messages.0.content.1: image 1 declares 100000 x 100000 pixels" in out
    assert f"{path}:5: messages.0.content: part 1: the image is over 20 MB" in out
    assert f"{path}:1:" not in out and f"{path}:6:" not in out
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0  # nothing enqueued
    with pytest.raises(ValueError, match=r"bad: messages.0.content.1: image 1 is a truncated PNG"):
        Client(connection=conn).submit(
            {"ok": chat("m"), "bad": image_chat(data_url(GOOD["png"]()[:-5]))}
        )
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0
