"""The speculation policy: measure plain and each k per pair, run the fastest, keep probing."""

from __future__ import annotations

import itertools

import pytest

from producer import Client
from schemas import ChatRequest
from schemas.store import read_result
from tests.conftest import chat, run_worker
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.policy import PLAIN, JobSpeed, SpeculationPolicy

STEP = 0.065  # seconds per plain decode step (a 12x1024 model on this CPU)


def round_s(k: int) -> float:
    """A speculative round: k cheap draft steps and one (k + 1)-token verify pass."""
    return STEP * 1.05 + 0.004 * k


def synthetic(k: int, p: float, tokens: int = 101) -> JobSpeed:
    """What a job tells the policy as it would be for draft length k at per-token
    acceptance p (a round rejects unless all k proposals are accepted: 1 - p^k)."""
    if k == PLAIN:
        return JobSpeed(tokens, (tokens - 1) * STEP)
    per_round = (1 - p ** (k + 1)) / (1 - p)
    rounds = max(1, round(tokens / per_round))
    rejections = round(rounds * (1 - p**k))
    return JobSpeed(tokens, rounds * round_s(k), tokens - rounds, rejections)


def true_speed(k: int, p: float) -> float:
    if k == PLAIN:
        return 1 / STEP
    return (1 - p ** (k + 1)) / (1 - p) / round_s(k)


def drive(policy: SpeculationPolicy, p: float, jobs: int) -> list[int]:
    chosen = []
    for _ in range(jobs):
        d = policy.choose("t", "d")
        chosen.append(d.k)
        policy.record("t", "d", d, synthetic(d.k, p))
    return chosen


def test_auto_settles_after_three_jobs_on_a_near_best_draft_length():
    policy = SpeculationPolicy("auto", default_k=3, probe_every=10)
    chosen = drive(policy, p=0.8, jobs=8)
    assert chosen[:3] == [PLAIN, 3, 6]  # plain, the default k and twice it
    best = max(true_speed(k, 0.8) for k in range(1, 9))
    assert all(true_speed(k, 0.8) >= 0.97 * best for k in chosen[3:])  # near-best, no plain
    assert "predicted k=" in policy.choose("t", "d").reason


def test_auto_runs_plain_when_the_draft_does_not_pay_and_probes_back():
    policy = SpeculationPolicy("auto", default_k=3, probe_every=5)
    chosen = drive(policy, p=0.0, jobs=15)
    # 2k is not measured: at the acceptance k measured, even a round no slower than k's
    # would emit fewer tokens per second than plain (auto's exploration costs less)
    assert chosen[:3] == [PLAIN, 3, PLAIN]
    exploit = chosen[3:]
    assert exploit.count(PLAIN) >= len(exploit) - 3  # plain, but for periodic probes
    assert set(exploit) == {PLAIN, 1}  # it re-measured the draft (at k=1) now and then
    # The draft starts agreeing (say the workload changed): probes pick it up.
    chosen = drive(policy, p=0.85, jobs=40)
    assert chosen[-10:].count(PLAIN) <= 2 and max(chosen[-10:]) >= 4  # plain: probes only


def test_probes_of_a_losing_draft_back_off_to_one_in_160_jobs():
    policy = SpeculationPolicy("auto", default_k=3, probe_every=10)
    chosen = drive(policy, p=0.0, jobs=600)
    probes = [i for i, k in enumerate(chosen[3:], start=4) if k != PLAIN]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:4] == [20, 40, 80, 160] and set(gaps[4:]) == {160}
    assert len(probes) <= 8  # vs 60 at a fixed one in ten
    # The backoff ends as soon as the draft wins again.
    chosen = drive(policy, p=0.9, jobs=200)
    assert chosen[-20:].count(PLAIN) == 0


def test_fixed_k_and_the_other_modes():
    auto = SpeculationPolicy("auto")
    assert auto.choose("t", "d", fixed_k=5).k == 5
    assert SpeculationPolicy("never").choose("t", "d", fixed_k=5).k == PLAIN
    always = SpeculationPolicy("always", default_k=3)
    assert [always.choose("t", "d").k for _ in range(3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="speculative mode"):
        SpeculationPolicy("sometimes")


@pytest.mark.parametrize("mode", ["auto", "never", "always"])
def test_greedy_output_is_identical_whatever_the_policy_runs(conn, redis_url, tiny, mode):
    client = Client(connection=conn)
    s = client.submit(
        [chat(tiny.target, max_tokens=16, temperature=0, draft_model=tiny.draft) for _ in range(10)]
        + [chat(tiny.target, max_tokens=16, temperature=0)]
    )
    rt = runtime.WorkerRuntime(cache=ModelCache(), policy=SpeculationPolicy(mode, default_k=3))
    run_worker(redis_url, runtime=rt)
    records = [read_result(conn, j) for j in s.job_ids]
    texts = {r.response.choices[0].message.content for r in records}
    assert len(texts) == 1
    drafted = records[:10]
    assert all(r.metrics.speculation_reason for r in drafted)
    ran = {r.metrics.num_draft_tokens if r.metrics.speculative else 0 for r in drafted}
    if mode == "never":
        assert ran == {0} and "never" in drafted[0].metrics.speculation_reason
    elif mode == "always":
        assert ran == {3}
    else:  # auto measured plain and climbed over some draft lengths
        assert 0 in ran and 3 in ran and len(ran) >= 3
        assert all(r.metrics.acceptance_rate is None for r in drafted if not r.metrics.speculative)
    assert records[-1].metrics.speculation_reason is None  # no draft named


def test_deep_queue_batches_instead_of_speculating_when_measured_faster():
    policy = SpeculationPolicy("auto", default_k=3)
    assert policy.batch_instead("t", "d", None, depth=8) is None  # measure the pair first
    drive(policy, p=0.8, jobs=3)  # plain, k=3, k=6 measured one at a time
    assert policy.batch_instead("t", "d", None, depth=1) is None  # nothing else waits
    first = policy.batch_instead("t", "d", None, depth=8)
    assert first is not None and first.k == PLAIN and "measuring batching" in first.reason
    alone = max(true_speed(k, 0.8) for k in range(1, 9))
    policy.sizes.record("t", None, 8, tokens=int(40 * alone), seconds=10.0)  # 4x alone
    second = policy.batch_instead("t", "d", None, depth=7)  # then a speculative batch
    assert second is not None and second.k == 6 and second.adaptive  # k per round, up to 2x3
    assert "measuring speculative batching" in second.reason
    policy.sizes.record("t", None, 8, tokens=int(20 * alone), seconds=10.0, draft="d", k=6)
    third = policy.batch_instead("t", "d", None, depth=7)  # a fixed k=6 batch is another
    assert third is not None and third.adaptive and "measuring" in third.reason
    policy.sizes.record("t", None, 8, int(20 * alone), 10.0, draft="d", k=6, adaptive=True)
    won = policy.batch_instead("t", "d", None, depth=7)  # nearest measured size: 8
    assert won is not None and won.k == PLAIN and "beats one at a time" in won.reason
    fixed = policy.batch_instead("t", "d", None, depth=8, fixed_k=2)  # the job's k rules
    assert fixed is not None and fixed.k == 2
    assert policy.batch_instead("t", "d", "an-adapter", depth=8).reason.startswith(
        "auto: measuring"
    )
    # A speculative batch measured faster than both (again and again): it runs.
    for _ in range(4):
        policy.sizes.record("t", None, 8, int(100 * alone), 10.0, draft="d", k=6, adaptive=True)
    spec = policy.batch_instead("t", "d", None, depth=8)
    assert spec is not None and spec.k == 6 and spec.adaptive
    assert "speculative batch (k per round, up to 6" in spec.reason
    assert policy.sizes.limit("t", None, "d", 6, True)[1].startswith("speed: 8 measured fastest")
    fixed6, adaptive6 = (policy.sizes.limit("t", None, "d", 6, a)[1] for a in (False, True))
    assert fixed6 != adaptive6  # measured apart

    slow = SpeculationPolicy("auto", default_k=3)
    drive(slow, p=0.8, jobs=3)
    slow.sizes.record("t", None, 8, tokens=int(5 * alone), seconds=10.0)  # 0.5x alone
    slow.sizes.record("t", None, 8, int(6 * alone), 10.0, draft="d", k=6, adaptive=True)
    assert slow.batch_instead("t", "d", None, depth=8) is None  # speculating one at a time wins

    always = SpeculationPolicy("always", default_k=4).batch_instead("t", "d", None, depth=8)
    assert always is not None and always.k == 4 and not always.adaptive  # what was asked
    never = SpeculationPolicy("never").batch_instead("t", "d", None, depth=2)
    assert never is not None and never.k == PLAIN


def test_a_speculative_batch_must_beat_a_plain_one_by_a_margin():
    from worker.schedule.policy import SPEC_BATCH_MARGIN

    assert 1.0 < SPEC_BATCH_MARGIN < 1.3
    for over, wins in ((1.0, False), (SPEC_BATCH_MARGIN + 0.05, True)):
        policy = SpeculationPolicy("auto", default_k=3)
        drive(policy, p=0.8, jobs=3)
        alone = max(true_speed(k, 0.8) for k in range(1, 9))
        policy.sizes.record("t", None, 8, tokens=int(40 * alone), seconds=10.0)
        rate = over * 4 * alone
        policy.sizes.record("t", None, 8, int(10 * rate), 10.0, draft="d", k=6, adaptive=True)
        decision = policy.batch_instead("t", "d", None, depth=8)
        assert decision is not None and decision.adaptive is wins, over


def test_whole_batches_decide_which_kind_of_batch():
    """Per-size rates show a speculative batch while full; whole batches (joins and the
    tail of rows ending unevenly included) decide between the two kinds once known."""
    policy = SpeculationPolicy("auto", default_k=3)
    assert policy.acceptance("t", "d") is None
    drive(policy, p=0.8, jobs=3)
    assert policy.acceptance("t", "d") == pytest.approx(0.8, abs=0.1)  # a batch's prior
    alone = max(true_speed(k, 0.8) for k in range(1, 9))
    policy.sizes.record("t", None, 8, tokens=int(40 * alone), seconds=10.0)  # 4x alone
    full = 1.5 * 4 * alone  # while full, 1.5x the plain batch
    policy.sizes.record("t", None, 8, int(10 * full), 10.0, draft="d", k=6, adaptive=True)
    assert policy.batch_instead("t", "d", None, depth=8).adaptive  # per-size only: spec
    policy.sizes.record_whole("t", None, int(30 * alone), 10.0)
    policy.sizes.record_whole("t", None, int(27 * alone), 10.0, "d", 6, adaptive=True)
    plain = policy.batch_instead("t", "d", None, depth=8)  # whole: 0.9x the plain batch
    assert plain.k == PLAIN and "a speculative batch (" in plain.reason
    policy.sizes.record_whole("t", None, int(27 * alone), 10.0, "d", 3)  # fixed k: apart
    assert policy.batch_instead("t", "d", None, depth=8).k == PLAIN
    for _ in range(3):
        policy.sizes.record_whole("t", None, int(40 * alone), 10.0, "d", 6, adaptive=True)
    spec = policy.batch_instead("t", "d", None, depth=8)
    assert spec.adaptive and "beats batching without the draft" in spec.reason


def test_a_measuring_decision_carries_plain_speed_to_give_up_below():
    policy = SpeculationPolicy("auto", default_k=3, probe_every=5)
    first = policy.choose("t", "d")
    assert first.k == PLAIN and first.give_up_below is None  # nothing to compare with yet
    policy.record("t", "d", first, synthetic(PLAIN, 0.0))
    measuring = policy.choose("t", "d")
    assert measuring.k == 3 and measuring.give_up_below == pytest.approx(1 / STEP)
    policy.record("t", "d", measuring, synthetic(3, 0.0))
    chosen = [policy.choose("t", "d") for _ in range(6)]
    probes = [d for d in chosen if d.probe]
    assert probes and all(d.give_up_below == pytest.approx(1 / STEP) for d in probes)
    assert all(d.give_up_below is None for d in chosen if not d.probe)  # plain: nothing to stop


def test_a_measuring_job_stops_speculating_once_it_measures_slower(tiny):
    """A job told to give up below an unreachable speed speculates its first tokens only
    (what the policy then learns is those), and its text is still the plain text."""
    from worker.engine.generator import ChatGenerator
    from worker.engine.speculate import GIVE_UP_AFTER
    from worker.runner.alone import speed_of

    gen = ChatGenerator.get_or_create(tiny.target, tiny.draft, cache=ModelCache(prefix_bytes=0))
    req = ChatRequest.model_validate(chat(tiny.target, max_tokens=48, temperature=0))
    plain = gen.generate(req, use_draft=False)
    assert plain.completion_tokens == 48
    stopped = gen.generate(req, num_draft_tokens=3, give_up_below=1e9)
    assert stopped.token_ids == plain.token_ids
    assert GIVE_UP_AFTER <= stopped.gave_up_after < GIVE_UP_AFTER + 4
    assert stopped.draft_tokens_proposed <= 3 * stopped.gave_up_after  # none after it
    learned = speed_of(stopped)
    assert (learned.tokens, learned.decode_s) == (stopped.gave_up_after, stopped.speculated_s)
    kept = gen.generate(req, num_draft_tokens=3, give_up_below=0.0)
    assert kept.token_ids == plain.token_ids and kept.gave_up_after == 0
    assert kept.draft_tokens_proposed > stopped.draft_tokens_proposed
