"""A recording's bytes to Whisper's input: mono float32 at 16 kHz, decoded by FFmpeg's
libraries through PyAV (its wheels carry them, on macOS and Linux alike: no ``ffmpeg``
binary to install), resampled by FFmpeg's own resampler to 16-bit as mlx-whisper's
``load_audio`` asks the ``ffmpeg`` command for.

Only the demuxer of the container the bytes name is used (``schemas.audio.audio_format``:
no probing, so no playlist or concat format can make FFmpeg open other files or URLs).
A file that is not that container, is cut short of the length it declares, has no audio
or decodes past :data:`~schemas.audio.MAX_AUDIO_S` (a small file of hours of silence: a
decompression bomb) is an :class:`~schemas.InvalidRequestError` naming it.
"""

from __future__ import annotations

import io

import numpy as np

from schemas import InvalidRequestError
from schemas.audio import MAX_AUDIO_S, audio_format

SAMPLE_RATE = 16_000
#: FFmpeg's demuxer for each container :func:`schemas.audio.audio_format` names.
DEMUXERS = {
    "wav": "wav",
    "flac": "flac",
    "ogg": "ogg",
    "mp3": "mp3",
    "mp4": "mov",
    "webm": "matroska",
    "aiff": "aiff",
}


def decode_audio(data: bytes, where: str = "file", max_s: float = MAX_AUDIO_S) -> np.ndarray:
    """The recording in ``data`` as 16 kHz mono float32 samples in [-1, 1)."""
    import av

    fmt = audio_format(data)
    if fmt is None:
        raise InvalidRequestError(f"{where}: not a recording of a known format")
    if fmt == "wav":
        _check_wav(data, where)
    try:
        container = av.open(io.BytesIO(data), format=DEMUXERS[fmt], metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError) as e:
        raise InvalidRequestError(f"{where}: not a {fmt} recording FFmpeg can read ({e})") from None
    with container:
        if not container.streams.audio:
            raise InvalidRequestError(f"{where}: the {fmt} file has no audio stream")
        stream = container.streams.audio[0]
        declared = _declared_s(container, stream)
        if declared is not None and declared > max_s:
            raise InvalidRequestError(_too_long(where, max_s, f"it declares {declared:.0f} s"))
        samples = _samples(container, stream, where, fmt, int(max_s * SAMPLE_RATE))
    if samples.size == 0:
        raise InvalidRequestError(f"{where}: the {fmt} file holds no audio samples")
    got = samples.size / SAMPLE_RATE
    if declared is not None and got < 0.9 * declared - 0.5:
        raise InvalidRequestError(
            f"{where}: the {fmt} file is truncated (it declares {declared:.1f} s of audio; "
            f"{got:.1f} s decode)"
        )
    return samples


def _samples(container: object, stream: object, where: str, fmt: str, limit: int) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    count = 0
    try:
        for frame in container.decode(stream):  # type: ignore[attr-defined]
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().reshape(-1)
                chunks.append(chunk)
                count += chunk.size
            if count > limit:
                raise InvalidRequestError(
                    _too_long(where, limit / SAMPLE_RATE, "it decodes longer")
                )
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as e:
        raise InvalidRequestError(f"{where}: the {fmt} recording is damaged ({e})") from None
    if not chunks:
        return np.zeros(0, np.float32)
    return np.concatenate(chunks).astype(np.float32) / 32768.0


def _check_wav(data: bytes, where: str) -> None:
    """A WAV file's data chunk must hold the bytes its header says (FFmpeg reads what is
    there and says nothing). A streamed WAV's unknown size (0 or 0xFFFFFFFF) passes."""
    at = 12
    while at + 8 <= len(data):
        size = int.from_bytes(data[at + 4 : at + 8], "little")
        if data[at : at + 4] == b"data":
            have = len(data) - at - 8
            if size not in (0, 0xFFFFFFFF) and have < size:
                raise InvalidRequestError(
                    f"{where}: the wav file is truncated (its header says {size} bytes of "
                    f"audio; {have} are there)"
                )
            return
        at += 8 + size + (size & 1)


def _declared_s(container: object, stream: object) -> float | None:
    duration, base = getattr(stream, "duration", None), getattr(stream, "time_base", None)
    if duration and base:
        return float(duration * base)
    total = getattr(container, "duration", None)
    return total / 1_000_000 if total else None


def _too_long(where: str, max_s: float, how: str) -> str:
    limit = f"{max_s / 3600:g} h" if max_s >= 3600 else f"{max_s:g} s"
    return f"{where}: the recording is longer than the limit of {limit} ({how})"
