"""Fair share between tenants: jobs taken by the real take script on a real Redis, then
through a real worker on a tiny model."""

from __future__ import annotations

import pytest

from producer import Client
from producer.batches import batch_status
from producer.tenants import queued, set_weight
from schemas import GenerationError, ResultRecord, keys
from tests.conftest import chat, run_worker
from tests.test_lifecycle import expire, lifecycle, succeeded
from tests.test_producer_cli import invoke


def _submit(
    conn, tenant: str, n: int, batch_id: str, model: str = "some/model", priority: int = 0
) -> list[str]:
    bodies = [chat(model, f"{batch_id} {i}", max_tokens=1) for i in range(n)]
    client = Client(connection=conn)
    return client.submit(bodies, batch_id=batch_id, tenant=tenant, priority=priority).job_ids


def _takes(lc, n: int) -> list[str]:
    """The batches of the next ``n`` jobs taken (each ended at once, as a worker would)."""
    out = []
    for _ in range(n):
        job = lc.take()
        if job is None:
            break
        out.append(keys.batch_of(job.id))
        lc.end(job, succeeded(job))
    return out


def test_a_small_batch_behind_a_big_one_starts_at_once(conn):
    _submit(conn, "big-team", 2000, "big")
    _submit(conn, "small-team", 10, "small")
    order = _takes(lifecycle(conn), 2011)  # the last take finds every list empty
    assert len(order) == 2010
    last_small = max(i for i, b in enumerate(order) if b == "small")
    # Every small job ends before half of the big batch has (FIFO: after all 2,000); in
    # fact before the 11th big one.
    assert last_small < 20
    assert conn.llen(keys.rq_queue_key("mlxq@big-team")) == 0
    assert not conn.exists(keys.fair_key("mlxq"))  # every list ran dry and left the set


def test_weights_share_the_takes_while_both_have_work(conn):
    set_weight(conn, "heavy", 3)
    _submit(conn, "heavy", 200, "h")
    _submit(conn, "light", 200, "l")
    order = _takes(lifecycle(conn), 100)
    heavy = order.count("h")
    assert 0.9 * 75 <= heavy <= 1.1 * 75, heavy


def test_the_default_tenant_shares_too_and_an_idle_tenant_banks_no_credit(conn):
    _submit(conn, keys.DEFAULT_TENANT, 100, "plain")  # on the queue's own list
    lc = lifecycle(conn)
    assert _takes(lc, 10) == ["plain"] * 10  # alone: FIFO as before tenants
    _submit(conn, "x", 10, "x1")
    order = _takes(lc, 20)
    assert order.count("x1") == 10 and order.count("plain") == 10
    # x was idle while plain ran on: its return gets its share, not a burst of credit.
    assert _takes(lc, 20) == ["plain"] * 20
    _submit(conn, "x", 10, "x2")
    order = _takes(lc, 10)
    assert 4 <= order.count("x2") <= 6, order


def test_requeue_and_recovery_put_a_tenants_job_back_on_its_list_in_the_share(conn):
    (first, *_) = _submit(conn, "a", 3, "a")
    _submit(conn, "b", 3, "b")
    a = lifecycle(conn, "a")
    job = a.take()
    assert job.id == first and job.queue == "mlxq@a"
    assert a.requeue(job)
    assert conn.lindex(keys.rq_queue_key("mlxq@a"), 0) == first.encode()
    held = a.take()
    assert held.id == first  # a's turn again: its virtual time did not move on a requeue
    expire(conn, a)
    b = lifecycle(conn, "b")  # recovers a's job to the front of mlxq@a
    assert conn.lindex(keys.rq_queue_key("mlxq@a"), 0) == first.encode()
    assert set(_takes(b, 6)) == {"a", "b"}
    assert conn.llen(keys.rq_queue_key("mlxq@a")) == 0


def test_a_tenants_higher_priority_batch_goes_first_and_the_share_holds(conn):
    _submit(conn, "a", 40, "a-normal")
    _submit(conn, "a", 5, "a-low", priority=-3)
    _submit(conn, "b", 40, "b-normal")
    _submit(conn, "a", 10, "a-urgent", priority=2)  # submitted last, taken first of a's
    _submit(conn, "a", 10, "a-high", priority=1)
    assert conn.hget(keys.batch_key("a-urgent"), "priority") == b"2"
    assert queued(conn)["a"] == {"mlxq": 65}
    order = _takes(lifecycle(conn), 106)  # the last take finds every list empty
    assert len(order) == 105
    of_a = [b for b in order if b.startswith("a-")]
    assert of_a == ["a-urgent"] * 10 + ["a-high"] * 10 + ["a-normal"] * 40 + ["a-low"] * 5
    # Priority orders a's own batches; b's share does not move: a and b alternate while
    # both have work (a's 60 first jobs against b's 40).
    first_80 = order[:80]
    assert 38 <= sum(b.startswith("a-") for b in first_80) <= 42, first_80
    assert not conn.exists(keys.fair_key("mlxq"), "mlxq:fair:mlxq@a:ranked")


def test_priority_on_the_default_tenant_and_back_to_its_list_after_requeue(conn):
    _submit(conn, keys.DEFAULT_TENANT, 10, "plain")
    (first, *_) = _submit(conn, keys.DEFAULT_TENANT, 3, "rush", priority=5)
    lc = lifecycle(conn)
    job = lc.take()
    assert job.id == first and job.queue == "mlxq@default^5"
    assert lc.requeue(job)
    assert lc.take().id == first  # back on its list, first of it, and its list first
    expire(conn, lc)
    other = lifecycle(conn, "other")  # recovers it to the front of its list
    assert _takes(other, 13) == ["rush"] * 3 + ["plain"] * 10


def test_a_running_limit_counts_every_priority_of_the_tenant(conn):
    from producer.tenants import set_limits

    set_limits(conn, "capped", 2, None)
    _submit(conn, "capped", 5, "c-high", priority=4)
    _submit(conn, "capped", 5, "c")
    lc = lifecycle(conn)
    held = [lc.take() for _ in range(3)]
    assert [keys.batch_of(j.id) for j in held[:2]] == ["c-high", "c-high"]
    assert held[2] is None  # its limit: neither of its lists is taken from


@pytest.mark.parametrize("bad", ["10", "-10", "high", "1.5"])
def test_hostile_priorities_are_refused_by_name(conn, redis_url, tmp_path, bad):
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"model": "m", "messages": [{"role": "user", "content": "x"}]}\n')
    result = invoke("submit", path, "--priority", bad, "--redis-url", redis_url)
    assert result.exit_code == 2 and "--priority" in result.output
    for value in (10, True, "1"):
        with pytest.raises(ValueError, match="priority"):
            keys.tenant_queue("mlxq", "team", value)
    assert conn.dbsize() == 0


def test_tenant_batches_run_through_a_worker_small_one_first_and_cancel_sweeps_them(
    conn, redis_url, tiny
):
    big = _submit(conn, "big-team", 24, "wbig", tiny.target)
    small = _submit(conn, "small-team", 4, "wsmall", tiny.target)
    idle = _submit(conn, "idle-team", 5, "widle", tiny.target)
    Client(connection=conn).cancel("widle")
    assert queued(conn)["big-team"] == {"mlxq": 24}
    run_worker(redis_url, max_batch=4)
    for b in ("wbig", "wsmall"):
        s = batch_status(conn, b)
        assert s.finished and s.failed == 0, s
    done_big = [j.decode() for j in conn.lrange(keys.batch_done_key("wbig"), 0, -1)]
    done_small = [j.decode() for j in conn.lrange(keys.batch_done_key("wsmall"), 0, -1)]
    assert sorted(done_big) == sorted(big) and sorted(done_small) == sorted(small)
    # The small batch's last job ended before half of the big one's had.
    last_small = max(_finished(conn, j) for j in small)
    assert sum(_finished(conn, j) < last_small for j in big) < 12
    assert batch_status(conn, "widle").cancelled == len(idle)
    assert conn.llen(keys.rq_queue_key("mlxq@idle-team")) == 0


def _finished(conn, job_id: str) -> float:
    from schemas.store import read_result

    return read_result(conn, job_id).finished_at


@pytest.mark.parametrize("bad", ["Upper", "-lead", "x" * 33, "a b", "a@b", ""])
def test_hostile_tenant_names_are_refused_by_name(conn, redis_url, tmp_path, bad):
    with pytest.raises(ValueError, match="invalid tenant"):
        keys.tenant_queue("mlxq", bad) if bad else keys.validate_tenant(bad)
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"model": "m", "messages": [{"role": "user", "content": "x"}]}\n')
    result = invoke("submit", path, "--tenant", bad, "--redis-url", redis_url)
    assert result.exit_code == 2 and "invalid tenant" in result.output
    assert conn.dbsize() == 0
    result = invoke("tenant", "set", "--weight", "2", "--redis-url", redis_url, "--", bad)
    assert result.exit_code == 2 and "invalid tenant" in result.output


@pytest.mark.parametrize("bad", ["q#b", "q@t", "q^1", "", "a b", "x" * 129, "q\n"])
def test_hostile_queue_names_are_refused_by_name_everywhere(conn, redis_url, tmp_path, bad):
    from click.testing import CliRunner

    from worker.cli import main as worker_main

    with pytest.raises(ValueError, match="invalid queue"):
        Client(connection=conn, queue=bad).submit([chat("m", "x")])
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"model": "m", "messages": [{"role": "user", "content": "x"}]}\n')
    result = invoke("submit", path, "--queue", bad, "--redis-url", redis_url)
    assert result.exit_code == 2 and "invalid queue" in result.output
    result = invoke("serve", "--queue", bad, "--no-auth", "--redis-url", redis_url)
    assert result.exit_code == 2 and "invalid queue" in result.output
    result = CliRunner().invoke(worker_main, ["--queue", "mlxq", "--queue", bad])
    assert result.exit_code == 2 and "invalid queue" in result.output
    assert conn.dbsize() == 0


def test_weights_out_of_range_are_refused(redis_url):
    for w in ("0", "-1", "1000", "nan"):
        result = invoke("tenant", "set", "team", "--weight", w, "--redis-url", redis_url)
        assert result.exit_code == 2 and "out of range" in result.output, w
    result = invoke("tenant", "set", "team", "--weight", "2.5", "--redis-url", redis_url)
    assert result.exit_code == 0
    listed = invoke("tenant", "list", "--redis-url", redis_url)
    assert "team" in listed.output and "weight 2.5" in listed.output


def test_usage_per_tenant_sums_the_records_and_is_exported(conn, redis_url, tiny):
    from prometheus_client import generate_latest

    from producer.metrics import registry_for
    from producer.tenants import usage
    from schemas.store import read_result

    ids = {
        "team-a": _submit(conn, "team-a", 5, "ua", tiny.target),
        "team-b": _submit(conn, "team-b", 3, "ub", tiny.target),
        keys.DEFAULT_TENANT: _submit(conn, keys.DEFAULT_TENANT, 2, "ud", tiny.target),
    }
    bad = chat(tiny.small_ctx, "word " * 200, max_tokens=2)  # fails: over the context
    Client(connection=conn).submit([bad], batch_id="ubad", tenant="team-b")
    run_worker(redis_url, max_batch=4)
    got = usage(conn)
    for tenant, job_ids in ids.items():
        records = [read_result(conn, j) for j in job_ids]
        assert got[tenant]["prompt_tokens"] == sum(r.response.usage.prompt_tokens for r in records)
        assert got[tenant]["completion_tokens"] == sum(
            r.response.usage.completion_tokens for r in records
        )
        assert got[tenant]["job_seconds"] > 0
    assert (got["team-a"]["jobs"], got["team-b"]["jobs"], got["team-b"]["failed"]) == (5, 4, 1)
    assert usage(conn, tenant="team-a").keys() == {"team-a"}
    text = generate_latest(registry_for(conn)).decode()
    assert 'mlxq_tenant_usage_today{kind="jobs",tenant="team-a"} 5.0' in text
    result = invoke("usage", "--days", "2", "--redis-url", redis_url)
    assert result.exit_code == 0 and "team-b" in result.output


def test_gateway_keys_name_their_tenant_for_batch_api_batches(conn, redis_url, tiny, tmp_path):
    from producer.serve.settings import (
        load_key_tenants,
        load_operator_keys,
        load_tenant_weights,
    )
    from tests.test_gateway import Gateway, write_batch_file
    from tests.waiting import wait_for

    key_file = tmp_path / "keys.txt"
    key_file.write_text("sk-team-a-key team-a 3  # team A, weight 3\nsk-plain-key\n")
    gw = Gateway(redis_url, tmp_path, "--api-key-file", str(key_file))
    try:
        assert conn.hget(keys.TENANTS, "team-a") == b"3.0"  # the key file's weight, at start
        path = write_batch_file(tmp_path / "in.jsonl", tiny.target, 3)
        made = {}
        for key in ("sk-team-a-key", "sk-plain-key"):
            client = gw.client(key=key)
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            made[key] = client.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            ).id
        wait_for(lambda: conn.llen(keys.rq_queue_key("mlxq@team-a")) == 3, timeout=30)
        wait_for(lambda: conn.llen(keys.rq_queue_key("mlxq")) == 3, timeout=30)
        assert conn.hget(keys.batch_key(made["sk-team-a-key"]), "tenant") == b"team-a"
        assert conn.hget(keys.batch_key(made["sk-plain-key"]), "tenant") == b"default"
    finally:
        gw.stop()
    bad = tmp_path / "bad-keys.txt"
    bad.write_text("sk-x Not_A_Tenant\n")
    with pytest.raises(ValueError, match="invalid tenant") as e:
        load_key_tenants(bad, None)
    assert "sk-x" not in str(e.value)  # a key is never printed
    assert load_key_tenants(None, "sk-1,sk-2=team-b:2") == (("sk-2", "team-b"),)
    assert load_key_tenants(None, "sk-1,sk-op=*") == ()  # an operator's key names no tenant
    assert load_operator_keys(None, "sk-1,sk-op=*,sk-2=team-b") == {"sk-op"}
    with pytest.raises(ValueError, match="operator's key"):
        load_operator_keys(None, "sk-op=*:2")
    assert load_tenant_weights(None, "sk-1,sk-2=team-b:2,sk-3=team-c") == {"team-b": 2.0}
    for env, why in (
        ("sk-secret=team-b:lots", "tenant 'team-b'"),
        ("sk-secret=team-b:0", "out of range"),
        ("sk-secret=team-b:inf", "out of range"),
        ("sk-secret=team-b:2,sk-other=team-b:3", "two weights"),
    ):
        with pytest.raises(ValueError, match=why) as e:
            load_tenant_weights(None, env)
        assert "sk-secret" not in str(e.value) and "sk-other" not in str(e.value)
    bad.write_text("sk-secret team-b 1 2\n")
    result = invoke("serve", "--api-key-file", str(bad), "--redis-url", redis_url)
    assert result.exit_code != 0 and "KEY TENANT WEIGHT" in result.output
    assert "sk-secret" not in result.output


def test_a_tenant_at_its_running_limit_waits_and_the_others_go_on(conn):
    from producer.tenants import set_limits

    set_limits(conn, "capped", 2, None)
    _submit(conn, "capped", 10, "c")
    _submit(conn, "free", 10, "f")
    lc = lifecycle(conn)
    held = [lc.take() for _ in range(8)]
    order = [keys.batch_of(j.id) for j in held]
    assert order.count("c") == 2 and order.count("f") == 6, order
    lc.end(held[order.index("c")], succeeded(held[order.index("c")]))  # one ends: room for one
    nxt = [keys.batch_of(lc.take().id) for _ in range(3)]
    assert nxt.count("c") == 1, nxt
    set_limits(conn, "capped", 0, None)  # lifted
    rest = [keys.batch_of(lc.take().id) for _ in range(8)]
    assert rest.count("c") >= 4, rest


def test_a_tenant_past_its_tokens_of_the_day_gets_429s_and_the_others_run(conn, redis_url, tiny):
    from producer.tenants import set_limits, usage
    from schemas.store import read_result

    first = _submit(conn, "metered", 2, "m1", tiny.target)
    run_worker(redis_url)
    used = usage(conn)["metered"]
    spent = int(used["prompt_tokens"] + used["completion_tokens"])
    assert all(read_result(conn, j).status == "succeeded" for j in first)
    set_limits(conn, "metered", None, spent)  # exactly used up
    later = _submit(conn, "metered", 3, "m2", tiny.target)
    other = _submit(conn, "unmetered", 2, "u", tiny.target)
    run_worker(redis_url, max_batch=4)
    for j in later:
        record = read_result(conn, j)
        assert record.status == "failed" and record.status_code == 429
        assert (
            record.error.code == "quota_exceeded"
            and f"{spent} of its {spent}" in record.error.message
        )
    assert all(read_result(conn, j).status == "succeeded" for j in other)
    set_limits(conn, "metered", None, 0)  # lifted: retry runs them
    assert Client(connection=conn).retry("m2", error_codes=("quota_exceeded",)).queued == 3
    run_worker(redis_url)
    assert all(read_result(conn, j).status == "succeeded" for j in later)


def test_a_keys_requests_through_the_gateway_are_its_tenants(
    conn, redis_url, tiny, tmp_path, workers
):
    """A key's chat completions wait on its tenant's list of the interactive queue and
    count in its tenant's usage; a key without a tenant's, in the default tenant's."""
    from producer.tenants import usage
    from tests.test_gateway import Gateway

    key_file = tmp_path / "keys.txt"
    key_file.write_text("sk-team-a-key team-a\nsk-plain-key\n")
    gw = Gateway(redis_url, tmp_path, "--api-key-file", str(key_file))
    workers()
    try:
        for key in ("sk-team-a-key", "sk-plain-key"):
            reply = gw.client(key=key).chat.completions.create(
                model=tiny.target, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.choices[0].message.content is not None
    finally:
        gw.stop()
    totals = usage(conn)
    assert totals["team-a"]["jobs"] == 1 and totals[keys.DEFAULT_TENANT]["jobs"] == 1
    lists = {q.decode() for q in conn.smembers(keys.RQ_QUEUES)}
    assert keys.rq_queue_key(f"{keys.INTERACTIVE_QUEUE}@team-a") in lists


def _lists(conn, lane: str = "mlxq") -> list[str]:
    """The lane's ring: its lists with work, in turn order."""
    return [m.decode() for m in conn.lrange(keys.ring_key(lane), 0, -1)]


def test_a_tenants_batches_of_one_priority_take_turns(conn):
    # The default tenant (no fair set at all) and a named one (its lane in the fair set).
    for tenant, lane in ((keys.DEFAULT_TENANT, "mlxq"), ("team", "mlxq@team")):
        _submit(conn, tenant, 300, f"{tenant}-big")  # chunks of 32, 64, 128, 76
        assert _lists(conn, lane) == []  # one batch: the lane's own list, FIFO, no ring
        _submit(conn, tenant, 10, f"{tenant}-small")
        _submit(conn, tenant, 100, f"{tenant}-mid")
        own = [f"{lane}#{tenant}-small", f"{lane}#{tenant}-mid"]
        assert _lists(conn, lane) == [lane, *own]
        # every chunk of a batch went where its first did
        assert [conn.llen(keys.rq_queue_key(n)) for n in [lane, *own]] == [300, 10, 100]
        assert conn.hget(keys.batch_key(f"{tenant}-mid"), f"list:{lane}") == own[1].encode()
        assert queued(conn)[tenant] == {"mlxq": 410}  # a lane counts its batches' lists
        order = _takes(lifecycle(conn, tenant), 411)  # the last take finds all empty
        assert len(order) == 410
        assert order[:6] == [f"{tenant}-big", f"{tenant}-small", f"{tenant}-mid"] * 2
        last_small = max(i for i, b in enumerate(order) if b == f"{tenant}-small")
        assert last_small == 28  # its 10th turn, not after the big batch's 300 jobs
        assert order[30:210] == [f"{tenant}-big", f"{tenant}-mid"] * 90
        assert order[210:] == [f"{tenant}-big"] * 200
        assert not conn.exists(keys.ring_key(lane), keys.fair_key("mlxq"))
        assert keys.tenant_of(own[0]) == tenant and keys.base_queue(own[0]) == "mlxq"


def test_turns_hold_under_requeue_recovery_retry_cancel_and_other_tenants(conn):
    from producer.batches import cancel_batch

    _submit(conn, "a", 4, "a1")
    (first, *_) = _submit(conn, "a", 4, "a2")
    _submit(conn, "a", 4, "a3")
    _submit(conn, "b", 6, "b1")
    lc = lifecycle(conn)
    assert lc.take().queue == "mlxq@a"  # a1: the lane's own list
    job = lc.take()  # b's turn: tenants first, then a's batches in turn
    assert job.queue == "mlxq@b"
    lc.end(job, succeeded(job))
    job = lc.take()
    assert (job.id, job.queue) == (first, "mlxq@a#a2")
    assert conn.zscore(keys.rq_started_key("mlxq@a"), f"{first}:{lc.token}")  # the lane's
    assert lc.requeue(job)  # handed back: a's turn again, and a2's within a
    assert lc.take().id == first
    expire(conn, lc)
    other = lifecycle(conn, "other")  # recovers a1's and a2's jobs to their lists' fronts
    assert _lists(conn, "mlxq@a")[0] in ("mlxq@a", "mlxq@a#a2")
    assert conn.lindex(keys.rq_queue_key("mlxq@a#a2"), 0) == first.encode()
    assert cancel_batch(conn, "a3") == (4, 0)  # its own list swept whole
    assert conn.llen(keys.rq_queue_key("mlxq@a#a3")) == 0
    job = None
    for _ in range(20):  # fail a2's first job; the rest succeed
        job = other.take()
        if job is None:
            break
        if job.id == first:
            failed = ResultRecord.failed(job.id, "a2", job.envelope.custom_id, GenerationError("x"))
            assert other.end(job, failed)
        else:
            other.end(job, succeeded(job))
    assert job is None and not conn.exists(keys.ring_key("mlxq@a"))
    assert Client(connection=conn).retry("a2").queued == 1  # back on a2's own list
    assert conn.lrange(keys.rq_queue_key("mlxq@a#a2"), 0, -1) == [first.encode()]
    assert _lists(conn, "mlxq@a") == ["mlxq@a#a2"]
    assert other.take().id == first
    assert [batch_status(conn, b).succeeded for b in ("a1", "a2", "a3", "b1")] == [4, 3, 0, 6]


def test_a_batchs_own_list_is_waiting_work_to_every_reader(conn):
    from producer.metrics import FleetCollector
    from producer.overview import overview

    _submit(conn, keys.DEFAULT_TENANT, 1, "first")
    _submit(conn, keys.DEFAULT_TENANT, 3, "second")  # first's job waits: its own list
    lc = lifecycle(conn)
    assert keys.batch_of(lc.take().id) == "first"
    # The queue's own list is empty now, and no fair set exists: only the ring says.
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0 and not conn.exists(keys.fair_key("mlxq"))
    assert lc.waiting("mlxq") == 3
    assert lc.first_waiting(["mlxq.interactive", "mlxq"]) == "mlxq"
    assert FleetCollector(conn).read()["queues"]["mlxq"][0] == 3
    assert {"name": "mlxq", "depth": 3} in overview(conn)["queues"]
    assert queued(conn) == {keys.DEFAULT_TENANT: {"mlxq": 3}}
    assert lc.take().queue == "mlxq#second"
