"""Where a job's stored images are: its own batch's image hash in Redis
(``schemas.images``). A job reads its batch's images only, each once per worker (the
engine keeps decoded images by SHA-256)."""

from __future__ import annotations

from redis import Redis

from schemas import keys
from worker.engine.images import Fetch
from worker.lifecycle.held import Job


def images_of(conn: Redis, job: Job) -> Fetch:
    """Fetch one stored image of ``job``'s batch by SHA-256 (None: not there)."""
    key = keys.batch_images_key(job.envelope.batch_id)

    def fetch(digest: str) -> bytes | None:
        return conn.hget(key, digest)  # type: ignore[return-value]

    return fetch
