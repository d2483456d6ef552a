"""Least-privilege users: each role does its job end to end with its own Redis user,
sends only the commands ``producer acl check`` checks it for, and cannot do more."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis
from redis.exceptions import NoPermissionError

from producer.acl import NEEDS, ROLES, acl_file
from producer.cli import main as producer_main
from producer.localredis import LocalRedis
from tests.conftest import chat, write_jsonl
from tests.waiting import seconds

ROOT = Path(__file__).parent.parent


class AclRedis:
    def __init__(self, server: LocalRedis, passwords: dict[str, str]) -> None:
        self.server, self.passwords = server, passwords

    def url(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.server.port}/0"

    def conn(self, role: str) -> Redis:
        return Redis.from_url(self.url(role))


@pytest.fixture
def acl_redis(tmp_path) -> Iterator[AclRedis]:
    passwords = {r: secrets.token_hex(12) for r in ["admin", *ROLES]}
    path = tmp_path / "users.acl"
    path.write_text(acl_file(passwords))
    server = LocalRedis(data_dir=tmp_path / "redis", extra_args=("--aclfile", str(path)))
    with server:
        yield AclRedis(server, passwords)


def commands_sent(admin: Redis) -> set[str]:
    """Commands the server ran since the last ``CONFIG RESETSTAT`` (scripts' included)."""
    stats = admin.info("commandstats")
    return {k.removeprefix("cmdstat_") for k in stats} - {"config|resetstat", "info"}


def needed(role: str) -> set[str]:
    out = set()
    for command in NEEDS[role]:
        name = command[0]
        out.add(f"{name}|{command[1]}" if name in ("script", "client", "acl") else name)
    return out


def cli(*args: str) -> str:
    result = CliRunner().invoke(producer_main, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_each_role_works_with_its_own_user_and_sends_what_acl_check_checks(
    acl_redis, tiny, tmp_path, workers
):
    admin = acl_redis.conn("admin")
    sent: dict[str, set[str]] = {}
    jobs = [chat(tiny.target, content=f"job {i}", max_tokens=3, temperature=0) for i in range(3)]
    path = write_jsonl(tmp_path / "jobs.jsonl", jobs)

    admin.config_resetstat()
    batch = cli("submit", str(path), "--redis-url", acl_redis.url("producer")).strip()
    # a second batch while the first waits: it takes turns (its own list, the lane's ring)
    cli("submit", str(path), "--redis-url", acl_redis.url("producer"))
    cli("status", batch, "--redis-url", acl_redis.url("producer"))
    sent["producer"] = commands_sent(admin)

    admin.config_resetstat()
    env = os.environ | {
        "MLXQ_REDIS_URL": acl_redis.url("worker"),
        "MLXQ_MODEL_DIRS": str(tiny.root),
    }
    worker = Path(sys.executable).with_name("worker")
    proc = subprocess.run(
        [str(worker), "--burst", "--name", "acl-w"],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(300),
    )
    assert proc.returncode == 0, proc.stderr
    assert "NOPERM" not in proc.stderr and "password" not in proc.stderr.lower()
    sent["worker"] = commands_sent(admin)

    admin.config_resetstat()
    out = tmp_path / "out.jsonl"
    cli("results", batch, "--redis-url", acl_redis.url("reader"), "-o", str(out))
    assert len(out.read_text().splitlines()) == 3 and '"status_code":200' in out.read_text()
    sent["reader"] = commands_sent(admin)

    admin.config_resetstat()
    scraped = cli("metrics", "--once", "--redis-url", acl_redis.url("exporter"))
    assert "mlxq_batch_jobs" in scraped and f'batch="{batch}",status="succeeded"}} 3.0' in scraped
    sent["exporter"] = commands_sent(admin)

    assert all(sent.values()), sent
    assert {role: commands - needed(role) for role, commands in sent.items()} == {
        role: set() for role in sent
    }
    # ... and producer acl check passes for every role's user.
    for role in sent:
        assert "fits role" in cli(
            "acl", "check", role, "--role", role, "--redis-url", acl_redis.url("admin")
        )


def test_the_gateway_answers_with_its_user(acl_redis, tiny, workers):
    from starlette.testclient import TestClient

    from producer.serve.app import create_app
    from producer.serve.settings import GatewaySettings

    workers(name="acl-gw-w", url=acl_redis.url("worker"), env={"MLXQ_MODEL_DIRS": str(tiny.root)})
    admin = acl_redis.conn("admin")
    settings = GatewaySettings(redis_url=acl_redis.url("gateway"), api_keys=frozenset({"sk-a"}))
    with TestClient(create_app(settings)) as http:
        admin.config_resetstat()
        body = chat(tiny.target, max_tokens=3, temperature=0)
        reply = http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-a"}
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None
        metrics = http.get("/metrics", headers={"Authorization": "Bearer sk-a"})
        assert metrics.status_code == 200 and "rq_workers" in metrics.text
    # The gateway's and the worker's commands (they ran side by side).
    assert commands_sent(admin) <= needed("gateway") | needed("worker")


def test_roles_cannot_do_more_and_acl_check_names_what_is_wrong(acl_redis):
    for role in ("producer", "worker", "gateway", "reader", "exporter"):
        conn = acl_redis.conn(role)
        for command in (["FLUSHALL"], ["CONFIG", "GET", "*"], ["KEYS", "*"], ["SET", "x", "1"]):
            with pytest.raises(NoPermissionError):
                conn.execute_command(*command)
    for role in ("reader", "exporter"):
        with pytest.raises(NoPermissionError):
            acl_redis.conn(role).set("mlxq:result:x", "forged")
    admin = acl_redis.conn("admin")
    url = acl_redis.url("admin")
    admin.execute_command("ACL", "SETUSER", "worker", "-evalsha")
    admin.execute_command("ACL", "SETUSER", "reader", "+set")
    for user, role, word in (
        ("worker", "worker", "missing: evalsha"),
        ("reader", "reader", "too much: set"),
    ):
        result = CliRunner().invoke(
            producer_main, ["acl", "check", user, "--role", role, "--redis-url", url]
        )
        assert result.exit_code == 1 and word in result.output, result.output
    # the default user is off: no anonymous access at all
    with pytest.raises(Exception, match=r"(?i)auth|noperm"):
        Redis(port=acl_redis.server.port).ping()


def test_the_shipped_acl_template_is_what_producer_acl_file_writes():
    shipped = (ROOT / "examples" / "redis" / "users.acl.template").read_text()
    assert shipped == acl_file() == cli("acl", "file")
    assert "user default off" in shipped and "@WORKER_PASSWORD@" in shipped


def test_the_compose_redis_runs_with_the_users_from_the_environment(tmp_path):
    import time

    import yaml

    from producer.localredis import free_port

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    script = compose["services"]["redis"]["command"][2].replace("$$", "$")  # compose's escape
    port = free_port()
    script = script.replace("/mlxq-acl", str(ROOT / "examples" / "redis"))
    script = script.replace("/tmp/users.acl", str(tmp_path / "users.acl"))
    script = script.replace(
        "exec redis-server $args", f"exec redis-server $args --port {port} --dir {tmp_path}"
    )
    roles = ["admin", *ROLES]
    env = os.environ | {f"MLXQ_ACL_{r.upper()}_PASSWORD": secrets.token_hex(8) for r in roles}
    missing = subprocess.run(
        ["sh", "-c", script],
        env={k: v for k, v in env.items() if k != "MLXQ_ACL_READER_PASSWORD"},
        capture_output=True,
        text=True,
        timeout=seconds(30),
    )
    assert missing.returncode == 1 and "set MLXQ_ACL_READER_PASSWORD" in missing.stdout
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        worker = Redis(port=port, username="worker", password=env["MLXQ_ACL_WORKER_PASSWORD"])
        deadline = time.monotonic() + seconds(10)
        while True:
            try:
                assert worker.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with pytest.raises(NoPermissionError):
            worker.flushall()
        with pytest.raises(Exception, match=r"(?i)auth|noperm"):
            Redis(port=port).ping()
    finally:
        proc.terminate()
        proc.wait(seconds(10))
