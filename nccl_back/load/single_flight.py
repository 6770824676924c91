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
from nccl_back.load.attempt import Attempt, NoHolder, Reason, Worker
from nccl_back.load.discover import sees_peer


@dataclass(frozen=True)
class Flight:
    """How the wait ended (the same on every rank), how long it took, and what this rank
    takes from it (the service applies it to the load)."""

    outcome: Outcome
    waited: float
    reason: Reason | None = None
    """This rank's vote after the wait (``peer``: None, discovery follows)."""
    error: Exception | None = None
    """What this rank raised while polling (every rank then stops)."""
    member: tuple[int, int] | None = None
    """``member``: ``(i, n)``, this worker's place in the cooperative download."""
    roster: list[str] | None = None
    """``elected``, cooperating: the members rank 0 named (itself first)."""


def single_flight(worker: Worker, a: Attempt, lease: DownloadLease | None) -> Flight:
    """Wait as a group for a holder, or download (``elected``); rank 0 polls ``lease``
    (kept by the caller, released when the load ends)."""
    s = worker.settings
    started = _clock.monotonic()
    # Holders re-publish their entry and truth at every heartbeat, over whatever
    # Redis lost or an attacker wrote there: while entries exist that cannot be used
    # (rejected, or no truth to verify them), this worker downloads only once a live
    # holder would have re-published (within peer_ttl, or it counts as dead). The
    # single flight still holds: one of the waiters takes the lease.
    after = s.peer_ttl if isinstance(a.reason, NoHolder) and a.reason.waits_for_holders else 0.0
    # A member waits again after serving its share: for the stream, not a second roster.
    cooperate = a.cooperative and a.member is None
    result = elect(lease, lambda: sees_peer(worker, a), a.group, a.rank, s, lease_after=after,
                   cooperate=cooperate)
    outcome, error = result.outcome, result.error
    waited = round(_clock.monotonic() - started, 3)
    if outcome == "member":
        a.log.info("download_member_named", waited=waited, member=result.member)
        return Flight(outcome, waited, a.reason, member=result.member)
    if outcome == "peer":
        a.log.info("single_flight_peer_appeared", waited=waited)
        return Flight(outcome, waited)
    if outcome == "elected":
        roster, named = _members(a, lease, s.download_group_window if cooperate else 0.0)
        a.log.info("single_flight_elected", waited=waited, group=named)
        # "Nobody trusted" keeps its own fallback code.
        why = (a.reason.also("this worker was elected to download it (single flight)")
               if isinstance(a.reason, NoHolder) else a.reason)
        return Flight(outcome, waited, why, roster=roster)
    if outcome == "timeout":
        return Flight(outcome, waited, NoPeerError(
            f"waited {waited:g} s (single_flight_wait {s.single_flight_wait:g} s, at most"
            f" single_flight_max_wait {s.single_flight_max_wait:g} s while the elected"
            " downloader lives) for it to publish; downloading too"))
    if error is not None:  # this rank could not poll; the others follow it
        if isinstance(error, NcclBackError):
            return Flight(outcome, waited, error)
        return Flight(outcome, waited, a.reason, error=error)
    a.log.warning("single_flight_rank_failed", failed_rank=result.rank)
    return Flight(outcome, waited, a.reason)


def _members(a: Attempt, lease: DownloadLease | None,
             window: float) -> tuple[list[str] | None, list[str] | None]:
    """Rank 0, holding the lease: with a ``window``, name the cooperative download's
    members after waiting it out (the roster waiters read); else who waits with it.
    Returns the roster and who is named, for the log; Nones on the other ranks or when
    Redis cannot say (the download goes on without a roster)."""
    if lease is None or not lease.held:
        return None, None
    try:
        if window > 0:
            roster = lease.name_members(window)
            return roster, roster
        return None, lease.group()
    except NcclBackError as e:
        a.log.warning("download_group_unread", error=str(e))
        return None, None
