"""Synthetic recordings for tests and benchmarks: tones, silence and noise at any sample
rate, encoded by PyAV into WAV, FLAC, MP3 or OGG (Opus). Seeded: the same bytes each run
on one machine (encoders may differ between FFmpeg builds; tests compare decoded audio
through one decoder, never bytes across machines)."""

from __future__ import annotations

import io

import numpy as np

#: Each format's codec and the sample rates it takes.
CODECS = {"wav": "pcm_s16le", "flac": "flac", "mp3": "libmp3lame", "ogg": "libopus"}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def speechlike(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Tones that come and go over a little noise (something for a model to attend to)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 180 + 40 * (seed % 7)
    on = (t % 2.3) < 1.4
    wave = 0.3 * np.sin(2 * np.pi * pitch * t) * on + 0.15 * np.sin(2 * np.pi * 3.1 * pitch * t)
    return (wave + 0.03 * rng.standard_normal(t.size)).astype(np.float32)


def silence(seconds: float, rate: int = 16000) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


def noise(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(int(seconds * rate))).astype(np.float32)


def encode(samples: np.ndarray, rate: int = 16000, fmt: str = "wav") -> bytes:
    """``samples`` (mono float32) as a ``fmt`` file's bytes."""
    import av

    codec = CODECS[fmt]
    if fmt == "ogg" and rate not in _OPUS_RATES:
        raise ValueError(f"Opus takes {_OPUS_RATES} Hz, not {rate}")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        pcm = np.clip(samples * 32767, -32768, 32767).astype(np.int16)
        step = stream.codec_context.frame_size or 1024
        for at in range(0, pcm.size, step):
            frame = av.AudioFrame.from_ndarray(
                pcm[None, at : at + step], format="s16", layout="mono"
            )
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
