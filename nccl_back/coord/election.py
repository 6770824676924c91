"""Single-flight download: one *worker* per version downloads, the others wait for it
(docs/design.md, "One load, step by step", 3). The lease record is :mod:`.leases`; this
module is the policy.

A worker of several ranks is elected as a whole: only rank 0 tries the lease, and every
poll ends in one collective (:func:`.consensus.gather`) carrying rank 0's result and each
rank's "I see a peer", so all ranks leave the wait with the same outcome (per-rank
elections could let worker A win rank 0 and B rank 1, each then waiting on the other).
A waiter the elected worker names in its roster (a cooperative download) finds its member
number in rank 0's poll code, so its wait ends as ``"member"``: it reads and serves its
share, then waits for the stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.consensus import Group, gather
from nccl_back.coord.records import Roster
from nccl_back.coord.registry import Registry
from nccl_back.coord.signed_store import Raw
from nccl_back.errors import NcclBackError
from nccl_back.log import get_logger
from nccl_back.timing import ELECTION_POLL as POLL
from nccl_back.transport_kinds import MAX_PARTS

log = get_logger("nccl_back.coord.election")

Outcome = Literal["peer", "elected", "member", "timeout", "error"]

# Per-rank bits of one poll's code.
_SEES_PEER = 1
_ELECTED = 2  # rank 0 only
_GIVE_UP = 4  # rank 0 only
_FAILED = 8  # this rank could not poll (Redis): the group stops waiting
# Rank 0's member number i of n in a roster, above the bits (i < n <= MAX_PARTS < 256).
_MEMBER_I, _MEMBER_N = 8, 16


class DownloadLease:
    """The right to be the one worker (of ``world`` ranks) downloading ``version``."""

    def __init__(self, registry: Registry, version: str, world: int, owner: str, ttl: float) -> None:
        self.registry = registry
        self.version = version
        self.world = world
        self.key = registry.keys.of(schema.LEASE, version, world)
        self.owner = owner
        self.ttl = ttl
        self._raw: Raw | None = None
        """The exact value we stored, which renewals and the release compare against."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.member: tuple[int, int] | None = None
        """``(i, n)`` once the holder's roster names this worker member ``i`` of ``n``."""
        self._roster_seen = False

    @property
    def held(self) -> bool:
        """Whether this process took the lease (and has not released it)."""
        return self._thread is not None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; start renewing it if taken."""
        if self._thread is not None:
            return True
        raw = self.registry.take_lease(self.version, self.world, self.owner, self.ttl)
        got = raw is not None
        if got:
            self._raw = raw
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                            name="nccl-back-lease")
            self._thread.start()
            log.info("download_lease_acquired", key=self.key, owner=self.owner)
        return got

    def join(self) -> None:
        """Enter this worker in the version's download group (the workers waiting for it)."""
        self.registry.join_download_group(self.version, self.world, self.owner)

    def group(self) -> list[str]:
        """The workers that entered the download group, in arrival order."""
        return self.registry.download_group(self.version, self.world)

    def name_members(self, window: float) -> list[str]:
        """Wait ``window`` seconds for the download group, then name this worker and the
        first of the others, at most ``MAX_PARTS``, in the roster; return the members.

        A former owner's members are left out: they read their shares already and wait
        for a stream (each would cost the stall bound). If one of them still announces
        its part, this worker adopts that split instead, naming nobody, so storage reads
        only the dead owner's share again."""
        former = self.registry.download_roster(self.version, self.world)
        if former is not None and former.owner != self.owner and self._serving(former):
            log.info("download_roster_adopted", key=self.key, former=former.owner,
                     members=len(former.members))
            return [self.owner, *former.members[1:]]
        _clock.wait(self._stop, window)
        former = self.registry.download_roster(self.version, self.world)
        gone = {self.owner, *(former.members if former is not None else ())}
        members = [self.owner, *[w for w in self.group() if w not in gone][:MAX_PARTS - 1]]
        self.registry.name_download_roster(self.version, self.world, members)
        return members

    def _serving(self, roster: Roster) -> bool:
        """Whether a member of ``roster`` still announces its part (members have one rank)."""
        return any(self.registry.download_member(self.version, 0, self.world, i) is not None
                   for i in range(1, len(roster.members)))

    def roster(self) -> Roster | None:
        """The roster of the worker holding the lease now, or None (none yet, or its owner
        lost the lease)."""
        got = self.registry.download_roster(self.version, self.world)
        if got is None or got.owner == self.owner or got.owner != self.holder():
            return None
        return got

    def read_roster(self) -> None:
        """Learn :attr:`member` from the holder's roster, once (a waiter not named receives)."""
        if self._roster_seen:
            return
        got = self.roster()
        if got is None:
            return
        self._roster_seen = True
        i = got.index(self.owner)
        if i is not None:
            self.member = (i, len(got.members))
        log.info("download_roster_read", key=self.key, owner=got.owner, member=i, of=len(got.members))

    def holder(self) -> str | None:
        """The worker holding the lease now, or None (also for an untrusted value)."""
        return self.registry.lease_holder(self.version, self.world, self.ttl)

    def release(self) -> None:
        """Stop renewing and drop the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl)
            self._thread = None
            try:
                if self._raw is not None:
                    self.registry.drop_lease(self.version, self.world, self._raw)
            except Exception as e:  # expiry cleans up anyway
                log.warning("download_lease_release_failed", key=self.key, error=str(e))

    def _renew_loop(self) -> None:
        while not _clock.wait(self._stop, self.ttl / 3):
            try:
                new = None if self._raw is None else self.registry.renew_lease(
                    self.version, self.world, self.owner, self._raw, self.ttl)
                if new is None:
                    log.warning("download_lease_lost", key=self.key, owner=self.owner)
                    return
                self._raw = new
            except Exception as e:
                log.warning("download_lease_renew_failed", key=self.key, error=str(e))


@dataclass(frozen=True)
class Election:
    """How a group's wait ended: the same on every rank."""

    outcome: Outcome
    """``"peer"`` (every rank sees one), ``"elected"`` (this worker downloads), ``"member"``
    (named in the roster: it serves its share, then waits on), ``"timeout"`` (download
    too) or ``"error"`` (a rank could not poll)."""
    rank: int | None = None
    """The rank that decided it: 0 when elected or timed out, the failing rank on error."""
    error: NcclBackError | None = None
    """On the rank that could not poll, its error; None on the others."""
    member: tuple[int, int] | None = None
    """``(i, n)`` with ``"member"``, as rank 0 read the roster."""


def elect(
    lease: DownloadLease | None,
    sees_peer: Callable[[], bool],
    group: Group,
    rank: int,
    settings: Settings,
    *,
    lease_after: float = 0.0,
    cooperate: bool = False,
) -> Election:
    """Wait, as a group, until every rank sees a peer or rank 0 wins ``lease``.

    Every rank calls this (``lease`` matters on rank 0) and gets the same
    :class:`Election`. ``lease_after``: seconds before rank 0 tries the lease (holders
    without ground truth re-publish it within a heartbeat). ``cooperate``: this worker
    can read a share, so rank 0 joins the group and reads the roster.
    """
    start = _clock.monotonic()
    joined = False
    while True:
        code = 0
        error: NcclBackError | None = None
        try:
            if rank == 0 and lease is not None and cooperate and not joined:
                lease.join()
                joined = True
            if sees_peer():
                code |= _SEES_PEER
            if rank == 0 and lease is not None and _clock.monotonic() - start >= lease_after:
                if lease.try_acquire():
                    code |= _ELECTED
                elif _give_up(lease, _clock.monotonic() - start, settings):
                    code |= _GIVE_UP
                elif cooperate and settings.download_group_window > 0:
                    lease.read_roster()
            if rank == 0 and lease is not None and cooperate and lease.member is not None:
                i, n = lease.member
                code |= i << _MEMBER_I | n << _MEMBER_N
        except NcclBackError as e:
            error, code = e, _FAILED
        codes = gather(code, group)
        failed = [r for r, c in enumerate(codes) if c & _FAILED]
        if failed:
            return Election("error", failed[0], error)
        member = _member(codes[0])
        if member is not None:
            # Before "peer": the elected worker waits for every member it named.
            return Election("member", 0, member=member)
        if all(c & _SEES_PEER for c in codes):
            if lease is not None and lease.held:
                lease.release()  # a peer is there after all: let nobody wait on us
            return Election("peer")
        if codes[0] & _ELECTED:
            return Election("elected", 0)
        if codes[0] & _GIVE_UP:
            return Election("timeout", 0)
        _clock.sleep(POLL)


def _member(code: int) -> tuple[int, int] | None:
    """The member number rank 0's ``code`` carries, if any."""
    n = code >> _MEMBER_N & 0xFF
    return (code >> _MEMBER_I & 0xFF, n) if n else None


def _give_up(lease: DownloadLease, waited: float, settings: Settings) -> bool:
    """Past ``single_flight_wait``, wait on only while the downloader renews its lease."""
    if waited < settings.single_flight_wait:
        return False
    if waited >= settings.single_flight_max_wait:
        return True
    holder = lease.holder()
    if holder is not None:
        log.debug("single_flight_still_waiting", key=lease.key, holder=holder, waited=round(waited, 1))
    return holder is None
