"""Auto's measurements shared across the fleet and restarts (``schemas.figures``).

Pure: merging (weights, decay, age), hostile entries, export and adoption by a
fresh policy. End to end: two workers in sequence on one Redis, the second
starting from the first's decision (no measuring records) for a bad draft, a good
draft, prompt lookup and batch sizes; not across machine kinds, not for other
weights under the same name, and not from hostile entries.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest

from producer import Client
from producer.cli import main
from producer.figures import beliefs
from producer.metrics import registry_for
from schemas.figures import (
    HALF_LIFE_S,
    INDEX,
    MAX_AGE_S,
    MAX_ENTRY_BYTES,
    BatchFigures,
    Measured,
    PairFigures,
    TargetFigures,
    merge,
    read_entries,
    scope_key,
    scope_of,
)
from schemas.store import read_result
from tests.conftest import chat, run_jobs
from tests.models import noisy_copy
from tests.test_policy import drive
from worker.dev.tinymodels import TinySpec, ensure_model
from worker.engine.identity import weights_identity
from worker.engine.models import local_dir
from worker.runner.figures import SharedFigures
from worker.schedule.policy import LOOKUP, PLAIN, SpeculationPolicy
from worker.schedule.shared import adopt, export

KIND = "test-kind, 8 GB, cpu"


def entry(worker: str, at: float, plain: float, runs: int = 4, **kw) -> TargetFigures:
    pair = PairFigures(arms={PLAIN: Measured(value=plain, runs=runs)}, **kw)
    return TargetFigures(worker=worker, at=at, target="t1", kind=KIND, mlx="m", pairs={"d1": pair})


# -- pure ---------------------------------------------------------------------
def test_merge_weighs_by_jobs_and_halves_with_age():
    now = 1e9
    same_age = merge([entry("a", now, 10.0, runs=1), entry("b", now, 40.0, runs=3)], now)
    assert same_age.pairs["d1"].arms[PLAIN].value == pytest.approx(32.5)
    assert same_age.pairs["d1"].arms[PLAIN].runs == 4
    old = merge([entry("a", now - HALF_LIFE_S, 10.0), entry("b", now, 40.0)], now)
    assert old.pairs["d1"].arms[PLAIN].value == pytest.approx((10 * 0.5 + 40) / 1.5)


def test_read_entries_skips_hostile_foreign_and_stale_ones():
    now = time.time()
    good = entry("a", now, 10.0)
    raw = {
        b"good": good.model_dump_json(),
        b"not-json": "{{{",
        b"list": "[1, 2]",
        b"negative": entry("x", now, 1.0).model_dump_json().replace('"value":1.0', '"value":-5'),
        b"nan": good.model_dump_json().replace('"value":10.0', '"value":NaN'),
        b"extra": json.dumps(good.model_dump() | {"exec": "rm -rf /"}),
        b"v2": json.dumps(good.model_dump() | {"v": 2}),
        b"huge": " " * (MAX_ENTRY_BYTES + 1),
        b"other-kind": good.model_copy(update={"kind": "M2 Ultra"}).model_dump_json(),
        b"other-model": good.model_copy(update={"target": "t2"}).model_dump_json(),
        b"stale": good.model_copy(update={"at": now - MAX_AGE_S - 1}).model_dump_json(),
    }
    usable, skipped = read_entries(raw, "t1", KIND, "m", now)
    assert usable == [good]
    assert len(skipped) == 9  # all but the good and the stale one (silently unused)
    assert any("other model" in s for s in skipped)


def _identify(name: str) -> str:
    return {"t": "t1", "d": "d1", LOOKUP: "lookup"}.get(name, name + "-id")


def test_a_fresh_policy_adopting_the_fleets_figures_decides_at_once():
    first = SpeculationPolicy("auto", default_k=3)
    chosen = drive(first, p=0.8, jobs=8)
    assert chosen[:3] == [PLAIN, 3, 6]  # measured
    first.sizes.record("t", None, 8, 800, 1.0)
    first.sizes.record("t", None, 16, 900, 1.0)
    first.sizes.record("t", None, 8, 1200, 1.0, "d", 6, adaptive=True)  # a speculative batch
    ex = export(first, "t", _identify, worker="w", kind=KIND, mlx="m", now=time.time())
    assert ex is not None and set(ex.pairs) == {"d1"}
    second = SpeculationPolicy("auto", default_k=3)
    taken = adopt(second, "t", None, "d", merge([ex]), _identify)
    assert taken == 8 + 2 + 1
    assert second.sizes.rate("t", None, 8, "d") == pytest.approx(1200)  # under its draft's id
    decided = second.choose("t", "d")
    assert "measuring" not in decided.reason and "fleet figures of 8 job(s)" in decided.reason
    assert decided.k == first.choose("t", "d").k
    assert second.sizes.limit("t", None)[1].startswith("speed: 16 measured fastest")
    # what the second measures itself is exported; what it adopted is not (no double count)
    assert export(second, "t", _identify, worker="w2", kind=KIND, mlx="m", now=1.0) is None
    drive(second, p=0.8, jobs=2)
    again = export(second, "t", _identify, worker="w2", kind=KIND, mlx="m", now=1.0)
    assert sum(m.runs for m in again.pairs["d1"].arms.values()) == 2
    assert again.batches == []


def test_adoption_never_replaces_what_a_policy_measured_itself():
    policy = SpeculationPolicy("auto")
    drive(policy, p=0.2, jobs=3)
    mine = dict(policy.pairs[("t", "d")].arms)
    fleet = TargetFigures(
        worker="fleet",
        at=time.time(),
        target="t1",
        kind=KIND,
        mlx="m",
        pairs={"d1": PairFigures(arms={PLAIN: Measured(value=1e6, runs=100)})},
        batches=[BatchFigures(by_size={4: Measured(value=5.0, runs=3)})],
    )
    assert adopt(policy, "t", None, "d", fleet, _identify) == 3  # the batch sizes only
    assert policy.pairs[("t", "d")].arms == mine


def test_a_model_not_on_this_machine_yet_is_asked_again_at_the_next_job(conn, tiny):
    seen: list[str] = []

    def find(name: str) -> Path | None:  # a hub model fetched by the first job's load
        seen.append(name)
        return Path(tiny.target) if len(seen) > 1 else None

    policy = SpeculationPolicy("auto")
    fig = SharedFigures(conn, policy, find, "w", KIND)
    policy.first_use("org/model", None, None)
    policy.first_use("org/model", None, None)
    policy.first_use("org/model", None, None)  # known by now: not asked again
    assert seen == ["org/model", "org/model"]
    assert fig.identify("org/model") == weights_identity(Path(tiny.target))


# -- end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def quoter(tmp_path_factory) -> str:
    """A model that quotes its prompt: prompt lookup's proposals are mostly accepted."""
    spec = TinySpec(layers=2, hidden=128, intermediate=256, heads=1, kv_heads=1, quote=32)
    return str(ensure_model(tmp_path_factory.mktemp("quoter") / "m", spec))


def _speculated(conn, redis_url, model, batch, n=5, kind=KIND, **fields):
    text = f"of {batch}: order 4411 ships to berlin on monday with two crates of apples"
    jobs = {
        f"{batch}-{i}": chat(model, f"job {i} {text}", max_tokens=24, temperature=0, **fields)
        for i in range(n)
    }
    records = run_jobs(conn, redis_url, jobs, batch, share_figures=True, machine_kind=kind)
    return [records[c].metrics.speculation_reason or "" for c in jobs]


def _measuring(reasons: list[str]) -> int:
    return sum(r.startswith("auto: measuring") for r in reasons)  # not probes (re-measuring)


def _arms(reasons: list[str]) -> set[str]:
    """The arms measured (``plain decoding``, ``k=4``...), from the jobs' reasons."""
    return {r.removeprefix("auto: measuring ") for r in reasons if r.startswith("auto: measuring")}


def _left_to_measure(conn, model: str, proposer: str) -> set[str]:
    """What a fresh policy holding only the fleet's figures in Redis measures first."""
    policy = SpeculationPolicy("auto")
    SharedFigures(conn, policy, local_dir, "onlooker", KIND)
    policy.first_use(model, None, proposer)
    return _arms([policy.choose(model, proposer).reason])


@pytest.fixture(scope="module")
def repeater(tmp_path_factory) -> tuple[str, str]:
    """A 6 x 512 target whose greedy output repeats its last token, and a 1 x 64 draft
    that predicts the last token again: speculation wins clearly (1.4-1.6x here)."""
    root = tmp_path_factory.mktemp("repeater")
    common = {"heads": 4, "kv_heads": 4, "weight_scale": 1.0}
    target = TinySpec(layers=6, hidden=512, intermediate=1024, repeats=True, seed=11, **common)
    draft = TinySpec(layers=1, hidden=64, intermediate=128, copy_last_token=True, seed=12, **common)
    return str(ensure_model(root / "t", target)), str(ensure_model(root / "d", draft))


def _margin(reason: str) -> float:
    """How clear a decision was: the faster of the predicted speculative and the plain
    tok/s in ``reason`` over the slower (inf where the reason gives no two figures)."""
    rates = [float(x) for x in re.findall(r"([0-9.]+) tok/s", reason)]
    return max(rates) / min(rates) if len(rates) == 2 and min(rates) > 0 else math.inf


def _plain(reason: str) -> bool:
    """Whether a decision's reason says plain decoding is faster: chosen as fastest, or
    an arm being measured that went back to plain, slower than it (seen under the full
    suite's load: the first worker's last job still measuring k=8, the second settled
    on plain from the same figures)."""
    went_back = re.search(r"speculating measured ([0-9.]+) tok/s, plain ([0-9.]+)", reason)
    if went_back:
        return float(went_back[1]) < float(went_back[2])
    return "plain decoding fastest" in reason


@pytest.mark.parametrize("draft", ["bad", "good", "lookup"])
def test_a_second_worker_starts_from_the_first_ones_decision(
    conn, redis_url, tiny, quoter, repeater, draft
):
    # a draft that never agrees, one that always does at a fraction of the cost, and
    # prompt lookup on a model that quotes its prompt: clear decisions (near a tie,
    # plain's drift may rightly ask to measure one more arm)
    model, fields = {
        "bad": (tiny.target, {"draft_model": tiny.draft}),
        "good": (repeater[0], {"draft_model": repeater[1]}),
        "lookup": (quoter, {"speculation": {"method": "prompt_lookup"}}),
    }[draft]
    first = _speculated(conn, redis_url, model, "first", **fields)
    assert len(_arms(first)) >= 2
    left = _left_to_measure(conn, model, fields.get("draft_model", LOOKUP))
    second = _speculated(conn, redis_url, model, "second", **fields)
    told = "\n".join([*first, "--", *second])
    # nothing the first measured is measured again; usually nothing at all. An arm the
    # first skipped (its bound said it loses to plain) is measured where plain slowed
    # after that (seen under the full suite's load: plain 709 tok/s, then 423, which
    # reopened k=8): the second measures exactly what the fleet's figures leave
    assert not _arms(first) & _arms(second), told
    assert _arms(second) <= left, told
    assert all("fleet figures of" in r for r in second if not r.startswith("auto: measuring"))
    # the same choice as the first worker settled on (plain, or speculating) where that
    # choice was clear: its last job's own figures, merged in after it chose, can tip a
    # near tie (seen once under the full suite's load: k=8 1.18x plain, then 0.83x)
    if _margin(first[-1]) >= 1.3:
        assert _plain(second[0]) == _plain(first[-1]), told
    assert conn.hlen(INDEX) == 1


def test_figures_stay_with_their_machine_kind_and_their_weights(conn, redis_url, tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny.target, model)
    _speculated(conn, redis_url, str(model), "a", draft_model=tiny.draft)
    other_kind = _speculated(
        conn, redis_url, str(model), "b", kind="M2 Ultra, 192 GB, gpu", draft_model=tiny.draft
    )
    assert _measuring(other_kind) >= 2
    noisy_copy(tiny.target, model, scale=0.05)  # new weights under the same name
    new_weights = _speculated(conn, redis_url, str(model), "c", draft_model=tiny.draft)
    assert _measuring(new_weights) >= 2
    draft = tmp_path / "draft"
    shutil.copytree(tiny.draft, draft)
    _speculated(conn, redis_url, str(model), "d", draft_model=str(draft))
    noisy_copy(tiny.draft, draft, scale=0.5)  # a changed draft: remeasured
    changed = _speculated(conn, redis_url, str(model), "e", draft_model=str(draft))
    assert _measuring(changed) >= 2


def test_hostile_entries_in_redis_are_ignored(conn, redis_url, tiny, caplog):
    target_id = weights_identity(Path(tiny.target))
    key = scope_key(scope_of(KIND, mx.__version__, target_id))
    conn.hset(key, mapping={"x": "not json", "y": json.dumps({"v": 1, "pairs": 5})})
    conn.hset(INDEX, "junk", "{{")
    with caplog.at_level(logging.WARNING, logger="worker.runner.figures"):
        reasons = _speculated(conn, redis_url, tiny.target, "h", draft_model=tiny.draft)
    assert _measuring(reasons) >= 2  # measured as if nothing were shared
    assert "ignored" in caplog.text
    assert conn.hlen(key) == 3  # its own entry besides the two
    found, notes = beliefs(conn)  # what producer policy show and the metrics read
    assert [b.label.target for b in found] == [tiny.target] and len(found[0].skipped) == 2
    assert any("junk" in n for n in notes)


def test_batch_sizes_are_shared_too(conn, redis_url, tiny):
    def jobs(tag: str) -> dict:
        return {f"{tag}{i}": chat(tiny.target, f"{tag} {i}", max_tokens=48) for i in range(12)}

    run_jobs(conn, redis_url, jobs("a"), "a", max_batch=None, share_figures=True, machine_kind=KIND)
    policy = SpeculationPolicy("auto")
    fig = SharedFigures(conn, policy, local_dir, "second", KIND)
    assert policy.sizes.limit(tiny.target, None)[1].startswith("speed: starting at")
    fig.use(tiny.target, None, None)
    reason = policy.sizes.limit(tiny.target, None)[1]
    assert not reason.startswith("speed: starting at") and fig.adopted > 0, reason
    # a second worker's first batch is sized by what the first measured
    policy = SpeculationPolicy("auto")
    run_jobs(
        conn,
        redis_url,
        jobs("b"),
        "b",
        max_batch=None,
        policy=policy,
        share_figures=True,
        machine_kind=KIND,
    )
    assert any(r.seeded for r in policy.sizes.plain[(tiny.target, None)].by_size.values())


def test_worker_processes_share_by_default_and_producer_policy_shows_and_forgets(
    conn, redis_url, tiny, workers
):
    def serve(batch: str) -> list[str]:
        jobs = [
            chat(tiny.target, f"{batch} {i}", max_tokens=16, temperature=0, draft_model=tiny.draft)
            for i in range(4)
        ]
        s = Client(connection=conn).submit(jobs, batch_id=batch)
        assert (
            workers("--burst", "--max-batch", "1", "--machine-kind", "cli-kind", name=batch).wait(
                120
            )
            == 0
        )
        return [read_result(conn, j).metrics.speculation_reason for j in s.job_ids]

    first = serve("one")
    assert _measuring(first) >= 2
    # the second process measures none of the arms the first did (an arm the first
    # skipped as losing may still be measured: its own plain speed, on a busy machine,
    # can make it look worth a try)
    assert not _arms(serve("two")) & _arms(first)
    runner = CliRunner()
    shown = runner.invoke(main, ["policy", "show", "--redis-url", redis_url])
    assert shown.exit_code == 0, shown.output
    assert f"{tiny.target} on cli-kind" in shown.output and "2 worker process(es)" in shown.output
    assert f"+ {tiny.draft}: plain" in shown.output
    rows = json.loads(
        runner.invoke(main, ["policy", "show", "--json", "--redis-url", redis_url]).output
    )
    assert [r["machine_kind"] for r in rows] == ["cli-kind"]
    fleet = runner.invoke(main, ["fleet", "--redis-url", redis_url]).output
    assert "shared figures" in fleet and f"{tiny.target} on cli-kind" in fleet
    scraped = generate_latest(registry_for(conn)).decode()
    labels = f'{{machine_kind="cli-kind",target="{tiny.target}"}}'
    assert f"mlxq_figures_measurements{labels} 8.0" in scraped  # 2 workers x 4 jobs
    other = runner.invoke(main, ["policy", "reset", "--model", "nobody", "--redis-url", redis_url])
    assert "of 0 target" in other.output
    forgot = runner.invoke(
        main, ["policy", "reset", "--model", tiny.draft, "--redis-url", redis_url]
    )
    assert "of 1 target" in forgot.output
    assert _measuring(serve("three")) >= 2
