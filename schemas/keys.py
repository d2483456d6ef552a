"""The Redis key layout: the one place that spells mlxq's keys.

Every key an app may read is documented in docs/results.md ("Redis keys").
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime

PREFIX = "mlxq"

#: The only job function a worker runs (dotted path stored in RQ job hashes).
JOB_FUNCTION = "worker.jobs.run_chat_job"

#: The RQ queue jobs go to unless told otherwise.
DEFAULT_QUEUE = "mlxq"

#: The queue of the gateway's chat completions (someone is waiting): workers serve it
#: before the batch queues by default.
INTERACTIVE_QUEUE = "mlxq.interactive"

#: The tenant of jobs submitted without one; its jobs wait on the queue's own list.
DEFAULT_TENANT = "default"

#: Hash: tenant -> its weight in fair share (a number; 1 when unset).
TENANTS = f"{PREFIX}:tenants"

#: Hash: tenant -> the most jobs of it the fleet may hold at once (unset: no limit).
TENANT_LIMITS = f"{PREFIX}:tenant-limits"

#: Hash: tenant -> the most prompt + completion tokens its jobs may use per UTC day.
TENANT_QUOTAS = f"{PREFIX}:tenant-quotas"

#: Hash: tenant -> the URL its batches' webhook events are POSTed to.
TENANT_WEBHOOKS = f"{PREFIX}:tenant-webhooks"

#: Sorted set: webhook events to deliver ("<type> <batch id> <retried>"), scored by when
#: the next attempt is due (unix seconds); ``producer.webhooks`` delivers them.
WEBHOOKS = f"{PREFIX}:webhooks"

#: Hash: a pending event -> the unix time it was first due (given up a day after).
WEBHOOKS_SINCE = f"{PREFIX}:webhooks:since"


def webhook_log_key(batch_id: str) -> str:
    """List (capped at 20, batch TTL): the batch's webhook deliveries and failures (JSON)."""
    return f"{PREFIX}:batch:{batch_id}:webhooks"


#: Sorted sets ``mlxq:fair:<queue>``: the queue's lists with work (``<queue>@<tenant>``,
#: ``<queue>@<tenant>^<priority>`` and the queue's own), scored by their tenant's virtual
#: time (``schemas/lua/fair.lua``); sets ``mlxq:fair:<queue>@<tenant>:ranked``: a tenant's
#: lists of priority != 0 in the sorted set.
FAIR_PREFIX = f"{PREFIX}:fair:"

#: Lists ``mlxq:ring:<lane>``: a tenant's batches of one priority with work, taken from in
#: turn (``schemas/lua/fair.lua``). A lane is a list of :func:`tenant_queue`; a batch
#: submitted while its lane holds work waits on its own list ``<lane>#<batch id>``
#: (``producer.enqueue``), which the ring names, as it names the lane itself then.
RING_PREFIX = f"{PREFIX}:ring:"

#: Rings a depth count reads at most per lane (:func:`schemas.lanes.depths`).
RING_COUNTED = 100


def ring_key(lane: str) -> str:
    """List: the lists of ``lane`` (its own and its batches') with work, in turn order."""
    return f"{RING_PREFIX}{lane_of(lane)}"


def lane_of(queue: str) -> str:
    """The lane the list ``queue`` belongs to: itself, or the lane of a batch's own list.
    RQ's registries and queue set are the lane's (a batch's list has none of its own)."""
    return queue.split("#", 1)[0]


#: Lists ``mlxq:wake:<queue>``: a token per job put on one of the queue's lists (at most
#: 64, 30 s), which idle workers block on (a hint to take; ``schemas/lua/fair.lua``).
WAKE_PREFIX = f"{PREFIX}:wake:"


def wake_key(queue: str) -> str:
    """The list idle workers of ``queue`` (maybe a tenant's list of it) block on."""
    return f"{WAKE_PREFIX}{base_queue(queue)}"


#: Usage per tenant is kept this long (seconds) per day.
USAGE_TTL = 40 * 24 * 3600


def usage_key(day: str) -> str:
    """Hash, 40 days: ``<tenant>:<field>`` -> the day's (UTC, ``YYYY-MM-DD``) total of
    ``jobs``, ``failed``, ``prompt_tokens``, ``completion_tokens`` and ``job_seconds`` (each
    job's run time, so jobs batched together each count theirs)."""
    return f"{PREFIX}:usage:{day}"


def usage_day(at: float) -> str:
    """The UTC day (``YYYY-MM-DD``) of unix time ``at``."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")


_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def validate_tenant(tenant: str) -> str:
    """Return ``tenant`` if it is 1-32 lowercase letters, digits, '_' or '-' (first a letter
    or digit); else raise ValueError."""
    if not _TENANT_RE.fullmatch(tenant):
        raise ValueError(
            f"invalid tenant {tenant!r}: use 1-32 lowercase letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return tenant


#: A batch's priority within its tenant (``producer submit --priority``): higher first.
MIN_PRIORITY, MAX_PRIORITY = -9, 9


def validate_priority(priority: int) -> int:
    """Return ``priority`` if it is an integer from -9 to 9; else raise ValueError."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"invalid priority {priority!r}: use an integer")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"priority {priority} out of range: use {MIN_PRIORITY} to {MAX_PRIORITY} "
            "(higher runs first within its tenant; 0 by default)"
        )
    return priority


_QUEUE_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def validate_queue(queue: str) -> str:
    """Return ``queue`` if it is 1-128 letters, digits, '.', '_', ':' or '-'; else raise
    ValueError ('@', '^' and '#' name a queue's tenant, priority and batch lists)."""
    if not _QUEUE_RE.fullmatch(queue):
        raise ValueError(
            f"invalid queue {queue!r}: use 1-128 letters, digits, '.', '_', ':' or '-' "
            "('@', '^' and '#' are kept for a queue's tenant, priority and batch lists)"
        )
    return queue


def tenant_queue(queue: str, tenant: str, priority: int = 0) -> str:
    """The list a tenant's jobs of ``queue`` wait on: ``queue@tenant`` (the default
    tenant's: ``queue`` itself), ``queue@tenant^P`` for its batches of priority P != 0.
    Workers serve ``queue``; its take shares it fairly between tenants and, within a
    tenant, takes from its highest priority first."""
    validate_queue(queue)
    if not validate_priority(priority) and tenant == DEFAULT_TENANT:
        return queue
    validate_tenant(tenant)
    return f"{queue}@{tenant}^{priority}" if priority else f"{queue}@{tenant}"


def base_queue(queue: str) -> str:
    """The queue workers serve that the list ``queue`` (maybe ``queue@tenant[^P][#batch]``)
    is part of."""
    return lane_of(queue).split("@", 1)[0]


def tenant_of(queue: str) -> str:
    """The tenant whose jobs wait on the list ``queue``."""
    lane = lane_of(queue)
    return lane.split("@", 1)[1].split("^", 1)[0] if "@" in lane else DEFAULT_TENANT


def priority_of(queue: str) -> int:
    """The priority of the batches whose jobs wait on the list ``queue`` (0 if none)."""
    _, _, priority = lane_of(queue).partition("@")[2].partition("^")
    try:
        return int(priority) if priority else 0
    except ValueError:
        return 0


def fair_key(queue: str) -> str:
    """Sorted set: the lists of ``queue`` with work, by virtual time (fair share)."""
    return f"{FAIR_PREFIX}{base_queue(queue)}"


def batch_shapes_key(batch_id: str) -> str:
    """Hash (batch TTL): job id -> the shape of its /v1/responses or /v1/completions line
    (JSON, ``schemas.shapes``), which its output line is translated back to."""
    return f"{PREFIX}:batch:{batch_id}:shapes"


def batch_images_key(batch_id: str) -> str:
    """Hash (batch TTL): SHA-256 (hex) -> the bytes of an image the batch's jobs show,
    stored once however many jobs show it; a job's part names it ``mlxq-image:<sha256>``."""
    return f"{PREFIX}:batch:{batch_id}:images"


#: Sorted set of batch ids, scored by creation time (unix seconds).
BATCHES = f"{PREFIX}:batches"


def tenant_batches_key(tenant: str) -> str:
    """Sorted set: ``tenant``'s batch ids, scored by creation time (what its keys list)."""
    return f"{BATCHES}@{tenant}"


#: Sorted set: the ids of batches made through Anthropic's Message Batches API (also in
#: :data:`BATCHES`), scored by creation time: what ``GET /v1/messages/batches`` lists.
MESSAGE_BATCHES = f"{PREFIX}:msgbatches"


def message_batches_key(tenant: str | None) -> str:
    """Sorted set: ``tenant``'s message batch ids (every tenant's: None)."""
    return MESSAGE_BATCHES if tenant is None else f"{MESSAGE_BATCHES}@{tenant}"


def gone_batches(ids: list[str], tenant: str | None) -> list[tuple[str, list[str]]]:
    """(sorted set, members) to ZREM for batches whose hashes expired: from
    :data:`BATCHES`, and from ``tenant``'s set if they were read from it."""
    if not ids:
        return []
    sets = [BATCHES] + ([tenant_batches_key(tenant)] if tenant is not None else [])
    return [(key, ids) for key in sets]


#: List of JSON entries for jobs that could not run at all (no or corrupt job hash).
DEAD_LETTERS = f"{PREFIX}:dead"
DEAD_LETTERS_MAX = 10_000

#: Results and batch records live this long by default (7 days): batch work
#: is collected hours or days later, not within RQ's 500 s default.
DEFAULT_RESULT_TTL = 7 * 24 * 3600

_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_batch_id(batch_id: str) -> str:
    """Return ``batch_id`` if it is 1-64 letters, digits, '_' or '-'; else raise ValueError."""
    if not _ID_RE.fullmatch(batch_id):
        raise ValueError(f"invalid batch id {batch_id!r}: use 1-64 letters, digits, '_' or '-'")
    return batch_id


def is_batch_id(batch_id: str) -> bool:
    """Whether ``batch_id`` is a valid batch id (:func:`validate_batch_id`)."""
    return _ID_RE.fullmatch(batch_id) is not None


def job_id_for(batch_id: str, custom_id: str) -> str:
    """The deterministic job id of ``custom_id`` in ``batch_id``.

    Deterministic ids make resubmission idempotent: the same line of the same
    batch always maps to the same RQ job and the same result key.
    """
    digest = hashlib.sha256(custom_id.encode()).hexdigest()[:20]
    return f"{batch_id}-{digest}"


def batch_of(job_id: str) -> str:
    """The batch id a job id belongs to (inverse of :func:`job_id_for`)."""
    return job_id.rsplit("-", 1)[0]


_JOB_ID_RE = re.compile(r"([A-Za-z0-9_-]{1,64})-[0-9a-f]{20}")


def is_job_id(job_id: str) -> bool:
    """Whether ``job_id`` has the form :func:`job_id_for` gives (batch id, '-', 20 hex)."""
    return _JOB_ID_RE.fullmatch(job_id) is not None


def result_key(job_id: str) -> str:
    """String: the job's result record (JSON), with a TTL. Written once."""
    return f"{PREFIX}:result:{job_id}"


def batch_key(batch_id: str) -> str:
    """Hash: batch metadata and counters (total, succeeded, failed, created_at, ...)."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_jobs_key(batch_id: str) -> str:
    """List: the batch's job ids in submission order."""
    return f"{PREFIX}:batch:{batch_id}:jobs"


def batch_done_key(batch_id: str) -> str:
    """List: job ids pushed (RPUSH) as each job of the batch ends; apps may BLPOP it."""
    return f"{PREFIX}:batch:{batch_id}:done"


def batch_errors_key(batch_id: str) -> str:
    """List: the ids of the batch's first failed jobs (at most :data:`BATCH_ERRORS_KEPT`), in
    the order they failed; a job retried and failed again may be named twice."""
    return f"{PREFIX}:batch:{batch_id}:errors"


BATCH_ERRORS_KEPT = 20


#: Lists a gateway process waits on: a job's record writer pushes a copy of the record onto
#: the list its batch names (batch hash field ``notify``), so one reader per process gets
#: every record its requests wait for (``producer.serve.notify``).
NOTIFY_PREFIX = f"{PREFIX}:notify:"
#: Seconds a notify list outlives its last push: a gone gateway's list is not kept long.
NOTIFY_TTL = 300


def notify_key(listener: str) -> str:
    """List: records of ended jobs whose batch names this listener (a gateway process)."""
    return f"{NOTIFY_PREFIX}{listener}"


def crashes_key(job_id: str) -> str:
    """String (counter): how many times the job's worker died while running it."""
    return f"{PREFIX}:crashes:{job_id}"


def queue_for_model(model: str) -> str:
    """The RQ queue of jobs routed by model (``producer submit --route model``).

    ``mlxq.m.<readable tail of the name>.<8 hex of its sha256>``: readable in
    dashboards, unique per model name (hub id or path).
    """
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")[-48:]
    return f"{PREFIX}.m.{tail}.{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def response_key(response_id: str) -> str:
    """String: a stored Responses API response and the conversation it ends (JSON, chat
    TTL; ``producer.serve.responses``)."""
    return f"{PREFIX}:response:{response_id}"


def stream_key(job_id: str) -> str:
    """Stream: the job's ``chat.completion.chunk`` objects (field ``chunk``), for stream=true."""
    return f"{PREFIX}:stream:{job_id}"


#: Hash: job id -> "<lease token> <queue>" for every job a worker holds (taken, not yet
#: ended). The job lifecycle (``worker.lifecycle.held``) is the only writer.
RUNNING = f"{PREFIX}:running"

#: Sorted set: lease token (one per worker process) -> when its lease ends, in Redis
#: server milliseconds. One lease covers every job the process holds.
LEASES = f"{PREFIX}:leases"

#: Hash: lease token -> JSON ``{"name", "host", "pid", "inbox_queue"}`` of its process.
HOLDERS = f"{PREFIX}:holders"


def inbox_key(token: str) -> str:
    """List: the id a worker's blocking wait moved off its first queue, before it is taken."""
    return f"{PREFIX}:inbox:{token}"


#: Sorted set of worker names, scored by their last registry heartbeat (unix seconds).
WORKERS = f"{PREFIX}:workers"


def worker_key(name: str) -> str:
    """String (JSON), short TTL: a live worker's published state (models, stats)."""
    return f"{PREFIX}:worker:{name}"


def file_key(file_id: str) -> str:
    """Hash, TTL: a file uploaded to the gateway (``id``, ``filename``, ``purpose``, ``bytes``,
    ``created_at``)."""
    return f"{PREFIX}:file:{file_id}"


def file_data_key(file_id: str) -> str:
    """List, TTL: the uploaded file's bytes in pieces of at most 1 MiB, in order."""
    return f"{PREFIX}:file:{file_id}:data"


def batch_queues_key(batch_id: str) -> str:
    """Set: the queues a batch's jobs were put on."""
    return f"{PREFIX}:batch:{batch_id}:queues"


def rq_job_key(job_id: str) -> str:
    """Hash: RQ's own job record (status, timestamps, JSON-serialised call)."""
    return f"rq:job:{job_id}"


def rq_queue_key(queue: str) -> str:
    """List: RQ's queue of job ids."""
    return f"rq:queue:{queue}"


def rq_started_key(queue: str) -> str:
    """Sorted set: RQ's started registry, ``job_id:<lease token>`` of running jobs.

    mlxq scores its entries ``+inf``: leases live in :data:`LEASES`, so RQ's own
    cleanup of this registry never fails an mlxq job behind mlxq's back.
    """
    return f"rq:wip:{lane_of(queue)}"


def rq_finished_key(queue: str) -> str:
    """Sorted set: RQ's finished registry (job ids scored by expiry, unix seconds)."""
    return f"rq:finished:{lane_of(queue)}"


def rq_failed_key(queue: str) -> str:
    """Sorted set: RQ's failed registry (job ids scored by expiry, unix seconds)."""
    return f"rq:failed:{lane_of(queue)}"


def rq_results_key(job_id: str) -> str:
    """Stream: RQ's results of a job; mlxq adds one for a failed job (its error, for rq-dashboard
    and ``Job.latest_result()``). A succeeded job's result is the mlxq record alone."""
    return f"rq:results:{job_id}"


#: Set: the keys of every RQ queue list (``rq info`` lists queues from it).
RQ_QUEUES = "rq:queues"

_RQ_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


def rq_time(at: datetime | None = None) -> str:
    """A timestamp in the format RQ stores in its hashes."""
    return (at or datetime.now(UTC)).strftime(_RQ_TIME)


#: Set: the keys of RQ's live workers (``rq info`` and rq-dashboard read it).
RQ_WORKERS = "rq:workers"

#: String: present while ``rq suspend`` holds the workers; mlxq's take honours it.
RQ_SUSPENDED = "rq:suspended"


def rq_worker_key(name: str) -> str:
    """Hash: RQ's record of a worker (state, current_job, queues, counters, heartbeat)."""
    return f"rq:worker:{name}"


def rq_queue_workers_key(queue: str) -> str:
    """Set: the keys of RQ's workers listening on ``queue``."""
    return f"rq:workers:{queue}"


#: Hash: the index of the fleet's shared figures, scope -> label (``schemas.figures``).
FIGURES = f"{PREFIX}:figures"


def figures_key(scope: str) -> str:
    """Hash of one scope's shared figures: worker process -> what it measured."""
    return f"{FIGURES}:{scope}"
