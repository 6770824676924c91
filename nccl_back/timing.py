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


# -- Fixed timing constants, by the module that uses them (not settings: each is a
# protocol's own bound, with its reason).

# coord/requests.py
#: Seconds between looks at an empty queue: the first, doubling up to the longest (a
#: request waits that long at most before it is seen). The pause carries over from one
#: wait to the next of the same queue until a request comes, so an idle endpoint looks
#: 1/REQUEST_POLL_MAX times a second (20), not the dozens a restarted doubling would cost.
REQUEST_POLL_MIN, REQUEST_POLL_MAX = 0.002, 0.05
#: Seconds the wake-up value of a request queue lives at most.
WAKE_TTL = 1.0

# coord/auth.py
#: Seconds a record's ``exp`` may lie in the past: clocks of a fleet drift a little.
CLOCK_SKEW = 5.0

# coord/handshake.py
#: Seconds before the second read of a key the other side is to write; each further
#: wait doubles, up to :data:`HANDSHAKE_POLL_MAX`.
HANDSHAKE_POLL = 0.005
#: Longest wait between two reads: a fleet released together runs one handshake per
#: part and member at once, and at 5 ms each one is 200 reads a second on the one
#: Redis and the CPUs the waiting processes share.
HANDSHAKE_POLL_MAX = 0.05

# coord/schema.py
#: Ground truth, layouts and position truth outlive a few missed heartbeats and the gap
#: between a storage load and its first publication.
GROUND_TRUTH_TTL_FACTOR = 6
#: Artifact-set records outlive their holder a while (a miss then says that no live
#: peer holds the set), and the next publisher replaces them.
ARTIFACT_TTL_FACTOR = 360
#: A handshake key outlives both sides' timeouts.
HANDSHAKE_KEY_TTL = 30.0
#: ``nccl-back check``'s probe key.
CHECK_TTL = 10.0

# coord/election.py
#: Seconds between two polls of the group.
ELECTION_POLL = 0.1

# coord/signed_store.py
#: A record kept longer than this many times the TTL its writers give it was not
#: written by a worker (a replayed or forged record): it is not obeyed.
TTL_SLACK = 2.0

# load/verify.py
#: Seconds between two reads of a stream's ground truth while its downloader loads (or
#: of the verdicts of the members a failed check blames).
VERDICT_POLL = 0.05
#: Seconds a failed check waits for the verdicts of the members it blames: they checked
#: what they received about when this rank did (upstream, they got it first). One whose
#: verdict has not come by then stays guilty.
VERDICT_WAIT = 2.0

# load/tree_parts.py
#: Seconds between two looks at the cohort's size while a leaf's part moves.
TREE_WATCH_POLL = 0.25

# load/asking.py
#: Seconds between two tries of a busy holder's send slots.
BUSY_POLL = 0.05

# load/cooperative.py
#: Seconds between two looks for a member's announcement.
ANNOUNCE_POLL = 0.05
#: Seconds between two looks at a member's announcement while its part is pulled.
SHARE_WATCH_POLL = 0.25

# budget.py
#: Seconds a reshard's discovery (other layouts' holders, their truth, the plan) may take.
DISCOVER_SECONDS = 10.0

# transport/relay/state.py
#: Seconds a member's relay endpoint stays up, idle, after its own load ended and the
#: cohort window passed, for a downstream member that is still re-attaching. A late
#: arrival (within a window of the previous one) may sit behind a member that already
#: finished: the endpoint stays up ``cohort_window`` + this, so it still finds it.
LINGER = 2.0
#: Seconds a member waits in the handshake with a relay upstream: a live one answers
#: within its poll interval, so a dead one costs little.
RELAY_HANDSHAKE = 3.0
#: Seconds a member that stalled this receiver has to answer when asked once more: a
#: live one answers within its poll interval (it stalled because one further up
#: stopped); one that stopped itself costs every seat below it this, not
#: :data:`RELAY_HANDSHAKE`.
STALLED_HANDSHAKE = 1.0

# transport/send.py
#: The slowest link a drain counts on, in GB/s (10^9 B/s), where the worker's send cap
#: is not lower: 200 Mbit/s, a slow and shared link, so that the bound errs long; the
#: cap ends it.
DRAIN_FLOOR_GBPS = 0.025
#: Seconds a drain adds to the bytes' time: the last step's acknowledgement, and a
#: busy machine's scheduling.
DRAIN_GRACE = 0.5
#: The most seconds a drain waits for an owed receiver (a follower of the download this
#: worker was elected to) to ask: one that saw this worker's weights asks within a poll
#: or two; one that never asks (fed by another member) costs no more.
DRAIN_ARRIVAL = 1.0
#: Seconds between two looks of a drain at its sends.
DRAIN_POLL = 0.02
#: The most seconds a drain waits for sends in flight, whatever their bytes: a closing
#: process's shutdown grace (an engine gives its worker a few seconds) is not spent on
#: one send, and a receiver told to move on loses less than a stall bound.
DRAIN_MAX = 5.0

# transport/rendezvous_store.py
#: Seconds a bootstrap key outlives the connect deadline, at most (a bound, the sides
#: delete their keys when the transfer ends).
KEY_TTL_SLACK = 5.0
#: Polling interval bounds, seconds: fast first (the peer writes within milliseconds),
#: then backing off so a slow peer costs Redis little.
STORE_POLL_MIN, STORE_POLL_MAX = 0.002, 0.05

# transport/nccl.py
#: Bound, in seconds, on host-side waits inside torch's non-blocking NCCL calls (the
#: lazy connect of the first collective). Used only when the environment sets none.
NONBLOCKING_TIMEOUT_S = 10
#: torch's own per-collective timeout is set this far past our deadline, so that our
#: deadline (and our abort, on the owner thread) always acts first.
TORCH_TIMEOUT_SLACK_S = 600.0
#: Seconds between polls of a pending collective or stream (the owner thread polls
#: rather than blocks, so it sees an abort request or the deadline within this).
NCCL_POLL_S = 0.0005

# sidecar/loop.py
#: A connection that sent nothing stays in the kernel about this long (the kernel counts
#: it in SYN-ACK retransmits: about 3 s) before it is accepted.
DEFER_SECONDS = 2

# sidecar/handoff/server.py
#: Seconds between two looks of the hand-off server's accept loop for a stop.
HANDOFF_ACCEPT_POLL = 0.1

# sidecar/health.py
#: Seconds from a connection's accept to the last byte of its reply, absolute.
HEALTH_REQUEST_TIMEOUT = 10.0

# sidecar/serve.py
#: How often the main thread re-checks for a stop while waiting on the load.
SIDECAR_STOP_POLL = 0.1

# model/storage.py
#: Seconds one request to remote storage may wait (to connect, and for each read).
STORAGE_TIMEOUT = 60.0
