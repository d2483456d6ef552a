"""The engines: pure MLX and mlx-lm, no Redis, no jobs.

One request preparation (``request``), one sequence type every engine advances
(``sequence``) and one output (``output``); engines behind one protocol
(``protocol``, run to their end by ``protocol.run_to_end``): one sequence alone
(``single``: plain through mlx-lm's loop, speculative through ``speculate``, exact on
every cache type by ``rewind``), a continuous batch (``batch``, which also runs n
choices of one prompt, ``generator``), a speculative batch (``specbatch``, with the
accept, count and draft rules of ``speculate``). The model cache (``models``), the prefix
cache (``prefix``, its snapshots of every cache type in ``layers``), memory
measurement (``memory``), constrained decoding (``constrain``), sampling and
logprobs live here too.
"""

from worker.engine.output import GenerationOutput
from worker.engine.protocol import NO_START, Engine, Start, Step
from worker.engine.request import (
    GenerationParams,
    Prepared,
    message_boundary,
    params_for,
    prepare,
    prompt_tokens,
)
from worker.engine.sequence import Sequence, StopScan

__all__ = [
    "NO_START",
    "Engine",
    "GenerationOutput",
    "GenerationParams",
    "Prepared",
    "Sequence",
    "Start",
    "Step",
    "StopScan",
    "message_boundary",
    "params_for",
    "prepare",
    "prompt_tokens",
]
