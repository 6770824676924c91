"""The library's one clock (private): every deadline, wait and timing reads time here,
so tests replace it in one place (``with _clock.use(fake):``, process-wide).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class Clock:
    """Real time. Subclass and override to control time in a test."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, timeouts)."""
        return time.monotonic()

    def wall(self) -> float:
        """Seconds since the epoch (expiry stamps that other hosts read)."""
        return time.time()

    def perf(self) -> float:
        """A high-resolution clock for measuring phases (``LoadResult.timings``)."""
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """``event.wait(seconds)``; a fake clock may advance its time instead."""
        return event.wait(max(seconds, 0.0))


_current = Clock()


def monotonic() -> float:
    return _current.monotonic()


def wall() -> float:
    return _current.wall()


def perf() -> float:
    return _current.perf()


def sleep(seconds: float) -> None:
    _current.sleep(seconds)


def wait(event: threading.Event, seconds: float) -> bool:
    return _current.wait(event, seconds)


def pauses(first: float, longest: float) -> Iterator[float]:
    """Seconds to sleep between polls of a key another process writes: ``first``, then
    doubling up to ``longest`` (fast when the writer is quick, cheap for the store when
    it is slow)."""
    pause = first
    while True:
        yield pause
        pause = min(pause * 2, longest)


@contextlib.contextmanager
def use(clock: Clock) -> Iterator[Clock]:
    """Make ``clock`` the library's clock until the block ends (tests only)."""
    global _current
    previous, _current = _current, clock
    try:
        yield clock
    finally:
        _current = previous
