"""Time, in one place: the bounds derived from the six durations a user sets (fields of
:class:`~nccl_back.config.Settings`, which inherits :class:`DerivedBounds`), and the
protocol's fixed timing constants. A caller may carve a derived bound shorter for one
phase (:meth:`DerivedBounds.capped`), never longer.
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

    # Settings' fields they derive from, declared for the type checker.
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
        """Seconds a claim, download member record or relay liveness mark lives unless its
        owner renews it (every third of it): :data:`CLAIM_TTL_OF_PEER_TTL` x :attr:`peer_ttl`."""
        return self._capped("claim_ttl", self.peer_ttl * CLAIM_TTL_OF_PEER_TTL)

    @property
    def download_lease(self) -> float:
        """Seconds an elected downloader's lease lasts unrenewed (a dead one is replaced):
        :data:`LEASE_OF_PEER_TTL` x :attr:`peer_ttl`."""
        return self._capped("download_lease", self.peer_ttl * LEASE_OF_PEER_TTL)

    @property
    def sender_handshake(self) -> float:
        """Seconds a sender waits in the handshake: a tenth of :attr:`handshake_timeout`
        (don't wait on a flaky receiver), at least :data:`SENDER_HANDSHAKE_FLOOR`, at most
        the receiver's."""
        wait = min(max(self.handshake_timeout / 10, SENDER_HANDSHAKE_FLOOR), self.handshake_timeout)
        return self._capped("sender_handshake", wait)

    @property
    def connect_timeout(self) -> float:
        """Seconds either side waits for the communicator after a handshake: both sides'
        handshake bounds (both just proved alive; a claim must not be held a whole
        :attr:`transfer_timeout` for a communicator that will never form), at most that."""
        return min(self.sender_handshake + self.handshake_timeout, self.transfer_timeout)

    @property
    def busy_wait(self) -> float:
        """Seconds a receiver waits for a busy peer's slot (or a new peer): half of
        :attr:`transfer_timeout`."""
        return self._capped("busy_wait", self.transfer_timeout / 2)

    @property
    def peer_budget(self) -> float:
        """Seconds all peer attempts of one load take at most together (fake or stalling peers
        cost no more), then storage: :attr:`busy_wait` + :attr:`transfer_timeout` +
        :data:`MAX_PEER_ATTEMPTS` x :attr:`handshake_timeout`."""
        bound = self.busy_wait + self.transfer_timeout + MAX_PEER_ATTEMPTS * self.handshake_timeout
        return self._capped("peer_budget", bound)

    @property
    def artifact_wait(self) -> float:
        """Seconds from its start that anything (inductor, in total; the engine, before it
        publishes) waits on a background compile-cache fetch; then the fetch is a miss and
        is given up. Half of :attr:`transfer_timeout`."""
        return self._capped("artifact_wait", self.transfer_timeout / 2)

    @property
    def single_flight_wait(self) -> float:
        """Seconds a worker waits for an elected downloader that stopped renewing its lease:
        :data:`SINGLE_FLIGHT_OF_TRANSFER` x :attr:`transfer_timeout`."""
        return self._capped("single_flight_wait", self.transfer_timeout * SINGLE_FLIGHT_OF_TRANSFER)

    @property
    def single_flight_max_wait(self) -> float:
        """Seconds a worker waits at most for a live elected downloader (storage is slower
        than a peer): :data:`DOWNLOAD_OF_TRANSFER` x :attr:`transfer_timeout`."""
        return self._capped("single_flight_max_wait", self.transfer_timeout * DOWNLOAD_OF_TRANSFER)

    @property
    def download_group_window(self) -> float:
        """Seconds the elected downloader waits for its group before naming a cooperative
        download's members: a tenth of :attr:`cohort_window`; 0 without the split."""
        return self.cohort_window / GROUP_WINDOW_OF_COHORT if self.cooperative_download else 0.0

    def capped(self: _B, **bounds: float) -> _B:
        """A copy whose :data:`CAPPABLE` bounds named in ``bounds`` are at most those seconds:
        a phase carved shorter than the load's. Not a setting; :meth:`replace` keeps it."""
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


# -- Fixed timing constants (a protocol's own bounds, not settings), by the module using them.

# coord/requests.py
#: Seconds between looks at an empty queue, doubling from the first to the longest. The
#: pause carries over between waits on one queue, so an idle endpoint looks 20 times a
#: second, not the dozens a restarted doubling would cost.
REQUEST_POLL_MIN, REQUEST_POLL_MAX = 0.002, 0.05
#: Seconds the wake-up value of a request queue lives at most.
WAKE_TTL = 1.0

# coord/auth.py
#: Seconds a record's ``exp`` may lie in the past: clocks of a fleet drift a little.
CLOCK_SKEW = 5.0

# coord/handshake.py
#: Seconds before the second read of a key the other side is to write, doubling up to:
HANDSHAKE_POLL = 0.005
#: the longest wait: a fleet released together runs many handshakes at once, and at 5 ms
#: each is 200 reads a second on the one Redis.
HANDSHAKE_POLL_MAX = 0.05

# coord/schema.py
#: Ground truth and layouts outlive a few missed heartbeats and a load's first publication.
GROUND_TRUTH_TTL_FACTOR = 6
#: Artifact-set records outlive their holder a while; the next publisher replaces them.
ARTIFACT_TTL_FACTOR = 360
#: A handshake key outlives both sides' timeouts.
HANDSHAKE_KEY_TTL = 30.0
#: ``nccl-back check``'s probe key.
CHECK_TTL = 10.0

# coord/election.py
#: Seconds between two polls of the group.
ELECTION_POLL = 0.1

# coord/signed_store.py
#: A record kept over this many times its writers' TTL is replayed or forged: not obeyed.
TTL_SLACK = 2.0

# load/verify.py
#: Seconds between two reads of a stream's ground truth (or of blamed members' verdicts).
VERDICT_POLL = 0.05
#: Seconds a failed check waits for the verdicts of members it blames (upstream, they
#: checked first); one whose verdict has not come by then stays guilty.
VERDICT_WAIT = 2.0

# load/rounds.py
#: Seconds between two looks at the cohort's size while a leaf's part moves.
TREE_WATCH_POLL = 0.25
#: Seconds to a leaf's first look at the cohort's size; the wait then doubles up to
#: TREE_WATCH_POLL (a fleet released together moves its leaves in the first tens of ms).
WATCH_FIRST = 0.02

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
#: Seconds a relay endpoint stays up, idle, past its load and the cohort window, so a
#: re-attaching or late downstream member still finds it.
LINGER = 2.0
#: Seconds a member waits in the handshake with a relay upstream: a live one answers
#: within its poll interval, so a dead one costs little.
RELAY_HANDSHAKE = 3.0
#: Seconds a member that stalled this receiver has to answer again: a live one answers
#: within its poll; a stopped one costs every seat below it this, not RELAY_HANDSHAKE.
STALLED_HANDSHAKE = 1.0

# transport/send.py
#: The slowest link a drain counts on, GB/s, unless the send cap is lower: 200 Mbit/s,
#: so the bound errs long.
DRAIN_FLOOR_GBPS = 0.025
#: Seconds a drain adds to the bytes' time: the last acknowledgement, a busy scheduler.
DRAIN_GRACE = 0.5
#: The most seconds a drain waits for an owed receiver (a follower of this worker's
#: download) to ask at all: one that saw the weights asks within a poll or two, but a
#: loaded machine stretched that past a second (each late one then read storage again);
#: a follower fed by others stops counting once it loaded. One whose transfer failed
#: (it gave it up) gets as long again after that, to ask once more.
DRAIN_ARRIVAL = 3.0
#: Seconds between two looks of a drain at its sends.
DRAIN_POLL = 0.02
#: Seconds between two looks of a drain at its owed receivers (a Redis read: which of
#: them published the version).
DRAIN_OWED_POLL = 0.1
#: The most seconds a drain waits for sends in flight: an engine's shutdown grace is a
#: few seconds, and a receiver told to move on loses less than a stall bound.
DRAIN_MAX = 5.0

# transport/rendezvous_store.py
#: Seconds a bootstrap key outlives the connect deadline (the sides delete it after).
KEY_TTL_SLACK = 5.0
#: Poll bounds, seconds: fast first (a peer writes within ms), backing off for slow ones.
STORE_POLL_MIN, STORE_POLL_MAX = 0.002, 0.05

# transport/nccl.py
#: Seconds bounding host-side waits in torch's non-blocking NCCL calls, unless env sets one.
NONBLOCKING_TIMEOUT_S = 10
#: torch's per-collective timeout lies this far past our deadline, so our abort acts first.
TORCH_TIMEOUT_SLACK_S = 600.0
#: Seconds between polls of a pending collective (polling, the owner sees an abort soon).
NCCL_POLL_S = 0.0005

# sidecar/loop.py
#: A connection that sent nothing waits in the kernel about this long before its accept
#: (counted in SYN-ACK retransmits: about 3 s).
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
