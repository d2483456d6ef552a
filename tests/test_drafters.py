"""Drafters: proposals from the target's hidden states, exact alone and batched.

EAGLE-3 heads, DFlash block drafters and a model's own MTP head (Qwen3.5's ``mtp.*``
layer, named as ``draft_model: "mtp"``). Each is a tiny checkpoint built from mlx-vlm's
own config and module (``worker.dev.tinydrafters``), trained here for a few seconds on
its target's greedy continuations of the test prompts (``bench.drafters``), so that
some proposals are kept and some are not (both rewinds run). EAGLE-3 targets: llama
(full attention), Gemma 3 (sliding window) and Qwen3.5 (linear-attention hybrid,
rewound by replay); DFlash targets: Qwen3 (full attention), gpt-oss (sliding window,
attention sinks, MoE) and Qwen3.5; the MTP head on Qwen3.5."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest

from bench.drafters import train_dflash, train_eagle3, train_mtp
from schemas import ChatRequest, IncompatibleDraftError, ModelKindError
from tests.conftest import chat, run_jobs
from tests.test_archs import WINDOW, _same_greedy
from tests.test_structured import schema_format
from worker.dev.tinydrafters import write_dflash, write_eagle3, write_mtp
from worker.dev.tinymodels import TinySpec, ensure_model
from worker.engine import Prepared, params_for, prompt_tokens
from worker.engine.generator import ChatGenerator
from worker.engine.heads import load as load_drafter
from worker.engine.hidden import Tap
from worker.engine.models import ModelCache
from worker.engine.specbatch import SpecBatchEngine
from worker.schedule.policy import SpeculationPolicy

LONG = "the queue worker model token draft target redis job batch result metric apple silicon"
#: (drafter kind, target architecture)
PAIRS = (
    ("eagle3", "llama"),
    ("eagle3", "gemma3_text"),
    ("eagle3", "qwen3_5"),
    ("mtp", "qwen3_5"),
    ("dflash", "qwen3"),
    ("dflash", "gpt_oss"),
    ("dflash", "qwen3_5"),
)


@dataclass(frozen=True)
class Pair:
    kind: str
    arch: str
    target: str
    drafter: str  # what a job names as its draft_model
    reqs: tuple[ChatRequest, ...]


def _reqs(target: str, n: int = 6) -> tuple[ChatRequest, ...]:
    return tuple(
        ChatRequest.model_validate(
            chat(target, f"{LONG} {i} " + "job " * i, max_tokens=24 + 5 * i, temperature=0)
        )
        for i in range(n)
    )


_PAIRS: dict[tuple[str, str], Pair] = {}


def _pair(kind: str, arch: str, tmp_path_factory) -> Pair:
    """A tiny target of ``arch`` and a drafter of ``kind`` trained for it (built once
    per module)."""
    if (kind, arch) not in _PAIRS:
        root = tmp_path_factory.mktemp(f"{kind}-{arch}")
        spec = TinySpec(arch=arch, layers=4, hidden=64, intermediate=128, seed=1)
        target = ensure_model(root / "target", spec)
        if kind == "mtp":  # its own head, in its own checkpoint
            target = write_mtp(root / "with-mtp", target, seed=2)
        reqs = _reqs(str(target))
        gen = ChatGenerator.get_or_create(str(target), cache=ModelCache(prefix_bytes=0))
        prompts = [prompt_tokens(gen.target.tokenizer, r) for r in reqs]
        if kind == "mtp":
            train_mtp(target, prompts, steps=60, new=48)
            drafter = "mtp"
        elif kind == "dflash":  # (whole blocks from states alone: slower to learn; the
            # Qwen3 pair's first proposal must be kept for the chi-square test's prompt)
            drafter = str(write_dflash(root / "dflash", target, seed=2))
            steps = 150 if arch == "qwen3" else 80
            train_dflash(Path(drafter), target, prompts, steps=steps, new=48, anchors=4)
        else:
            drafter = str(write_eagle3(root / "eagle3", target, seed=2))
            train_eagle3(Path(drafter), target, prompts, steps=60, new=48)
        _PAIRS[kind, arch] = Pair(kind, arch, str(target), drafter, reqs)
    return _PAIRS[kind, arch]


@pytest.fixture(scope="module", params=PAIRS, ids=["-".join(p) for p in PAIRS])
def pair(request, tmp_path_factory) -> Pair:
    return _pair(*request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Pair:
    """The llama pair, for what does not depend on the target's architecture."""
    return _pair("eagle3", "llama", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Pair:
    """The DFlash pair on Qwen3."""
    return _pair("dflash", "qwen3", tmp_path_factory)


def _gen(pair: Pair, drafter: bool = True) -> ChatGenerator:
    named = pair.drafter if drafter else None
    return ChatGenerator.get_or_create(pair.target, named, cache=ModelCache(prefix_bytes=0))


def _add(engine: SpecBatchEngine, gen: ChatGenerator, tag: int, req: ChatRequest) -> None:
    prompt = prompt_tokens(gen.target.tokenizer, req)
    engine.add(tag, Prepared(prompt, params_for(req, len(prompt), 512, 512, 3)))


def _batched(pair: Pair, gen: ChatGenerator, budget: int | None = None) -> dict:
    """Every request through one speculative batch with the drafter: three at first,
    one more joining every other round (others leave as they end)."""
    engine = SpecBatchEngine(gen.target, None, 3, prefill_budget=budget, drafter=gen.drafter)
    waiting, outs, rounds, sizes = list(enumerate(pair.reqs)), {}, 0, []
    for _ in range(3):
        _add(engine, gen, *waiting.pop(0))
    while len(engine) or waiting:
        sizes.append(len(engine))
        outs.update(engine.step().done)
        rounds += 1
        if waiting and rounds % 2 == 0:
            _add(engine, gen, *waiting.pop(0))
    assert max(sizes) >= 3
    return outs


def test_the_tap_records_the_layers_and_changes_nothing(pair):
    gen = _gen(pair, drafter=False)
    model = gen.target.model
    tokens = mx.array([prompt_tokens(gen.target.tokenizer, pair.reqs[3])])
    before = model(tokens)
    tap = Tap(model, [3, 0, 3])
    with tap:
        during = model(tokens)
    states = tap.take()
    assert states is not None and states.shape == (1, tokens.shape[1], 3 * 64)
    assert mx.array_equal(before, during)
    assert mx.array_equal(states[..., :64], states[..., 128:])  # layer 3 twice
    assert not mx.array_equal(states[..., :64], states[..., 64:128])
    model(tokens)  # closed: nothing recorded
    assert tap.take() is None
    if pair.arch == "llama":  # its last layer's output, normed, is what the logits read
        logits = model.model.embed_tokens.as_linear(model.model.norm(states[..., :64]))
        assert mx.allclose(logits, before, atol=1e-4)


@pytest.mark.parametrize("kind,arch", [("eagle3", "llama"), ("mtp", "qwen3_5")])
def test_proposals_are_what_mlx_vlms_own_drafter_proposes(kind, arch, tmp_path_factory):
    """The batched drafter state (``Rows``) against mlx-vlm's own drafter module driven
    its own way (prefill from the target's states, draft a block, accept verified tokens)
    over three rounds with made-up verdicts: the same proposals each round. (mlx-vlm's MTP
    head keeps the entries it drafted for the proposals a round keeps, where mlxq feeds
    them again with the target's states; rounds that keep none are compared there.)"""
    pair = _pair(kind, arch, tmp_path_factory)
    gen = _gen(pair)
    head = gen.drafter
    assert head is not None
    mtp = kind == "mtp"
    reference, _ = load_drafter(Path(pair.target if mtp else pair.drafter), own=mtp)
    reference.reset(gen.target.model)
    prompt = prompt_tokens(gen.target.tokenizer, pair.reqs[2])
    with head.tap:
        gen.target.model(mx.array([prompt]))
    states = head.tap.take()
    assert states is not None

    def theirs(s: mx.array) -> mx.array:  # (mlx-vlm's MTP reads the normed last state)
        return head.from_target(s) if mtp else s

    bonus, k = 7, 3
    reference.prefill_from_target_hidden(
        mx.array([prompt]), theirs(states), bonus, None, mx.uint32, greedy=True
    )
    rows = head.rows().add(1)
    rows.feed(states, [[*prompt[1:], bonus]])
    for r, verdict in enumerate((0, 0, 0) if mtp else (0, 3, 1)):  # drafts kept
        want = reference.draft_block(bonus, None, None, k + 1, None, mx.uint32, greedy=True)
        got = rows.propose(k)
        assert got.tolist() == want.tolist()
        verify = mx.random.normal((1, k + 1, states.shape[-1]), key=mx.random.key(r))
        kept = [*got[0, :verdict].tolist(), 11 + r]
        reference.accept_verified_tokens(theirs(verify), want, verdict, kept, None, mx.uint32, True)
        rows.feed(verify, [kept])
        bonus = kept[-1]


def test_dflash_blocks_are_what_mlx_vlms_own_drafter_proposes(qwen3):
    """Two rows of different lengths in one batch (the shorter left-padded) against
    mlx-vlm's own DFlash drafter driven its own way, a row at a time (context from the
    target's states, a block of the bonus token and masks, the kept tokens' states as
    the next round's context) over three rounds with made-up verdicts: the same blocks
    each round, and the batch's caches hold only context (the blocks' entries trimmed)."""
    pair = qwen3
    gen = _gen(pair)
    head = gen.drafter
    assert head is not None
    prompts = [prompt_tokens(gen.target.tokenizer, pair.reqs[i]) for i in (1, 4)]
    assert len(prompts[0]) < len(prompts[1])
    refs, hidden, caches, bonus = [], [], [], []
    for prompt in prompts:
        with head.tap:
            gen.target.model(mx.array([prompt]))
        states = head.tap.take()
        assert states is not None
        ref, _ = load_drafter(Path(pair.drafter))
        ref.reset(gen.target.model)
        refs.append(ref)
        caches.append(ref.make_cache())
        hidden.append(states[:, :-1])
        bonus.append(prompt[-1])
    rows = head.rows().add(2)
    width = max(h.shape[1] for h in hidden)
    padded = mx.concatenate(
        [mx.pad(h, [(0, 0), (0, width - h.shape[1]), (0, 0)]) for h in hidden], axis=0
    )
    rows.feed(padded, [p[1:] for p in prompts])
    k, fed = 3, [len(p) - 1 for p in prompts]

    def argmax(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    for r, verdicts in enumerate(((0, 2), (3, 0), (1, 1))):
        got = rows.propose(k).tolist()
        kept, states = [], []
        for i, ref in enumerate(refs):
            want = ref.draft_block(bonus[i], hidden[i], caches[i], k + 1, argmax, mx.uint32)
            assert got[i] == want[0].tolist(), (r, i)
            kept.append([*got[i][: verdicts[i]], 11 + r + i])
            states.append(mx.random.normal((1, k + 1, hidden[i].shape[-1]), key=mx.random.key(r)))
            hidden[i] = states[i][:, : verdicts[i] + 1]
            bonus[i] = kept[i][-1]
        rows.feed(mx.concatenate(states, axis=0), kept)
        fed = [n + v + 1 for n, v in zip(fed, verdicts, strict=True)]
        assert rows.caches is not None and rows.caches[0].offset.tolist() == fed


def test_greedy_text_alone_and_batched_is_the_plain_text(pair):
    """Alone, batched with joins and leaves, and batched under a prefill budget (prompts
    prefilled a chunk a round): each job's greedy text is the plain text, with some
    proposals kept and some not, and each row proposing and keeping what it did alone."""
    gen, plain_gen = _gen(pair), _gen(pair, drafter=False)
    plain = [plain_gen.generate(r) for r in pair.reqs]
    assert plain[-1].prompt_tokens + plain[-1].completion_tokens > 2 * WINDOW
    alone = [gen.generate(r, num_draft_tokens=3) for r in pair.reqs]
    kept = sum(o.draft_tokens_accepted for o in alone)
    assert 0 < kept < sum(o.draft_tokens_proposed for o in alone)
    for how, outs in (
        ("alone", dict(enumerate(alone))),
        ("batched", _batched(pair, gen)),
        ("budget", _batched(pair, gen, budget=8)),
    ):
        for i, r in enumerate(pair.reqs):
            if not _same_greedy(gen, r, outs[i].token_ids, plain[i].token_ids):
                continue  # parted at a tie: the counts after it are another text's
            counts = (outs[i].draft_tokens_proposed, outs[i].draft_tokens_accepted)
            assert counts == (alone[i].draft_tokens_proposed, alone[i].draft_tokens_accepted)
        assert sum(o.draft_tokens_accepted for o in outs.values()) > 0, how


def _agreeing(pair: Pair, gen: ChatGenerator) -> ChatRequest:
    """The first request whose drafter's first proposal is the target's greedy token (so
    that rows sampling it keep proposals often): the accept path is what is tested."""
    head, model = gen.drafter, gen.target.model
    assert head is not None
    for r in pair.reqs:
        prompt = prompt_tokens(gen.target.tokenizer, r)
        with head.tap:
            model(mx.array([prompt[:-1]]))
        rows = head.rows().add(1)
        rows.feed(head.tap.take(), [prompt[1:]])
        if rows.propose(1).item() == mx.argmax(model(mx.array([prompt]))[0, -1]).item():
            return r
    raise AssertionError("no request's first proposal is the target's greedy token")


def _chi2_quantile(p: float, df: int) -> float:
    """The chi-square distribution's ``p`` quantile (Wilson and Hilferty's approximation)."""
    z = {0.999: 3.090, 0.001: -3.090}[p]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("kind,arch", [("eagle3", "llama"), ("dflash", "qwen3")])
def test_sampled_tokens_keep_the_targets_distribution(kind, arch, tmp_path_factory):
    """400 rows sampling at temperature 0.3 in one batch, the drafter proposing three
    tokens a round: each row's second token (drawn at a verified position when the
    first proposal was kept, else at the next round) follows the target's own law,
    sum over t1 of p(t1) p(t2 | t1), by a chi-square test at 0.1%."""
    pair = _pair(kind, arch, tmp_path_factory)
    gen = _gen(pair)
    base = _agreeing(pair, gen).model_copy(update={"temperature": 0.3, "max_tokens": 2})
    engine = SpecBatchEngine(gen.target, None, 3, drafter=gen.drafter)
    n = 400
    for i in range(n):
        _add(engine, gen, i, base.model_copy(update={"seed": 1000 + i}))
    outs: dict = {}
    while len(engine):
        outs.update(engine.step().done)
    assert sum(o.draft_tokens_accepted for o in outs.values()) > 0
    seconds = [o.token_ids[1] for o in outs.values()]
    prompt = prompt_tokens(gen.target.tokenizer, base)
    model = gen.target.model
    p1 = mx.softmax(model(mx.array([prompt]))[0, -1] / 0.3).tolist()
    law = [0.0] * len(p1)
    for t1, q in enumerate(p1):
        if q > 1e-5:
            p2 = mx.softmax(model(mx.array([[*prompt, t1]]))[0, -1] / 0.3).tolist()
            law = [a + q * b for a, b in zip(law, p2, strict=True)]
    bins = [t for t in range(len(law)) if law[t] * n >= 5]
    observed = [seconds.count(t) for t in bins] + [sum(t not in bins for t in seconds)]
    expected = [law[t] * n for t in bins] + [n * (1 - sum(law[t] for t in bins))]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    df = len(bins)
    assert df >= 3
    assert stat < _chi2_quantile(0.999, df), (stat, df)


def test_a_drafter_for_another_target_or_of_another_family_is_refused_by_name(llama, tmp_path):
    """EAGLE-3 heads for another target, other drafter families, a drafter named as the
    model, and "mtp" on targets without MTP heads mlxq runs: each refused by name."""
    pair = llama
    narrow = ensure_model(tmp_path / "narrow", TinySpec(hidden=32, intermediate=64, seed=4))
    with pytest.raises(IncompatibleDraftError, match=r"\(eagle3\) cannot draft for.*narrow.*size"):
        ChatGenerator.get_or_create(str(narrow), pair.drafter, cache=ModelCache())
    wide = ensure_model(tmp_path / "wide", TinySpec(vocab=400, seed=4))
    with pytest.raises(IncompatibleDraftError, match="vocabulary has 512 tokens, the target's 400"):
        ChatGenerator.get_or_create(str(wide), pair.drafter, cache=ModelCache())
    with pytest.raises(ModelKindError, match="is a drafter"):
        ChatGenerator.get_or_create(pair.drafter, cache=ModelCache())
    dflash = tmp_path / "dflash"
    dflash.mkdir()
    config = json.loads((Path(pair.drafter) / "config.json").read_text())
    del config["speculators_model_type"]
    (dflash / "config.json").write_text(json.dumps(config | {"model_type": "qwen3_dspark"}))
    with pytest.raises(Exception, match="qwen3_dspark drafter: mlxq runs EAGLE-3"):
        ChatGenerator.get_or_create(pair.target, str(dflash), cache=ModelCache())
    # "mtp": the target's own heads, refused by name where it has none mlxq runs
    with pytest.raises(Exception, match="model_type 'llama': mlxq runs the MTP heads of"):
        ChatGenerator.get_or_create(pair.target, "mtp", cache=ModelCache())
    qwen = ensure_model(tmp_path / "qwen", TinySpec(arch="qwen3_5", layers=4, seed=4))
    with pytest.raises(Exception, match="declares no MTP layers"):
        ChatGenerator.get_or_create(str(qwen), "mtp", cache=ModelCache())


def test_a_dflash_drafter_for_another_target_or_shape_is_refused_by_name(qwen3, tmp_path):
    """A DFlash drafter on a target of another depth, on a Gemma target (its embedding
    scaled), with sliding layers, of another block family (DFlash2), or named as the
    model: each refused by name."""
    pair = qwen3
    deep = ensure_model(tmp_path / "deep", TinySpec(arch="qwen3", layers=6, seed=4))
    with pytest.raises(
        IncompatibleDraftError, match=r"\(qwen3_dflash\) cannot draft.*of 4 layers.* has 6"
    ):
        ChatGenerator.get_or_create(str(deep), pair.drafter, cache=ModelCache())
    gemma = ensure_model(tmp_path / "gemma", TinySpec(arch="gemma3_text", layers=4, seed=4))
    with pytest.raises(IncompatibleDraftError, match="gemma3_text target scales its embedding"):
        ChatGenerator.get_or_create(str(gemma), pair.drafter, cache=ModelCache())
    with pytest.raises(ModelKindError, match="is a drafter"):
        ChatGenerator.get_or_create(pair.drafter, cache=ModelCache())
    config = json.loads((Path(pair.drafter) / "config.json").read_text())
    for name, change, why in (
        ("sliding", {"layer_types": ["sliding_attention"] * 2, "sliding_window": 8}, "full-att"),
        ("dflash2", {"architectures": ["DFlash2DraftModel"]}, "a dflash2 drafter: mlxq runs"),
    ):
        other = tmp_path / name
        other.mkdir()
        (other / "config.json").write_text(json.dumps(config | change))
        (other / "model.safetensors").write_bytes(
            (Path(pair.drafter) / "model.safetensors").read_bytes()
        )
        with pytest.raises(Exception, match=why):
            ChatGenerator.get_or_create(pair.target, str(other), cache=ModelCache())


#: The worker-level test's pairs: each kind once, each cache type once (every pair runs
#: the engine-level tests above).
WORKER_PAIRS = (("eagle3", "gemma3_text"), ("mtp", "qwen3_5"), ("dflash", "qwen3"))


@pytest.mark.parametrize("kind,arch", WORKER_PAIRS, ids=["-".join(p) for p in WORKER_PAIRS])
def test_a_worker_runs_drafter_jobs_alone_and_batched(
    conn, redis_url, kind, arch, tmp_path_factory
):
    """Through Redis and a real worker: alone and batched (``--speculative always``), and
    under ``auto`` (which measures the drafter as it measures a draft model), with a
    schema, logprobs, a stop string and n = 2 among them: each record's text (each
    choice's) is the plain job's; speculative records name the method and the drafter's
    acceptance (the n = 2 job's choices speculate as rows of a speculative batch, and
    decode as one plain batch alone)."""
    pair = _pair(kind, arch, tmp_path_factory)
    jobs = {
        f"j{i}": r.model_dump(exclude_none=True) | {"draft_model": pair.drafter}
        for i, r in enumerate(pair.reqs)
    }
    jobs["j1"] |= {"logprobs": True, "top_logprobs": 2}
    jobs["j2"] |= {"stop": ["job"]}
    jobs["j3"] |= {"response_format": schema_format()}
    jobs["j4"] |= {"n": 2}
    plain = run_jobs(
        conn,
        redis_url,
        {c: {k: v for k, v in j.items() if k != "draft_model"} for c, j in jobs.items()},
        f"eagle-plain-{pair.arch}",
        4,
        SpeculationPolicy("never"),
    )
    for how, size in (("auto", 4), ("alone", 1), ("batched", 4)):
        policy = SpeculationPolicy("auto" if how == "auto" else "always")
        runs = run_jobs(conn, redis_url, jobs, f"eagle-{how}-{pair.arch}", size, policy)
        for cid, rec in runs.items():
            assert rec.status == "succeeded", (how, cid, rec.error)
            texts = [c.message.content for c in rec.response.choices]
            assert texts == [c.message.content for c in plain[cid].response.choices], (how, cid)
        assert len(runs["j4"].response.choices) == 2
        if how == "auto":
            continue
        assert sum(r.metrics.draft_tokens_accepted or 0 for r in runs.values()) > 0, how
        # (alone, the n = 2 job's choices decode as one plain batch; in a speculative
        # batch they are rows like the others)
        methods = {r.metrics.speculation_method for c, r in runs.items() if c != "j4"}
        assert methods == {pair.kind}
        j4 = runs["j4"].metrics
        assert j4.speculation_method == (pair.kind if how == "batched" else None), how
        if how == "batched":
            assert max(r.metrics.batch_size for r in runs.values()) > 1


def test_a_job_whose_drafter_its_target_cannot_use_ends_failed_and_the_rest_run(
    conn, redis_url, llama
):
    """``"mtp"`` on a target without MTP layers, alone and batched: one failed record
    naming why, never held; the other jobs (the same target with its EAGLE-3 head) run."""
    bad = chat(llama.target, "queue worker", max_tokens=8, temperature=0, draft_model="mtp")
    good = llama.reqs[0].model_dump(exclude_none=True) | {"draft_model": llama.drafter}
    jobs = {"bad": bad, "good": good, "good2": good}
    for size in (1, 4):
        runs = run_jobs(
            conn, redis_url, jobs, f"bad-drafter-{size}", size, SpeculationPolicy("always")
        )
        assert runs["bad"].status == "failed", runs["bad"]
        assert "mlxq runs the MTP heads of" in runs["bad"].error.message
        assert runs["good"].status == runs["good2"].status == "succeeded", size


def test_a_chat_model_mlx_lm_knows_is_never_taken_for_a_drafter():
    """mlx-vlm's table of drafter types also lists ``laguna``, a chat model mlx-lm runs:
    a type mlx-lm implements is a chat model."""
    from worker.engine.drafters import drafter_type

    assert drafter_type({"model_type": "laguna"}) is None
    assert drafter_type({"model_type": "llama"}) is None
    assert drafter_type({"model_type": "qwen3_dspark"}) == "qwen3_dspark"
    assert drafter_type({"model_type": "x", "speculators_model_type": "eagle3"}) == "eagle3"
    assert drafter_type({"model_type": "not a type"}) is None
    # a DFlash drafter declares a chat model's type, and a dflash_config
    dflash = {"model_type": "qwen3", "dflash_config": {"mask_token_id": 1}}
    assert drafter_type(dflash) == "qwen3_dflash"
    assert drafter_type(dflash | {"dflash_config": {"projector_type": "dspark"}}) == "dspark"
    assert drafter_type({"model_type": "qwen3", "dflash_config": None}) is None


@pytest.mark.parametrize("kind,arch", [("eagle3", "llama"), ("dflash", "qwen3")])
def test_the_drafters_kv_caches_are_counted(kind, arch, tmp_path_factory):
    """What a drafter's caches hold per token is in its profile, and a job alone or a
    lane reserves it beside the target's."""
    from worker.engine.layers import nbytes
    from worker.runner.alone import _reserved_models

    gen = _gen(_pair(kind, arch, tmp_path_factory))
    assert gen.drafter is not None and gen.drafter_entry is not None
    rows = gen.drafter.rows().add(2)
    rows.feed(mx.zeros((2, 10, 3 * 64)), [[1] * 10, [2] * 7])
    allocated = rows.caches[0].keys.shape[2]
    assert gen.drafter_entry.kv.per_token * allocated * 2 == nbytes(rows.caches) > 0
    assert _reserved_models(gen, True, False) == [gen.target, gen.drafter_entry]
    assert _reserved_models(gen, True, True) == [gen.target]  # (prompt lookup instead)


def test_an_mtp_pairs_figures_are_shared_by_name():
    """A fleet shares speculation figures per (target identity, proposer identity): the
    "mtp" proposer has no weights of its own to identify, so its identity is its name
    (the target's identity scopes it), never a look-up that finds no checkpoint."""
    from worker.schedule.shared import proposer_id

    def identify(name: str) -> str | None:
        raise AssertionError(f"looked up {name!r}")

    assert proposer_id("mtp", identify) == "mtp"
    assert proposer_id("/models/eagle3", lambda name: f"id:{name}") == "id:/models/eagle3"


def test_a_worker_group_refuses_drafters_by_name(llama):
    """A worker group (``--shard``) does not run drafters yet: binding one there fails
    with an error that says so and names the other ways to speculate."""
    from worker.engine.generator import bind

    cache = ModelCache(prefix_bytes=0)
    gen = ChatGenerator.get_or_create(llama.target, llama.drafter, cache=cache)
    assert gen.drafter_entry is not None
    cache.group = object()  # type: ignore[assignment]  # (a group's rank holds one)
    with pytest.raises(IncompatibleDraftError, match=r"\(eagle3\): a worker group does not"):
        bind(cache, gen.target, gen.drafter_entry)
