"""Where a job's images come from, beside those inline (``worker.engine.images``):

- ``mlxq-image:<sha256>``: its own batch's image hash in Redis (``schemas.images``), never
  another batch's;
- ``mlxq-file:<id>``: an image uploaded through the gateway's Files API (purpose
  ``vision``) by its own tenant; another tenant's file is "not found", as a missing one;
- an http(s) URL: a host the worker's operator allows (``worker.runner.imagehosts``).

Each is checked for every job, even when the decoded image is cached; the bytes come
once per worker.
"""

from __future__ import annotations

from redis import Redis

from schemas import InvalidRequestError, keys
from schemas.images import FILE_REF, digest_of
from worker.lifecycle.held import Job
from worker.runner.imagehosts import ImageHosts


class JobImages:
    """The images one job may see (an :class:`worker.engine.images.ImageSource`)."""

    def __init__(self, conn: Redis, job: Job, hosts: ImageHosts) -> None:
        self.conn, self.job, self.hosts = conn, job, hosts
        self.batch = keys.batch_images_key(job.envelope.batch_id)
        self._tenant: str | None = None

    def check(self, url: str, where: str) -> None:
        if (digest := digest_of(url)) is not None:
            if not self.conn.hexists(self.batch, digest):
                raise _not_stored(digest, where)
        elif (file_id := FILE_REF.fullmatch(url)) is not None:
            self._file(file_id.group(1), where)
        elif not url.startswith(("https://", "http://")):
            raise InvalidRequestError(f"{where}: not an image this worker reads")

    def fetch(self, url: str, max_bytes: int, where: str) -> bytes:
        if (digest := digest_of(url)) is not None:
            data = self.conn.hget(self.batch, digest)
            if data is None:  # (gone since the check: its batch expired)
                raise _not_stored(digest, where)
            return data  # type: ignore[return-value]
        if (file_id := FILE_REF.fullmatch(url)) is not None:
            size = self._file(file_id.group(1), where)
            if size > max_bytes:
                raise InvalidRequestError(
                    f"{where} is {size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB"
                )
            pieces = self.conn.lrange(keys.file_data_key(file_id.group(1)), 0, -1)
            return b"".join(pieces)  # type: ignore[arg-type]
        return self.hosts.fetch(url, max_bytes, where)

    def _file(self, file_id: str, where: str) -> int:
        """An uploaded image file's size, if this job's tenant owns it (raises if not)."""
        raw = self.conn.hmget(keys.file_key(file_id), ["tenant", "purpose", "bytes"])
        tenant, purpose, size = (v.decode() if v is not None else None for v in raw)  # type: ignore[union-attr]
        if size is None or (tenant or keys.DEFAULT_TENANT) != self.tenant:
            raise InvalidRequestError(f"{where}: no file {file_id!r} (of this tenant)")
        if purpose != "vision":
            raise InvalidRequestError(
                f"{where}: file {file_id!r} has purpose {purpose!r}; an image is uploaded "
                "with purpose 'vision'"
            )
        return int(size)

    @property
    def tenant(self) -> str:
        """The job's tenant: its batch's, else its queue's."""
        if self._tenant is None:
            batch = keys.batch_key(self.job.envelope.batch_id)
            found = self.conn.hget(batch, "tenant")
            self._tenant = found.decode() if found else keys.tenant_of(self.job.queue)  # type: ignore[union-attr]
        return self._tenant


def _not_stored(digest: str, where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{where}: image {digest[:12]}... is not stored with this job's batch (its batch "
        "expired, or the reference was not made by the producer)"
    )


def images_of(conn: Redis, job: Job, hosts: ImageHosts) -> JobImages:
    """Where ``job``'s stored images, files and URLs come from."""
    return JobImages(conn, job, hosts)
