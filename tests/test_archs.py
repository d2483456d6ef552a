"""Every path on every architecture: sliding-window, linear-attention, SSM hybrid and MoE
models as well as llama-shaped ones.

Each architecture is a tiny random checkpoint loaded through ``mlx_lm.load``, with a
sliding window (16) or recurrent state that the test prompts pass. Each path must give
the greedy text of the same job alone without a draft (logprobs within 1e-4), or be
refused by name; speculation must be exact past the window (mlx-lm's own speculative
loop is not: its rewind of a wrapped window is a no-op, and it cannot rewind
recurrent state at all).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass

import jsonschema
import pytest

from schemas import ChatRequest
from tests.conftest import chat, run_jobs
from tests.models import noisy_copy
from tests.test_logprobs import TOL
from tests.test_structured import SCHEMA, schema_format
from worker.dev.tinymodels import ARCHS, TinySpec, ensure_model
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.rewind import describe
from worker.schedule.policy import SpeculationPolicy

WINDOW = 16
LONG = "the queue worker model token draft target redis job batch result metric apple silicon"


@dataclass(frozen=True)
class Arch:
    name: str
    target: str
    twin: str  # the same weights: every proposal accepted
    noisy: str  # noise on its projections: some proposals accepted, some not


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory) -> Arch:
    root = tmp_path_factory.mktemp(request.param)
    spec = TinySpec(arch=request.param, layers=4, hidden=64, intermediate=128, seed=1)
    target = ensure_model(root / "target", spec)
    twin = root / "twin"
    shutil.copytree(target, twin)
    noisy = noisy_copy(str(target), root / "noisy", 0.02, parts=("proj",))
    return Arch(request.param, str(target), str(twin), noisy)


def _req(arch: Arch, **fields) -> ChatRequest:
    fields = {"max_tokens": 40, "temperature": 0} | fields
    return ChatRequest.model_validate(chat(arch.target, content=LONG, **fields))


def _alone(arch: Arch, req: ChatRequest, draft: str | None = None, k: int = 3):
    gen = ChatGenerator.get_or_create(arch.target, draft, cache=ModelCache(prefix_bytes=0))
    return gen.generate(req.model_copy(update={"draft_model": draft}), num_draft_tokens=k)


#: Top-two logit gap under which greedy decoding is a coin toss: batched arithmetic
#: (another summation order) may break such a tie either way.
TIE = 1e-4


def _same_greedy(gen: ChatGenerator, req: ChatRequest, got, want) -> bool:
    """True when ``got`` is ``want``. False when they part only at a tie of the target
    (its top two logits within :data:`TIE` where they part, and ``got`` took one of
    them); any other difference fails the test."""
    import mlx.core as mx

    got, want = list(got), list(want)
    if got == want:
        return True
    j = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    j = min(len(got), len(want)) if j is None else j
    logits = gen.target.model(mx.array([gen.prompt_of(req) + want[:j]]))[0, -1]
    order = mx.argsort(-logits.astype(mx.float32)).tolist()
    gap = float(logits[order[0]] - logits[order[1]])
    assert gap < TIE, f"parted at token {j}, where the top two logits differ by {gap}"
    assert j == len(got) or got[j] in order[:2], f"token {j}: {got[j]} is not a top-two token"
    return False


def test_the_matrix_covers_every_cache_kind(arch):
    gen = ChatGenerator.get_or_create(arch.target, cache=ModelCache())
    from mlx_lm.models.cache import make_prompt_cache

    kinds = describe(make_prompt_cache(gen.target.model))
    expected = {
        "gemma3_text": "kv+sliding-window",
        "gemma4_text": "kv+sliding-window",
        "gpt_oss": "kv+sliding-window",
        "qwen3_next": "kv+recurrent",
        "qwen3_5": "kv+recurrent",
        "nemotron_h": "kv+recurrent",
        "falcon_h1": "kv+recurrent",
    }.get(arch.name, "kv")
    assert kinds == expected


def test_a_kept_prefix_never_changes_whatever_a_job_restored_from_it_does(arch):
    """A kept entry's arrays are shared (not copied) by every job restored from it. Jobs
    step their caches in place: mlx-lm writes a wrapped window's one-token update into
    its buffer (``keys[..., i, :] = k``), and ``mx.array.__setitem__`` changes that very
    array object. So a job whose prompt is one token past an entry (its last token is
    its first step) must leave the entry as it was, and a later job restored from it
    must see the prompt's state, on every cache type."""
    import mlx.core as mx

    from worker.engine.layers import restore, snapshot
    from worker.engine.prefill import prefill
    from worker.engine.rewind import leaves

    gen = ChatGenerator.get_or_create(arch.target, cache=ModelCache(prefix_bytes=0))
    model = gen.target.model
    tokens = [5 + (i * 7) % 200 for i in range(3 * WINDOW + 5)]  # past the window
    kept = snapshot(prefill(model, tokens, gen.target.new_cache()), len(tokens))
    assert kept is not None

    def state() -> list:
        return [[a.tolist() for a in _arrays(c.state)] for c in leaves(kept)]

    before = state()
    job = restore(kept, len(tokens))
    for t in (11, 12, 13):  # one-token steps, as a job's last prompt token and decode
        mx.eval(model(mx.array([[t]]), cache=job))
    assert state() == before


def _arrays(state) -> list:
    import mlx.core as mx

    out = []
    for part in state if isinstance(state, (list, tuple)) else [state]:
        if isinstance(part, mx.array):
            out.append(part)
        elif isinstance(part, (list, tuple)):
            out.extend(_arrays(part))
    return out


def test_speculation_alone_is_exact_past_the_window(arch, k=3):
    req = _req(arch)
    plain = _alone(arch, req)
    assert plain.prompt_tokens + plain.completion_tokens > 2 * WINDOW
    noisy = _alone(arch, req, arch.noisy, k)
    assert noisy.token_ids == plain.token_ids
    assert noisy.text == plain.text
    # some proposals accepted and some rejected: both rewinds ran
    assert 0 < noisy.draft_tokens_accepted < noisy.draft_tokens_proposed
    twin = _alone(arch, req, arch.twin, k)
    assert twin.token_ids == plain.token_ids
    assert twin.draft_tokens_proposed == twin.draft_tokens_accepted > 0
    assert twin.draft_rejections == 0


def test_speculative_logprobs_and_schema_match_plain(arch):
    req = _req(arch, logprobs=True, top_logprobs=2)
    plain, spec = _alone(arch, req), _alone(arch, req, arch.noisy)
    assert spec.token_ids == plain.token_ids
    assert plain.logprobs is not None and spec.logprobs is not None
    for (t, lp, top), (u, lq, toq) in zip(spec.logprobs, plain.logprobs, strict=True):
        assert t == u and abs(lp - lq) < TOL
        assert [i for i, _ in top] == [i for i, _ in toq]
        assert all(abs(a - b) < TOL for (_, a), (_, b) in zip(top, toq, strict=True))
    req = _req(arch, response_format=schema_format(), max_tokens=60)
    plain, spec = _alone(arch, req), _alone(arch, req, arch.noisy)
    assert spec.text == plain.text
    if plain.finish_reason == "stop":
        jsonschema.validate(json.loads(spec.text), SCHEMA)


def test_request_controls_match_plain_on_every_cache_type(arch):
    """A regex output, a repetition penalty and min_tokens: the draft's proposals under the
    same processors leave the plain text, on full, sliding-window and hybrid caches."""
    regex = "[a-z]{2,8}( [a-z]{2,8}){0,5}"
    fields = {"repetition_penalty": 1.3, "min_tokens": 4, "max_tokens": 40}
    req = _req(arch, structured_outputs={"regex": regex}, **fields)
    plain, spec = _alone(arch, req), _alone(arch, req, arch.noisy)
    assert spec.token_ids == plain.token_ids and plain.completion_tokens >= 4
    assert plain.finish_reason != "stop" or re.fullmatch(regex, plain.text), plain.text


def test_every_worker_path_gives_the_text_of_the_job_alone(conn, redis_url, arch):
    """Alone, a continuous batch, speculative (always and auto), streamed, n = 2, with a
    shared system prompt or a shared document in the user message (reused on tokens),
    through a real worker: each job's text is the plain job's. A seeded sampling job
    samples the same text alone, batched and as choice 0."""
    system = {"role": "system", "content": (LONG + " ") * 3}

    def job(i: int, **fields) -> dict:
        # Even jobs share a system prompt; odd ones a document heading their only message.
        item = f"item {i} " + "cache " * (i % 3)
        messages = (
            [system, {"role": "user", "content": item}]
            if i % 2 == 0
            else [{"role": "user", "content": f"{system['content']}\n{item}"}]
        )
        base = {"model": arch.target, "messages": messages, "max_tokens": 24, "temperature": 0}
        return base | fields

    jobs = range(6)
    seeded = {"temperature": 0.9, "seed": 5}  # sampled from its own key: alone, batched, n
    asks = {f"j{i}": job(i) for i in jobs} | {"s": job(6, **seeded)}
    plain = run_jobs(conn, redis_url, asks, f"{arch.name}-plain")
    texts = {c: r.response.choices[0].message.content for c, r in plain.items()}
    cached = [plain[f"j{i}"].response.usage.prompt_tokens_details.cached_tokens for i in jobs]
    # j0 keeps the system prompt (a boundary), j2 and j4 reuse it; the document: j1 keeps
    # it on plain KV caches (it looks at the queue), else j3 (it finds j1's in the recent
    # prompts); j5 reuses it either way.
    assert cached[0] == cached[1] == 0 and min(cached[2], cached[4], cached[5]) > 2 * WINDOW
    variants = {
        "batch": ({}, 4, "auto"),
        "spec-always": ({"draft_model": arch.noisy}, 4, "always"),
        "spec-auto": ({"draft_model": arch.noisy}, 4, "auto"),
        "stream": ({"stream": True, "draft_model": arch.twin}, 1, "auto"),
        "n": ({"n": 2}, 1, "auto"),
        "n-batch": ({"n": 2}, 5, "auto"),  # choices as rows of a batch among others
    }
    for name, (fields, max_batch, mode) in variants.items():
        asks = {f"j{i}": job(i, **fields) for i in jobs}
        if name in ("batch", "n", "n-batch"):  # (speculation samples another way: its own test)
            asks["s"] = job(6, **seeded, **fields)
        got = run_jobs(
            conn,
            redis_url,
            asks,
            f"{arch.name}-{name}",
            max_batch=max_batch,
            policy=SpeculationPolicy(mode),
        )
        for c, r in got.items():
            assert r.status == "succeeded", (name, c, r.error)
            choices = r.response.choices
            if c == "s":  # choice 0 draws from the job's seed; choice 1 from seed + 1
                assert choices[0].message.content == texts["s"], name
                assert r.metrics.batch_size > 1, name
                continue
            assert [ch.message.content for ch in choices] == [texts[c]] * len(choices), name
        if name == "n-batch":  # two jobs' choices decoded together
            assert max(r.metrics.batch_size for r in got.values()) >= 4


@pytest.mark.parametrize("shape", ["system", "document"])
def test_prefix_cache_on_every_cache_type(arch, shape):
    """A shared system prompt (a message boundary) is kept by its first job; a shared
    document heading the only user message (tokens alone) by the first job that finds
    it in a recent prompt. Either is reused, past the window, with the same text."""
    shared = (LONG + " ") * 3

    def messages(i: int) -> list[dict]:
        if shape == "system":
            return [{"role": "system", "content": shared}, {"role": "user", "content": f"q {i}"}]
        return [{"role": "user", "content": f"{shared}\nq {i}"}]

    reqs = [
        ChatRequest.model_validate(
            {"model": arch.target, "messages": messages(i), "max_tokens": 12, "temperature": 0}
        )
        for i in range(4)
    ]
    cold = ChatGenerator.get_or_create(arch.target, cache=ModelCache(prefix_bytes=0))
    warm = ChatGenerator.get_or_create(arch.target, cache=ModelCache())
    outs = [warm.generate(r) for r in reqs]
    assert [o.text for o in outs] == [cold.generate(r).text for r in reqs]
    first = 1 if shape == "system" else 2  # the jobs before it had nothing to reuse
    assert all(o.cached_tokens == 0 for o in outs[:first]), [o.cached_tokens for o in outs]
    assert all(o.cached_tokens > 2 * WINDOW for o in outs[first:]), [o.cached_tokens for o in outs]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Arch:
    """An SSM hybrid a speculative batch cannot hold (nemotron_h: padded rows are not
    exact in mlx-lm 0.32)."""
    root = tmp_path_factory.mktemp("hybrid")
    spec = TinySpec(arch="nemotron_h", layers=4, hidden=64, intermediate=128, seed=1)
    target = ensure_model(root / "target", spec)
    twin = root / "twin"
    shutil.copytree(target, twin)
    noisy = noisy_copy(str(target), root / "noisy", 0.02, parts=("proj",))
    return Arch("nemotron_h", str(target), str(twin), noisy)


def test_no_job_is_held_unrun_when_a_speculative_batch_refuses_it(conn, hybrid, workers):
    """A long-running worker (not burst) told to batch draft jobs speculatively, on a
    hybrid model a speculative batch cannot hold: every job runs (speculating alone,
    exact) and its record says why it was not batched; none waits in the worker."""
    from producer import Client
    from schemas.store import read_result
    from tests.waiting import wait_for

    jobs = {
        f"j{i}": chat(
            hybrid.target,
            content=f"{LONG} {i}",
            max_tokens=16,
            temperature=0,
            draft_model=hybrid.noisy,
        )
        for i in range(4)
    }
    plain = {
        c: _alone(arch=hybrid, req=ChatRequest.model_validate(j | {"draft_model": None})).text
        for c, j in jobs.items()
    }
    s = Client(connection=conn).submit(jobs)
    w = workers("--speculative", "always", "--max-batch", "4")
    records = wait_for(
        lambda: all(r := [read_result(conn, j) for j in s.job_ids]) and r, timeout=120
    )
    assert w.proc.poll() is None  # still serving
    for r in records:
        assert r.status == "succeeded", r.error
        assert r.response.choices[0].message.content == plain[r.custom_id]
        assert r.metrics.speculative
    reasons = [r.metrics.speculation_reason or "" for r in records]
    assert any("cannot prefill padded rows" in why for why in reasons), reasons


def test_a_batch_never_holds_more_than_projected_on_every_cache_type(arch):
    """Admission's projection bounds what the batch's caches really hold: sliding-window
    layers stop growing at their window, recurrent state is fixed per sequence."""
    from worker.engine.batch import BatchEngine
    from worker.schedule.admission import batch_peak_bytes

    gen = ChatGenerator.get_or_create(arch.target, cache=ModelCache(prefix_bytes=0))
    kv = gen.target.kv
    if "sliding-window" in describe(_cache(gen)):
        assert kv.windows and all(w == WINDOW for w, _ in kv.windows)
        assert kv.bytes_for(10 * WINDOW) - kv.bytes_for(5 * WINDOW) == kv.per_token * 5 * WINDOW
    if "recurrent" in describe(_cache(gen)):
        assert kv.fixed > 0
    engine = BatchEngine(gen.target, 8)
    for i, n in enumerate((60, 5, 30)):
        req = _req(arch, max_tokens=n, logit_bias={"3": -100})
        engine.add(i, gen.prepare(req))
    projected = batch_peak_bytes(kv, list(engine.lengths().values()))
    peak = 0
    while len(engine):
        engine.step()
        peak = max(peak, engine.kv_bytes)
        held = list(engine.lengths().values())
        assert engine.kv_bytes <= batch_peak_bytes(kv, held) or not len(engine)
    engine.close()
    assert 0 < peak <= projected
    assert peak >= projected // 3  # a bound, not a guess off by miles


def _cache(gen: ChatGenerator) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(gen.target.model)


@pytest.mark.parametrize("planner", [False, True])
def test_speculative_batches_are_exact_on_every_cache_type(arch, planner):
    """Rows joining and leaving a speculative batch past the window: each row's greedy
    text (and its proposals and acceptances) as the job speculating alone; rows of a
    recurrent model are rewound by replay. An architecture it cannot hold is refused by
    name, before anything changes."""
    from tests.test_specbatch import _run_engine
    from worker.engine.protocol import CannotTake
    from worker.engine.specbatch import SpecBatchEngine
    from worker.schedule.goodput import Goodput

    gen = ChatGenerator.get_or_create(arch.target, arch.noisy, cache=ModelCache(prefix_bytes=0))
    reqs = [
        ChatRequest.model_validate(
            chat(arch.target, f"{LONG} {i} " + "job " * i, max_tokens=8 + 7 * (i % 4))
            | {"temperature": 0}
        )
        for i in range(6)
    ]
    engine = SpecBatchEngine(gen.target, gen.draft, 3, Goodput(3, 0.5) if planner else None)
    if arch.name == "nemotron_h":
        with pytest.raises(CannotTake, match="nemotron_h"):
            _run_engine(engine, gen, reqs)
        assert len(engine) == 0
        return
    outs, sizes = _run_engine(engine, gen, reqs)
    assert max(sizes) >= 3
    for i, r in enumerate(reqs):
        plain = _alone(arch, r)
        if not _same_greedy(gen, r, outs[i].token_ids, plain.token_ids):
            continue  # parted at a tie: the counts after it are another text's
        if not planner:
            alone = _alone(arch, r, arch.noisy, 3)
            assert (outs[i].draft_tokens_proposed, outs[i].draft_tokens_accepted) == (
                alone.draft_tokens_proposed,
                alone.draft_tokens_accepted,
            ), i
    if "recurrent" in describe(_cache(gen)):
        assert engine.replays > 0


def test_prompt_lookup_is_exact_on_every_cache_type(arch):
    """Speculation without a draft model (prompt lookup), alone and in a batch with joins
    and leaves, past the window: the plain greedy text. Random weights seldom copy their
    prompt, so most proposals are rejected and every rewind runs (acceptance itself is
    ``tests/test_lookup``'s quoting model's business)."""
    from tests.test_specbatch import _run_engine
    from worker.engine.protocol import CannotTake
    from worker.engine.specbatch import SpecBatchEngine

    gen = ChatGenerator.get_or_create(arch.target, cache=ModelCache(prefix_bytes=0))
    lookup = {"method": "prompt_lookup", "ngram_min": 1}
    reqs = [
        ChatRequest.model_validate(
            chat(arch.target, f"{LONG} job batch job batch {i} " + "job " * i)
            | {"max_tokens": 30 + 3 * i, "temperature": 0, "speculation": lookup}
        )
        for i in range(5)
    ]
    proposed = 0
    for r in reqs:
        job = gen.prepare(r)
        plain = gen.generate(job, use_draft=False)
        assert plain.prompt_tokens + plain.completion_tokens > 2 * WINDOW
        looked = gen.generate(job.with_params(num_draft_tokens=4), lookup=job.params.lookup)
        assert looked.token_ids == plain.token_ids
        proposed += looked.draft_tokens_proposed - looked.draft_tokens_accepted
    assert proposed > 0  # rejected proposals: the target was rewound
    engine = SpecBatchEngine(gen.target, None, 4)
    if arch.name == "nemotron_h":
        with pytest.raises(CannotTake, match="nemotron_h"):
            _run_engine(engine, gen, reqs)
        return
    outs, _ = _run_engine(engine, gen, reqs)
    for i, r in enumerate(reqs):
        assert outs[i].token_ids == gen.generate(r, use_draft=False).token_ids, i
