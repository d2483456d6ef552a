"""Prometheus metrics: what a scrape reports equals what ``producer status`` and
``producer fleet`` report for the same state, and a scrape's Redis calls are bounded."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from bench.metrics import Counting
from producer import Client
from producer.batches import batch_status
from producer.cli import main as producer_main
from producer.fleet import live_workers
from producer.metrics import FleetCollector, registry_for
from schemas import keys
from schemas.store import read_result
from tests.conftest import chat
from tests.waiting import wait_for

ROOT = Path(__file__).parent.parent


def scrape(conn: Redis) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One scrape through prometheus_client's own exposition and parser:
    (sample name, sorted labels) -> value."""
    text = generate_latest(registry_for(conn)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, metric: str, /, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def test_a_scrape_equals_status_and_fleet(conn, redis_url, tiny, workers, tmp_path):
    client = Client(connection=conn)
    exact = {"max_tokens": 4, "temperature": 0, "logit_bias": {"3": -100}}
    jobs = {f"ok{i}": chat(tiny.target, content=f"job {i}", **exact) for i in range(3)}
    jobs["refused"] = chat("/etc", max_tokens=2)  # outside the worker's model dirs
    done = client.submit(jobs)
    nobody = Client(connection=conn, queue="nobody")  # a queue no worker serves
    waiting = nobody.submit({f"w{i}": chat(tiny.target) for i in range(2)})
    w = workers("--lease-seconds", "6", name="metrics-w")
    wait_for(lambda: client.status(done.batch_id).finished, timeout=120)
    wait_for(
        lambda: [(x.jobs_succeeded, x.jobs_failed) for x in live_workers(conn)] == [(3, 1)],
        timeout=30,
    )
    samples = scrape(conn)
    # Batches: as producer status counts them.
    for batch in (done.batch_id, waiting.batch_id):
        st = batch_status(conn, batch)
        for status in ("queued", "running", "succeeded", "failed", "cancelled"):
            got = value(samples, "mlxq_batch_jobs", batch=batch, status=status)
            assert got == getattr(st, status), (batch, status)
    # Queues: RQ's list and registries.
    assert value(samples, "rq_jobs", queue="nobody", status="queued") == 2
    assert value(samples, "rq_jobs", queue="mlxq", status="queued") == 0
    assert value(samples, "rq_jobs", queue="mlxq", status="finished") == conn.zcard(
        keys.rq_finished_key("mlxq")
    )
    assert value(samples, "rq_jobs", queue="mlxq", status="failed") == 1
    # The worker: as producer fleet shows it.
    [info] = live_workers(conn)
    assert value(samples, "mlxq_worker_up", worker="metrics-w") == 1
    assert (
        value(
            samples, "rq_workers", name="metrics-w", queues=",".join(info.queues), state=info.state
        )
        == 1
    )
    assert value(samples, "mlxq_worker_jobs_total", worker="metrics-w", status="succeeded") == 3
    assert value(samples, "mlxq_worker_jobs_total", worker="metrics-w", status="failed") == 1
    tokens = sum(p.tokens for p in info.pairs)
    assert tokens == 12
    assert value(samples, "mlxq_worker_generated_tokens_total", worker="metrics-w") == tokens
    [pair] = info.pairs
    tps = value(
        samples, "mlxq_worker_tokens_per_second", worker="metrics-w", target=tiny.target, draft=""
    )
    assert abs(tps - pair.tokens_per_s) < 1e-9
    pc = info.prefix_cache  # the prefix cache: as producer fleet shows it
    assert value(samples, "mlxq_worker_prefix_cache_entries", worker="metrics-w") == pc.entries
    assert value(samples, "mlxq_worker_prefix_cache_bytes", worker="metrics-w") == pc.used_mb * 1e6
    reused = value(samples, "mlxq_worker_prefix_cache_reused_tokens_total", worker="metrics-w")
    assert reused == pc.tokens_reused
    renew = value(samples, "mlxq_worker_lease_renew_age_seconds", worker="metrics-w")
    assert 0 <= renew <= 6
    # Latency histograms: the records' own figures, every job observed once.
    records = [read_result(conn, j) for j in done.job_ids]
    job_s = sum(r.metrics.total_time_s for r in records)
    name = "gen_ai_server_request_duration_seconds"
    assert value(samples, f"{name}_count", worker="metrics-w") == 4
    assert abs(value(samples, f"{name}_sum", worker="metrics-w") - job_s) < 1e-6
    ttft = "gen_ai_server_time_to_first_token_seconds"
    assert value(samples, f"{ttft}_count", worker="metrics-w") == 3  # not the refused job
    assert value(samples, f"{ttft}_bucket", worker="metrics-w", le="+Inf") == 3
    wait = "mlxq_queue_wait_seconds"
    assert value(samples, f"{wait}_count", worker="metrics-w") == 4
    assert value(samples, f"{wait}_bucket", worker="metrics-w", le="0.01") <= 4
    w.stop()


def test_a_scrape_costs_the_same_commands_however_many_jobs_wait(conn, tiny):
    client = Client(connection=conn, queue="q1")
    client.submit({f"a{i}": chat(tiny.target) for i in range(5)})
    counted = Counting(conn)
    FleetCollector(counted).read()  # type: ignore[arg-type]
    first = list(counted.commands)
    client.submit({f"b{i}": chat(tiny.target) for i in range(2000)})
    counted.commands.clear()
    state = FleetCollector(counted).read()  # type: ignore[arg-type]
    # One more batch: its hash, and the length of its own list (it came while q1 held
    # work: it takes turns); nothing per job.
    grown = collections.Counter(counted.commands) - collections.Counter(first)
    assert grown == {"HGETALL": 1, "LLEN": 1} and len(counted.commands) == len(first) + 2
    assert state["queues"]["q1"][0] == 2005
    assert not {"SCAN", "KEYS", "SSCAN", "HSCAN", "ZSCAN"} & set(counted.commands)


def test_producer_metrics_once_and_the_dashboard_names(conn, redis_url, tiny):
    Client(connection=conn, queue="solo").submit({"x": chat(tiny.target)})
    out = CliRunner().invoke(producer_main, ["metrics", "--once", "--redis-url", redis_url])
    assert out.exit_code == 0, out.output
    names = {f.name for f in text_string_to_metric_families(out.output)}
    assert 'rq_jobs{queue="solo",status="queued"} 1.0' in out.output
    # Every metric the shipped Grafana dashboard plots is one the exporter exposes.
    board = (
        Path(__file__).parent.parent
        / "examples"
        / "monitoring"
        / "grafana"
        / "dashboards"
        / "mlxq.json"
    )
    exprs = [t["expr"] for p in json.loads(board.read_text())["panels"] for t in p["targets"]]
    known = names | {f"{n}_total" for n in names} | {f"{n}_bucket" for n in names}
    known |= {f"{n}_sum" for n in names} | {f"{n}_count" for n in names}
    used = {word for e in exprs for word in _metric_words(e)}
    assert used and used <= known, used - known


def _metric_words(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:rq|mlxq|gen_ai)_[a-z_]+)\b", expr))


def test_the_gateway_serves_metrics_behind_its_key(conn, redis_url, tiny):
    from starlette.testclient import TestClient

    from producer.serve.app import create_app
    from producer.serve.settings import GatewaySettings

    Client(connection=conn, queue="gw").submit({f"x{i}": chat(tiny.target) for i in range(3)})
    app = create_app(GatewaySettings(redis_url=redis_url, api_keys=frozenset({"sk-m"})))
    with TestClient(app) as http:
        assert http.get("/metrics").status_code == 401
        reply = http.get("/metrics", headers={"Authorization": "Bearer sk-m"})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(reply.text)
        for s in f.samples
    }
    assert samples[("rq_jobs", (("queue", "gw"), ("status", "queued")))] == 3
