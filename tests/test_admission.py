"""Batch admission by memory and measured speed (``--max-batch auto``).

Real Redis, tiny real models. Memory budgets are set in bytes from each
model's measured KV profile, so "room for three of these" means exactly that.
"""

from __future__ import annotations

import threading
import time

import pytest

from producer import Client
from producer.fleet import fleet_table, live_workers
from schemas import ChatRequest
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.waiting import seconds
from worker.engine import Prepared, params_for, prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.memory import kv_profile
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.runner.loop import Worker
from worker.schedule.admission import KV_STEP, Verdict, admit, batch_peak_bytes
from worker.schedule.batchsize import REPROBE_EVERY, START_BATCH, BatchRates
from worker.schedule.policy import SpeculationPolicy

EOS_OFF = {"3": -100}  # the tiny tokenizer's EOS: jobs run to max_tokens


def _body(model: str, words: int, max_tokens: int, **fields) -> dict:
    content = "queue " * words  # about one token per word
    return chat(model, content=content, max_tokens=max_tokens, temperature=0, **fields)


def _need(cache: ModelCache, model: str, body: dict) -> tuple[int, int, int]:
    """(prompt tokens, max_tokens, KV bytes alone) of a job body on ``model``."""
    entry = cache.get(model)[0]
    prompt = len(prompt_tokens(entry.tokenizer, ChatRequest.model_validate(body)))
    return prompt, body["max_tokens"], batch_peak_bytes(entry.kv, [(prompt, body["max_tokens"])])


def _serve(conn, redis_url, bodies, cache, max_batch, policy=None):
    s = Client(connection=conn).submit(bodies)
    rt = runtime.WorkerRuntime(cache=cache, policy=policy or SpeculationPolicy())
    run_worker(redis_url, runtime=rt, max_batch=max_batch)
    return {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}, rt


def _budgeted(model: str, room: int) -> ModelCache:
    """A cache whose budget leaves ``room`` bytes after ``model`` (no kept prefixes)."""
    cache = ModelCache(prefix_bytes=0)
    cache.budget_bytes = cache.get(model)[0].nbytes + room
    return cache


def _start(record) -> float:
    return record.finished_at - record.metrics.total_time_s


# -- the admission decision (pure: no model, no Redis) ----------------------
class _PerToken:
    def bytes_for(self, tokens: int) -> int:
        return 100 * tokens


def test_a_job_joins_only_while_the_batch_projected_with_it_fits():
    peak = lambda seqs: batch_peak_bytes(_PerToken(), seqs)  # noqa: E731
    running = [(100, 50), (20, 200)]
    # Largest just before the newcomer leaves: 3 rows of the longest held (100) plus
    # its 10 still to come, plus a growth step.
    need = 3 * 100 * (100 + 10 + KV_STEP)
    assert admit(peak, running, (10, 10), room=need) == Verdict(True)
    late = admit(peak, running, (10, 10), room=need - 1)
    assert not late.join and late.over == 1
    assert (
        "next job (10 + 10 tokens)" in late.reason
        and f"{(need - 1) / 1e6:.1f} MB left" in late.reason
    )
    # A short newcomer is padded to the longest row: room for it alone beside the
    # others is not enough.
    assert not admit(peak, running, (10, 10), room=peak(running) + peak([(10, 10)])).join


# -- the KV model ---------------------------------------------------------
def test_kv_profile_matches_the_models_shape(tiny):
    entry = ModelCache().get(tiny.target)[0]
    c = entry.config
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    expected = c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 4  # k, v fp32
    assert kv_profile(entry.model).per_token == expected
    assert entry.kv.bytes_for(100) == 100 * expected


def test_a_batch_never_holds_more_kv_than_projected(tiny):
    entry = ModelCache().get(tiny.target)[0]
    engine = BatchEngine(entry, 8)
    shapes = [(300, 20), (10, 120), (150, 60), (40, 5)]
    for i, (words, max_tokens) in enumerate(shapes):
        body = _body(tiny.target, words, max_tokens, logit_bias=EOS_OFF)
        req = ChatRequest.model_validate(body)
        prompt = prompt_tokens(entry.tokenizer, req)
        engine.add(i, Prepared(prompt, params_for(req, len(prompt), entry.context_length, 512)))
    projected = batch_peak_bytes(entry.kv, list(engine.lengths().values()))
    peak = 0
    while len(engine):
        engine.step()
        peak = max(peak, engine.kv_bytes)
        held = list(engine.lengths().values())
        assert engine.kv_bytes <= batch_peak_bytes(entry.kv, held) or not len(engine)
    engine.close()
    assert 0 < peak <= projected
    assert peak >= projected // 2  # the projection is a bound, not a guess off by miles


# -- memory ---------------------------------------------------------------
@pytest.mark.parametrize("max_batch", [None, 8])
def test_a_small_budget_holds_only_what_fits_and_every_job_runs(conn, redis_url, tiny, max_batch):
    bodies = {f"j{i}": _body(tiny.target, 250, 40, logit_bias=EOS_OFF) for i in range(7)}
    probe = ModelCache()
    _, _, one = _need(probe, tiny.target, bodies["j0"])
    room = 3 * one + one // 2  # three of these at once, not four
    records, rt = _serve(conn, redis_url, bodies, _budgeted(tiny.target, room), max_batch)
    assert all(r.status == "succeeded" for r in records.values()), [
        r.error for r in records.values()
    ]
    assert max(r.metrics.batch_size for r in records.values()) == 3
    assert rt.stats.peak_batch == 3
    assert 0 < rt.stats.peak_kv_bytes <= rt.stats.peak_projected_kv_bytes <= room


@pytest.mark.parametrize("path", ["batched", "alone", "speculative", "streamed"])
def test_a_job_too_large_even_alone_fails_naming_the_numbers(conn, redis_url, tiny, path):
    fields = {"draft_model": tiny.draft} if path == "speculative" else {}
    if path == "streamed":
        fields["stream"] = True
    big = _body(tiny.target, 300, 150, **fields)
    small = _body(tiny.target, 5, 8, **fields)
    _, _, one = _need(ModelCache(), tiny.target, big)
    cache = _budgeted(tiny.target, one // 2 + one // 4)
    if path == "speculative":
        cache.budget_bytes += cache.get(tiny.draft)[0].nbytes
    bodies = {"small-1": small, "big": big, "small-2": small}
    max_batch = None if path == "batched" else 1
    records, _ = _serve(conn, redis_url, bodies, cache, max_batch, SpeculationPolicy("always"))
    assert records["big"].status == "failed"
    assert records["big"].error.code == "context_too_large"
    assert records["big"].status_code == 507
    message = records["big"].error.message
    assert "max_tokens 150" in message and "MB of KV cache" in message
    assert f"leaves {(one // 2 + one // 4) / 1e6:,.2f} MB" in message
    assert records["small-1"].status == records["small-2"].status == "succeeded"


def test_a_job_that_does_not_fit_yet_waits_at_the_head_of_its_queue(conn, redis_url, tiny):
    small = _body(tiny.target, 10, 30, logit_bias=EOS_OFF)
    big = _body(tiny.target, 300, 100, logit_bias=EOS_OFF)
    probe = ModelCache()
    s_prompt, _, s_one = _need(probe, tiny.target, small)
    b_prompt, _, b_one = _need(probe, tiny.target, big)
    kv = probe.get(tiny.target)[0].kv
    room = 3 * s_one + s_one // 4
    # Three small ones fit together; the big one fits alone but not with any small one.
    assert b_one <= room < batch_peak_bytes(kv, [(b_prompt, 100), (s_prompt, 30)])
    order = ["s1", "s2", "s3", "big", "s4", "s5"]
    bodies = {k: big if k == "big" else small for k in order}
    records, rt = _serve(conn, redis_url, bodies, _budgeted(tiny.target, room), None)
    assert all(r.status == "succeeded" for r in records.values())
    starts = {k: _start(r) for k, r in records.items()}
    assert starts["big"] < starts["s4"] and starts["big"] < starts["s5"]
    assert max(starts[k] for k in ("s1", "s2", "s3")) < starts["big"]
    assert records["big"].metrics.batch_size == 1
    assert rt.stats.peak_projected_kv_bytes <= room


# -- measured speed -------------------------------------------------------
def _rates(**by_size: float) -> BatchRates:
    rates = BatchRates()
    for size, rate in by_size.items():
        rates.record(int(size[1:]), rate)
    return rates


def test_the_speed_limit_grows_while_larger_batches_pay_and_stops_where_they_do_not():
    assert BatchRates().limit()[0] == START_BATCH
    assert _rates(s8=50, s16=60).limit()[0] == 32  # the largest measured is the fastest
    assert _rates(s1=20, s2=38).limit()[0] == START_BATCH  # never below the start
    rates = _rates(s8=50, s16=60, s32=59)  # 32 is no faster than 16
    limit, reason = rates.limit()
    assert limit == 16 and "16" in reason and "32" in reason
    assert _rates(s8=50, s16=54, s32=53).limit()[0] == 8  # 8% is not a measurable gain
    assert _rates(s8=50, s16=60, s32=70).limit()[0] == 64  # 17% is
    for _ in range(REPROBE_EVERY - 1):
        rates.record(16, 60)
    assert rates.limit()[0] == 16
    rates.record(12, 50)
    assert rates.limit()[0] == 32  # now and then the next size up is measured again
    rates.record(24, 58)
    assert rates.limit()[0] == 16


@pytest.mark.parametrize("max_batch", [None, 8, 32])
def test_auto_grows_past_its_start_when_a_larger_batch_measures_faster(
    conn, redis_url, tiny, max_batch
):
    n = START_BATCH + 8
    bodies = {f"j{i:02}": _body(tiny.target, 5, 60, logit_bias=EOS_OFF) for i in range(n)}
    records, rt = _serve(conn, redis_url, bodies, ModelCache(), max_batch)
    assert all(r.status == "succeeded" for r in records.values())
    largest = max(r.metrics.batch_size for r in records.values())
    if max_batch is None:  # started at 32, measured it, grew: all of them together
        assert largest == n
        assert rt.policy.sizes.plain[(tiny.target, None)].by_size[START_BATCH].runs >= 1
    else:
        assert largest == max_batch


def test_auto_stays_small_where_larger_batches_measured_slower(conn, redis_url, tiny):
    policy = SpeculationPolicy()
    for size, rate in ((2, 40.0), (4, 60.0), (8, 45.0)):
        policy.sizes.record(tiny.target, None, size, int(rate * 10), 10.0)
    bodies = {f"j{i:02}": _body(tiny.target, 5, 20, logit_bias=EOS_OFF) for i in range(8)}
    records, _ = _serve(conn, redis_url, bodies, ModelCache(), None, policy)
    assert max(r.metrics.batch_size for r in records.values()) == 4


# -- what the fleet sees --------------------------------------------------
def test_fleet_shows_the_batch_size_and_what_limits_it(conn, redis_url, tiny):
    body = _body(tiny.slow, 20, 400, logit_bias=EOS_OFF)
    probe = ModelCache()
    _, _, one = _need(probe, tiny.slow, body)
    cache = _budgeted(tiny.slow, 2 * one + one // 2)
    Client(connection=conn).submit({f"j{i}": body for i in range(4)})
    rt = runtime.WorkerRuntime(cache=cache)
    worker = Worker(conn, ["mlxq"], rt, name="fleet-batch", max_batch=None, burst=True)
    thread = threading.Thread(target=worker.work)
    thread.start()
    seen = None
    deadline = time.monotonic() + seconds(60)
    while thread.is_alive() and time.monotonic() < deadline:
        infos = [w for w in live_workers(conn) if w.name == "fleet-batch"]
        if infos and infos[0].batch is not None and infos[0].batch.reason.startswith("memory"):
            seen = infos[0]
            break
        time.sleep(0.2)
    thread.join(seconds(120))
    assert seen is not None and seen.batch is not None
    assert seen.batch.size == 2 and seen.max_batch == "auto"
    assert 0 < seen.batch.kv_projected_mb <= seen.batch.kv_room_mb
    table = fleet_table([seen])
    assert "batch: 2 job(s)" in table and "memory: the next job" in table


@pytest.mark.parametrize("value", ["0", "257", "eight", "-1", "8.5"])
def test_a_bad_max_batch_is_refused_naming_it(value):
    from click.testing import CliRunner

    from worker.cli import main as worker_main

    out = CliRunner().invoke(worker_main, ["--max-batch", value, "--burst"])
    assert out.exit_code == 2
    assert "--max-batch" in out.output and repr(value) in out.output


def test_max_batch_accepts_auto_and_numbers():
    from worker.cli import BatchSize

    assert BatchSize().convert("auto", None, None) is None
    assert BatchSize().convert(" AUTO ", None, None) is None
    assert BatchSize().convert("16", None, None) == 16


@pytest.mark.parametrize(
    ("held", "n", "limit", "joins"),
    [
        (6, 2, 8, True),  # two places free
        (7, 2, 8, False),  # one free: it waits for the second
        (0, 6, 4, True),  # more choices than the cap: an empty lane takes them
        (8, 1, 8, True),  # one sequence: counted before it is taken
    ],
)
def test_a_job_of_n_choices_needs_n_places(held, n, limit, joins):
    from worker.schedule.admission import places

    verdict = places(held, n, limit, "cap: --max-batch 8")
    assert verdict.join is joins
    if not joins:
        assert (
            verdict.reason == "places: the next job's 2 choices need 2, 1 free (cap: --max-batch 8)"
        )
        assert verdict.over == 0  # (no memory to make: nothing is preempted for places)
