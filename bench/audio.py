"""Audio jobs through the queue against mlx-whisper one recording at a time, side by side.

N synthetic recordings of 5-60 s (seeded; WAV) are transcribed twice by the same tiny
random Whisper (``worker.dev.tinywhisper``, Whisper's own 448-token text context and
vocabulary; its text is noise, its shapes are Whisper's), in one process, the model loaded
once before timing:

- mlx-whisper: ``mlx_whisper.transcribe`` on each recording in turn (decoded once, before
  timing, by ``worker.engine.audio``);
- queue: N audio jobs submitted to a local Redis and served by an in-process worker
  (decoding included: it is part of a job), windows of up to 16 recordings decoded
  together (``worker.engine.whisper``).

Both greedy, with no hotter retries (a random model fails every threshold; its retries
sample). Figures: audio seconds per wall second each way and the ratio; every job's text
is checked equal to mlx-whisper's.

    LD_PRELOAD=.../libblas.so.3 .venv/bin/python -m bench.audio [--recordings 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from redis import Redis

from producer import Client
from producer.localredis import LocalRedis
from schemas.audio import data_url
from schemas.store import read_result
from worker.dev.sounds import encode, speechlike
from worker.dev.tinywhisper import write_whisper
from worker.engine.audio import decode_audio
from worker.engine.models import ModelCache
from worker.engine.whisper import whisper_dtype
from worker.runner.loop import Worker
from worker.runner.runtime import WorkerRuntime

OUT = Path(__file__).parent / "out"
GREEDY = {"logprob_threshold": None, "compression_ratio_threshold": None}


def recordings(n: int, seed: int = 0) -> list[bytes]:
    """``n`` WAV files of 5 to 60 s (evenly spread, seeded)."""
    lengths = [5 + (55 * i) / max(1, n - 1) for i in range(n)]
    return [encode(speechlike(s, 16000, seed + i), 16000, "wav") for i, s in enumerate(lengths)]


def alone(model: str, files: list[bytes]) -> tuple[float, list[str]]:
    from mlx_whisper.transcribe import ModelHolder, transcribe

    fp16 = whisper_dtype() == mx.float16
    ModelHolder.get_model(model, mx.float16 if fp16 else mx.float32)  # loaded before timing
    audio = [decode_audio(f) for f in files]
    start = time.perf_counter()
    texts = [
        transcribe(a, path_or_hf_repo=model, fp16=fp16, language="en", temperature=0.0, **GREEDY)[
            "text"
        ]
        for a in audio
    ]
    return time.perf_counter() - start, texts


def queued(model: str, files: list[bytes], root: Path) -> tuple[float, list[str], int]:
    with LocalRedis(data_dir=root / "redis") as server:
        conn = Redis.from_url(server.url)
        jobs = {
            f"r{i}": {"model": model, "file": data_url(f, "wav"), "language": "en", **GREEDY}
            for i, f in enumerate(files)
        }
        s = Client(connection=conn).submit(jobs)
        rt = WorkerRuntime(cache=ModelCache(), worker_id="bench")
        rt.cache.get(model)  # loaded before timing, as the other arm's
        worker = Worker(conn, ["mlxq"], rt, name="bench-audio", burst=True, max_batch=None)
        start = time.perf_counter()
        worker.work()
        elapsed = time.perf_counter() - start
        records = [read_result(conn, j) for j in s.job_ids]
    texts = [r.response.text if r and r.response else "" for r in records]
    rows = max((r.metrics.batch_size for r in records if r and r.metrics), default=0)
    return elapsed, texts, rows


def one_row(model: str, data: bytes) -> str:
    """The recording through mlxq's decoder with room for one row (matrix products of one
    row, as mlx-whisper's): for a text that differs batched, whether it is the batching."""
    from worker.engine.transcript import Settings, Transcript
    from worker.engine.whisper import WhisperBatch, load_whisper

    settings = Settings(language="en", temperatures=(0.0,), **GREEDY)
    t = Transcript(load_whisper(Path(model), whisper_dtype()), decode_audio(data), settings)
    batch = WhisperBatch(t.model, 1)
    while not t.done:
        ended = batch.add([(t, t.window())])
        while not ended:
            ended = batch.step()
        t.take(ended[0][1])  # type: ignore[arg-type]
    return t.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recordings", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-audio-") as tmp:
        root = Path(tmp)
        model = str(write_whisper(root / "whisper", text_ctx=448))
        files = recordings(args.recordings)
        seconds = sum(decode_audio(f).size for f in files) / 16000
        print(f"{len(files)} recordings, {seconds:.0f} s of audio; model: tiny Whisper, 448 ctx")
        t_queue, queue_texts, rows = queued(model, files, root)
        t_alone, alone_texts = alone(model, files)
        differ = [
            i for i, (a, b) in enumerate(zip(alone_texts, queue_texts, strict=True)) if a != b
        ]
        for i in differ:
            a, b = alone_texts[i], queue_texts[i]
            at = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            single = one_row(model, files[i]) == a
            print(
                f"r{i}: differs from character {at} of {len(a)}; one row at a time: "
                f"{'equal' if single else 'differs too'}"
            )
    equal = len(files) - len(differ)
    result = {
        "recordings": len(files),
        "audio_s": round(seconds, 1),
        "mlx_whisper_s": round(t_alone, 2),
        "queue_s": round(t_queue, 2),
        "mlx_whisper_audio_s_per_s": round(seconds / t_alone, 2),
        "queue_audio_s_per_s": round(seconds / t_queue, 2),
        "ratio": round(t_alone / t_queue, 2),
        "texts_equal": f"{equal}/{len(files)}",
        "peak_rows": rows,
        "differ": differ,
    }
    for k, v in result.items():
        print(f"{k:>28}: {v}")
    OUT.mkdir(exist_ok=True)
    (OUT / "audio.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
