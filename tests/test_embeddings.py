"""Embedding jobs end to end: real Redis, real workers, a tiny BERT and a tiny decoder
embedder made here (and the real all-MiniLM-L6-v2 in the real tier)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import openai
import pytest

from producer import Client
from producer.lines import parse_lines
from schemas.embeddings import EmbeddingList, decode_base64
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.test_faults import one_result
from tests.test_gateway import gateway  # noqa: F401  (the fixture)
from tests.waiting import wait_for


@pytest.fixture(scope="session")
def embedders(tmp_path_factory):
    from worker.dev.tinyembed import write_bert, write_decoder_embedder

    root = tmp_path_factory.mktemp("embedders")
    return {
        "bert": str(write_bert(root / "bert")),
        "bert-cls": str(write_bert(root / "bert-cls", seed=3, mode="cls", normalize=False)),
        "decoder": str(write_decoder_embedder(root / "decoder")),
    }


def _vectors(record) -> np.ndarray:
    assert record.status == "succeeded", record.error
    assert isinstance(record.response, EmbeddingList)
    rows = [
        decode_base64(d.embedding) if isinstance(d.embedding, str) else d.embedding
        for d in sorted(record.response.data, key=lambda d: d.index)
    ]
    return np.array(rows, dtype=np.float32)


def _run(conn, redis_url, jobs: dict, max_batch=8) -> dict:
    s = Client(connection=conn).submit(jobs)
    run_worker(redis_url, max_batch=max_batch)
    return {cid: read_result(conn, j) for cid, j in zip(jobs, s.job_ids, strict=True)}


TEXTS = ["hello world", "the cat sat on the mat", "a", "embedding a longer sentence " * 3]


@pytest.mark.parametrize("kind", ["bert", "bert-cls", "decoder"])
def test_every_input_shape_embeds_the_same_alone_and_in_company(conn, redis_url, embedders, kind):
    model = embedders[kind]
    from worker.engine.models import ModelCache

    entry, _ = ModelCache().get(model)
    assert entry.embedder is not None
    ids = entry.embedder.tokenize(TEXTS)
    jobs = {
        "list": {"model": model, "input": TEXTS},
        "one": {"model": model, "input": TEXTS[1]},
        "ids": {"model": model, "input": ids[3]},
        "idlists": {"model": model, "input": ids},
        "b64": {"model": model, "input": TEXTS, "encoding_format": "base64"},
        **{f"alone{i}": {"model": model, "input": t} for i, t in enumerate(TEXTS)},
    }
    records = _run(conn, redis_url, jobs)
    many = _vectors(records["list"])
    assert many.shape == (4, entry.embedder.pooling.dims)
    alone = np.concatenate([_vectors(records[f"alone{i}"]) for i in range(4)])
    np.testing.assert_allclose(many, alone, atol=1e-5)  # batching changes nothing
    np.testing.assert_allclose(_vectors(records["one"])[0], many[1], atol=1e-5)
    np.testing.assert_allclose(_vectors(records["ids"])[0], many[3], atol=1e-5)
    np.testing.assert_allclose(_vectors(records["idlists"]), many, atol=1e-5)
    np.testing.assert_allclose(_vectors(records["b64"]), many, atol=1e-6)
    # different texts give different vectors, and the normalising ones are unit length
    assert not np.allclose(many[0], many[1], atol=1e-3)
    if entry.embedder.pooling.normalize:
        np.testing.assert_allclose(np.linalg.norm(many, axis=1), 1.0, atol=1e-5)
    usage = records["list"].response.usage
    assert usage.prompt_tokens == usage.total_tokens == sum(len(t) for t in ids)
    metrics = records["alone0"].metrics
    assert metrics.batch_size > 1  # the one-text jobs were embedded together


@pytest.mark.parametrize(
    "arch", ["bert", "llama", "qwen3_moe", "gemma3_text", "qwen3_next", "nemotron_h", "falcon_h1"]
)
def test_a_rows_vector_is_the_same_padded_beside_longer_rows_on_every_cache_type(
    tmp_path_factory, arch
):
    """One forward pass over rows of different lengths (padded keys masked; decoders,
    sliding-window, MoE and recurrent layers alike, padded on the right) gives each row
    the vector it gets alone."""
    from worker.dev.tinyembed import write_bert, write_decoder_embedder
    from worker.engine.models import ModelCache

    root = tmp_path_factory.mktemp(f"pad-{arch}")
    path = (
        write_bert(root / "m") if arch == "bert" else write_decoder_embedder(root / "m", arch=arch)
    )
    embedder = ModelCache().get(str(path))[0].embedder
    assert embedder is not None
    rows = embedder.tokenize(["a short one", "a much longer text " * 5, "x"])
    assert len({len(r) for r in rows}) == 3
    assert max(len(r) for r in rows) <= (embedder.context or 10**6)  # within its positions
    together = embedder.forward(rows)
    alone = np.concatenate([embedder.forward([r]) for r in rows])
    # BLAS may sum a padded matrix in another order (OpenBLAS: ~1e-5); a mask gone wrong
    # moves values by 1e-2 and more.
    np.testing.assert_allclose(together, alone, atol=5e-5, rtol=1e-5)
    assert not np.allclose(together[0], together[2], atol=1e-3)


def test_bad_inputs_fail_alone_with_a_400_naming_what(conn, redis_url, embedders, tiny):
    bert = embedders["bert"]
    jobs = {
        "good": {"model": bert, "input": "fine"},
        "too-long": {"model": bert, "input": "word " * 200},
        "cut": {"model": bert, "input": "word " * 200, "truncate": True},
        "vocab": {"model": bert, "input": [[1, 2, 100000]]},
        "dims": {"model": bert, "input": "x", "dimensions": 8},
        "dims-over": {"model": bert, "input": "x", "dimensions": 999},
        "chat-model": {"model": tiny.target, "input": "x"},
        "chat-on-embedder": chat(bert, max_tokens=2),
    }
    r = _run(conn, redis_url, jobs)
    assert r["good"].status == "succeeded" and r["cut"].status == "succeeded"
    assert r["cut"].response.usage.prompt_tokens == 64  # the tiny BERT's context
    expect = {
        "too-long": ("context_length_exceeded", "embeds at most 64"),
        "vocab": ("invalid_request", "outside the vocabulary"),
        "dims": ("invalid_request", "not trained for shorter vectors"),
        "dims-over": ("invalid_request", "it gives 32"),
        "chat-model": ("wrong_model_kind", "is a chat model"),
        "chat-on-embedder": ("wrong_model_kind", "is an embedding model"),
    }
    for cid, (code, words) in expect.items():
        record = r[cid]
        assert record.status == "failed" and record.status_code == 400, (cid, record)
        assert record.error.code == code and words in record.error.message, (cid, record.error)


def test_batch_lines_mix_chat_and_embeddings_and_refuse_bad_ones_by_line(embedders, tiny):
    lines = [
        {
            "custom_id": "e",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": ["a"]},
        },
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat("m")},
        {
            "custom_id": "empty",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": ""},
        },
        {
            "custom_id": "many",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": ["a"] * 2049},
        },
        {
            "custom_id": "neg",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": [[-3]]},
        },
        {
            "custom_id": "mixed",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": ["a", 3]},
        },
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": chat("m")},
        {
            "custom_id": "fmt",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "m", "input": "a", "encoding_format": "int8"},
        },
    ]
    parsed = parse_lines(json.dumps(x) for x in lines)
    assert [p.custom_id for p in parsed.lines] == ["e", "c"]
    errors = {e.lineno: e.message for e in parsed.errors}
    assert "empty string" in errors[3]
    assert "at most 2048" in errors[4]
    assert "token ids are integers" in errors[5]
    assert "not a mix" in errors[6]
    assert "unknown field 'messages'" in errors[7]
    assert "encoding_format" in errors[8]


def test_a_chat_batch_leaves_embedding_jobs_for_after_it_and_both_finish(
    conn, redis_url, embedders, tiny
):
    jobs = {f"c{i}": chat(tiny.target, max_tokens=4, content=str(i)) for i in range(3)}
    jobs |= {"e": {"model": embedders["bert"], "input": "between"}}
    jobs |= {f"d{i}": chat(tiny.target, max_tokens=4, content=f"x{i}") for i in range(3)}
    r = _run(conn, redis_url, jobs)
    assert all(rec.status == "succeeded" for rec in r.values()), r
    assert isinstance(r["e"].response, EmbeddingList)


def test_sigkill_mid_embedding_leaves_one_record_per_job(
    tmp_path, conn, redis_url, embedders, workers
):
    model = embedders["bert"]
    jobs = {
        f"j{i}": {"model": model, "input": [f"text {i} {k}" * 4 for k in range(64)]}
        for i in range(200)
    }
    s = Client(connection=conn).submit(jobs)
    a = workers("--lease-seconds", "2", name="killed")
    wait_for(lambda: any(read_result(conn, j) for j in s.job_ids), timeout=120)
    a.signal(signal.SIGKILL)
    done = sum(1 for j in s.job_ids if read_result(conn, j) is not None)
    assert done < len(s.job_ids)  # killed mid-way: the rest are held, or queued
    workers("--lease-seconds", "2", name="rescuer")
    for job_id in s.job_ids:
        record = one_result(conn, job_id)
        assert record.status == "succeeded", record
        assert len(record.response.data) == 64


def test_the_gateway_embeds_through_the_sdk_and_the_batch_api(
    gateway,  # noqa: F811 (the fixture imported above)
    workers,
    embedders,
    tiny,
    tmp_path,
):
    bert = embedders["bert"]
    gw = gateway()
    client = gw.client()
    workers()
    # the SDK asks for base64 by default and decodes it; floats on request
    got = client.embeddings.create(model=bert, input=["one text", "another"])
    floats = client.embeddings.create(
        model=bert, input=["one text", "another"], encoding_format="float"
    )
    assert [d.index for d in got.data] == [0, 1] and got.model == bert
    np.testing.assert_allclose(
        [d.embedding for d in got.data], [d.embedding for d in floats.data], atol=1e-6
    )
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError, match="empty string"):
        client.embeddings.create(model=bert, input="")
    with pytest.raises(openai.BadRequestError, match="is a chat model"):
        client.embeddings.create(model=tiny.target, input="x")
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.chat.completions.create(model=bert, messages=[{"role": "user", "content": "x"}])
    # a Batch API batch of embeddings lines; a chat line in it fails the batch by line
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": bert, "input": f"text {i}"},
        }
        for i in range(4)
    ]
    path = tmp_path / "emb.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=120
    )
    assert done.endpoint == "/v1/embeddings" and done.request_counts.completed == 4
    output = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    for line in output:
        body = EmbeddingList.model_validate(line["response"]["body"])
        assert len(body.data) == 1 and len(body.data[0].embedding) == 32
    mixed = tmp_path / "mixed.jsonl"
    chat_line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": chat(tiny.target),
    }
    mixed.write_text(json.dumps(lines[0]) + "\n" + json.dumps(chat_line) + "\n")
    uploaded = client.files.create(file=mixed.open("rb"), purpose="batch")
    bad = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    failed = wait_for(lambda: (b := client.batches.retrieve(bad.id)).status == "failed" and b)
    assert (
        "a /v1/chat/completions request in a batch for /v1/embeddings"
        in failed.errors.data[0].message
    )


@pytest.mark.real
def test_all_minilm_l6_v2_gives_sentence_transformers_vectors_through_the_queue(conn, redis_url):
    """The real model from the package index, through a real queue and worker: the vectors
    sentence-transformers itself makes for 13 texts (``bench/minilm_reference.py``: accents,
    CJK, emoji, code, a 148-token paragraph), each to cosine >= 0.9999; the same token
    counts; and the score its documentation prints for its similarity example."""
    from worker.dev.tinyembed import minilm

    ref = json.loads((Path(__file__).parent / "data" / "minilm_reference.json").read_text())
    model = str(minilm(Path(__file__).resolve().parents[1] / ".mlxq" / "models"))
    texts, want = ref["texts"], np.array(ref["vectors"])
    jobs = {"all": {"model": model, "input": texts}}
    jobs |= {f"t{i}": {"model": model, "input": t} for i, t in enumerate(texts)}
    records = _run(conn, redis_url, jobs)
    v = _vectors(records["all"])
    assert v.shape == want.shape == (13, 384)
    cosine = (v * want).sum(axis=1) / np.linalg.norm(v, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(v, want, atol=1e-5)
    counts = [records[f"t{i}"].response.usage.prompt_tokens for i in range(len(texts))]
    assert counts == ref["tokens"]
    assert abs(float(v[2] @ v[3]) - 0.7553) < 1e-4  # (as sentence-transformers' docs print)


def test_modernbert_gives_hugging_faces_vectors_local_and_global_layers(conn, redis_url, tmp_path):
    """ModernBERT (rotary positions, local layers within 4 positions either side, global
    ones, GLU blocks, no biases) through the queue: the vectors sentence-transformers made
    for the same tiny random model through Hugging Face's own ModernBertModel
    (``bench/modernbert_reference.py``), one job of all texts (padded together) and one
    job per text; past its 64 positions, a clear 400."""
    import hashlib

    from worker.dev.tinyembed import write_modernbert

    ref = json.loads(
        (Path(__file__).parent / "data" / "tiny_modernbert_reference.json").read_text()
    )
    path = write_modernbert(tmp_path / "modernbert")
    for name, digest in ref["sha256"].items():  # (else: remake the reference)
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, name
    texts, want = ref["texts"], np.array(ref["vectors"])
    jobs = {"all": {"model": str(path), "input": texts}}
    jobs |= {f"t{i}": {"model": str(path), "input": t} for i, t in enumerate(texts)}
    jobs["long"] = {"model": str(path), "input": "apple silicon " * 40}
    records = _run(conn, redis_url, jobs)
    np.testing.assert_allclose(_vectors(records["all"]), want, atol=1e-5)
    for i in range(len(texts)):
        np.testing.assert_allclose(_vectors(records[f"t{i}"])[0], want[i], atol=1e-5)
        assert records[f"t{i}"].response.usage.prompt_tokens == ref["tokens"][i]
    assert records["long"].error.code == "context_length_exceeded", records["long"].error


def test_an_architecture_only_remote_code_defines_is_refused_by_name(conn, redis_url, tmp_path):
    """nomic-bert (nomic-embed-text) is defined by its own code (``auto_map``), which mlxq
    never runs: its job fails naming that; an ``auto_map`` beside a type mlxq runs is no
    reason to refuse (the same ModernBERT with one still embeds)."""
    import shutil

    from worker.dev.tinyembed import write_modernbert

    good = write_modernbert(tmp_path / "modernbert")
    nomic, mapped = tmp_path / "nomic", tmp_path / "mapped"
    for path, model_type in ((nomic, "nomic_bert"), (mapped, "modernbert")):
        shutil.copytree(good, path)
        config = json.loads((path / "config.json").read_text())
        auto_map = {"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"}
        config |= {"model_type": model_type, "auto_map": auto_map}
        (path / "config.json").write_text(json.dumps(config))
    jobs = {name: {"model": str(tmp_path / name), "input": "hello"} for name in ("nomic", "mapped")}
    records = _run(conn, redis_url, jobs)
    error = records["nomic"].error
    assert error.code == "model_load_error" and "nomic_bert" in error.message, error
    assert "own code" in error.message
    assert _vectors(records["mapped"]).shape == (1, 32)


@pytest.mark.parametrize("model_type", ["xlm-roberta", "roberta"])
def test_a_roberta_encoder_embeds_as_its_bert_twin(conn, redis_url, tmp_path, model_type):
    """XLM-RoBERTa (multilingual-e5, bge-m3) and RoBERTa: positions from pad_token_id + 1,
    one token type, weights under ``roberta.``. A twin of the tiny BERT in that form gives
    the BERT's vectors through the queue, and the same usable length (its table less 2)."""
    from worker.dev.tinyembed import write_bert, write_roberta_twin
    from worker.engine.models import ModelCache

    bert = write_bert(tmp_path / "bert", seed=5, context=16)
    twin = str(write_roberta_twin(bert, tmp_path / "twin", model_type))
    texts = ["hello world", "the cat sat on the mat", "a few more words to embed"]
    jobs = {"bert": {"model": str(bert), "input": texts}, "twin": {"model": twin, "input": texts}}
    records = _run(conn, redis_url, jobs)
    np.testing.assert_allclose(_vectors(records["twin"]), _vectors(records["bert"]), atol=1e-5)
    embedder = ModelCache().get(twin)[0].embedder
    assert embedder.context == 16  # 18 positions less the 2 before the first token
    long = embedder.tokenize(["a much longer text " * 3])
    records = _run(conn, redis_url, {"long": {"model": twin, "input": long[0]}})
    assert records["long"].error.code == "context_length_exceeded", records["long"].error


def test_rows_past_the_models_positions_and_non_finite_results_fail_by_name(tmp_path, monkeypatch):
    """A row longer than BERT's position table is refused before the pass (read past the
    table's end, it gave an all-NaN row now and then); a non-finite result fails by name:
    never NaN in a result."""
    import mlx.core as mx

    import worker.engine.embed as embed
    from schemas import ContextLengthError, GenerationError
    from worker.dev.tinyembed import write_bert
    from worker.engine.models import ModelCache

    embedder = ModelCache().get(str(write_bert(tmp_path / "m", context=16)))[0].embedder
    (fits, long) = embedder.tokenize(["a short one", "a much longer text " * 3])
    assert len(fits) <= 16 < len(long)
    with pytest.raises(ContextLengthError, match="longer than the model's 16"):
        embedder.forward([fits, long])
    assert np.isfinite(embedder.forward([fits])).all()
    monkeypatch.setattr(embed, "pool", lambda *a: mx.full((1, 32), mx.nan))
    with pytest.raises(GenerationError, match="non-finite"):
        embedder.forward([fits])
