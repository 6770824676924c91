"""The per-worker send-rate cap: one token bucket shared by all outgoing transfers.

``Settings.max_send_gbps`` bounds a worker's outgoing bytes per second over all its
sends and relay hops, so serving weights never starves its own inference traffic. The
bucket holds at most :data:`DEFAULT_BURST` seconds of bytes, so an idle worker cannot
save up; a larger step waits for its whole size (debt), so the long-run rate is exact.
"""

from __future__ import annotations

import threading

from nccl_back import _clock

#: Seconds of bytes the bucket may hold (how far a late thread may catch up at once).
DEFAULT_BURST = 0.05


class Pacer:
    """A token bucket of ``gbps`` (10^9 bytes/s); thread-safe; 0 or less: unlimited."""

    def __init__(self, gbps: float) -> None:
        self.rate = gbps * 1e9
        self._capacity = self.rate * DEFAULT_BURST
        self._tokens = self._capacity
        self._last = _clock.monotonic()
        self._lock = threading.Lock()

    @property
    def limited(self) -> bool:
        return self.rate > 0

    def take(self, nbytes: int) -> None:
        """Return once ``nbytes`` more may be sent (at once when unlimited)."""
        if self.rate <= 0 or nbytes <= 0:
            return
        with self._lock:
            now = _clock.monotonic()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            # Take now, pay back by waiting: concurrent senders queue behind each other's
            # debt, so their sum never exceeds the rate.
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            _clock.sleep(wait)
