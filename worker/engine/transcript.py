"""One recording's transcription, window by window: mlx-whisper's ``transcribe`` loop,
turned inside out so that many recordings share the decoder (``worker.engine.whisper``).

:meth:`Transcript.window` says which 30 s window to decode next (with the recording's
previous text as its prompt, and the temperature of the current try); :meth:`Transcript.take`
takes its result: a try that fails the compression-ratio or log-probability thresholds is
tried again at the next temperature, as ``transcribe`` does, then the segments are cut at
the timestamp tokens and the recording moves on (to the last timestamp, or to the window's
end). Segment timestamps only: word timestamps are refused at the door.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from worker.engine.whisper import Decoded, Window, whisper_dtype

#: mlx-whisper's (and OpenAI's) temperatures tried in turn when ``temperature`` is 0.
FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True)
class Settings:
    """How a recording is transcribed (``transcribe``'s arguments)."""

    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperatures: tuple[float, ...] = FALLBACK
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    seed: int = 0


class Transcript:
    """The windows of one recording and what they decoded to."""

    def __init__(self, model: Any, audio: np.ndarray, settings: Settings) -> None:
        from mlx_whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram
        from mlx_whisper.tokenizer import get_tokenizer

        self.model, self.settings = model, settings
        # the audio's dtype (mlx-whisper's ``fp16`` option), not the weights': float16
        # weights read float32 audio on the CPU
        self.dtype = whisper_dtype()
        self.mel = log_mel_spectrogram(audio, n_mels=model.dims.n_mels, padding=N_SAMPLES)
        self.frames = self.mel.shape[-2] - N_FRAMES
        self.language = settings.language or self._detect()
        self.tokenizer = get_tokenizer(
            model.is_multilingual,
            num_languages=model.num_languages,
            language=self.language,
            task=settings.task,
        )
        self.seek, self.attempt, self.windows = 0, 0, 0
        self.tokens: list[int] = []
        self.segments: list[dict[str, Any]] = []
        self.prompt_from = 0
        self.initial: list[int] = []
        if settings.prompt is not None:
            self.initial = self.tokenizer.encode(" " + settings.prompt.strip())
            self.tokens.extend(self.initial)
        self._features: mx.array | None = None

    @property
    def duration_s(self) -> float:
        from mlx_whisper.audio import HOP_LENGTH, SAMPLE_RATE

        return float(self.frames * HOP_LENGTH / SAMPLE_RATE)

    @property
    def done(self) -> bool:
        return self.seek >= self.frames

    def _detect(self) -> str:
        from mlx_whisper.audio import N_FRAMES, pad_or_trim

        if not self.model.is_multilingual:
            return "en"
        segment = pad_or_trim(self.mel, N_FRAMES, axis=-2).astype(self.dtype)
        _, probs = self.model.detect_language(segment)
        return str(max(probs, key=probs.get))

    def _size(self) -> int:
        from mlx_whisper.audio import N_FRAMES

        return min(N_FRAMES, self.frames - self.seek)

    def window(self) -> Window:
        """The next decode (the current window, at the current try's temperature)."""
        from mlx_whisper.audio import N_FRAMES, pad_or_trim
        from mlx_whisper.decoding import DecodingOptions

        assert not self.done
        s = self.settings
        mel = self.mel[self.seek : self.seek + self._size()]
        mel = pad_or_trim(mel, N_FRAMES, axis=-2).astype(self.dtype)
        options = DecodingOptions(
            task=s.task,
            language=self.language,
            temperature=s.temperatures[self.attempt],
            prompt=self.tokens[self.prompt_from :],
            fp16=self.dtype == mx.float16,
        )
        seed = (s.seed * 1_000_003 + self.windows * 31 + self.attempt) % 2**63
        return Window(mel, options, seed, self._features)

    def take(self, result: Decoded) -> None:
        """A window's result: tried again hotter, or cut into segments and moved past."""
        s = self.settings
        retry = (
            s.compression_ratio_threshold is not None
            and result.compression_ratio > s.compression_ratio_threshold
        ) or (s.logprob_threshold is not None and result.avg_logprob < s.logprob_threshold)
        if s.no_speech_threshold is not None and result.no_speech_prob > s.no_speech_threshold:
            retry = False  # silence
        if retry and self.attempt + 1 < len(s.temperatures):
            self.attempt += 1
            self._features = result.features
            return
        self.attempt, self._features = 0, None
        self.windows += 1
        self._advance(result)

    def _advance(self, result: Decoded) -> None:
        from mlx_whisper.audio import HOP_LENGTH, N_FRAMES, SAMPLE_RATE

        s, tok = self.settings, self.tokenizer
        size = self._size()
        if s.no_speech_threshold is not None:
            skip = result.no_speech_prob > s.no_speech_threshold
            if s.logprob_threshold is not None and result.avg_logprob > s.logprob_threshold:
                skip = False
            if skip:
                self.seek += size
                return
        offset = float(self.seek * HOP_LENGTH / SAMPLE_RATE)
        stride = N_FRAMES // self.model.dims.n_audio_ctx
        precision = stride * HOP_LENGTH / SAMPLE_RATE
        tokens = np.array(result.tokens)
        stamps = tokens >= tok.timestamp_begin
        single_ending = stamps[-2:].tolist() == [False, True]
        consecutive = np.where(np.logical_and(stamps[:-1], stamps[1:]))[0] + 1
        current: list[dict[str, Any]] = []
        if len(consecutive) > 0:
            slices = consecutive.tolist()
            if single_ending:
                slices.append(len(tokens))
            last = 0
            for cut in slices:
                part = tokens[last:cut]
                start = offset + (part[0].item() - tok.timestamp_begin) * precision
                end = offset + (part[-1].item() - tok.timestamp_begin) * precision
                current.append(self._segment(start, end, part, result))
                last = cut
            if single_ending:
                self.seek += size
            else:
                self.seek += (tokens[last - 1].item() - tok.timestamp_begin) * stride
        else:
            duration = size * HOP_LENGTH / SAMPLE_RATE
            times = tokens[stamps.nonzero()[0]]
            if len(times) > 0 and times[-1].item() != tok.timestamp_begin:
                duration = (times[-1].item() - tok.timestamp_begin) * precision
            current.append(self._segment(offset, offset + duration, tokens, result))
            self.seek += size
        for segment in current:  # an instantaneous or empty segment keeps no text
            if segment["start"] == segment["end"] or segment["text"].strip() == "":
                segment["text"], segment["tokens"] = "", []
        first = len(self.segments)
        self.segments.extend({"id": first + i, **seg} for i, seg in enumerate(current))
        self.tokens.extend(t for seg in current for t in seg["tokens"])
        if not s.condition_on_previous_text or result.temperature > 0.5:
            self.prompt_from = len(self.tokens)

    def _segment(
        self, start: float, end: float, tokens: np.ndarray, result: Decoded
    ) -> dict[str, Any]:
        listed = tokens.tolist()
        text = [t for t in listed if t < self.tokenizer.eot]
        return {
            "seek": self.seek,
            "start": start,
            "end": end,
            "text": self.tokenizer.decode(text),
            "tokens": listed,
            "temperature": result.temperature,
            "avg_logprob": result.avg_logprob,
            "compression_ratio": result.compression_ratio,
            "no_speech_prob": result.no_speech_prob,
        }

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens[len(self.initial) :])


def with_temperature(settings: Settings, temperature: float) -> Settings:
    """``temperature`` as the API takes it: 0 tries the fallback temperatures in turn (as
    OpenAI and mlx-whisper do), above 0 that temperature alone."""
    temps = FALLBACK if temperature == 0 else (temperature,)
    return replace(settings, temperatures=temps)
