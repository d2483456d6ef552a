"""The job lifecycle's state transitions, each one Lua script (atomic in Redis).

The sources are ``schemas/lua/<name>.lua`` (keys and arguments at the top of each),
loaded by :func:`schemas.scripts.source`.

Keys (names from ``schemas.keys``; ``<token>`` is one worker process's lease token)::

    rq:queue:<q>            list    RQ's queue of job ids (producers LPUSH/RPUSH)
    rq:job:<id>             hash    RQ's job (JSON call in ``data``; status, times)
    mlxq:running            hash    id -> "<token> <q>": every job a worker holds
    mlxq:leases             zset    token -> lease end (Redis server ms); one lease
                                    covers every job its process holds
    mlxq:holders            hash    token -> {"name", "host", "pid", "inbox_queue"}
    mlxq:inbox:<token>      list    an id a blocking wait moved off the first queue
    mlxq:result:<id>        string  the result record, written once
    mlxq:crashes:<id>       string  how often the job's holder died
    rq:wip:<q>              zset    RQ's started registry: "<id>:<token>" -> +inf
    rq:finished:<q>, rq:failed:<q>  RQ's registries: id -> expiry (unix s)
    rq:worker:<name>        hash    RQ's worker record (state, current_job, counts)

A job is *held* from the moment TAKE pops it until END (or REQUEUE) clears its
``mlxq:running`` entry, and its holder's lease covers it all that time, however
long the holder spends loading a model, prefilling or waiting on Redis. When a
lease runs out (the process died, or stalled longer than the lease), RECOVER
gives its jobs back: to the front of their queue, or to the recovering worker
to fail as poison once they have killed ``max_crashes`` holders. Leases are
timed by Redis's clock (TIME), so workers' clocks do not matter. RQ's started
registry entries are scored ``+inf``: RQ's own cleanups never act on them.
"""

from __future__ import annotations

from schemas.scripts import source

#: Take the next job (the inbox first, then the queues in order) and start it.
TAKE = source("take")
#: End a held job: write its record once, then RQ's bookkeeping, then let go of it.
END = source("end")
#: Give a held job back, unstarted, to the front of its queue.
REQUEUE = source("requeue")
#: Extend this process's lease (registering it when absent), and RQ's worker heartbeat.
RENEW = source("renew")
#: Give back the jobs of every process whose lease ended (or that has none).
RECOVER = source("recover")
#: Remove expired entries from RQ's finished and failed registries, in bounded steps.
PRUNE = source("prune")
#: A clean exit: hand back anything still held or in the inbox, end the lease.
UNREGISTER = source("unregister")
