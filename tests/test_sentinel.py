"""Redis Sentinel: every role follows a failover; URLs parse or are refused by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis

from bench.sentinel import SentinelGroup
from producer import Client
from producer.cli import main as producer_main
from producer.localredis import LocalRedis
from schemas import keys
from schemas.connect import SentinelURL, redis_from_url
from schemas.settings import redact_url
from schemas.store import read_result
from tests.conftest import chat, write_jsonl
from tests.test_faults import FAULT_REPORT
from tests.waiting import seconds, wait_for


def test_sentinel_urls_parse_and_bad_ones_are_named():
    s = SentinelURL(
        "rediss+sentinel://worker:p%40ss@10.0.0.1:26379,10.0.0.2/mm/3"
        "?sentinel_password=sp&sentinel_tls=true"
    )
    assert s.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
    assert (s.master, s.db, s.username, s.password, s.tls) == ("mm", 3, "worker", "p@ss", True)
    assert s.sentinel_kwargs()["password"] == "sp" and s.sentinel_kwargs()["ssl"] is True
    assert "p%40ss" not in redact_url("redis+sentinel://worker:p%40ss@h:1/mm?sentinel_password=sp")
    assert "sp" not in redact_url("redis+sentinel://h:1/mm?sentinel_password=sp")
    for url, word in (
        ("redis+sentinel:///mm", "host:port"),
        ("redis+sentinel://h:1", "MASTER_NAME"),
        ("redis+sentinel://h:1/mm/zero", "database"),
        ("redis+sentinel://h:x/mm", "h:x"),
        ("redis+sentinel://h:1/mm?bogus=1", "bogus"),
    ):
        with pytest.raises(ValueError, match=word):
            SentinelURL(url)
    bad = CliRunner().invoke(producer_main, ["fleet", "--redis-url", "redis+sentinel://h:1"])
    assert bad.exit_code == 2 and "MASTER_NAME" in bad.output


@pytest.fixture
def group(tmp_path) -> Iterator[SentinelGroup]:
    g = SentinelGroup(tmp_path / "sentinel")
    yield g
    g.stop()


def test_a_primary_killed_under_load_loses_no_job(tmp_path, tiny):
    """The issue's scale: 4 worker processes and a gateway on the Sentinel URL; the
    primary is SIGKILLed right after ``producer submit``'s first chunk of 5,000 jobs,
    while 1,000 others run. Every job ends with exactly one record, none is left
    running, the submit completes (and its rerun by batch id adds nothing it lacks),
    the gateway answers again, and no process needs a restart."""
    from bench.failover import run

    report = run(tmp_path, str(tiny.target), tiny.root, jobs=5000, warm=1000, window_s=3)
    print(json.dumps(report, indent=1))  # (whole, in a failure's captured output)
    assert report["new_primary"] and 0 < report["submit_total_at_kill"] < 5000, report
    resumed = report["submit_resumed"]
    assert resumed["exit"] == 0 and resumed["submitted"] + resumed["already_present"] == 5000
    assert report["jobs_in_batches"] == report["jobs_with_record"] == 6000, report
    assert report["succeeded"] == 6000 and report["records_announced_twice"] == 0
    assert report["left_running"] == 0 and report["processes_exited"] == [], report
    assert report["gateway_after"]["ok"] >= 1, report
    FAULT_REPORT.append(
        {
            "test": "sentinel failover",
            **{k: report[k] for k in ("first_job_after_kill_s", "jobs_per_s_before")},
            "jobs_per_s_after": report["jobs_per_s_after"],
        }
    )


def test_a_frozen_primary_comes_back_as_a_replica_and_clients_move(group, tiny, workers):
    url = group.url
    conn = redis_from_url(url)
    client = Client(connection=conn)
    exact = {"max_tokens": 6, "temperature": 0}
    jobs = {f"f{i}": chat(tiny.target, content=f"f {i}", **exact) for i in range(120)}
    batch = client.submit(jobs)
    ws = [workers("--lease-seconds", "3", name=f"fz{i}", url=url) for i in range(2)]
    wait_for(lambda: client.status(batch.batch_id).done >= 20, timeout=120)
    old = group.primary.port
    group.freeze_primary()
    try:
        wait_for(lambda: group.primary_port() != old, timeout=30)  # failed over
    finally:
        group.thaw_primary()
    # The old primary is demoted to a replica of the new one; its clients get READONLY
    # (or lose their connection) and move. Writes it took after the failover are lost
    # on resync, and the jobs they touched are run again, each ending once.
    wait_for(lambda: Redis(port=old).info("replication").get("role") == "slave", timeout=30)
    wait_for(lambda: client.status(batch.batch_id).finished, timeout=180)
    records = [read_result(conn, j) for j in batch.job_ids]
    assert [r.custom_id for r in records if r is None or r.status != "succeeded"] == []
    assert conn.hlen(keys.RUNNING) == 0
    assert all(w.proc.poll() is None for w in ws), "a worker needed a restart"


def _burst_worker(url: str, tiny, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"MLXQ_REDIS_URL": url, "MLXQ_MODEL_DIRS": str(tiny.root)}
    exe = str(Path(sys.executable).with_name("worker"))
    return subprocess.run(
        [exe, "--burst", "-v", *args], env=env, capture_output=True, text=True, timeout=seconds(300)
    )


def test_wait_replicas_keeps_acknowledged_records_and_says_when_it_cannot(tmp_path, tiny):
    primary = LocalRedis(data_dir=tmp_path / "p").start()
    replica = LocalRedis(
        data_dir=tmp_path / "r", extra_args=("--replicaof", "127.0.0.1", str(primary.port))
    ).start()
    try:
        wait_for(lambda: Redis(port=replica.port).info("replication")["master_link_status"] == "up")
        conn, copy = Redis(port=primary.port), Redis(port=replica.port)
        lines = [chat(tiny.target, content=f"w {i}", max_tokens=3) for i in range(4)]
        jobs = write_jsonl(tmp_path / "jobs.jsonl", lines)
        # With replication working: every acknowledged record is on the replica the
        # moment the worker has written it (no shortfall), so losing the primary now
        # would lose none of them.
        sub = CliRunner().invoke(
            producer_main, ["submit", str(jobs), "--redis-url", primary.url, "--wait-replicas", "1"]
        )
        assert sub.exit_code == 0 and "warning" not in sub.stderr, sub.output
        done = _burst_worker(primary.url, tiny, "--wait-replicas", "1")
        assert done.returncode == 0 and "replica(s) within" not in done.stderr, done.stderr
        ids = conn.lrange(keys.batch_jobs_key(sub.stdout.strip()), 0, -1)
        assert len(ids) == 4 and all(copy.exists(keys.result_key(j.decode())) for j in ids)
        # Replication frozen: the submit and the worker say their writes reached no
        # replica in time; without --wait-replicas nothing would say so.
        replica.proc.send_signal(signal.SIGSTOP)  # frozen, and its link cut: nothing
        conn.client_kill_filter(_type="replica")  # written from now on reaches it
        try:
            sub = CliRunner().invoke(
                producer_main,
                ["submit", str(jobs), "--redis-url", primary.url, "--wait-replicas", "1"],
            )
            assert sub.exit_code == 0 and "reached fewer than 1 replica" in sub.stderr
            frozen = _burst_worker(primary.url, tiny, "--wait-replicas", "1")
            assert frozen.returncode == 0
            assert "reached 0 of 1 replica(s) within 1000 ms" in frozen.stderr, frozen.stderr
            batch = sub.stdout.strip().splitlines()[0]
            ids = [k.decode() for k in conn.lrange(keys.batch_jobs_key(batch), 0, -1)]
            assert all(conn.exists(keys.result_key(j)) for j in ids)
            primary.proc.kill()  # the primary dies before the replica caught up
            primary.proc.wait(seconds(10))
            primary.proc = None
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        assert not any(copy.exists(keys.result_key(j)) for j in ids)  # lost, as reported
    finally:
        replica.stop()
        primary.stop()


def test_the_gateways_enqueue_waits_for_replicas_and_counts_shortfalls(tmp_path):
    import asyncio

    from redis.asyncio import Redis as AsyncRedis

    from producer.serve.coalesce import Coalesced

    primary = LocalRedis(data_dir=tmp_path / "p").start()
    replica = LocalRedis(
        data_dir=tmp_path / "r", extra_args=("--replicaof", "127.0.0.1", str(primary.port))
    ).start()
    lua = "redis.call('SET', KEYS[1], ARGV[1]) return 1"

    async def enqueue(n: int) -> Coalesced:
        script = Coalesced(AsyncRedis(port=primary.port), lua, wait_replicas=1)
        script.start()
        try:
            await asyncio.gather(*(script([f"mlxq:k{i}"], [str(i)]) for i in range(n)))
        finally:
            await script.stop()
        return script

    try:
        wait_for(lambda: Redis(port=replica.port).info("replication")["master_link_status"] == "up")
        healthy = asyncio.run(enqueue(20))
        assert healthy.shortfalls == 0
        assert Redis(port=replica.port).get("mlxq:k19") == b"19"  # there once acknowledged
        replica.proc.send_signal(signal.SIGSTOP)
        Redis(port=primary.port).client_kill_filter(_type="replica")
        try:
            cut = asyncio.run(enqueue(5))
            assert cut.shortfalls >= 1  # every write answered, and each shortfall counted
            assert Redis(port=primary.port).get("mlxq:k4") == b"4"
        finally:
            replica.proc.send_signal(signal.SIGCONT)
    finally:
        replica.stop()
        primary.stop()


def test_the_asyncio_client_follows_a_failover(group):
    import asyncio

    from schemas.connect import async_redis_from_url

    async def run() -> tuple[bytes | None, bytes | None]:
        conn = async_redis_from_url(group.url)
        await conn.set("mlxq:before", "1")
        assert await conn.wait(len(group.replicas), 10_000) == len(group.replicas)
        group.kill_primary()
        await conn.set("mlxq:after", "2")  # retried until the Sentinels name the new primary
        got = await conn.get("mlxq:before"), await conn.get("mlxq:after")
        await conn.aclose()
        return got

    old = group.primary.port
    assert asyncio.run(run()) == (b"1", b"2")
    assert group.primary_port() != old


def test_sentinel_and_nodes_over_tls_with_a_private_ca(tmp_path, tiny):
    """TLS-only Sentinels and TLS data nodes, certificates from a private CA named by
    ``ssl_ca_certs``: the producer's submit, a worker process and the asyncio client
    work through it and follow a failover; without the CA the certificate is refused."""
    import asyncio

    from redis.exceptions import ConnectionError as RedisConnectionError

    from schemas.connect import async_redis_from_url

    group = SentinelGroup(tmp_path / "tls", tls=True)
    try:
        url = group.url
        assert url.startswith("rediss+sentinel://") and "ssl_ca_certs=" in url
        with pytest.raises(ValueError, match="ssl_ca_certs: no such file"):
            SentinelURL(url.replace("ca.crt", "nope.crt"))
        untrusted = redis_from_url(url.split("&ssl_ca_certs=")[0], retry=None)
        with pytest.raises(RedisConnectionError):
            untrusted.ping()
        jobs = write_jsonl(
            tmp_path / "jobs.jsonl",
            [chat(tiny.target, content=f"t {i}", max_tokens=3) for i in range(3)],
        )
        sub = CliRunner().invoke(producer_main, ["submit", str(jobs), "--redis-url", url])
        assert sub.exit_code == 0, sub.output
        done = _burst_worker(url, tiny)
        assert done.returncode == 0, done.stderr
        conn = redis_from_url(url)
        batch = sub.stdout.strip()
        assert Client(connection=conn).status(batch).succeeded == 3
        assert conn.wait(len(group.replicas), 10_000) == len(group.replicas)  # replicated
        old = group.primary_port()
        group.kill_primary()

        async def after() -> int:
            a = async_redis_from_url(url)
            try:
                return int(await a.hget(keys.batch_key(batch), "succeeded"))
            finally:
                await a.aclose()

        assert conn.set("mlxq:after", "1") and asyncio.run(after()) == 3
        assert group.primary_port() != old
    finally:
        group.stop()
