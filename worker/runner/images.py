"""Where a job's images come from, beside those inline: its own batch's image hash in
Redis (``schemas.images``: a job reads its batch's images only) and the http(s) hosts
the worker's operator allows (``worker.runner.imagehosts``). The engine keeps decoded
images by SHA-256, so each comes here once per worker."""

from __future__ import annotations

from redis import Redis

from schemas import keys
from schemas.images import digest_of
from worker.engine.images import Fetch
from worker.lifecycle.held import Job
from worker.runner.imagehosts import ImageHosts


def images_of(conn: Redis, job: Job, hosts: ImageHosts) -> Fetch:
    """Fetch one image of ``job`` by reference (its batch's) or URL (an allowed host's)."""
    key = keys.batch_images_key(job.envelope.batch_id)

    def fetch(url: str, max_bytes: int, where: str) -> bytes | None:
        digest = digest_of(url)
        if digest is not None:
            return conn.hget(key, digest)  # type: ignore[return-value]
        return hosts.fetch(url, max_bytes, where)

    return fetch
