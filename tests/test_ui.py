"""The gateway's ``/ui`` page and retry route: a real gateway, a real worker process, a real
Redis, and the page in a real headless Chromium (Debian's ``chromium-headless-shell``,
driven by Playwright). CI installs the browser (``.ci/run``); elsewhere the browser test
is skipped when none is found, unless ``MLXQ_REQUIRE_BROWSER=1``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from producer import Client
from producer.overview import overview
from schemas import keys
from tests.conftest import chat, run_worker
from tests.test_gateway import KEY, Gateway, auth, request
from tests.test_retry import _mixed_batch
from tests.waiting import seconds, wait_for

BROWSERS = ("/usr/bin/chromium-headless-shell", "/usr/bin/chromium")
#: Where the browser test keeps its screenshot (a test artifact; not committed).
ARTIFACTS = Path(os.environ.get("MLXQ_TEST_ARTIFACTS", "test-artifacts"))


@pytest.fixture
def gw(redis_url, tmp_path):
    g = Gateway(redis_url, tmp_path)
    yield g
    g.stop()


def _browser() -> str:
    found = next((b for b in BROWSERS if Path(b).exists()), None)
    if found is None:
        if os.environ.get("MLXQ_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no headless browser at {' or '.join(BROWSERS)} (MLXQ_REQUIRE_BROWSER=1)")
        pytest.skip("no headless Chromium here (apt-get install chromium-headless-shell)")
    return found


def test_the_page_loads_without_a_key_and_its_data_needs_one(gw, conn):
    g = gw
    page = request("GET", f"{g.url}/ui")
    assert page.status == 200 and b'<table id="batches">' in page.body
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert request("GET", f"{g.url}/ui/ui.js").status == 200
    assert request("GET", f"{g.url}/ui/state").status == 401
    assert request("GET", f"{g.url}/ui/state", headers=auth("sk-wrong")).status == 401
    Client(connection=conn).submit([chat("m", "x")], batch_id="seen")
    state = request("GET", f"{g.url}/ui/state", headers=auth()).json()
    assert [(b["batch_id"], b["total"], b["queued"]) for b in state["batches"]] == [("seen", 1, 1)]
    assert state["queues"] == [{"name": "mlxq", "depth": 1}]


def test_retry_through_the_gateway(gw, conn, redis_url, tiny, tmp_path):
    g = gw
    _, _, later = _mixed_batch(conn, tiny, tmp_path, "gw-retry")
    run_worker(redis_url)
    url = f"{g.url}/v1/batches/gw-retry/retry"
    bad = request("POST", url, {"status_codes": ["9xx"]}, auth())
    assert bad.status == 400 and "invalid status code '9xx'" in bad.json()["error"]["message"]
    bad = request("POST", url, {"codes": ["x"]}, auth())
    assert bad.status == 400 and "codes" in bad.json()["error"]["message"]
    assert request("POST", f"{g.url}/v1/batches/nope/retry", None, auth()).status == 404
    assert request("POST", url, {"status_codes": ["5xx"]}, auth("sk-wrong")).status == 401

    shutil.copytree(tiny.target, later)
    reply = request("POST", url, {"error_codes": ["context_length_exceeded"]}, auth())
    assert reply.status == 200, reply.body
    obj = reply.json()
    assert obj["object"] == "batch" and obj["status"] == "in_progress"
    assert (obj["retry"]["queued"], obj["retry"]["unmatched"]) == (2, 3)
    assert obj["request_counts"] == {"total": 7, "completed": 2, "failed": 3}
    assert request("POST", url, None, auth()).json()["retry"]["queued"] == 3  # the rest
    assert request("POST", url, None, auth()).json()["retry"]["pending"] == 5  # twice
    run_worker(redis_url)
    obj = request("GET", f"{g.url}/v1/batches/gw-retry", headers=auth()).json()
    assert obj["status"] == "completed"
    assert obj["request_counts"] == {"total": 7, "completed": 5, "failed": 2}
    request("POST", f"{g.url}/v1/batches/gw-retry/cancel", None, auth())
    refused = request("POST", url, None, auth())
    assert refused.status == 409 and refused.json()["error"]["code"] == "batch_cancelled"


def _commands(conn) -> int:
    return sum(v["calls"] for v in conn.info("commandstats").values())


def test_a_refresh_costs_the_same_redis_commands_with_a_million_queued_jobs(conn, tiny):
    client = Client(connection=conn)
    client.submit([chat(tiny.target, f"{i}") for i in range(10)], batch_id="small")

    def cost() -> tuple[int, dict]:
        before = _commands(conn)
        snapshot = overview(conn)
        return _commands(conn) - before - 1, snapshot  # less the INFO that counted

    small, _ = cost()
    filler = keys.rq_queue_key("deep")
    ids = [f"big-{i:020x}" for i in range(10_000)]
    with conn.pipeline(transaction=False) as pipe:
        for _ in range(100):
            pipe.rpush(filler, *ids)
        pipe.execute()
    conn.sadd(keys.RQ_QUEUES, filler)
    conn.hset(keys.batch_key("big"), mapping={"total": 1_000_000, "created_at": 1.0})
    conn.zadd(keys.BATCHES, {"big": 2e9})
    big, snapshot = cost()
    assert {"name": "deep", "depth": 1_000_000} in snapshot["queues"]
    assert snapshot["batches"][0]["batch_id"] == "big"
    assert snapshot["batches"][0]["queued"] == 1_000_000
    # One batch more to show (its hash, done list head, errors) and one queue more (its
    # ring and its length): 5.
    assert big - small <= 5, (small, big)
    assert big < 40
    conn.delete(filler)


def test_the_page_in_a_browser_shows_progress_workers_and_errors_and_retries_and_cancels(
    gw, workers, conn, tiny, tmp_path
):
    from playwright.sync_api import expect, sync_playwright

    browser_path = _browser()
    g = gw
    _, _, later = _mixed_batch(conn, tiny, tmp_path, "page-batch")
    w = workers("--queue", "mlxq", name="page-worker")
    wait_for(lambda: Client(connection=conn).status("page-batch").finished, timeout=120)
    idle_client = Client(connection=conn, queue="nobody")
    idle_client.submit([chat(tiny.target, "never run")], batch_id="idle")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        # Not the suite's LD_PRELOAD of OpenBLAS (tests/run.sh): Chromium's renderer dies of it.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        browser = p.chromium.launch(executable_path=browser_path, env=env)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("dialog", lambda d: d.accept())
        page.goto(f"{g.url}/ui")

        page.fill("#key", "sk-wrong")
        page.press("#key", "Enter")  # the keyboard alone submits
        expect(page.locator("#status")).to_contain_text("refused")
        expect(page.locator("#data")).to_be_hidden()
        assert page.locator("#batches tbody tr").count() == 0

        page.fill("#key", KEY)
        page.click("text=Show the fleet")
        row = page.locator('tr[data-batch="page-batch"]')
        expect(row).to_contain_text("7/7 (100%)")
        expect(row.locator("td.state")).to_have_text("completed")
        errors = page.locator("tr.errors", has_text="page-batch")
        expect(errors).to_contain_text("context_length_exceeded")
        expect(errors).to_contain_text("late-")
        worker_row = page.locator("#workers tbody tr", has_text="page-worker")
        expect(worker_row.locator("td.state")).to_have_text("idle", timeout=seconds(30) * 1000)
        expect(page.locator("#queues tbody")).to_contain_text("nobody")
        page.screenshot(path=str(ARTIFACTS / "ui.png"), full_page=True)

        shutil.copytree(tiny.target, later)
        row.get_by_role("button", name="Retry failed page-batch").click()
        expect(page.locator("#status")).to_contain_text("5 failed job(s) queued again")
        wait_for(lambda: Client(connection=conn).status("page-batch").finished, timeout=120)
        expect(row.locator("td.num").nth(1)).to_have_text("2")  # failed: the two long ones
        expect(row.locator("td.num").nth(0)).to_have_text("5")  # succeeded

        idle = page.locator('tr[data-batch="idle"]')
        expect(idle.locator("td.state")).to_have_text("in progress")
        idle.get_by_role("button", name="Cancel idle").click()
        expect(idle.locator("td.state")).to_have_text("cancelled")
        page.screenshot(path=str(ARTIFACTS / "ui-after.png"), full_page=True)
        browser.close()
    assert Client(connection=conn).status("idle").cancelled == 1
    assert w.proc.poll() is None
