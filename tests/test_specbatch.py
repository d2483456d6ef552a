"""Speculative decoding inside continuous batches: the same greedy output and the same
acceptance counts as each job speculating alone, whoever shares the batch."""

from __future__ import annotations

import json

import pytest

from producer import Client
from schemas import ChatRequest, keys
from tests.conftest import chat, run_jobs
from tests.models import noisy_copy, with_eos
from tests.test_logprobs import _close
from tests.test_structured import SCHEMA, schema_format
from tests.waiting import seconds
from worker.engine import Prepared, Start, params_for, prompt_tokens
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.protocol import CannotTake
from worker.engine.specbatch import SpecBatchEngine
from worker.schedule.goodput import Goodput
from worker.schedule.policy import Decision, SpeculationPolicy

K = 3


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory) -> tuple[str, str]:
    """The tiny target with an extra EOS on a common token (sequences end at different
    rounds), and a noisy copy of it as the draft (acceptance about 0.5-0.7)."""
    root = tmp_path_factory.mktemp("spec")
    gen = ChatGenerator.get_or_create(tiny.target, cache=ModelCache())
    probe = gen.generate(
        ChatRequest.model_validate(chat(tiny.target, max_tokens=60, temperature=0))
    )
    common = max(set(probe.token_ids), key=probe.token_ids.count)
    target = with_eos(tiny.target, root / "target-eos", common)
    return target, noisy_copy(tiny.target, root / "noisy", 0.01)


def _requests(target: str, n: int, **fields) -> list[ChatRequest]:
    return [
        ChatRequest.model_validate(
            chat(
                target,
                content=f"prompt {i} " + "queue worker " * (i % 4),
                max_tokens=8 + 9 * (i % 5),
                temperature=0,
                stop=[". "] if i % 3 == 2 else None,
                **fields,
            )
        )
        for i in range(n)
    ]


def test_engine_equals_speculating_alone_with_joins_leaves_stops_and_eos(pair):
    target, draft = pair
    gen = ChatGenerator.get_or_create(target, draft, cache=ModelCache())
    reqs = _requests(target, 9)
    alone = [gen.generate(r, num_draft_tokens=K) for r in reqs]
    engine = SpecBatchEngine(gen.target, gen.draft, K)
    outs, sizes = _run_engine(engine, gen, reqs)
    assert max(sizes) >= 4 and len(set(sizes)) > 2
    assert {o.finish_reason for o in outs.values()} == {"stop", "length"}
    eos = gen.target.tokenizer.eos_token_ids
    assert any(o.token_ids[-1] in eos for o in outs.values())  # ended by EOS
    assert any(o.finish_reason == "stop" and o.token_ids[-1] not in eos for o in outs.values())
    for i, a in enumerate(alone):
        b = outs[i]
        assert (b.text, b.finish_reason, b.token_ids) == (a.text, a.finish_reason, a.token_ids), i
        assert (b.draft_tokens_proposed, b.draft_tokens_accepted) == (
            a.draft_tokens_proposed,
            a.draft_tokens_accepted,
        ), i
    accepted = sum(o.draft_tokens_accepted for o in outs.values())
    proposed = sum(o.draft_tokens_proposed for o in outs.values())
    assert 0.2 < accepted / proposed < 0.95  # a draft that is right only some of the time


class _Adaptive(SpeculationPolicy):
    """``always``, with its speculative batches choosing each round's k (what auto runs
    when it picks a speculative batch)."""

    def __init__(self) -> None:
        super().__init__("always")

    def batch_instead(self, *args, **kwargs) -> Decision | None:
        decision = super().batch_instead(*args, **kwargs)
        if decision is None or not decision.speculative:
            return decision
        return Decision(4, "test: k per round, up to 4", adaptive=True)


def _alone_and_batched(
    conn, redis_url, jobs: dict, name: str, batched: type[SpeculationPolicy] | None = None
) -> dict[str, dict]:
    """``jobs`` under ``--speculative always``: one at a time, then batched (up to 4;
    under ``batched``'s policy if given)."""
    runs = {
        how: run_jobs(conn, redis_url, jobs, f"{name}-{how}", size, policy())
        for how, size, policy in (
            ("alone", 1, lambda: SpeculationPolicy("always")),
            ("batched", 4, batched or (lambda: SpeculationPolicy("always"))),
        )
    }
    assert max(r.metrics.batch_size for r in runs["batched"].values()) > 1
    assert all(r.status == "succeeded" for run in runs.values() for r in run.values())
    return runs


def test_worker_runs_draft_jobs_in_a_speculative_batch(conn, redis_url, pair):
    target, draft = pair
    jobs = {
        f"j{i}": r.model_dump(exclude_none=True)
        for i, r in enumerate(_requests(target, 8, draft_model=draft))
    }
    runs = _alone_and_batched(conn, redis_url, jobs, "plain")
    for cid, a in runs["alone"].items():
        b = runs["batched"][cid]
        assert b.metrics.speculative and "speculative batch at k=3" in b.metrics.speculation_reason
        assert b.response.choices[0].message.content == a.response.choices[0].message.content
        assert b.metrics.draft_tokens_accepted == a.metrics.draft_tokens_accepted
        assert b.metrics.draft_tokens_proposed == a.metrics.draft_tokens_proposed


@pytest.mark.parametrize("adaptive", [False, True])
def test_schema_and_logprobs_in_a_speculative_batch(conn, redis_url, tiny, pair, adaptive):
    """Fixed k, and k per round with an unrelated draft (mostly plain rounds, a probe
    every few, the draft catching up through the JSON mask): the same constrained text
    and logprobs as alone."""
    draft = tiny.draft if adaptive else pair[1]
    body = {
        "max_tokens": 120,
        "temperature": 0,
        "draft_model": draft,
        "response_format": schema_format(),
        "logprobs": True,
        "top_logprobs": 2,
    }
    jobs = {f"c{i}": chat(tiny.target, content=f"thing {i} " * (i + 1), **body) for i in range(4)}
    runs = _alone_and_batched(
        conn, redis_url, jobs, f"fmt-{adaptive}", _Adaptive if adaptive else None
    )
    for cid, a in runs["alone"].items():
        b = runs["batched"][cid]
        assert ("k per round" in b.metrics.speculation_reason) is adaptive
        choice = b.response.choices[0]
        assert choice.message.content == a.response.choices[0].message.content
        if choice.finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        _close(choice.logprobs.content, a.response.choices[0].logprobs.content)


def test_a_model_with_caches_that_cannot_be_batched_is_refused(tiny):
    from mlx_lm.models.cache import QuantizedKVCache

    gen = ChatGenerator.get_or_create(tiny.target, tiny.twin, cache=ModelCache())
    engine = SpecBatchEngine(gen.target, gen.draft, K)
    req = _requests(tiny.target, 1)[0]
    prompt = prompt_tokens(gen.target.tokenizer, req)
    quantized = [QuantizedKVCache() for _ in gen.target.model.layers]
    with pytest.raises(CannotTake, match="QuantizedKVCache"):
        engine.add("x", Prepared(prompt, params_for(req, len(prompt), 512, 512)), Start(quantized))
    assert len(engine) == 0


def test_a_model_as_its_own_draft(conn, redis_url, tiny):
    """One loaded model as target and draft (separate caches): every proposal accepted."""
    jobs = {
        f"j{i}": chat(tiny.target, content=f"self {i}", max_tokens=20 + i, temperature=0)
        | {"draft_model": tiny.target, "logit_bias": {"3": -100}}
        for i in range(3)
    }
    runs = _alone_and_batched(conn, redis_url, jobs, "self")
    for cid, a in runs["alone"].items():
        b = runs["batched"][cid]
        assert b.response.choices[0].message.content == a.response.choices[0].message.content
        assert b.metrics.acceptance_rate == 1.0


def _run_engine(
    engine: SpecBatchEngine, gen: ChatGenerator, reqs: list[ChatRequest]
) -> tuple[dict, list[int]]:
    """Every request through ``engine``, four at first, two joining every other round
    (others have left meanwhile); the outputs and the batch's size at each round."""
    outs, sizes, waiting = {}, [], list(enumerate(reqs))

    def join(count: int) -> None:
        for _ in range(min(count, len(waiting))):
            i, r = waiting.pop(0)
            prompt = prompt_tokens(gen.target.tokenizer, r)
            engine.add(i, Prepared(prompt, params_for(r, len(prompt), 512, 512, K)))

    join(4)
    while len(engine) or waiting:
        sizes.append(len(engine))
        for tag, out in engine.step().done:
            outs[tag] = out
        if len(sizes) % 2 == 0:
            join(2)
    return outs, sizes


@pytest.mark.parametrize("which", ["noisy", "unrelated", "twin"])
def test_adaptive_k_keeps_every_greedy_output(pair, tiny, which):
    """Each round's k chosen by measured goodput (0 = a plain step, the draft catches up
    later): the same greedy text as decoding alone, whatever k each round ran. A draft
    that never agrees ends up plain. (Which k pays for a good draft is the unit tests'
    business: here target and drafts are the same size, so drafting rarely pays.)"""
    target, noisy = pair
    draft = {"noisy": noisy, "unrelated": tiny.draft, "twin": target}[which]
    gen = ChatGenerator.get_or_create(target, draft, cache=ModelCache())
    reqs = _requests(target, 9)
    alone = [gen.generate(r, use_draft=False) for r in reqs]
    engine = SpecBatchEngine(gen.target, gen.draft, 4, planner=Goodput(4))
    outs, _ = _run_engine(engine, gen, reqs)
    for i, a in enumerate(alone):
        b = outs[i]
        assert (b.text, b.finish_reason, b.token_ids) == (a.text, a.finish_reason, a.token_ids), i
    assert isinstance(engine.planner, Goodput)
    chosen = engine.planner.chosen
    assert chosen.get(0) and chosen.get(4)  # both ends measured
    rounds = sum(chosen.values())
    accepted = sum(o.draft_tokens_accepted for o in outs.values())
    proposed = sum(o.draft_tokens_proposed for o in outs.values())
    if which == "unrelated":
        assert chosen[0] > 0.7 * rounds and accepted < 0.2 * proposed
    if which == "twin":
        assert accepted >= 0.9 * proposed  # all but proposals past an EOS


@pytest.mark.parametrize("kind", ["plain", "draft", "lookup", "eagle3", "dflash"])
def test_streamed_jobs_share_batches_and_stream_what_their_records_hold(
    conn, redis_url, pair, kind, tmp_path
):
    """Streamed jobs join batches (plain, a draft's speculative batch, prompt lookup's, an
    EAGLE-3 or DFlash drafter's) with jobs that do not stream: each record's text is the
    text unstreamed (greedy), and each stream's pieces concatenate to it and end with its
    usage. Before, a streamed job always ran alone."""
    from worker.dev.tinydrafters import write_dflash, write_eagle3

    target, draft = pair
    fields = {
        "draft": {"draft_model": draft},
        "lookup": {"speculation": {"method": "prompt_lookup", "num_tokens": 3}},
        "eagle3": {"draft_model": str(write_eagle3(tmp_path / "eagle3", target))},
        "dflash": {"draft_model": str(write_dflash(tmp_path / "dflash", target))},
    }.get(kind, {})
    jobs = {
        f"j{i}": r.model_dump(exclude_none=True)
        for i, r in enumerate(_requests(target, 6, **fields))
    }
    mode = "always" if fields else "never"
    plain = run_jobs(conn, redis_url, jobs, f"unstreamed-{kind}", 6, SpeculationPolicy(mode))
    streamed = ("j0", "j2", "j5")
    for c in streamed:
        jobs[c]["stream"] = True
    got = run_jobs(conn, redis_url, jobs, f"streamed-{kind}", 6, SpeculationPolicy(mode))
    for c, r in got.items():
        assert r.status == "succeeded", (c, r.error)
        assert r.response.choices[0].message.content == plain[c].response.choices[0].message.content
        assert r.metrics.batch_size > 1, c
        assert r.metrics.speculative is bool(fields), c
    client = Client(connection=conn)
    for c in streamed:
        record = got[c]
        pieces = list(client.stream(record.job_id, timeout=seconds(10)))
        assert "".join(pieces) == record.response.choices[0].message.content, c
        raw = [json.loads(f[b"chunk"]) for _, f in conn.xrange(keys.stream_key(record.job_id))]
        assert {chunk["id"] for chunk in raw} == {record.response.id}
        assert raw[-1]["usage"] == record.response.usage.model_dump()
