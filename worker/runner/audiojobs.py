"""Audio jobs: recordings of one Whisper model transcribed together, each ended with its
own record.

The worker loop hands the first audio job here. Its recording is fetched (its batch's
stored bytes, an inline data URL, or a URL from an allowed host) and decoded
(``worker.engine.audio``); jobs behind it in the same queue for the same model join while
``worker.schedule.audio`` says so, and their windows share the decoder
(``worker.engine.whisper``: at most 16 rows, fewer if the memory budget says so). A job
whose recording is bad fails alone with a 400; a cancel or a time limit removes a job's
rows at the next step (``worker.runner.stops``), with the text of its finished windows in
the record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from schemas import GenerationError, InvalidRequestError, MlxqError, ModelKindError, ResultRecord
from schemas.audio import (
    AUDIO_REF,
    MAX_AUDIO_BYTES,
    AudioUsage,
    Segment,
    Transcription,
    TranscriptionRequest,
    decoded,
)
from schemas.keys import base_queue, batch_images_key
from schemas.result import Partial, Usage
from worker.engine.audio import decode_audio
from worker.engine.models import LoadedModel
from worker.engine.transcript import Settings, Transcript, with_temperature
from worker.engine.whisper import WhisperBatch, row_bytes
from worker.lifecycle.held import Job
from worker.runner import records
from worker.runner.lane import Host
from worker.runner.runtime import WorkerRuntime
from worker.runner.stops import LOOK_EVERY_S, Stops
from worker.schedule.audio import may_join, rows_that_fit

log = logging.getLogger(__name__)


def is_audio(job: Job) -> bool:
    return isinstance(job.envelope.request, TranscriptionRequest)


def request_of(job: Job) -> TranscriptionRequest:
    req = job.envelope.request
    assert isinstance(req, TranscriptionRequest)
    return req


@dataclass
class _Running:
    job: Job
    transcript: Transcript
    load_time_s: float
    cache_hit: bool
    busy: bool = False  # a window of it is in the decoder


class AudioRun:
    """Transcribes jobs of one model together until none is left (see the module)."""

    def __init__(
        self,
        rt: WorkerRuntime,
        conn: object,
        take: Callable[[], Job | None],
        finish: Callable[[list[tuple[Job, ResultRecord]]], None],
        ahead: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rt, self.conn, self.take, self.finish = rt, conn, take, finish
        #: Whether a queue served before this run's has work: then no more jobs join, and
        #: the worker serves it once the recordings in flight end.
        self.ahead = ahead
        self.running: list[_Running] = []
        self.stops = Stops(conn, rt.time_limit_s)  # type: ignore[arg-type]
        self.audio_s = 0.0
        self.peak_rows = 0
        self._look_at = 0.0  # when the queue is worth asking again (it was empty)

    @property
    def jobs(self) -> list[Job]:
        return [r.job for r in self.running]

    def run(self, first: Job) -> None:
        """Transcribe ``first`` and the jobs that join it; end each with its record."""
        model = self._start(first)
        if model is None:
            return
        started = time.perf_counter()
        capacity = self._capacity(model)
        batch = WhisperBatch(model.model, capacity)
        try:
            with self.rt.cache.reserving(capacity * row_bytes(model.model), "audio rows"):
                while self.running:
                    self._stop_due(batch)
                    self._join(model, batch.room)
                    self._feed(batch)
                    self._ended(batch.step())
        except MlxqError as e:  # (no room for one row beside the models)
            self._fail_all(e)
        except Exception as e:  # never let one batch's surprise take the worker down
            log.exception("transcribing %d job(s) failed unexpectedly", len(self.running))
            self._fail_all(GenerationError(f"{type(e).__name__}: {e}"))
        self.rt.stats.add_audio(self.audio_s, time.perf_counter() - started)

    def _fail_all(self, error: MlxqError) -> None:
        ended = [(r.job, records.failure(r.job, self.rt, error)) for r in self.running]
        self.running.clear()
        self.finish(ended)

    # -- jobs in --------------------------------------------------------------
    def _start(self, first: Job) -> LoadedModel | None:
        req = request_of(first)
        try:
            self.rt.check_allowed(req.model)
            model, hit = self.rt.cache.get(req.model)
            if model.kind != "audio":
                raise ModelKindError(
                    f"model {req.model!r} is {'an' if model.kind == 'embeddings' else 'a'} "
                    f"{model.kind} model, not a Whisper model: "
                    "send it chat or embeddings requests"
                )
        except MlxqError as e:
            self.finish([(first, records.failure(first, self.rt, e))])
            return None
        self._admit(first, model, 0.0 if hit else model.load_time_s, hit)
        return model if self.running else None

    def _join(self, model: LoadedModel, room: int) -> None:
        """Jobs of the same model from the first job's queue while :func:`may_join` says so
        (the queue, and those ahead, asked again :data:`LOOK_EVERY_S` after a no)."""
        looked: list[bool] = []  # what may_join saw of the queues ahead, if it looked

        def ahead() -> bool:
            looked.append(self.ahead())
            return looked[-1]

        while time.monotonic() >= self._look_at:
            looked.clear()
            audio_s = sum(r.transcript.duration_s for r in self.running)
            if not may_join(len(self.running), self._waiting(), room, audio_s, ahead):
                if looked:  # work ahead: look again later, not at every step
                    self._look_at = time.monotonic() + LOOK_EVERY_S
                return
            job = self.take()
            if job is None:
                self._look_at = time.monotonic() + LOOK_EVERY_S
                return
            self._admit(job, model, 0.0, True)

    def _waiting(self) -> int:
        return sum(1 for r in self.running if not r.busy and not r.transcript.done)

    def _admit(self, job: Job, model: LoadedModel, load_s: float, hit: bool) -> None:
        try:
            req = request_of(job)
            if req.model != model.name:
                raise InvalidRequestError(f"model {req.model!r} joined a batch of {model.name!r}")
            audio = decode_audio(self._bytes(job, req), "file", self.rt.max_audio_s)
            transcript = Transcript(model.model, audio, _settings(job, req, model))
        except MlxqError as e:
            self.finish([(job, records.failure(job, self.rt, e))])
            return
        except Exception as e:  # one recording's surprise fails that job alone
            log.exception("audio job %s could not start", job.id)
            self.finish([(job, records.failure(job, self.rt, GenerationError(str(e))))])
            return
        running = _Running(job, transcript, load_s, hit)
        if transcript.done:  # (no audio frames at all: an empty transcription)
            self.finish([(job, self._success(running))])
            return
        self.running.append(running)

    def _bytes(self, job: Job, req: TranscriptionRequest) -> bytes:
        url = req.file
        if (ref := AUDIO_REF.fullmatch(url)) is not None:
            data = self.conn.hget(batch_images_key(job.envelope.batch_id), ref.group(1))  # type: ignore[attr-defined]
            if data is None:
                raise InvalidRequestError(
                    f"file: recording {ref.group(1)[:12]}... is not stored with this job's "
                    "batch (its batch expired, or the reference was not made by the producer)"
                )
            return bytes(data)
        if url.startswith("data:"):
            data = decoded(url)
            if data is None:
                raise InvalidRequestError("file: the data URL is not valid base64")
            return data
        return self.rt.image_hosts.fetch(url, MAX_AUDIO_BYTES, "file")

    # -- steps ----------------------------------------------------------------
    def _capacity(self, model: LoadedModel) -> int:
        return rows_that_fit(row_bytes(model.model), self.rt.cache.fits_beside)

    def _feed(self, batch: WhisperBatch) -> None:
        asked = []
        for r in self.running:
            if len(asked) >= batch.room:
                break
            if not r.busy and not r.transcript.done:
                r.busy = True
                asked.append((r, r.transcript.window()))
        if asked:
            self._ended(batch.add(asked))
        self.peak_rows = max(self.peak_rows, len(batch.rows))

    def _ended(self, results: list[tuple[object, object]]) -> None:
        done = []
        for owner, result in results:
            r = owner
            assert isinstance(r, _Running)
            r.busy = False
            r.transcript.take(result)  # type: ignore[arg-type]
            if r.transcript.done:
                done.append(r)
        for r in done:
            self.running.remove(r)
        if done:
            self.finish([(r.job, self._success(r)) for r in done])

    def _stop_due(self, batch: WhisperBatch) -> None:
        due = self.stops.due(self.jobs)
        if not due:
            return
        ended = []
        for job, error in due:
            r = next(r for r in self.running if r.job is job)
            batch.drop(r)
            self.running.remove(r)
            ended.append((job, self._stopped(r, error)))
        self.finish(ended)

    # -- records --------------------------------------------------------------
    def _success(self, r: _Running) -> ResultRecord:
        t, req = r.transcript, request_of(r.job)
        self.audio_s += t.duration_s
        elapsed = r.job.started.elapsed()
        metrics = records.base_metrics(self.rt, r.job).model_copy(
            update={
                "load_time_s": r.load_time_s,
                "cache_hit": r.cache_hit,
                "batch_size": max(1, self.peak_rows),
                "audio_seconds": round(t.duration_s, 3),
                "audio_seconds_per_s": round(t.duration_s / elapsed, 3) if elapsed > 0 else None,
            }
        )
        return ResultRecord(
            job_id=r.job.id,
            batch_id=r.job.envelope.batch_id,
            custom_id=r.job.envelope.custom_id,
            status="succeeded",
            response=Transcription(
                task=req.task,
                language=t.language,
                duration=round(t.duration_s, 3),
                text=t.text,
                segments=[Segment.model_validate(s) for s in t.segments],
                usage=AudioUsage(seconds=round(t.duration_s, 3)),
                model=req.model,
                response_format=req.response_format,
            ),
            metrics=metrics,
            finished_at=time.time(),
        )

    def _stopped(self, r: _Running, error: MlxqError) -> ResultRecord:
        record = records.failure(r.job, self.rt, error)
        partial = Partial(
            texts=[r.transcript.text],
            usage=Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0),
        )
        return record.model_copy(update={"partial": partial})


def _settings(job: Job, req: TranscriptionRequest, model: LoadedModel) -> Settings:
    from mlx_whisper.tokenizer import LANGUAGES

    if req.language is not None and req.language not in LANGUAGES:
        raise InvalidRequestError(f"language: {req.language!r} is not a language Whisper knows")
    if req.language not in (None, "en") and not model.model.is_multilingual:
        raise InvalidRequestError(f"language: {model.name!r} is an English-only model")
    if req.task == "translate" and not model.model.is_multilingual:
        raise InvalidRequestError(f"{model.name!r} is an English-only model: it does not translate")
    seed = req.seed if req.seed is not None else int(job.id.encode().hex()[:15], 16)
    base = Settings(
        task=req.task,
        language=req.language,
        prompt=req.prompt,
        compression_ratio_threshold=req.compression_ratio_threshold,
        logprob_threshold=req.logprob_threshold,
        no_speech_threshold=req.no_speech_threshold,
        condition_on_previous_text=req.condition_on_previous_text,
        seed=seed,
    )
    return with_temperature(base, req.temperature)


def serve_audio(host: Host, first: Job) -> None:
    """Transcribe ``first`` with the audio jobs of its model that join it (the next jobs
    of its queue, while no queue served before it has work), and end them."""
    queue, model = base_queue(first.queue), request_of(first).model

    def take() -> Job | None:  # the next job of the queue, if it is one of ours
        job = host.take_from(queue, model)
        if job is not None and not (is_audio(job) and request_of(job).model == model):
            host.lifecycle.requeue(job)
            return None
        return job

    ahead = host.queues[: host.queues.index(queue)] if queue in host.queues else []

    def higher() -> bool:  # (an interactive job waits: the run takes no more)
        return any(host.lifecycle.waiting(q) for q in ahead)

    run = AudioRun(host.rt, host.lifecycle.conn, take, host.finish, higher)
    try:
        with host.computing():
            run.run(first)
    except BaseException:
        for job in run.jobs:
            host.lifecycle.requeue(job)
        raise
