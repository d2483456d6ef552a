"""Audio runs: how many rows a run holds, and when another recording may join it.

Pure Python: the runner (``worker.runner.audiojobs``) asks, with what it counts.
"""

from __future__ import annotations

from collections.abc import Callable

#: Recordings in flight at once, and decoder rows (windows) at once.
MAX_JOBS = 32
MAX_ROWS = 16
#: No more recordings join while those in flight add up to this much audio (each holds its
#: spectrogram: 4 h of audio is 460 MB of it).
MAX_IN_FLIGHT_S = 4 * 3600


def rows_that_fit(row_bytes: int, fits: Callable[[int], bool], most: int = MAX_ROWS) -> int:
    """Rows for a run: ``most``, halved until their caches fit beside the models (at
    least one: a row that does not fit either fails the run's jobs by name)."""
    rows = most
    while rows > 1 and not fits(rows * row_bytes):
        rows //= 2
    return rows


def may_join(
    in_flight: int, idle: int, room: int, audio_s: float, ahead: Callable[[], bool]
) -> bool:
    """Whether another recording may join a run: fewer than :data:`MAX_JOBS` in flight,
    fewer waiting for a row than rows free (else it would only wait), less than
    :data:`MAX_IN_FLIGHT_S` of audio held, and no work on a queue served first (that work
    runs once the recordings in flight end; asked last: it is a look at Redis)."""
    return in_flight < MAX_JOBS and idle < room and audio_s < MAX_IN_FLIGHT_S and not ahead()
