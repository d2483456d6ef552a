"""The job lifecycle and the fleet's records: Redis only, no MLX, no engines.

- ``held``: take, refuse, start (lease), renew, end, requeue, recover: every job a
  worker holds goes through these transitions, each one Lua script (``scripts``);
- ``heartbeat``: the one thread that keeps a process's lease and runs recovery;
- ``registry``: the worker's public records (``producer fleet``, RQ's worker record);
- ``streaming``: a streamed job's chunks on its Redis stream.
"""
