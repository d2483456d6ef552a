"""The speculation policy: measure plain and each k per pair, run the fastest, keep probing."""

from __future__ import annotations

import pytest

from producer import Client
from schemas.store import read_result
from tests.conftest import chat, run_worker
from worker import runtime
from worker.cache import ModelCache
from worker.engine import GenerationOutput
from worker.policy import PLAIN, SpeculationPolicy


def out(tokens_per_s: float, tokens: int = 101) -> GenerationOutput:
    decode = (tokens - 1) / tokens_per_s
    return GenerationOutput(
        text="",
        finish_reason="length",
        prompt_tokens=5,
        completion_tokens=tokens,
        time_to_first_token_s=0.5,
        prompt_tokens_per_s=10.0,
        generation_tokens_per_s=0.0,
        total_time_s=0.5 + decode,
        draft_tokens_proposed=0,
        draft_tokens_accepted=0,
        peak_memory_gb=0.0,
        token_ids=(),
    )


def drive(policy: SpeculationPolicy, speeds: dict[int, float], jobs: int) -> list[int]:
    chosen = []
    for _ in range(jobs):
        d = policy.choose("t", "d")
        chosen.append(d.k)
        policy.record("t", "d", d, out(speeds[d.k]))
    return chosen


def test_auto_climbs_to_the_fastest_draft_length():
    policy = SpeculationPolicy("auto", default_k=2, ks=(1, 2, 4, 8), probe_every=10)
    chosen = drive(policy, {PLAIN: 20.0, 1: 25.0, 2: 31.0, 4: 28.0, 8: 99.0}, 8)
    # plain and the default k, then each neighbour of the best, twice (one job is a
    # noisy reading): 8 is never tried, as k=4 (the way to it) was slower than k=2.
    assert chosen[:6] == [PLAIN, 2, 1, 1, 4, 4]
    assert chosen[6:] == [2] * 2  # then the fastest
    assert "k=2 fastest measured (31.0 tok/s; plain 20.0)" in policy.choose("t", "d").reason
    assert "re-measuring plain decoding" in policy.choose("t", "d").reason  # 10th job probes


def test_auto_runs_plain_when_the_draft_does_not_pay_and_probes_back():
    policy = SpeculationPolicy("auto", default_k=2, ks=(2, 4), probe_every=5)
    speeds = {PLAIN: 20.0, 2: 14.0, 4: 12.0}
    chosen = drive(policy, speeds, 12)
    assert chosen[:3] == [PLAIN, 2, 2]
    exploit = chosen[3:]
    assert exploit.count(PLAIN) >= len(exploit) - 2  # plain, but for periodic probes
    assert set(exploit) == {PLAIN, 2}  # it did re-measure the draft
    # The draft starts paying (say the workload changed): a probe finds k=2 faster
    # than plain, and the climb then finds k=4.
    speeds = {PLAIN: 20.0, 2: 40.0, 4: 60.0}
    chosen = drive(policy, speeds, 30)
    assert chosen[-10:].count(4) >= 8  # k=4 now, but for periodic probes


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
