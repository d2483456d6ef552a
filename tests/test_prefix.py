"""The prefix cache: shared system prompts are prefilled once, outputs do not change.

Real Redis, real workers, tiny real models. Each path a job can take (alone,
batched, speculative, streamed) runs the same jobs with the cache and without
it (``--prefix-cache-gb 0``) and must give the same text.
"""

from __future__ import annotations

import signal

import mlx.core as mx
import pytest
from click.testing import CliRunner

from producer import Client
from producer.cli import main as producer_main
from schemas import ChatRequest
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.templates import FAMILIES, with_template
from tests.waiting import seconds
from worker.engine import prompt_tokens
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.prefill import prefill
from worker.engine.prefix import (
    BLOCK,
    MIN_TOKENS,
    PrefixCache,
    cache_nbytes,
    common_prefix,
    restore,
    snapshot,
)
from worker.engine.protocol import drive
from worker.runner import runtime
from worker.runner.alone import generate_reserved
from worker.schedule.admission import batch_peak_bytes
from worker.schedule.policy import SpeculationPolicy

SYSTEM = "You grade queue worker logs for a fleet of small machines. Be terse. " * 6


def with_system(model: str, user: str, system: str = SYSTEM, **fields) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": model, "messages": messages, "temperature": 0, **fields}


def run(conn, redis_url, bodies, *, prefix_gb: float = 1.0, max_batch: int = 1, policy=None):
    cache = ModelCache(prefix_bytes=int(prefix_gb * 1e9))
    rt = runtime.WorkerRuntime(cache=cache, policy=policy or SpeculationPolicy("always"))
    s = Client(connection=conn).submit(bodies)
    run_worker(redis_url, runtime=rt, max_batch=max_batch)
    return [read_result(conn, j) for j in s.job_ids], rt


PATHS = {
    "alone": ({}, 1),
    "batched": ({}, 4),
    "speculative": ({"draft": True}, 1),
    "streamed": ({"stream": True}, 4),
    "penalties, batched": ({"frequency_penalty": 0.8, "presence_penalty": 0.5}, 4),
    "penalties, alone": ({"frequency_penalty": 0.8}, 1),
}


@pytest.mark.parametrize("path", PATHS)
def test_same_output_with_and_without_the_cache_and_cached_tokens_say_so(
    conn, redis_url, tiny, path
):
    fields, max_batch = PATHS[path]
    fields = dict(fields)
    if fields.pop("draft", False):
        fields |= {"draft_model": tiny.twin, "num_draft_tokens": 3}
    users = ["first log line", "a second, longer log line to grade", "third", "fourth!"]
    bodies = [with_system(tiny.target, u, max_tokens=12, **fields) for u in users]
    off, _ = run(conn, redis_url, bodies, prefix_gb=0, max_batch=max_batch)
    on, rt = run(conn, redis_url, bodies, max_batch=max_batch)
    for a, b in zip(off, on, strict=True):
        assert a.status == b.status == "succeeded", (a.error, b.error)
        assert b.response.choices[0].message.content == a.response.choices[0].message.content
        assert b.response.usage.prompt_tokens == a.response.usage.prompt_tokens
        assert a.response.usage.prompt_tokens_details.cached_tokens == 0
    cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in on]
    assert [r.metrics.cached_tokens for r in on] == cached
    shared = max(cached)
    assert cached[0] == 0 and shared >= MIN_TOKENS  # the first job prefilled it for all
    assert shared < min(r.response.usage.prompt_tokens for r in on)
    if path == "penalties, alone":  # mlx-lm's penalties see only what is prefilled:
        window = 12  # the window (max_tokens) stays out of the cache
        expected = [min(shared, r.response.usage.prompt_tokens - window) for r in on[1:]]
        assert cached[1:] == expected and min(expected) < shared
    else:  # the second job may extend the first's entry (by the next turn's marker)
        assert all(shared - BLOCK < c <= shared for c in cached[1:]) and cached[-1] == shared
    stats = rt.cache.prefixes.stats
    assert (stats.lookups, stats.hits, stats.tokens_reused) == (4, 3, sum(cached))
    models = 2 if "draft_model" in fields else 1  # a speculative job keeps the draft's too
    assert len(rt.cache.prefixes) == models
    if "speculative" in path:
        assert all(r.metrics.speculative and r.metrics.acceptance_rate == 1.0 for r in on)
    if max_batch > 1 and "stream" not in fields:
        assert max(r.metrics.batch_size for r in on) > 1


def test_a_seeded_job_samples_the_same_text_cached_or_not(conn, redis_url, tiny):
    body = with_system(tiny.target, "sample me", max_tokens=16, seed=7) | {"temperature": 0.9}
    off, _ = run(conn, redis_url, [body])
    warm, _ = run(conn, redis_url, [with_system(tiny.target, "warm the prefix"), body])
    assert warm[1].response.usage.prompt_tokens_details.cached_tokens > 0
    text = off[0].response.choices[0].message.content
    assert warm[1].response.choices[0].message.content == text


def test_short_prefixes_are_not_kept_and_a_repeated_prompt_is(conn, redis_url, tiny):
    short = [with_system(tiny.target, f"hi {i}", system="Be brief.", max_tokens=3) for i in (1, 2)]
    records, rt = run(conn, redis_url, short)
    assert [r.response.usage.prompt_tokens_details.cached_tokens for r in records] == [0, 0]
    assert len(rt.cache.prefixes) == 0 and rt.cache.prefixes.nbytes == 0
    # The same single-message prompt twice: the second starts from the first's (all of
    # it but the last token), whatever the messages.
    same = [chat(tiny.target, content="only a user turn " * 20, max_tokens=3, temperature=0)] * 2
    records, rt = run(conn, redis_url, same)
    cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in records]
    assert cached == [0, records[1].response.usage.prompt_tokens - 1]
    assert len(rt.cache.prefixes) == 1


def _entry(cache: ModelCache, model: str, system: str):
    gen = ChatGenerator.get_or_create(model, cache=cache)
    req = ChatRequest.model_validate(with_system(model, "x", system=system, max_tokens=2))
    drive(generate_reserved(gen, gen.prepare(req)))  # as a worker runs it: its KV reserved
    return gen


def test_the_byte_budget_holds_under_many_distinct_prefixes(tiny):
    one = ModelCache()
    _entry(one, tiny.target, SYSTEM)
    size = one.prefixes.nbytes
    budget = int(size * 2.5)  # room for two entries of this size
    cache = ModelCache(prefix_bytes=budget)
    for i in range(6):
        _entry(cache, tiny.target, f"Variant {i}. " + SYSTEM)
        assert cache.prefixes.nbytes <= budget
        assert cache.prefixes.nbytes == sum(
            cache_nbytes(e.layers) for e in cache.prefixes.entries()
        )
        assert len(cache.prefixes) == min(i + 1, 2)
    # The most recent prefixes are the ones kept.
    again = ChatRequest.model_validate(with_system(tiny.target, "y", system="Variant 5. " + SYSTEM))
    out = ChatGenerator.get_or_create(tiny.target, cache=cache).generate(again)
    assert out.cached_tokens > MIN_TOKENS


def _job_kv(cache: ModelCache, model: str) -> int:
    """KV bytes an :func:`_entry` job needs: the budget must leave them free too."""
    entry = cache.get(model)[0]
    req = ChatRequest.model_validate(with_system(model, "x", max_tokens=2))
    return batch_peak_bytes(entry.kv, [(len(prompt_tokens(entry.tokenizer, req)), 2)])


def test_a_models_prefixes_go_with_it_and_go_first_when_room_is_needed(tiny):
    probe = ModelCache()
    target_bytes = probe.get(tiny.target)[0].nbytes
    draft_bytes = probe.get(tiny.draft)[0].nbytes
    kv = _job_kv(probe, tiny.target)
    _entry(probe, tiny.target, SYSTEM)
    prefix_bytes = probe.prefixes.nbytes
    cache = ModelCache(budget_bytes=target_bytes + prefix_bytes + kv)
    _entry(cache, tiny.target, SYSTEM)
    assert len(cache.prefixes) == 1
    # Room for both models, or for the target and its prefix: not for all three.
    cache.budget_bytes = target_bytes + draft_bytes + prefix_bytes // 2
    cache.get(tiny.draft)  # needs room: the prefix goes, not the target
    assert len(cache.prefixes) == 0 and (tiny.target, None) in cache
    assert cache.used_bytes <= cache.budget_bytes
    cache.budget_bytes += kv  # room for the job's KV cache, not for its prefix besides
    _entry(cache, tiny.target, SYSTEM)  # no room left for a prefix: the job runs without
    assert len(cache.prefixes) == 0 and cache.used_bytes <= cache.budget_bytes
    # Room for one model of the target's size, its prefix and a job: a second such
    # model evicts the target, and no prefix of it is left behind.
    small = ModelCache(budget_bytes=target_bytes + prefix_bytes + kv + 1000)
    _entry(small, tiny.target, SYSTEM)
    assert len(small.prefixes) == 1
    small.get(tiny.twin)
    assert (tiny.target, None) not in small and len(small.prefixes) == 0
    assert small.used_bytes <= small.budget_bytes
    _entry(small, tiny.twin, SYSTEM)
    small.evict_all()  # evicting a model drops its prefixes, whatever the budget
    assert len(small.prefixes) == 0 and small.prefixes.nbytes == 0


def test_kept_entries_are_compact_and_never_change(tiny):
    gen = ChatGenerator.get_or_create(tiny.target, cache=ModelCache())
    tokens = list(range(5, 5 + 300))
    full = prefill(gen.target.model, tokens)
    kept = snapshot(full, 300)
    assert kept is not None and all(c.keys.shape[2] == 300 for c in kept)  # not the 512 buffer
    store = PrefixCache(10**9)
    assert store.put(("m", None), tokens, kept, room=10**9)
    before = [c.keys.tolist() for c in kept]
    entry, n = store.match(("m", None), [*tokens, 1, 2, 3])
    assert n == 300
    job = restore(entry.layers, 200)  # a job that shares only 200 tokens, then goes on
    gen.target.model(mx.array([[7, 8, 9]]), cache=job)
    assert [c.keys.tolist() for c in entry.layers] == before
    assert job[0].offset == 203


def test_fleet_shows_the_prefix_cache(conn, redis_url, tiny, workers):
    w = workers("--max-batch", "1", name="pc")
    client = Client(connection=conn)
    s = client.submit([with_system(tiny.target, f"job {i}", max_tokens=2) for i in range(3)])
    client.wait(s.batch_id, timeout=seconds(60))
    from tests.waiting import wait_for

    info = wait_for(lambda: (f := client.fleet()) and f[0].prefix_cache.hits == 2 and f[0])
    pc = info.prefix_cache
    assert (pc.entries, pc.lookups, pc.budget_mb) == (1, 3, 1000.0)
    assert 0 < pc.used_mb <= pc.budget_mb and pc.hit_rate == pytest.approx(2 / 3)
    url = redis_url
    out = CliRunner().invoke(producer_main, ["fleet", "--redis-url", url]).output
    assert "prefix cache: 1 prefix(es)" in out and "hit rate 67% (2/3 jobs)" in out
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def test_an_adapter_never_reuses_its_base_models_prefix(conn, redis_url, tiny, tmp_path):
    from tests.models import write_lora_adapter

    adapter = write_lora_adapter(tiny.target, tmp_path / "lora", seed=3)
    base = with_system(tiny.target, "same item", max_tokens=10)
    tuned = base | {"adapter": adapter}
    alone, _ = run(conn, redis_url, [tuned], prefix_gb=0)
    records, rt = run(conn, redis_url, [base, tuned, tuned])
    cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in records]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0  # its own entry, not the base's
    assert records[1].response.choices[0].message.content == (
        alone[0].response.choices[0].message.content
    )
    assert len(rt.cache.prefixes) == 2


# -- prefixes on tokens, whatever the chat template -------------------------------------

DOC = "Contract. " + "The worker leases a job, runs it and writes its record once. " * 8


def _shaped(model: str, i: int, shape: str) -> dict:
    """A job of the group: a shared system prompt, or a shared document heading its only
    user message (the commonest extraction shape: no message boundary at all)."""
    if shape == "system":
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"item {i}"}]
    else:
        messages = [{"role": "user", "content": f"{DOC}\n\nQuestion {i}: what does it say?"}]
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": 6}


@pytest.mark.parametrize("family", FAMILIES)
def test_what_jobs_share_is_reused_whatever_the_template(conn, redis_url, tiny, tmp_path, family):
    """Gemma folds the system prompt into the first user turn, Gemma 2 has none, Mistral
    v0.3 and Tekken move it to the last user turn, v7 and ChatML render it on its own: on
    every one, every job after the first starts from what the group shares (the first
    one, seeing the next in the queue, prefilled it once), with the text unchanged."""
    template, takes_system = FAMILIES[family]
    model = with_template(tiny.target, tmp_path / family, template)
    for shape in ("system", "document") if takes_system else ("document",):
        bodies = [_shaped(model, i, shape) for i in range(4)]
        records, rt = run(conn, redis_url, bodies)
        off, _ = run(conn, redis_url, bodies, prefix_gb=0)
        texts = [r.response.choices[0].message.content for r in records]
        assert texts == [r.response.choices[0].message.content for r in off], shape
        cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in records]
        gen = ChatGenerator.get_or_create(model, cache=rt.cache)
        prompts = [gen.prompt_of(ChatRequest.model_validate(b)) for b in bodies]
        common = min(common_prefix(prompts[0], p) for p in prompts[1:])
        assert common >= MIN_TOKENS, (family, shape)  # the template keeps it shared
        assert cached[0] == 0 and all(common - BLOCK < c <= common for c in cached[1:]), (
            family,
            shape,
            cached,
            common,
        )
        assert len(rt.cache.prefixes) == 1


@pytest.mark.parametrize("where", ["a tenant's list", "a batch's own list"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_batch_off_the_queues_own_list_still_prefills_its_shared_part_once(
    conn, redis_url, tiny, where, max_batch
):
    """The first job sees the next ones where they wait (its own list), whether that is a
    tenant's list or the batch's own (it came while the queue's list held work)."""
    client = Client(connection=conn)
    if where == "a batch's own list":
        client.submit([chat(tiny.target, "unrelated first", max_tokens=2)], batch_id="first")
    bodies = [_shaped(tiny.target, i, "document") for i in range(4)]
    tenant = "team" if where == "a tenant's list" else "default"
    s = client.submit(bodies, batch_id="docs", tenant=tenant)
    rt = runtime.WorkerRuntime(cache=ModelCache(prefix_bytes=10**9))
    run_worker(redis_url, runtime=rt, max_batch=max_batch)
    records = [read_result(conn, j) for j in s.job_ids]
    assert {r.status for r in records} == {"succeeded"}
    cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in records]
    assert cached[0] == 0 and all(c >= MIN_TOKENS for c in cached[1:]), (where, cached)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_jobs_that_share_nothing_keep_nothing(conn, redis_url, tiny, max_batch):
    bodies = [
        chat(tiny.target, content=f"{i} " + "distinct words here " * 12, max_tokens=4)
        for i in range(4)
    ]
    records, rt = run(conn, redis_url, bodies, max_batch=max_batch)
    assert all(r.response.usage.prompt_tokens_details.cached_tokens == 0 for r in records)
    assert len(rt.cache.prefixes) == 0 and rt.cache.prefixes.stats.hits == 0


def test_a_longer_shared_part_extends_the_entry_it_starts_from(tiny):
    """Jobs 0-2 share a document; 3-5 share it plus an annex: the second entry is
    prefilled from what the first holds of it (only the rest is new), and outputs equal
    a cache-less run."""
    gen = ChatGenerator.get_or_create(tiny.target, cache=ModelCache())
    cold = ChatGenerator.get_or_create(tiny.target, cache=ModelCache(prefix_bytes=0))
    more = DOC + " Annex. " + "Records are written once and read by any app. " * 6
    reqs = [
        ChatRequest.model_validate(
            chat(tiny.target, content=f"{d}\n\nQ{i}?", max_tokens=4, temperature=0)
        )
        for i, d in enumerate([DOC, DOC, DOC, more, more, more])
    ]
    outs = [gen.generate(r) for r in reqs]
    assert [o.text for o in outs] == [cold.generate(r).text for r in reqs]
    cached = [o.cached_tokens for o in outs]
    assert cached[:2] == [0, 0] and cached[2] > MIN_TOKENS  # the first group
    assert MIN_TOKENS < cached[3] <= cached[2]  # the next group's first job reuses what
    # it shares of that entry (the document), then the rest extend it
    assert cached[5] > cached[2] + MIN_TOKENS  # and the rest start from the longer one
    first, second = gen.models.prefixes.entries()  # (the first ends "Q", not " Annex")
    assert len(second.tokens) > len(first.tokens) + MIN_TOKENS


def test_a_queue_of_unrelated_prompts_is_read_now_and_then():
    from worker.runner.company import MISSES, Scout

    scout = Scout()
    looks = []
    for _ in range(5 * MISSES):
        looks.append(scout.due())
        scout.found(False)
    assert looks[:MISSES] == [True] * MISSES  # every job looks at first
    assert sum(looks[MISSES:]) == 4  # then one job in MISSES
    scout.found(True)
    assert scout.due() and scout.misses == 0  # a find: every job looks again
