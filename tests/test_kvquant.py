"""Quantized KV caches (``worker --kv-bits``) on every path and every cache type.

Quantizing changes a model's outputs, so the reference here is the same job alone
with the same bits: a batch (joins and leaves), speculation alone and in a batch (draft
or prompt lookup, rewinds past a sliding window and through recurrent state), n
choices and the prefix cache must each give its greedy tokens. Layers mlx-lm cannot
quantize stay as they are and say so; a model whose attention takes no quantized cache
(gpt-oss: attention sinks) runs unquantized, said in the log and in its records.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import mlx.core as mx
import pytest

from schemas import ChatRequest
from tests.conftest import chat, run_jobs
from tests.models import noisy_copy
from worker.dev.tinymodels import ARCHS, TinySpec, ensure_model
from worker.engine.generator import ChatGenerator
from worker.engine.kvquant import BatchQuantizedKV, KVQuant, QuantizedKV, describe, positions
from worker.engine.models import ModelCache
from worker.schedule.policy import SpeculationPolicy

LONG = "the queue worker model token draft target redis job batch result metric apple silicon"
WINDOW = 16
#: KV only, KV + sliding window, KV + linear attention, KV + SSM.
FOUR_BITS = ("llama", "gemma3_text", "qwen3_next", "falcon_h1")


@dataclass(frozen=True)
class Arch:
    name: str
    target: str
    noisy: str  # a draft that agrees often, not always


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory) -> Arch:
    root = tmp_path_factory.mktemp(f"kvq-{request.param}")
    # Head size 32: a whole number of quantization groups of 32.
    spec = TinySpec(
        arch=request.param, layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128, seed=1
    )
    target = ensure_model(root / "target", spec)
    noisy = noisy_copy(str(target), root / "noisy", 0.02, parts=("proj",))
    return Arch(request.param, str(target), noisy)


def _cache(bits: int | None) -> ModelCache:
    return ModelCache(prefix_bytes=0, kv_quant=KVQuant(bits, 32) if bits else None)


def _req(arch: Arch, i: int, **fields) -> ChatRequest:
    body = chat(arch.target, f"{LONG} {i} " + "job " * i, max_tokens=10 + 7 * (i % 4))
    return ChatRequest.model_validate(body | {"temperature": 0} | fields)


# -- the batch layer -----------------------------------------------------------------
def _row(n: int, seed: int) -> QuantizedKV:
    mx.random.seed(seed)
    c = QuantizedKV(group_size=32, bits=8)
    c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
    return c


def _same(a: QuantizedKV, b: QuantizedKV) -> bool:
    ka, va = a.keys_and_values()
    kb, vb = b.keys_and_values()
    return a.offset == b.offset and all(
        mx.array_equal(x, y).item() for x, y in zip((*ka, *va), (*kb, *vb), strict=True)
    )


def test_a_batch_of_quantized_rows_gives_each_row_back_exactly():
    """Merge (left padding), extend, filter, extract: each row's quantized positions come
    back bit for bit, never requantized."""
    rows = [_row(n, seed) for seed, n in enumerate((5, 12, 1))]
    batch = QuantizedKV.merge(rows)
    assert isinstance(batch, BatchQuantizedKV) and batch.quant_bits == 8 and batch.group_size == 32
    assert batch.left_padding.tolist() == [7, 0, 11]
    assert all(_same(batch.extract(i), r) for i, r in enumerate(rows))
    more = QuantizedKV.merge([_row(20, 9)])
    batch.extend(more)
    assert _same(batch.extract(3), _row(20, 9)) and _same(batch.extract(0), rows[0])
    batch.filter([0, 3])
    assert _same(batch.extract(0), rows[0]) and _same(batch.extract(1), _row(20, 9))
    assert batch.nbytes == sum(int(x.nbytes) for x in positions(batch))
    # a new position for every row goes after each row's own
    mx.random.seed(3)
    k, v = mx.random.normal((2, 2, 1, 32)), mx.random.normal((2, 2, 1, 32))
    batch.update_and_fetch(k, v)
    grown = rows[0]
    grown.update_and_fetch(k[:1], v[:1])
    assert _same(batch.extract(0), grown)


def test_a_pass_of_several_tokens_attends_dequantized_and_keeps_them_quantized():
    """mlx-lm's attention takes its quantized path where the cache has ``bits``: a pass of
    one token does (decoding), a pass of several gets the keys dequantized (the fused
    attention; prefill 2.8x faster here) while the layer keeps them quantized."""
    for c in (QuantizedKV(32, 8), BatchQuantizedKV([0], 32, 8)):
        k = mx.random.normal((1, 2, 5, 32))
        dense, _ = c.update_and_fetch(k, k)
        assert not hasattr(c, "bits") and isinstance(dense, mx.array)
        assert mx.allclose(dense, k, atol=0.05).item()
        packed, _ = c.update_and_fetch(k[..., :1, :], k[..., :1, :])
        assert c.bits == 8 and isinstance(packed, tuple) and packed[0].dtype == mx.uint32
        c.update_and_fetch(k, k)
        # read while ``bits`` is hidden (prefill evaluates it): the layer's own bits
        assert c.quant_bits == 8 and not hasattr(c, "bits")
        assert isinstance(c, BatchQuantizedKV) or c.state[4] == 8


def test_right_padded_prefill_rolls_the_quantized_rows_like_plain_ones():
    """A speculative batch's joiners prefill right-padded and are rolled into left padding
    (``finalize``): quantized rows move as the plain rows do."""
    from mlx_lm.models.cache import BatchKVCache

    mx.random.seed(0)
    keys = mx.random.normal((2, 2, 6, 32))
    plain, quant = BatchKVCache([0, 0]), BatchQuantizedKV([0, 0], 32, 8)
    for c in (plain, quant):
        c.prepare(lengths=[6, 4], right_padding=[0, 2])
        c.update_and_fetch(keys, keys)
        c.finalize()
    assert quant.left_padding.tolist() == plain.left_padding.tolist() == [0, 2]
    assert quant.offset.tolist() == plain.offset.tolist()
    w, s, b = quant.keys_and_values()[0]
    back = mx.dequantize(w, s, b, group_size=32, bits=8)
    assert mx.allclose(back, plain.keys_and_values()[0], atol=0.05).item()


# -- every architecture, every path --------------------------------------------------
def test_each_layer_is_quantized_or_said_not_to_be(arch, caplog):
    gen = ChatGenerator.get_or_create(arch.target, cache=_cache(8))
    said = describe(gen.target.new_cache())
    if arch.name == "gpt_oss":  # attention sinks: mlx-lm's quantized attention refuses
        assert gen.target.kv_bits is None
        assert "attention sinks" in caplog.text and "unquantized" in caplog.text
        return
    assert gen.target.kv_bits == 8 and said.startswith("8-bit kv")
    if arch.name.startswith("gemma"):
        assert "unquantized sliding-window" in said
    if arch.name in ("qwen3_next", "qwen3_5", "nemotron_h", "falcon_h1"):
        assert "recurrent state as is" in said
    plain = ChatGenerator.get_or_create(arch.target, cache=_cache(None)).target.kv
    quant = gen.target.kv
    # 8 bits and a scale and bias per 32 values of float32: 5/16 of the bytes
    assert quant.per_token == pytest.approx(plain.per_token * 5 / 16, rel=0.01)
    assert quant.windows == plain.windows and quant.fixed == plain.fixed


@pytest.mark.parametrize("bits", [8, 4])
def test_every_engine_path_gives_the_job_alone_at_the_same_bits(arch, bits):
    """A continuous batch, speculation alone (a draft) and in a batch (a draft, prompt
    lookup), n choices: each row's greedy tokens are the job's alone with the same bits.
    8 bits on every architecture; 4 bits on one of each cache kind (the same code: the
    bits are a parameter of ``mx.quantize``)."""
    if bits == 4 and arch.name not in FOUR_BITS:
        pytest.skip("4 bits: one architecture of each cache kind")
    from tests.test_specbatch import _run_engine
    from worker.engine.batch import BatchEngine
    from worker.engine.protocol import CannotTake
    from worker.engine.specbatch import SpecBatchEngine

    gen = ChatGenerator.get_or_create(arch.target, arch.noisy, cache=_cache(bits))
    reqs = [_req(arch, i) for i in range(6)]
    alone = [gen.generate(r, use_draft=False).token_ids for r in reqs]
    engine = BatchEngine(gen.target, 4)
    for i, r in enumerate(reqs):
        engine.add(i, gen.prepare(r))
    outs, peak = {}, 0
    while len(engine):  # (six rows, four at once: two wait with empty caches at first)
        outs.update(engine.step().done)
        peak = max(peak, engine.kv_bytes)  # what the runner reads after every step
    assert [outs[i].token_ids for i in range(6)] == alone, "continuous batch"
    assert peak > 0
    spec = [gen.generate(r, num_draft_tokens=3) for r in reqs[:3]]
    assert [o.token_ids for o in spec] == alone[:3], "speculative alone"
    assert sum(o.draft_tokens_proposed - o.draft_tokens_accepted for o in spec) > 0
    lookup = {"method": "prompt_lookup", "ngram_min": 1}
    for draft, extra in ((gen.draft, {}), (None, {"speculation": lookup})):
        batch = [_req(arch, i, **extra) for i in range(6)]
        engine = SpecBatchEngine(gen.target, draft, 3)
        if arch.name == "nemotron_h":  # padded rows are not exact in mlx-lm 0.32
            with pytest.raises(CannotTake, match="nemotron_h"):
                _run_engine(engine, gen, batch)
            continue
        got, sizes = _run_engine(engine, gen, batch)
        assert max(sizes) >= 3
        assert [got[i].token_ids for i in range(6)] == alone, ("speculative batch", draft)
    two = gen.generate_choices(_req(arch, 1, n=2))
    assert [two.token_ids, *(o.token_ids for o in two.others)] == [alone[1]] * 2, "n"


def test_kept_prefixes_stay_quantized_and_give_the_same_tokens(arch):
    """A shared system prompt kept by the prefix cache, past the window: held quantized
    (fewer bytes than unquantized), reused, and the same greedy text as without it."""
    shared = (LONG + " ") * 3

    def req(i: int) -> ChatRequest:
        msgs = [{"role": "system", "content": shared}, {"role": "user", "content": f"q {i}"}]
        return ChatRequest.model_validate(
            {"model": arch.target, "messages": msgs, "max_tokens": 12, "temperature": 0}
        )

    kv = KVQuant(8, 32)
    cold = ChatGenerator.get_or_create(arch.target, cache=ModelCache(prefix_bytes=0, kv_quant=kv))
    cache = ModelCache(kv_quant=kv)
    warm = ChatGenerator.get_or_create(arch.target, cache=cache)
    outs = [warm.generate(req(i)) for i in range(3)]
    assert [o.text for o in outs] == [cold.generate(req(i)).text for i in range(3)]
    assert outs[0].cached_tokens == 0 and min(o.cached_tokens for o in outs[1:]) > 2 * WINDOW
    if warm.target.kv_bits:
        assert any(isinstance(c, QuantizedKV) for c in _kept_layers(cache))


def _kept_layers(cache: ModelCache) -> list:
    from worker.engine.rewind import leaves

    return [c for e in cache.prefixes._entries.values() for c in leaves(e.layers)]


# -- through a worker ----------------------------------------------------------------
def test_records_say_the_bits_on_every_worker_path(conn, redis_url, tmp_path):
    """Batched, speculative, streamed and n jobs through a worker with 8-bit caches: each
    record says ``kv_bits`` 8 and holds the text of the job alone at 8 bits."""
    spec = TinySpec(arch="gemma3_text", layers=4, hidden=64, heads=2, kv_heads=1, seed=1)
    target = str(ensure_model(tmp_path / "t", spec))
    noisy = noisy_copy(target, tmp_path / "noisy", 0.02, parts=("proj",))
    kv = KVQuant(8, 32)
    gen = ChatGenerator.get_or_create(target, cache=ModelCache(prefix_bytes=0, kv_quant=kv))

    def job(i: int, **fields) -> dict:
        return (
            chat(target, f"{LONG} {i} " + "job " * i, max_tokens=20) | {"temperature": 0} | fields
        )

    want = {f"j{i}": gen.generate(ChatRequest.model_validate(job(i))).text for i in range(4)}
    variants = {
        "batch": {},
        "spec": {"draft_model": noisy},
        "stream": {"stream": True},
        "n": {"n": 2},
    }
    for name, fields in variants.items():
        got = run_jobs(
            conn,
            redis_url,
            {f"j{i}": job(i, **fields) for i in range(4)},
            f"kvq-{name}",
            max_batch=4,
            policy=SpeculationPolicy("always"),
            cache=ModelCache(kv_quant=kv),
        )
        for c, r in got.items():
            assert r.status == "succeeded", (name, r.error)
            assert r.metrics.kv_bits == 8, name
            assert {ch.message.content for ch in r.response.choices} == {want[c]}, name
    plain = run_jobs(conn, redis_url, {"j0": job(0)}, "kvq-plain")
    assert plain["j0"].metrics.kv_bits is None


def test_disk_prefixes_are_kept_per_bits(tmp_path):
    """Entries written by a worker with 8-bit caches serve a restarted one with 8 bits,
    never one with 4 bits or none (their layers differ)."""
    from worker.engine.prefixdisk import PrefixDisk

    spec = TinySpec(layers=2, hidden=64, heads=2, kv_heads=1, seed=3, context=4096)
    target = str(ensure_model(tmp_path / "t", spec))
    shared = (LONG + " ") * 4

    def req(i: int) -> ChatRequest:
        msgs = [{"role": "system", "content": shared}, {"role": "user", "content": f"q {i}"}]
        return ChatRequest.model_validate(
            {"model": target, "messages": msgs, "max_tokens": 8, "temperature": 0}
        )

    def worker(bits: int | None) -> tuple[ChatGenerator, PrefixDisk]:
        disk = PrefixDisk(tmp_path / "disk")
        kv = KVQuant(bits, 32) if bits else None
        cache = ModelCache(prefix_disk=disk, kv_quant=kv)
        return ChatGenerator.get_or_create(target, cache=cache), disk

    first, disk = worker(8)
    made = first.generate(req(0))
    disk.flush()
    assert made.cached_tokens == 0
    for bits, reused in ((4, False), (None, False), (8, True)):
        again, _ = worker(bits)
        out = again.generate(req(1))
        assert (out.cached_tokens > 0) == reused, bits
        if bits == 8:
            assert out.text == first.generate(req(1)).text
    assert any(f.suffix == ".safetensors" for f in (tmp_path / "disk").rglob("*"))
    shutil.rmtree(tmp_path / "disk")


def test_bad_kv_flags_are_refused_by_name(tmp_path):
    """Bad flags stop the worker naming the flag; a job cannot ask for bits (the cache is
    the worker's memory, shared by every job)."""
    import subprocess
    import sys
    from pathlib import Path

    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="kv_bits"):
        ChatRequest.model_validate(chat("m", "hi") | {"kv_bits": 4})

    exe = str(Path(sys.executable).with_name("worker"))
    for flag, value in (("--kv-bits", "3"), ("--kv-bits", "x"), ("--kv-group-size", "16")):
        p = subprocess.run([exe, flag, value, "--burst"], capture_output=True, text=True)
        assert p.returncode == 2 and flag in p.stderr, (flag, p.stderr)


def test_the_fleet_shows_the_bits_and_the_group():
    """``producer fleet`` and the registry entry say a worker's KV bits (and a group's
    size: ``tests/test_group.py`` runs the groups)."""
    from producer.fleet import fleet_table
    from schemas.fleet import WorkerInfo
    from worker.runner.fleet import worker_info
    from worker.runner.runtime import WorkerRuntime

    rt = WorkerRuntime(cache=ModelCache(kv_quant=KVQuant(8)))
    info = worker_info(rt, "w", ["mlxq"], "idle", None)
    assert (info.kv_bits, info.group_size) == (8, 1)
    shown = WorkerInfo.model_validate(info.model_dump() | {"group_size": 2, "shard": "tensor"})
    text = fleet_table([shown])
    assert "a group of 2 ranks (--shard tensor); KV caches at 8 bits" in text
