"""A rank's relay endpoints: its seat in a cohort's trees (and its upstreams there), a
streamed download's endpoint, and a cooperative download member's endpoint for its part."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.records import Member
from nccl_back.coord.registry import Registry
from nccl_back.errors import PeerError, RegistryError, TransferStalledError
from nccl_back.log import get_logger
from nccl_back.metrics import Metrics
from nccl_back.transport import Rendezvous, Step, payload_bytes, plan
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay import topology
from nccl_back.transport.relay.forwarder import RelayServer
from nccl_back.transport.relay.state import (
    LINGER,
    RELAY_HANDSHAKE,
    SHARE_SENDS,
    STALLED_HANDSHAKE,
    STREAM_SENDS,
    TREE_SENDS,
    Fills,
    Place,
    Progress,
)

log = get_logger(__name__)


@dataclass(eq=False)
class Seat:
    """This receiver's seat in a cohort's two trees, its progress and its relay endpoint."""

    place: Place
    member: Member
    progress: Progress
    server: RelayServer
    registry: Registry
    failed: set[str] = field(default_factory=set)
    """Member ids that failed this receiver as upstreams (never tried again)."""
    stalled: set[str] = field(default_factory=set)
    """Member ids that stalled this receiver once (asked once more: :meth:`counts_failed`)."""

    @property
    def position(self) -> int:
        return self.place.position

    def counts_failed(self, member_id: str, e: PeerError) -> bool:
        """Whether upstream ``member_id`` failed this receiver for good with ``e`` (then in
        :attr:`failed`). A first stall does not count while its liveness mark lives: every
        seat below a stopped one stalls at once and re-attaches within a handshake bound,
        so asking it once more (with a short handshake) resumes there and keeps the seats
        below off the suspects further up. A second stall, or any other failure, counts."""
        if isinstance(e, TransferStalledError) and member_id not in self.stalled and not self._lapsed(member_id):
            self.stalled.add(member_id)
            return False
        self.failed.add(member_id)
        return True

    def _lapsed(self, member_id: str) -> bool:
        """Whether ``member_id``'s liveness mark lapsed (Redis trouble here says no)."""
        try:
            gone = self.registry.lapsed(member_id)
        except RegistryError:
            return False
        if gone:
            log.info("relay_upstream_lapsed", member=self.member.member_id, peer=member_id)
        return gone

    def handshake_bound(self, member_id: str, bound: float) -> float:
        """The handshake bound with ``member_id``: short once it stalled this receiver (a
        live one answers within its poll interval)."""
        return min(bound, STALLED_HANDSHAKE) if member_id in self.stalled else bound

    def stall_bound(self, member_id: str, stall: float) -> float:
        """The stall bound from ``member_id``, plus its own re-attach's once it stalled us."""
        return stall + RELAY_HANDSHAKE if member_id in self.stalled else stall

    def tree_path(self, tree: int, max_size: int) -> list[int]:
        """The seats this one receives tree ``tree``'s part through in the cohort as it
        now stands, parent first, ending at :data:`topology.SOURCE`."""
        # Seats past max_size are not the join script's (an outsider's pushes): not built over.
        size = max(min(self.registry.chain_size(self.place.key), max_size), self.position + 1)
        return topology.seat_upstreams(self.position, size, tree)

    def tree_upstreams(self, tree: int, path: list[int]) -> list[tuple[int, Member]]:
        """``(seat, member)`` this one receives tree ``tree``'s part from, best first: its
        ancestors on ``path``, then the earlier seats interior in that tree, nearest first,
        without those that failed us or stopped. Only interior seats (a leaf's part may
        come from a later seat, which could wait on this one); the source is left to the
        caller, last, or every seat falling back to it would overload it."""
        seats = [p for p in path if p != topology.SOURCE]
        seats += [q for q in range(self.position - 1, -1, -1) if q % topology.TREES == tree
                  and q not in seats]
        if not seats:
            return []
        found = self.registry.chain_members(self.place.key, 0, max(seats))
        by_id = {m.member_id: p for p in seats if p < len(found) and (m := found[p]) is not None}
        return [(by_id[m.member_id], m) for m in self._live([found[p] for p in seats if p < len(found)])]

    def _live(self, found: list[Member | None]) -> list[Member]:
        """``found`` without untrusted records, those that failed us and stopped ones."""
        out = [m for m in found if m is not None  # None: untrusted, said why
               and m.member_id not in self.failed and m.member_id != self.member.member_id]
        try:
            gone = self.registry.gone_members([m.member_id for m in out])
        except RegistryError:
            gone = set()  # tried in turn, as without tombstones: a stopped one costs its handshake
        return [m for m in out if m.member_id not in gone]

    def end(self, ok: bool, reason: str = "") -> None:
        self.server.end(ok, reason)


@dataclass(frozen=True)
class Replica:
    """One rank's copy of a version as cohort records key it, and how that rank speaks."""

    version: str
    rank: int
    world: int
    manifest_digest: str
    kind: str
    device: torch.device
    tensors: dict[str, torch.Tensor]

    @property
    def key(self) -> tuple[str, int, int, str]:
        """``(version, rank, world, manifest digest)``: what the registry keys it by."""
        return (self.version, self.rank, self.world, self.manifest_digest)

    def speaks(self, member: Member) -> bool:
        return member.transport == self.kind and member.device == self.device.type


@dataclass(frozen=True)
class Endpoints:
    """What one rank's relay endpoints (seat, stream, share) are made of."""

    settings: Settings
    registry: Registry
    rendezvous: Rendezvous
    worker_id: str
    replica: Replica
    pacer: Pacer
    log: Any
    metrics: Metrics | None = None
    """Where relay sends are counted (the service's); None: counted nowhere visible."""

    def server(self, role: str, **options: Any) -> RelayServer:
        """A relay endpoint (not started) of a fresh member ``{worker}-r{rank}-{role}-…``."""
        r = self.replica
        member = Member(f"{self.worker_id}-r{r.rank}-{role}-{uuid.uuid4().hex[:6]}"[-200:],
                        self.rendezvous.address, r.kind, r.device.type)
        return RelayServer(self.settings, self.registry, self.rendezvous, member, r.tensors,
                           r.manifest_digest, self.pacer, Progress(),
                           self.log.bind(member=member.member_id), metrics=self.metrics,
                           **options)


def join(p: Endpoints) -> Seat:
    """Take a seat in the current cohort and start this member's relay endpoint; raises
    :class:`RegistryError` (the caller then receives on its own)."""
    s = p.settings
    # Two children, one moving in before a leaf moved out, one re-attaching.
    server = p.server("relay", max_sends=TREE_SENDS).start()  # listening before anyone can read our record
    member = server.member
    try:
        key, position = p.registry.join_cohort(
            *p.replica.key, member.to_dict(), window=s.cohort_window, max_size=s.cohort_limit,
            ttl=s.transfer_timeout + s.busy_wait,
        )
    except RegistryError:
        server.end(False, "could not join a cohort")
        raise

    # A member stalled behind a stopped one is asked once more by the seats below it, one
    # that stopped itself is not (Seat.counts_failed).
    kept_alive(p, server)
    p.log.info("cohort_joined", chain=p.registry.keys.chain_place(key), position=position,
               member=member.member_id)
    return Seat(Place(key, position), member, server.progress, server, p.registry)


class Stream:
    """The elected downloader's relay endpoint for one rank (see the package docstring)."""

    def __init__(self, registry: Registry, server: RelayServer, steps: list[Step],
                 key: tuple[str, int, int, str]) -> None:
        self.server = server
        self.member = server.member
        self.filled = Fills(steps, server.progress).filled
        """Tensor ``name`` is in place (the loader's ``on_filled``)."""
        self._steps = len(steps)
        self._registry = registry
        self._key = key
        server.unannounce = self._drop  # announced no longer than it serves

    def loaded(self) -> None:
        """Every tensor is in place (also what a loader without per-tensor fills says)."""
        if self._steps:
            self.server.progress.complete(self._steps)

    def end(self, ok: bool, reason: str = "") -> None:
        """The download ended. Failed: the stream is dropped and its links fail at once.
        ``ok``: the announcement lives on while the endpoint lingers (its TTL cut to the
        linger), for followers that have not asked yet."""
        self.server.end(ok, reason)
        with contextlib.suppress(RegistryError):
            if not ok or not self.server.alive:
                self._drop()
                return
            s = self.server.settings
            mine = self._registry.get_stream(*self._key)
            if mine is not None and mine.member_id == self.member.member_id:
                self._registry.put_stream(*self._key, self.member.to_dict(),
                                          ttl=s.cohort_window + LINGER + s.redis_timeout)

    def _drop(self) -> None:
        with contextlib.suppress(RegistryError):
            self._registry.drop_stream(*self._key, self.member.member_id)


def stream(p: Endpoints) -> Stream:
    """Start the relay endpoint a download is streamed from and announce it; raises
    :class:`RegistryError` (the worker then downloads without streaming)."""
    # A receiver may wait for the whole download, as in the election: the same bound.
    wait = p.settings.transfer_timeout + p.settings.single_flight_max_wait
    server = p.server("stream", max_sends=STREAM_SENDS, send_timeout=wait).start()
    try:
        p.registry.put_stream(*p.replica.key, server.member.to_dict(), ttl=wait)
    except RegistryError:
        server.end(False, "could not announce the stream")
        raise
    # Its waiters await its truth while it lives, not while its record does (announced
    # for a whole download's wait, the record outlives a killed downloader by far).
    kept_alive(p, server)
    tensors = p.replica.tensors
    steps = plan(tensors, p.settings.bucket_for(p.replica.kind, payload_bytes(tensors)))
    p.log.info("download_streamed", member=server.member.member_id, steps=len(steps))
    return Stream(p.registry, server, steps, p.replica.key)


class Share:
    """A cooperative download member's relay endpoint for one rank, serving its part to
    the elected worker step by step as its share read places them. Its announcement is
    renewed while the endpoint lives, so the elected worker gives up on a dead member
    within ``claim_ttl``, not a handshake or connect timeout."""

    def __init__(self, server: RelayServer, announce: Callable[[], None], ttl: float) -> None:
        self.server = server
        self.member = server.member
        renew(server, announce, ttl, "share")

    def placed(self, steps: list[int]) -> None:
        """These steps of the part are in the member's tensors: they may go out."""
        for k in steps:
            self.server.progress.advance(k)

    def end(self, ok: bool, reason: str = "") -> None:
        """The member's load ended; failed (or its share unread): requests are refused."""
        self.server.end(ok, reason)


def kept_alive(p: Endpoints, server: RelayServer) -> None:
    """Mark ``server``'s member alive for ``claim_ttl``, renewed while it lives
    (:meth:`~nccl_back.coord.cohorts.CohortRecords.lapsed` once it stops or dies); a
    missing mark costs its receivers time, never bytes."""
    member, ttl = server.member.member_id, p.settings.claim_ttl

    def alive() -> None:
        p.registry.mark_alive(member, ttl)

    try:
        alive()
    except RegistryError as e:
        p.log.warning("alive_mark_failed", member=member, error=str(e))
    renew(server, alive, ttl, "alive")


def renew(server: RelayServer, announce: Callable[[], None], ttl: float, what: str) -> None:
    """``announce`` every third of ``ttl`` on a daemon thread while ``server`` lives, so
    the record lapses within ``ttl`` once it stops. A failed renewal is logged: a lapse
    costs speed, never bytes."""
    member = server.member.member_id

    def run() -> None:
        while True:
            _clock.sleep(ttl / 3)
            if not server.alive:
                return  # the endpoint stopped: the record lapses with it
            try:
                announce()
            except RegistryError as e:
                log.warning(f"{what}_renew_failed", member=member, error=str(e))

    threading.Thread(target=run, daemon=True, name=f"nccl-back-{what}-{member[-6:]}").start()


def share(p: Endpoints, member: int) -> Share:
    """Start and announce member ``member``'s endpoint; raises :class:`RegistryError`."""
    # The send waits for the share's read as a stream's for storage: the same bound.
    wait = p.settings.transfer_timeout + p.settings.single_flight_max_wait
    server = p.server("share", max_sends=SHARE_SENDS, send_timeout=wait).start()
    r = p.replica

    def announce() -> None:
        p.registry.announce_download_member(r.version, r.rank, r.world, member, server.member)

    try:
        announce()
    except RegistryError:
        server.end(False, "could not announce the share")
        raise
    p.log.info("download_share_announced", member=member, endpoint=server.member.member_id)
    return Share(server, announce, p.settings.claim_ttl)
