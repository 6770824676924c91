"""Time, in one place: the durations a user sets, the bounds derived from them, and the
fixed timing constants of the protocol.

A user sets six durations (fields of :class:`~nccl_back.config.Settings`):
``redis_timeout``, ``peer_ttl``, ``handshake_timeout``, ``stall_timeout``,
``transfer_timeout`` and ``cohort_window``. Every other bound is derived from them by
:class:`DerivedBounds` (which ``Settings`` inherits), each documented there once; the
ratios keep the defaults of the settings they replaced (``Settings()`` derives
``claim_ttl`` 6 s, ``download_lease`` 15 s, a sender's handshake 1 s, ``busy_wait`` and
``artifact_wait`` 60 s, ``peer_budget`` 210 s, ``single_flight_wait`` 300 s,
``single_flight_max_wait`` 3600 s, ``download_group_window`` 0.2 s). A caller may carve
a derived bound shorter for one phase (:meth:`DerivedBounds.capped`), never longer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeVar

from nccl_back.errors import ConfigError

#: Peers a receiver tries (real failures, not busy ones) before it falls back to storage.
MAX_PEER_ATTEMPTS = 3
#: ``claim_ttl`` = this x ``peer_ttl``: a claim outlives two missed renewals (every third).
CLAIM_TTL_OF_PEER_TTL = 0.6
#: ``download_lease`` = this x ``peer_ttl``: a downloader's lease outlives its heartbeat.
LEASE_OF_PEER_TTL = 1.5
#: A sender's handshake waits at least this (a scheduler's hiccup), else a tenth of the receiver's.
SENDER_HANDSHAKE_FLOOR = 1.0
#: ``single_flight_wait`` = this x ``transfer_timeout``.
SINGLE_FLIGHT_OF_TRANSFER = 2.5
#: ``single_flight_max_wait`` = this x ``transfer_timeout``: storage is slower than a peer.
DOWNLOAD_OF_TRANSFER = 30.0
#: A download group's window = ``cohort_window`` / this.
GROUP_WINDOW_OF_COHORT = 10

_B = TypeVar("_B", bound="DerivedBounds")

#: The derived bounds :meth:`DerivedBounds.capped` may lower.
CAPPABLE = ("claim_ttl", "download_lease", "sender_handshake", "busy_wait", "peer_budget",
            "artifact_wait", "single_flight_wait", "single_flight_max_wait")


class DerivedBounds:
    """The bounds derived from the durations a user sets (a base of ``Settings``)."""

    # The fields they derive from (declared here for the type checker; Settings has them).
    peer_ttl: float
    handshake_timeout: float
    transfer_timeout: float
    cohort_window: float
    cooperative_download: bool


    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats: a third of :attr:`peer_ttl` (one lost beat is harmless)."""
        return self.peer_ttl / 3

    @property
    def claim_ttl(self) -> float:
        """Seconds a send-slot claim, a download member's record or a relay member's liveness
        mark lives unless renewed by its running owner (every third of it): a dead or
        stopped one is given up on. :data:`CLAIM_TTL_OF_PEER_TTL` of :attr:`peer_ttl` (6 s)."""
        return self._capped("claim_ttl", self.peer_ttl * CLAIM_TTL_OF_PEER_TTL)

    @property
    def download_lease(self) -> float:
        """Seconds an elected downloader's lease lasts without renewal (a dead one is
        replaced). :data:`LEASE_OF_PEER_TTL` times :attr:`peer_ttl` (15 s)."""
        return self._capped("download_lease", self.peer_ttl * LEASE_OF_PEER_TTL)

    @property
    def sender_handshake(self) -> float:
        """Seconds a sender waits in the liveness handshake: a tenth of
        :attr:`handshake_timeout` (short: don't wait on a flaky receiver), at least
        :data:`SENDER_HANDSHAKE_FLOOR` (a scheduler's hiccup) and at most the receiver's own."""
        wait = min(max(self.handshake_timeout / 10, SENDER_HANDSHAKE_FLOOR), self.handshake_timeout)
        return self._capped("sender_handshake", wait)

    @property
    def connect_timeout(self) -> float:
        """Seconds either side waits for the communicator to form after a handshake: both
        sides' handshake bounds (both proved alive a moment ago, so a communicator that has
        not formed within them never will, and the claim must not be held for a whole
        :attr:`transfer_timeout`); never longer than :attr:`transfer_timeout`."""
        return min(self.sender_handshake + self.handshake_timeout, self.transfer_timeout)

    @property
    def busy_wait(self) -> float:
        """Seconds a receiver waits for a busy peer's send slot (or a new peer) before
        storage: half of :attr:`transfer_timeout` (60 s)."""
        return self._capped("busy_wait", self.transfer_timeout / 2)

    @property
    def peer_budget(self) -> float:
        """Seconds all peer attempts of one load may take together (claims, handshakes,
        transfers, waits for busy peers), so fake or stalling peers cannot cost more; past
        it the worker loads from storage: :attr:`busy_wait` + :attr:`transfer_timeout` +
        :data:`MAX_PEER_ATTEMPTS` x :attr:`handshake_timeout` (210 s)."""
        bound = self.busy_wait + self.transfer_timeout + MAX_PEER_ATTEMPTS * self.handshake_timeout
        return self._capped("peer_budget", bound)

    @property
    def artifact_wait(self) -> float:
        """Seconds, counted from its start, that anything waits on a background fetch of
        compile caches (the precompiled headers): inductor, before it builds a header itself
        (in total, however many headers it looks for), and the engine, for the fetch's
        outcome before it decides what to publish; past it the fetch is a miss ("timed
        out") and its transfer is given up. Half of :attr:`transfer_timeout` (60 s)."""
        return self._capped("artifact_wait", self.transfer_timeout / 2)

    @property
    def single_flight_wait(self) -> float:
        """Seconds a worker waits for an elected downloader before loading from storage
        itself, unless the downloader still renews its lease:
        :data:`SINGLE_FLIGHT_OF_TRANSFER` x :attr:`transfer_timeout` (300 s)."""
        return self._capped("single_flight_wait", self.transfer_timeout * SINGLE_FLIGHT_OF_TRANSFER)

    @property
    def single_flight_max_wait(self) -> float:
        """Upper bound in seconds on waiting for an elected downloader that is alive (still
        renewing its lease): a storage download may take longer than a peer's copy,
        :data:`DOWNLOAD_OF_TRANSFER` x :attr:`transfer_timeout` (3600 s)."""
        return self._capped("single_flight_max_wait", self.transfer_timeout * DOWNLOAD_OF_TRANSFER)

    @property
    def download_group_window(self) -> float:
        """Seconds the elected downloader waits for its download group before naming the
        members of a cooperative download: a tenth of :attr:`cohort_window` (0.2 s); 0
        without :attr:`cooperative_download`."""
        return self.cohort_window / GROUP_WINDOW_OF_COHORT if self.cooperative_download else 0.0

    def capped(self: _B, **bounds: float) -> _B:
        """A copy whose derived bounds named in ``bounds`` (``busy_wait``, ``peer_budget``,
        ``claim_ttl``, ...) are at most those seconds: a phase carved shorter than the
        load's (a fetch nobody waits for long). Not a setting: nothing reads it from the
        environment; :meth:`replace` keeps it."""
        for name, seconds in bounds.items():
            if name not in CAPPABLE:
                raise ConfigError(f"{name}: not a derived bound; choose from {', '.join(CAPPABLE)}")
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < math.inf:
                raise ConfigError(f"{name}={seconds!r}: must be a positive number of seconds")
        copy = dataclasses.replace(self)  # type: ignore[type-var]  # Settings, a dataclass
        object.__setattr__(copy, "_caps", {**self.caps, **bounds})  # frozen: set once, here
        return copy

    @property
    def caps(self) -> dict[str, float]:
        """The bounds :meth:`capped` lowered (empty for settings as the user gave them)."""
        return dict(self.__dict__.get("_caps", {}))

    def _capped(self, name: str, seconds: float) -> float:
        return min(seconds, self.__dict__.get("_caps", {}).get(name, seconds))
