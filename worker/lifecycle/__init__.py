"""The job lifecycle and the fleet's records: Redis only, no MLX, no engines.

- ``held``: a job's transitions, take (and start), refuse, end, requeue: every job a
  worker holds goes through them, each one Lua script (``scripts``);
- ``upkeep``: the process's lease (register, renew, unregister) and the fleet's upkeep
  (recover, poison, reconcile, prune), mixed into ``held.Lifecycle``;
- ``heartbeat``: the one thread that keeps a process's lease and runs recovery;
- ``registry``: the worker's public records (``producer fleet``, RQ's worker record);
- ``streaming``: a streamed job's chunks on its Redis stream.
"""
