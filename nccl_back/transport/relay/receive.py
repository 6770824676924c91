"""The relay's receiving half: a rank's seat in a cohort, the stream it may be fed
from, which upstream it receives from and re-attaching further up when one fails.

The sending half is :mod:`.server` (a member's endpoint); seats and streams are
announced by :mod:`.chain`. What a rank does with one source's bytes (the request,
the handshake, the transfer into its tensors, verification) belongs to the load
layer above: it hands :meth:`Cohorts.receive` a :class:`Link`, so the data plane
never imports the load.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.errors import (
    HandshakeTimeoutError,
    IncompatiblePeerError,
    NcclBackError,
    PeerError,
    RegistryError,
    UntrustedRecordError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.metrics import Metrics
from nccl_back.transport import Rendezvous
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay.chain import Chain, Place, Stream, join, stream
from nccl_back.transport.relay.server import RelayServer
from nccl_back.transport.relay.state import RELAY_HANDSHAKE, Member, parse_member
from nccl_back.transport.store import unreachable_reason


class DamagedBytes(WeightVerificationError):
    """Verification failed after a transfer; ``blamed`` names the sources (holders, relay
    members, a stream) that sent the steps carrying the failing layers (:class:`.Held`).
    What they sent was discarded, so the next source sends it again. Internal: what a
    load reports (or raises with ``strict``) is :attr:`error`, the integrity check's own."""

    def __init__(self, error: WeightVerificationError, blamed: set[str]) -> None:
        super().__init__(str(error))
        self.error = error
        self.blamed = frozenset(blamed)


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
        return (self.version, self.rank, self.world, self.manifest_digest)

    def speaks(self, member: Member) -> bool:
        return member.transport == self.kind and member.device == self.device.type


class Sender(Protocol):
    """What a relay endpoint borrows from its worker's sender (the PeerServer)."""

    pacer: Pacer

    def rendezvous(self, kind: str, device: torch.device) -> Rendezvous: ...


class Link(Protocol):
    """How the receiving rank takes one transfer from one source (the load layer's)."""

    def pull(self, source: str, kind: str, address: str, *, handshake_timeout: float,
             deadline: float, stall: float) -> None:
        """Request a transfer from ``source`` (resuming at the first step this rank lacks),
        receive it and verify it: raises :class:`PeerError`, :class:`RegistryError` or
        :class:`WeightVerificationError` (:class:`DamagedBytes` once sources are known)."""

    def blame(self, error: WeightVerificationError, tried: str) -> set[str]:
        """Record a verification failure; returns the sources blamed for it."""


@dataclass
class Relayed:
    """What one pass over a chain's upstreams gave."""

    source: str | None = None
    """The member (or stream) that served this rank; None: nobody could by the deadline."""
    error: NcclBackError | None = None
    """The last upstream failure, if any (the reason when nothing else serves us)."""
    stream_failed: bool = False
    """The stream feeding this rank failed it: never tried again, nor counted as a peer."""


class Cohorts:
    """This worker's part in cohorts: the seats it takes, the streams it reads or opens,
    the relay endpoints it runs (closed with the worker)."""

    def __init__(self, settings: Settings, registry: Registry, worker_id: str, sender: Sender,
                 metrics: Metrics) -> None:
        self.settings = settings
        self._registry = registry
        self._worker_id = worker_id
        self._sender = sender
        self._metrics = metrics
        self._servers: list[RelayServer] = []
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.settings.cohort_max_size > 1

    def close(self, timeout: float) -> None:
        with self._lock:
            servers, self._servers = self._servers, []
        for r in servers:
            r.close(timeout)

    def find_stream(self, replica: Replica, failed: Collection[str], log: Any) -> Member | None:
        """The elected downloader's stream of this rank's flavour, if one is announced,
        speaks our transport and has not failed us (cohorts only: it feeds a chain)."""
        if not self.enabled:
            return None
        raw = self._registry.get_stream(*replica.key)
        if raw is None:
            return None
        try:
            m = parse_member(raw)
        except UntrustedRecordError as e:
            log.warning("stream_record_skipped", reason=str(e))
            return None
        if (m.member_id in failed or m.member_id.startswith(self._worker_id + "-")
                or not replica.speaks(m)):
            return None
        return m

    def join(self, replica: Replica, log: Any) -> Chain | None:
        """A seat in the current cohort for this rank, or None (cohorts off, or Redis or
        the rendezvous failed: then this rank receives on its own, as without cohorts)."""
        if not self.enabled:
            return None
        try:
            chain = join(self._place(replica, log))
        except NcclBackError as e:
            log.warning("cohort_join_failed", error=str(e))
            return None
        self._track(chain.server)
        return chain

    def open_stream(self, replica: Replica, log: Any) -> Stream | None:
        """Stream this rank's download to waiting workers' cohorts, or None: cohorts off,
        or the announcement failed (logged)."""
        if not self.enabled:
            return None
        try:
            s = stream(self._place(replica, log))
        except NcclBackError as e:
            log.warning("stream_not_announced", error=str(e))
            return None
        self._track(s.server)
        return s

    def receive(self, chain: Chain, replica: Replica, fed_by: Member | None, link: Link,
                budget: float | None, log: Any) -> Relayed:
        """Receive from the nearest live member upstream of us (then the stream
        ``fed_by``), re-attaching further up when one fails (resuming at the first step
        we lack). ``source`` None: nobody is upstream of us (the head of a cohort that
        no stream feeds), or none could serve us by the chain's deadline; the caller
        then tries holders, from where we stopped."""
        out = Relayed()
        if chain.position == 0 and fed_by is None:
            return out  # the head of a cohort without a stream: holders feed it
        s = self.settings
        deadline = _clock.monotonic() + s.transfer_timeout + s.receiver_handshake_timeout
        if fed_by is not None:  # we may wait for the whole download, as in the election
            deadline += s.single_flight_max_wait
        deadline = min(deadline, budget if budget is not None else deadline)
        # A chain fed by a download moves at storage's pace: a step may take a shard's
        # download; a downloader that stops renewing its lease is given up on as long.
        stall = (max(s.relay_stall_timeout, s.download_lease) if fed_by is not None
                 else s.relay_stall_timeout)
        while _clock.monotonic() < deadline:
            try:
                upstreams = chain.upstreams()
            except RegistryError as e:
                log.warning("cohort_read_failed", error=str(e))
                return out
            if fed_by is not None and fed_by.member_id not in chain.failed:
                upstreams.append(fed_by)  # the cohort's source, or past every member
            if not upstreams:
                return out
            member = upstreams[0]
            try:
                if not replica.speaks(member):
                    raise IncompatiblePeerError(
                        f"cohort member {member.member_id} speaks {member.transport} on {member.device}")
                why = unreachable_reason(s, member.address)
                if why is not None:  # not worth a handshake: try the next one now
                    raise IncompatiblePeerError(f"cohort member {member.member_id}: {why}")
                link.pull(member.member_id, member.transport, member.address,
                          handshake_timeout=min(s.receiver_handshake_timeout, RELAY_HANDSHAKE,
                                                max(deadline - _clock.monotonic(), 0.001)),
                          deadline=deadline, stall=stall)
                out.source = member.member_id
                return out
            except WeightVerificationError as e:
                # Whoever sent the failing steps is never asked again and what it sent
                # is gone: the next upstream (or a holder) sends it again.
                blamed = link.blame(e, member.member_id)
                chain.failed.update(blamed)
                if fed_by is not None and fed_by.member_id in blamed:
                    out.stream_failed = True
                out.error = e.error if isinstance(e, DamagedBytes) else e
            except PeerError as e:
                chain.failed.add(member.member_id)
                out.error = e
                if fed_by is not None and member.member_id == fed_by.member_id:
                    out.stream_failed = True
                if isinstance(e, HandshakeTimeoutError):
                    self._metrics.record_handshake_timeout()
                log.warning("relay_upstream_failed", peer=member.member_id,
                            held_steps=chain.progress.done, reason=fallback_reason(e),
                            error=str(e))
            except RegistryError as e:
                log.warning("relay_upstream_failed", peer=member.member_id, error=str(e))
                return out
        return out

    def _place(self, replica: Replica, log: Any) -> Place:
        """Where this rank's relay endpoints live (raises if the rendezvous fails)."""
        return Place(
            self.settings, self._registry, self._sender.rendezvous(replica.kind, replica.device),
            self._worker_id, replica.version, replica.rank, replica.world,
            replica.manifest_digest, replica.kind, replica.device, replica.tensors,
            self._sender.pacer, log, self._metrics,
        )

    def _track(self, server: RelayServer) -> None:
        """Keep ``server`` for :meth:`close` (dropping the endpoints that stopped)."""
        with self._lock:
            self._servers = [r for r in self._servers if r.alive] + [server]
