"""A real ``worker`` process whose model loads each take ``MLXQ_TEST_SLOW_LOAD_S`` longer.

Tests start it with ``python -m tests.slowload --name ... [worker options]`` to see
what a slow first load (a hub download, a cold disk) does to a job's lease.
"""

from __future__ import annotations

import os
import sys
import time

import mlx_lm.utils


def main() -> None:
    delay = float(os.environ["MLXQ_TEST_SLOW_LOAD_S"])
    real = mlx_lm.utils.load

    def slow_load(*args: object, **kwargs: object) -> object:
        time.sleep(delay)
        return real(*args, **kwargs)

    mlx_lm.utils.load = slow_load
    from worker.cli import main as worker_main

    worker_main(sys.argv[1:])


if __name__ == "__main__":
    main()
