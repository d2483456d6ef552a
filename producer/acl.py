"""Least-privilege Redis users for each role of an mlxq fleet, and a check of a live Redis.

Every role sees only mlxq's and RQ's keys (``~mlxq:* ~rq:*``) and mlxq's channels,
and none may run a command in Redis' ``@dangerous`` category (``FLUSHALL``,
``CONFIG``, ``KEYS``, ``INFO``, ``CLIENT KILL``, ...). ``producer acl file`` writes
the users as a Redis ACL file (``--aclfile``); ``producer acl check USER --role R``
asks a live Redis, with ``ACL DRYRUN``, whether USER may run every command role R
sends (measured: ``tests/test_acl.py`` runs each role end to end with its user and
checks the commands it sent against :data:`NEEDS`) and none it must not.
"""

from __future__ import annotations

from collections.abc import Mapping

from redis import Redis
from redis.exceptions import ResponseError

#: mlxq's keys and channels: the only ones any role may touch.
NAMESPACE = "resetkeys ~mlxq:* ~rq:* resetchannels &mlxq:*"
# +time: the lifecycle's scripts time leases by the server's clock.
_WRITER = "-@all +@connection +@read +@write +@scripting +@transaction +time -@dangerous -function"

#: Each role's ACL rules (after its password).
ROLES: dict[str, str] = {
    "producer": f"{NAMESPACE} {_WRITER}",
    "worker": f"{NAMESPACE} {_WRITER} +@blocking",
    "gateway": f"{NAMESPACE} {_WRITER} +@blocking +@pubsub",
    # Dashboards and scripts that read results: nothing that writes.
    "reader": f"{NAMESPACE} -@all +@connection +@read -@dangerous",
    # producer metrics: reads, and the server's clock for lease ages.
    "exporter": f"{NAMESPACE} -@all +@connection +@read +time -@dangerous",
    # A replica's link to its primary, and Sentinel's (as Redis' documentation lists them).
    "replica": "resetkeys resetchannels -@all +psync +replconf +ping",
    "sentinel": (
        "resetkeys allchannels -@all +multi +slaveof +ping +exec +subscribe +config|rewrite "
        "+role +publish +info +client|setname +client|kill +script|kill"
    ),
}
#: An operator's user (everything) for ``producer acl check`` and maintenance.
ADMIN = "~* &* +@all"

_KEY, _JOB = "mlxq:acl-check", "rq:job:acl-check"
#: What each role sends (command and sample arguments within its keys), by the
#: commands each sent in tests/test_acl.py's end-to-end runs.
_READS = [
    ["get", _KEY],
    ["mget", _KEY, _JOB],
    ["hget", _JOB, "status"],
    ["hgetall", _JOB],
    ["hmget", _JOB, "status"],
    ["hkeys", _KEY],
    ["hlen", _KEY],
    ["hexists", _JOB, "status"],
    ["exists", _KEY],
    ["llen", _KEY],
    ["lrange", _KEY, "0", "-1"],
    ["lindex", _KEY, "0"],
    ["lpos", _KEY, "x"],  # (in scripts: a lane's ring, when its batches take turns)
    ["smembers", _KEY],
    ["scard", _KEY],
    ["zrange", _KEY, "0", "-1"],
    ["zrevrange", _KEY, "0", "-1"],
    ["zcard", _KEY],
    ["zscore", _KEY, "x"],
    ["zrangebyscore", _KEY, "0", "1"],
    ["ttl", _KEY],
    ["ping"],
    ["hello"],
]
_WRITES = [
    ["set", _KEY, "1"],
    ["del", _KEY],
    ["expire", _KEY, "10"],
    ["hset", _JOB, "status", "queued"],
    ["hdel", _JOB, "status"],
    ["hsetnx", _JOB, "status", "queued"],
    ["hincrby", _KEY, "n", "1"],
    ["hincrbyfloat", _KEY, "s", "0.5"],
    ["rpush", _KEY, "x"],
    ["ltrim", _KEY, "0", "-1"],
    ["lrem", _KEY, "0", "x"],
    ["lpop", _KEY],
    ["lmove", _KEY, _KEY + ":b", "RIGHT", "LEFT"],
    ["sadd", _KEY, "x"],
    ["srem", _KEY, "x"],
    ["zadd", _KEY, "1", "x"],
    ["zrem", _KEY, "x"],
    ["evalsha", "0" * 40, "1", _KEY],
    ["eval", "return 1", "1", _KEY],
    ["script", "load", "return 1"],
    ["multi"],
    ["exec"],
    ["time"],
    ["wait", "1", "100"],
]
NEEDS: dict[str, list[list[str]]] = {
    "producer": _READS + _WRITES,
    "worker": _READS + _WRITES + [["blpop", _KEY, "1"]],  # (idle: on its queues' wake list)
    "gateway": _READS + _WRITES + [["blpop", _KEY, "1"], ["subscribe", "mlxq:notify:x"]],
    "reader": _READS,
    "exporter": [*_READS, ["time"]],
}
#: What no mlxq role may do, whatever it needs.
FORBIDDEN: list[list[str]] = [
    ["flushall"],
    ["flushdb"],
    ["config", "get", "*"],
    ["keys", "*"],
    ["info"],
    ["client", "kill", "id", "1"],
    ["set", "other:key", "1"],
    ["get", "other:key"],
    ["debug", "sleep", "0"],
]
#: And what the read-only roles may not do either.
READ_ONLY_FORBIDDEN: list[list[str]] = [
    ["set", _KEY, "1"],
    ["del", _KEY],
    ["evalsha", "0" * 40, "1", _KEY],
]


def acl_file(passwords: Mapping[str, str] | None = None) -> str:
    """The ACL file: ``default`` off, ``admin`` and one user per role. Without
    ``passwords`` each password is a placeholder ``@ROLE_PASSWORD@`` (the shipped
    template, which the compose file fills from the environment)."""

    def password(role: str) -> str:
        if passwords is None:
            return f"@{role.upper()}_PASSWORD@"
        if not passwords.get(role):
            raise ValueError(f"no password for the {role!r} user")
        if any(c.isspace() for c in passwords[role]):
            raise ValueError(f"the {role!r} password has whitespace (an ACL file cannot hold it)")
        return passwords[role]

    lines = [  # (an ACL file holds no comments: redis-server refuses the whole file)
        "user default off",
        f"user admin on >{password('admin')} {ADMIN}",
    ]
    lines += [f"user {role} on >{password(role)} {rules}" for role, rules in ROLES.items()]
    return "\n".join(lines) + "\n"


def dry_run(conn: Redis, user: str, command: list[str]) -> str | None:
    """None if ``user`` may run ``command`` (``ACL DRYRUN``), else Redis' reason."""
    try:
        reply = conn.execute_command("ACL", "DRYRUN", user, *command)
    except ResponseError as e:
        return str(e)
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return None if text == "OK" else text


def check(conn: Redis, user: str, role: str) -> list[str]:
    """What is wrong with ``user`` for ``role`` on the Redis behind ``conn`` (an admin
    connection): every command the role needs that it may not run, and every command
    it must not run that it may. Empty when the user fits the role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    problems = []
    for command in NEEDS.get(role, []):
        why = dry_run(conn, user, command)
        if why is not None:
            problems.append(f"missing: {' '.join(command)} ({why})")
    forbidden = FORBIDDEN + (READ_ONLY_FORBIDDEN if role in ("reader", "exporter") else [])
    if role in NEEDS:
        for command in forbidden:
            if dry_run(conn, user, command) is None:
                problems.append(f"too much: {' '.join(command)} is allowed")
    return problems
