"""Scheduling: what runs together, when to speculate, admission by memory.

Pure Python: neither Redis nor MLX, so every decision is testable in
milliseconds. The runner feeds it measurements and asks it questions:

- ``policy``: plain or speculative, and k, per (target, draft) pair; a batch or
  one at a time; which kind of batch (``--speculative auto``);
- ``goodput``: each round's k inside a speculative batch;
- ``batchsize``: what batches measured (``BatchMemory``) and how large a batch grows
  (``--max-batch auto``); the policy reads it to choose a batch or one at a time;
- ``route``: a job's route, decided once when it is taken (every question above);
- ``grouping``: which jobs may share a batch;
- ``admission``: the KV bytes a batch can grow to;
- ``step``: the rules between a running batch's steps (join or beside, a place at the
  cap, the prefill budget, the time share of jobs beside it), with their constants;
- ``estimators``: the running averages, cost lines and acceptance they all use.
"""
