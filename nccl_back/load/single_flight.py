"""The single flight: some rank found nobody holding the version, so the worker as a
whole waits for a holder to appear, or downloads it itself when elected.

Its rank 0 tries the download lease; one collective per poll tells every rank whether
all of them see a peer or rank 0 was elected (:func:`nccl_back.coord.election.elect`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.coord.election import DownloadLease, Outcome, elect
from nccl_back.errors import NcclBackError, NoPeerError
from nccl_back.load.attempt import Attempt, NoHolder, Worker
from nccl_back.load.discover import discover, sees_peer
from nccl_back.load.vote import caught


@dataclass(frozen=True)
class Flight:
    """How the wait ended (the same on every rank) and how long it took."""

    outcome: Outcome
    waited: float


def single_flight(worker: Worker, a: Attempt) -> Flight:
    """Wait as a group for a holder, or download (``a.elected``). Rank 0 keeps the lease
    it may win in ``a.lease`` (released when the load ends). Sets this rank's vote:
    a fresh discovery once a peer appeared, else why it goes to storage."""
    s = worker.settings
    if a.rank == 0:
        a.lease = DownloadLease(worker.registry, a.spec.version, a.world, worker.id,
                                s.download_lease)
    started = _clock.monotonic()
    # Holders re-publish their entry and truth at every heartbeat, over whatever
    # Redis lost or an attacker wrote there: while entries exist that cannot be used
    # (rejected, or no truth to verify them), this worker downloads only once a live
    # holder would have re-published (within peer_ttl, or it counts as dead). The
    # single flight still holds: one of the waiters takes the lease.
    after = s.peer_ttl if isinstance(a.reason, NoHolder) and a.reason.waits_for_holders else 0.0
    # A member waits again after serving its share: for the stream, not a second roster.
    cooperate = a.cooperative and a.member is None
    result = elect(a.lease, lambda: sees_peer(worker, a), a.group, a.rank, s, lease_after=after,
                   cooperate=cooperate)
    outcome, error = result.outcome, result.error
    flight = Flight(outcome, round(_clock.monotonic() - started, 3))
    if outcome == "member":
        a.member = result.member
        a.log.info("download_member_named", waited=flight.waited, member=a.member)
    elif outcome == "peer":
        a.log.info("single_flight_peer_appeared", waited=flight.waited)
        with caught(a, "discover"):
            a.discovered(discover(worker, a))
    elif outcome == "elected":
        a.log.info("single_flight_elected", waited=flight.waited,
                   group=_members(a, s.download_group_window if cooperate else 0.0))
        a.elected = True
        if isinstance(a.reason, NoHolder):  # "nobody trusted" keeps its own fallback code
            a.reason = a.reason.also("this worker was elected to download it (single flight)")
    elif outcome == "timeout":
        a.reason = NoPeerError(
            f"waited {flight.waited:g} s (single_flight_wait {s.single_flight_wait:g} s, at most"
            f" single_flight_max_wait {s.single_flight_max_wait:g} s while the elected"
            " downloader lives) for it to publish; downloading too"
        )
    elif error is not None:  # this rank could not poll; the others follow it
        if isinstance(error, NcclBackError):
            a.reason = error
        else:
            a.error = error
    else:
        a.log.warning("single_flight_rank_failed", failed_rank=result.rank)
    return flight


def _members(a: Attempt, window: float) -> list[str] | None:
    """Rank 0, holding the lease: with a ``window``, name the cooperative download's
    members after waiting it out (the roster waiters read, kept in ``a.roster``); else
    who waits with it. Returned for the log; None on the other ranks or when Redis
    cannot say (the download goes on without a roster)."""
    if a.lease is None or not a.lease.held:
        return None
    try:
        if window > 0:
            a.roster = a.lease.name_members(window)
            return a.roster
        return a.lease.group()
    except NcclBackError as e:
        a.log.warning("download_group_unread", error=str(e))
        return None
