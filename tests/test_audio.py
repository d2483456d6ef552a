"""Audio transcription jobs end to end: a tiny random Whisper made here (the same bytes on
every machine), synthetic recordings in WAV, FLAC, MP3 and OGG at several sample rates,
real Redis, real workers. Every text is compared with mlx-whisper's own ``transcribe`` on
the same model and decoded audio. No real Whisper weights are run here."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

pytest.importorskip("mlx_whisper")

from producer import Client
from producer.lines import Defaults, LineInvalid, parse_line
from schemas.audio import Transcription, data_url, render
from schemas.store import read_result
from tests.conftest import chat, run_jobs, write_jsonl
from tests.test_faults import one_result
from tests.test_gateway import auth, gateway, request  # noqa: F401  (the fixture)
from tests.waiting import wait_for
from worker.dev.sounds import encode, noise, silence, speechlike
from worker.engine.audio import decode_audio

#: Greedy at temperature 0 alone (no hotter retries: a random model fails every threshold).
GREEDY = {"logprob_threshold": None, "compression_ratio_threshold": None}
#: (seconds, sample rate, format) of the recordings compared with mlx-whisper.
RECORDINGS = [(2.5, 8000, "wav"), (12, 22050, "flac"), (33, 44100, "mp3"), (61, 48000, "ogg")]


@pytest.fixture(scope="session")
def whisper(tmp_path_factory) -> str:
    from worker.dev.tinywhisper import write_whisper

    return str(write_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper"))


def _file(seconds: float, rate: int, fmt: str, seed: int = 0) -> bytes:
    return encode(speechlike(seconds, rate, seed), rate, fmt)


def _reference(model: str, data: bytes, **options) -> dict:
    """mlx-whisper's own transcription of ``data`` (decoded as the worker decodes it)."""
    import mlx.core as mx
    from mlx_whisper.transcribe import transcribe

    from worker.engine.whisper import whisper_dtype

    fp16 = whisper_dtype() == mx.float16
    return transcribe(decode_audio(data), path_or_hf_repo=model, fp16=fp16, **options)


def _same(record, reference: dict) -> None:
    assert record.status == "succeeded", record.error
    got = record.response
    assert isinstance(got, Transcription)
    assert got.text == reference["text"]
    assert [s.tokens for s in got.segments] == [s["tokens"] for s in reference["segments"]]
    times = [t for s in got.segments for t in (s.start, s.end)]
    assert times == pytest.approx(
        [t for s in reference["segments"] for t in (s["start"], s["end"])]
    )
    assert got.language == reference["language"]


def test_every_format_and_sample_rate_decodes_to_16khz_mono():
    for seconds, rate, fmt in [*RECORDINGS, (4, 16000, "wav"), (3, 24000, "ogg")]:
        audio = decode_audio(_file(seconds, rate, fmt))
        assert audio.dtype == np.float32
        assert abs(audio.size / 16000 - seconds) < 0.1, (fmt, rate)
        assert 0.05 < float(np.abs(audio).max()) <= 1.0


@pytest.mark.parametrize("language", ["en", None])
def test_batched_text_equals_mlx_whisper_alone(conn, redis_url, whisper, language):
    files = [_file(s, r, f, seed=i) for i, (s, r, f) in enumerate(RECORDINGS)]
    files.append(encode(silence(5), 16000, "wav"))
    files.append(encode(noise(7, 16000, seed=3), 16000, "flac"))
    lang = {"language": language} if language else {}
    jobs = {
        f"r{i}": {"model": whisper, "file": data_url(d, "x"), **GREEDY, **lang}
        for i, d in enumerate(files)
    }
    jobs["translated"] = {**jobs["r1"], "task": "translate"}
    jobs["prompted"] = {**jobs["r2"], "prompt": "A meeting about the budget."}
    got = run_jobs(conn, redis_url, jobs, f"audio-{language}")
    for i, data in enumerate(files):
        _same(got[f"r{i}"], _reference(whisper, data, temperature=0.0, **GREEDY, **lang))
    opts = {"temperature": 0.0, **GREEDY, **lang}
    _same(got["translated"], _reference(whisper, files[1], task="translate", **opts))
    prompted = _reference(whisper, files[2], initial_prompt="A meeting about the budget.", **opts)
    _same(got["prompted"], prompted)
    # they ran together: more than one window in the decoder at once
    assert max(r.metrics.batch_size for r in got.values()) > 1
    seconds = got["r3"].metrics.model_extra["audio_seconds"]
    assert seconds == pytest.approx(61, abs=0.05) and got["r3"].response.duration == seconds


def test_hotter_retries_are_keyed_by_seed_alone_or_batched(conn, redis_url, whisper):
    """With the default thresholds the random model's windows fail them and are tried
    hotter (sampled): the same seed gives the same text, alone or among others."""
    data = _file(20, 16000, "wav", seed=5)
    one = {"model": whisper, "file": data_url(data, "wav"), "language": "en", "seed": 7}
    alone = run_jobs(conn, redis_url, {"x": one}, "audio-seed-alone")["x"]
    others = {f"o{i}": {**one, "seed": i} for i in range(4)}
    together = run_jobs(conn, redis_url, {"x": one, **others}, "audio-seed-batch")
    assert alone.status == "succeeded"
    assert {s.temperature for s in alone.response.segments} - {0.0}  # it did sample
    assert together["x"].response.text == alone.response.text
    assert together["o0"].response.text != alone.response.text  # another seed: other samples


def test_hostile_recordings_fail_alone_with_a_clear_record(conn, redis_url, whisper, tmp_path):
    wav = _file(6, 16000, "wav")
    mp3 = _file(6, 44100, "mp3")
    long = encode(silence(90, 8000), 8000, "flac")
    bomb = bytearray(long)  # its STREAMINFO's length zeroed ("unknown"): found by decoding
    head = int.from_bytes(bomb[18:26], "big") & ~((1 << 36) - 1)
    bomb[18:26] = head.to_bytes(8, "big")
    bad = {
        "truncated-wav": (wav[: len(wav) // 2], "truncated"),
        "truncated-mp3": (mp3[: len(mp3) // 3], "truncated"),
        "header-only": (b"RIFF\x00\x00\x00\x00WAVE" + b"\x00" * 40, "wav"),
        "garbage-mp3": (b"ID3" + bytes(range(256)) * 20, "mp3"),
        "too-long": (long, "longer than the limit of 60 s (it declares 90 s)"),
        "bomb": (bytes(bomb), "longer than the limit of 60 s (it decodes longer)"),
    }
    jobs = {k: {"model": whisper, "file": data_url(d, "x"), **GREEDY} for k, (d, _) in bad.items()}
    jobs["url"] = {"model": whisper, "file": "https://example.com/a.wav", **GREEDY}
    jobs["unstored"] = {"model": whisper, "file": "mlxq-audio:" + "ab" * 32, **GREEDY}
    jobs["unknown-language"] = {"model": whisper, "file": data_url(wav, "x"), "language": "zz"}
    jobs["good"] = {"model": whisper, "file": data_url(wav, "wav"), "language": "en", **GREEDY}
    got = run_jobs(conn, redis_url, jobs, "audio-hostile", max_audio_s=60)
    for name, (_, why) in bad.items():
        assert got[name].status == "failed" and got[name].status_code == 400, name
        assert why in got[name].error.message, (name, got[name].error.message)
    assert "fetches no image URLs" in got["url"].error.message
    assert "not stored with this job's batch" in got["unstored"].error.message
    assert "'zz' is not a language Whisper knows" in got["unknown-language"].error.message
    assert got["good"].status == "succeeded"
    # refused at the door, nothing queued: not audio, empty, over the limit
    client = Client(connection=conn)
    for data, why in [
        (b"hello, not audio", "not a recording of a known format"),
        (b"", "empty"),
        (b"RIFF\x00\x00\x00\x00WAVE" + bytes(26 * 2**20), "over 25 MB"),
    ]:
        with pytest.raises(ValueError, match=why):
            client.submit({"x": {"model": whisper, "file": data_url(data, "wav")}})


def test_jobs_file_paths_stay_under_their_root(tmp_path, whisper):
    (tmp_path / "audio").mkdir()
    (tmp_path / "audio" / "a.flac").write_bytes(_file(3, 16000, "flac"))
    (tmp_path / "notes.txt").write_text("not audio")
    defaults = Defaults(audio_root=tmp_path / "audio")
    line = {"model": whisper, "file": "a.flac"}
    _, req, body, _ = parse_line(json.dumps(line), 1, defaults)
    assert body["file"].startswith("data:audio/flac;base64,") and req.task == "transcribe"
    batch = {
        "custom_id": "t",
        "method": "POST",
        "url": "/v1/audio/translations",
        "body": line,
    }
    assert parse_line(json.dumps(batch), 2, defaults)[1].task == "translate"
    for file, why in [
        ("../notes.txt", "is outside"),
        ("/etc/passwd", "is outside"),
        ("missing.wav", "no file 'missing.wav'"),
    ]:
        with pytest.raises(LineInvalid, match=why):
            parse_line(json.dumps({**line, "file": file}), 3, defaults)
    with pytest.raises(LineInvalid, match="a path is read by `producer submit`"):
        parse_line(json.dumps(line), 4, Defaults())  # the gateway's Batch API: no paths
    with pytest.raises(LineInvalid, match="word timestamps are not produced"):
        parse_line(json.dumps({**line, "timestamp_granularities": ["word"]}), 5, defaults)
    with pytest.raises(LineInvalid, match="runs 'translate', not 'transcribe'"):
        bad = {**batch, "body": {**line, "task": "transcribe"}}
        parse_line(json.dumps(bad), 6, defaults)


def test_producer_submit_reads_paths_and_results_come_back(
    conn, redis_url, whisper, tmp_path, workers
):
    for i, (s, r, f) in enumerate(RECORDINGS[:3]):
        (tmp_path / f"r{i}.{f}").write_bytes(_file(s, r, f, seed=i))
    lines = [
        {"custom_id": f"r{i}", "model": whisper, "file": f"r{i}.{f}", "language": "en", **GREEDY}
        for i, (_, _, f) in enumerate(RECORDINGS[:3])
    ]
    jobs = write_jsonl(tmp_path / "jobs.jsonl", lines)
    producer = str(Path(sys.executable).with_name("producer"))
    env = {"MLXQ_REDIS_URL": redis_url}
    out = subprocess.run(
        [producer, "submit", str(jobs), "--json"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    batch = json.loads(out.stdout)["batch_id"]
    # the recording is stored once with the batch, not in each job
    stored = conn.hkeys(f"mlxq:batch:{batch}:images")
    assert len(stored) == 3
    workers("--burst").wait(120)
    results = tmp_path / "out.jsonl"
    subprocess.run(
        [producer, "results", batch, "-o", str(results)], check=True, env=env, capture_output=True
    )
    rows = {json.loads(x)["custom_id"]: json.loads(x) for x in results.read_text().splitlines()}
    for i, (s, r, f) in enumerate(RECORDINGS[:3]):
        body = rows[f"r{i}"]["response"]["body"]
        expected = _reference(
            whisper, _file(s, r, f, seed=i), temperature=0.0, language="en", **GREEDY
        )
        assert body["text"] == expected["text"]


def test_the_sdk_transcribes_in_every_response_format(
    gateway,  # noqa: F811 (the fixture imported above)
    workers,
    whisper,
    conn,
):
    gw = gateway()
    client = gw.client()
    workers()
    data = _file(40, 16000, "wav", seed=2)
    upload = ("talk.wav", data, "audio/wav")
    # (a form field has no null: "null" is read as JSON, as numbers and booleans are)
    extra = {"language": "en", "logprob_threshold": "null", "compression_ratio_threshold": "null"}
    full = client.audio.transcriptions.create(
        model=whisper, file=upload, response_format="verbose_json", extra_body=extra
    )
    expected = _reference(whisper, data, temperature=0.0, language="en", **GREEDY)
    assert full.text == expected["text"] and full.language == "en"
    assert [s.tokens for s in full.segments] == [s["tokens"] for s in expected["segments"]]
    assert full.duration == pytest.approx(40, abs=0.05)
    plain = client.audio.transcriptions.create(model=whisper, file=upload, extra_body=extra)
    assert plain.text == full.text
    record = Transcription.model_validate(
        {**full.model_dump(), "object": "transcription", "model": whisper, "task": "transcribe"}
    )
    for fmt in ("text", "srt", "vtt"):
        got = client.audio.transcriptions.create(
            model=whisper, file=upload, response_format=fmt, extra_body=extra
        )
        assert got == render(record, fmt)[0], fmt
    srt = render(record, "srt")[0]
    assert srt.startswith("1\n00:00:") and " --> " in srt
    assert render(record, "vtt")[0].startswith("WEBVTT\n\n")
    translated = client.audio.translations.create(
        model=whisper, file=upload, response_format="json", extra_body=extra
    )
    as_translation = _reference(
        whisper, data, task="translate", temperature=0.0, language="en", **GREEDY
    )
    assert translated.text == as_translation["text"]
    with pytest.raises(openai.BadRequestError, match="not a recording of a known format"):
        client.audio.transcriptions.create(model=whisper, file=("x.wav", b"not audio at all"))
    with pytest.raises(openai.BadRequestError, match="word timestamps"):
        client.audio.transcriptions.create(
            model=whisper, file=upload, timestamp_granularities=["word"]
        )
    # Prometheus: the seconds of audio the worker transcribed (published at its heartbeat)

    def transcribed() -> bool:
        text = request("GET", f"{gw.url}/metrics", headers=auth()).body.decode()
        found = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("mlxq_worker_audio_seconds_total")
        ]
        return bool(found) and found[0] >= 40 * 6

    wait_for(transcribed, what="the worker's audio seconds in /metrics")


def test_sigkill_mid_batch_loses_nothing(conn, whisper, workers):
    jobs = {
        f"k{i}": {"model": whisper, "file": data_url(_file(45, 16000, "wav", i), "wav"), **GREEDY}
        for i in range(8)
    }
    s = Client(connection=conn).submit(jobs)
    a = workers("--lease-seconds", "2", name="killed")
    wait_for(lambda: any(read_result(conn, j) for j in s.job_ids), timeout=120)
    a.signal(signal.SIGKILL)
    assert sum(1 for j in s.job_ids if read_result(conn, j) is not None) < len(s.job_ids)
    workers("--lease-seconds", "2", name="rescuer")
    for job_id in s.job_ids:
        record = one_result(conn, job_id, timeout=180)
        assert record.status == "succeeded", record.error


def test_a_cancel_stops_a_running_transcription(conn, whisper, workers):
    long = _file(600, 16000, "wav")
    s = Client(connection=conn).submit({"long": {"model": whisper, "file": data_url(long, "wav")}})
    w = workers()
    w.begun(s.job_ids[0])
    Client(connection=conn).cancel(s.batch_id)
    record = one_result(conn, s.job_ids[0], timeout=60)
    assert record.status == "cancelled", record
    assert record.partial is not None and record.partial.cut


def test_the_timestamp_rule_rules_out_what_mlx_whisper_rules_out(whisper):
    """Row by row, the batched rule equals mlx-whisper's ``ApplyTimestampRules`` on random
    histories, ties at the margin included (where only the exact sum decides)."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_whisper.decoding import ApplyTimestampRules, DecodingOptions, DecodingTask

    from worker.engine.whisper import load_whisper, timestamp_rules

    model = load_whisper(Path(whisper))
    task = DecodingTask(model, DecodingOptions(language="en", prompt=[220, 330]))
    theirs = next(f for f in task.logit_filters if isinstance(f, ApplyTimestampRules))
    tok = task.tokenizer
    rng = np.random.default_rng(0)
    rows, logits = [], []
    for k in range(96):
        sampled = []
        for _ in range(int(rng.integers(1, 12))):
            stamp = rng.random() < 0.4
            sampled.append(
                int(rng.integers(tok.timestamp_begin, tok.timestamp_begin + 1500))
                if stamp
                else int(rng.integers(0, tok.eot))
            )
        row = rng.standard_normal(model.dims.n_vocab).astype(np.float32) * 3
        if k % 2 == 0:  # the best text token exactly at the timestamps' total (or an ulp
            # off): the log-sum-exp taken apart or not can decide either way here
            total = mx.logsumexp(mx.array(row[tok.timestamp_begin :])).item()
            step = (0, np.inf, 0, -np.inf)[k // 2 % 4]
            best = np.float32(total) if step == 0 else np.nextafter(np.float32(total), step)
            row[int(np.argmax(row[: tok.timestamp_begin]))] = best
        tokens = list(task.initial_tokens) + sampled
        rows.append(SimpleNamespace(task=task, rule=theirs, tokens=tokens))
        logits.append(row)
    batch = mx.array(np.stack(logits))
    ours = np.array(timestamp_rules(batch, rows))
    for k, row in enumerate(rows):
        expected = theirs.apply(batch[k : k + 1], mx.array([row.tokens]))
        assert np.array_equal(ours[k], np.array(expected)[0]), k


def test_each_window_is_the_one_mlx_whisper_decodes(whisper):
    """Window by window, the same mel (values and dtype), prompt and temperature as
    mlx-whisper's ``transcribe`` asks its decoder for, and the same tokens back."""
    import importlib

    import mlx.core as mx
    from mlx_whisper.decoding import DecodingOptions

    from worker.engine.transcript import Settings, Transcript
    from worker.engine.whisper import WhisperBatch, load_whisper, whisper_dtype

    audio = decode_audio(_file(75, 16000, "wav", seed=9))
    module = importlib.import_module("mlx_whisper.transcribe")
    fp16 = whisper_dtype() == mx.float16
    model = module.ModelHolder.get_model(whisper, mx.float16 if fp16 else mx.float32)
    asked, decode = [], type(model).decode

    def spy(self, mel, options=None, **kw):
        options = options or DecodingOptions()
        result = decode(self, mel, options, **kw)
        asked.append((mel, options, result.tokens))
        return result

    type(model).decode = spy
    try:
        module.transcribe(
            audio, path_or_hf_repo=whisper, fp16=fp16, language="en", temperature=0.0, **GREEDY
        )
    finally:
        type(model).decode = decode
    ours = load_whisper(Path(whisper), whisper_dtype())
    settings = Settings(language="en", temperatures=(0.0,), **GREEDY)
    t = Transcript(ours, audio, settings)
    n = 0
    while not t.done:
        window = t.window()
        mel, options, tokens = asked[n]
        assert window.mel.dtype == mel.dtype and mx.array_equal(window.mel, mel).item(), n
        assert list(window.options.prompt or []) == list(options.prompt or []), n
        assert window.options.temperature == options.temperature
        batch = WhisperBatch(ours, 1)
        ended = batch.add([(t, window)])
        while not ended:
            ended = batch.step()
        assert ended[0][1].tokens == tokens, n
        t.take(ended[0][1])
        n += 1
    assert n == len(asked) >= 3


def test_no_room_for_one_row_fails_the_jobs_not_the_worker(conn, redis_url, whisper):
    from worker.engine.models import ModelCache
    from worker.engine.whisper import row_bytes

    probe, _ = ModelCache().get(whisper)
    budget = probe.nbytes + row_bytes(probe.model) // 2  # the model, and half a row
    wav = data_url(_file(4, 16000, "wav"), "wav")
    jobs = {f"j{i}": {"model": whisper, "file": wav, **GREEDY} for i in range(3)}
    got = run_jobs(conn, redis_url, jobs, "audio-no-room", cache=ModelCache(budget))
    for record in got.values():
        assert record.status == "failed" and "audio rows needs" in record.error.message
    assert len(got) == 3  # every job ended, each with its record (the worker went on)


def test_decoder_steps_give_mlx_whispers_logits_bit_for_bit(whisper):
    """A row alone gives, step by step, the very logits mlx-whisper's own decoder gives
    (float16 layers under float32 audio included: a dtype apart flips near-ties somewhere in
    a long batch); rows of different prompts stepped together give them to float rounding
    (batched matrix products may round apart from one row's, by BLAS)."""
    import mlx.core as mx
    from mlx_whisper.decoding import DecodingOptions

    from worker.engine.whisper import Window, load_whisper, whisper_dtype

    dtype = whisper_dtype()
    model = load_whisper(Path(whisper), dtype)
    mels = [pad_window(decode_audio(_file(s, 16000, "wav", seed=s)), dtype) for s in (12, 30)]
    prompts = [[], list(range(220, 250))]
    windows = [
        Window(m, DecodingOptions(language="en", prompt=p, fp16=dtype == mx.float16))
        for m, p in zip(mels, prompts, strict=True)
    ]
    follow = [[int(t) for t in np.random.default_rng(i).integers(0, 50000, 6)] for i in range(2)]
    theirs = [_their_steps(model, w, f) for w, f in zip(windows, follow, strict=True)]
    for i, window in enumerate(windows):
        alone = _our_steps(model, [window], [follow[i]])[0]
        for step, (a, b) in enumerate(zip(alone, theirs[i], strict=True)):
            assert mx.array_equal(a, b).item(), (i, step)
    together = _our_steps(model, windows, follow)
    for i in range(2):
        for a, b in zip(together[i], theirs[i], strict=True):
            assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


def _their_steps(model, window, tokens: list[int]) -> list:
    import mlx.core as mx
    from mlx_whisper.decoding import DecodingTask

    task = DecodingTask(model, window.options)
    features = model.encoder(window.mel[None])
    _, cache, _ = model.decoder(mx.array([list(task.initial_tokens)]), features)
    out = []
    for token in tokens[:-1]:
        logits, cache, _ = model.decoder(mx.array([[token]]), features, kv_cache=cache)
        out.append(logits[0, -1].astype(mx.float32))
    return out


def _our_steps(model, windows: list, follow: list[list[int]]) -> list[list]:
    """Each row's logits at each step, the rows fed ``follow``'s tokens."""
    from worker.engine.whisper import WhisperBatch

    batch = WhisperBatch(model, 4)
    assert batch.add(list(enumerate(windows))) == []
    for row, tokens in zip(batch.rows, follow, strict=True):
        row.tokens[-1] = tokens[0]
    out: list[list] = [[] for _ in windows]
    for step in range(len(follow[0]) - 1):
        logits = batch._forward()
        for i, row in enumerate(batch.rows):
            out[i].append(logits[i])
            row.tokens.append(follow[i][step + 1])
    return out


def pad_window(audio: np.ndarray, dtype) -> object:
    from mlx_whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim

    mel = log_mel_spectrogram(audio, n_mels=80, padding=N_SAMPLES)
    return pad_or_trim(mel[:N_FRAMES], N_FRAMES, axis=-2).astype(dtype)


def test_an_interactive_job_is_served_before_the_audio_queue_drains(conn, whisper, tiny, workers):
    """While recordings run, a job on a queue served first stops more recordings from
    joining: it runs once those in flight end, not after the whole audio queue."""
    from schemas import keys

    files = [data_url(_file(1 + i % 3, 16000, "wav", seed=i), "wav") for i in range(36)]
    # (hotter retries make rows end at different steps: the run never empties by itself)
    audio = Client(connection=conn).submit(
        {f"a{i}": {"model": whisper, "file": f, "language": "en"} for i, f in enumerate(files)}
    )
    workers()
    wait_for(lambda: any(read_result(conn, j) for j in audio.job_ids), timeout=120)
    quick = Client(connection=conn, queue=keys.INTERACTIVE_QUEUE).submit(
        {"q": chat(tiny.target, max_tokens=4)}
    )
    record = one_result(conn, quick.job_ids[0], timeout=120)
    assert record.status == "succeeded"
    done = sum(1 for j in audio.job_ids if read_result(conn, j) is not None)
    assert done < len(audio.job_ids)  # (at most 32 recordings are in flight at once)
    for job_id in audio.job_ids:
        assert one_result(conn, job_id, timeout=120).status == "succeeded"


def test_each_kind_of_model_refuses_the_other_kinds_by_name(conn, redis_url, whisper, tiny):
    wav = data_url(_file(2, 16000, "wav"), "wav")
    jobs = {
        "chat-to-whisper": {"model": whisper, "messages": [{"role": "user", "content": "hi"}]},
        "embed-whisper": {"model": whisper, "input": "hello"},
        "audio-to-chat": {"model": tiny.target, "file": wav},
    }
    got = run_jobs(conn, redis_url, jobs, "audio-kinds")
    assert "is an audio model, not a chat model" in got["chat-to-whisper"].error.message
    assert "/v1/audio/transcriptions" in got["chat-to-whisper"].error.message
    assert "is an audio model, not an embedding" in got["embed-whisper"].error.message
    assert "is a chat model, not a Whisper model" in got["audio-to-chat"].error.message
    assert {r.status_code for r in got.values()} == {400}


def test_batch_api_files_take_audio_lines_and_refuse_what_they_cannot_run(whisper):
    """A Batch API file for an audio endpoint (the gateway's: no paths) takes base64 and URL
    recordings; a chat line in it, a path, a stream or word timestamps are refused by name."""
    from schemas.audio import TRANSCRIPTIONS_URL

    batch = Defaults(endpoint=TRANSCRIPTIONS_URL)
    wav = data_url(_file(2, 16000, "wav"), "wav")

    def line(body: dict, url: str = TRANSCRIPTIONS_URL) -> str:
        return json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": body})

    for file in (wav, "https://example.com/a.mp3"):
        _, req, _, _ = parse_line(line({"model": whisper, "file": file}), 1, batch)
        assert req.task == "transcribe" and req.file == file
    for text, why in [
        (line(chat(whisper), "/v1/chat/completions"), "in a batch for"),
        (line({"model": whisper, "file": "a.wav"}), "a path is read by `producer submit`"),
        (line({"model": whisper, "file": wav, "stream": True}), "not streamed"),
        (line({"model": whisper, "file": wav, "timestamp_granularities": ["word"]}), "word"),
        (line({"model": whisper, "file": "data:audio/wav;base64,aGVsbG8="}), "known format"),
    ]:
        with pytest.raises(LineInvalid, match=why):
            parse_line(text, 2, batch)
