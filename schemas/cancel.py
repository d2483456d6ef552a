"""Cancelled batches: a flag on the batch record that every job taker checks.

``producer cancel`` sets ``cancelled_at`` on ``mlxq:batch:<id>`` (one command,
whatever the batch's size). From then on a worker never starts a job of that
batch: ``drop`` (``schemas/lua/drop.lua``) runs on each such id a worker's take (or the cancel
command's own sweep of the queue heads) pops. The job gets no result record;
readers (``producer status`` / ``results``, :class:`producer.Client`) count it
cancelled from the flag. Its hash shrinks to its status and custom_id until the
batch record expires, so ``producer results`` can still name it.
"""

from __future__ import annotations

#: The batch-hash field that marks a batch cancelled (unix seconds).
CANCELLED_AT = "cancelled_at"
