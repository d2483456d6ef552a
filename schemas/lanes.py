"""How many jobs wait in a lane: its own list and its batches' own lists.

A lane is one tenant's list of one priority (:func:`schemas.keys.tenant_queue`). A batch
submitted while its lane holds work waits on its own list, ``<lane>#<batch id>``, and
takes turns with the lane's other batches (``schemas/lua/fair.lua``): the lane's ring
(:func:`schemas.keys.ring_key`) names the lists with work. RQ's queue set names lanes
only, so every depth a reader shows counts the ring's lists too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas import keys

if TYPE_CHECKING:
    from redis import Redis


def depths(conn: Redis, lanes: Sequence[str]) -> list[int]:
    """The jobs waiting in each of ``lanes`` (up to :data:`~schemas.keys.RING_COUNTED` of
    its lists counted), in two pipelined round trips."""
    with conn.pipeline(transaction=False) as pipe:
        for lane in lanes:
            pipe.lrange(keys.ring_key(lane), 0, keys.RING_COUNTED - 1)
        rings = pipe.execute()
    lists = [{lane} | {m.decode() for m in ring} for lane, ring in zip(lanes, rings, strict=True)]
    with conn.pipeline(transaction=False) as pipe:
        for names in lists:
            for name in names:
                pipe.llen(keys.rq_queue_key(name))
        found = iter(pipe.execute())
    return [sum(int(next(found)) for _ in names) for names in lists]
