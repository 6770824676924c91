"""Asking one source for the weights, the same way on every path (a holder, a relay
upstream, a holder's part, a reshard's piece, a cooperative download's part): who is
asked (:class:`Source`), what and within which bounds (:class:`Ask`), then
:func:`transfer`: the resume point, the transfer request, the liveness handshake, the
guarded transfer; and a holder's send slot, claimed and renewed for as long as the
transfer runs (:func:`claimed`).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.budget import Budget, Phase, Span
from nccl_back.config import Settings
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import abandoned, run_receiver
from nccl_back.coord.records import Member, TransferRequest
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import NoPeerError, RegistryError
from nccl_back.load.attempt import Attempt, PeerBusy, Receiving, Worker
from nccl_back.timing import BUSY_POLL
from nccl_back.transport import Transport, plan, receiver_transport, recv_tensors, run_guarded
from nccl_back.transport.broadcast import resume_point
from nccl_back.transport.parts import Part, part_steps
from nccl_back.transport.relay import RELAY_HANDSHAKE, Seat


@dataclass(frozen=True)
class Source:
    """Who is asked (a holder, or a relay endpoint: a seat's, a stream's, a share's), over
    which transport kind, at which address."""

    id: str
    kind: str
    address: str

    @classmethod
    def peer(cls, p: PeerInfo) -> Source:
        return cls(p.peer_id, p.transport, p.address)

    @classmethod
    def member(cls, m: Member) -> Source:
        return cls(m.member_id, m.transport, m.address)


@dataclass(frozen=True)
class Into:
    """Where a transfer lands when not in this rank's tensors, resumed from its record of
    who sent which step: a reshard's pieces (the plan's digest proven, its request
    fields), a cooperative download's parts (proven by the files' CRC32C instead)."""

    digest: str
    tensors: Mapping[str, torch.Tensor]
    bucket: int
    on_step: Callable[[int], None] | None = None
    layout: str | None = None
    group: str | None = None
    holder: int | None = None


@dataclass(frozen=True)
class Ask:
    """What a source is asked (all of this rank's tensors, or ``part``; ``into`` else),
    with the slot ``claim`` held, and within which bounds: the ``handshake`` phase, then
    the transfer ``within`` (a holder's its own ``transfer_timeout`` of the load's budget;
    a relay upstream's the relay phase). ``started``: told the transport before data
    moves (a reshard aborts the others). ``gone``: set once the source is known dead
    (the handshake then ends at once; the caller aborts the transport ``started`` gave
    it)."""

    handshake: float
    within: Span
    stall: float
    transfer_timeout: float | None = None
    part: Part | None = None
    claim: str | None = None
    into: Into | None = None
    started: Callable[[Transport], None] | None = None
    gone: threading.Event | None = None

    @classmethod
    def holder(cls, s: Settings, budget: Budget, claim: str, *, part: Part | None = None,
               into: Into | None = None, started: Callable[[Transport], None] | None = None) -> Ask:
        """A holder (its slot ``claim`` held), within the load's peer ``budget``; a silent
        one costs the stall bound."""
        return cls(budget.phase("handshake", s.handshake_timeout).timeout(), budget, s.stall_timeout,
                   s.transfer_timeout, part, claim, into, started)

    @classmethod
    def upstream(cls, s: Settings, seat: Seat, source: str, relay: Phase, stall: float, part: Part,
                 claim: str | None, started: Callable[[Transport], None], gone: threading.Event) -> Ask:
        """A seat's upstream in a tree (a member, the stream, a holder as the cohort's
        source), within the ``relay`` phase: the relay's handshake bound, short once
        ``source`` stalled this seat."""
        bound = relay.phase("handshake", min(s.handshake_timeout, RELAY_HANDSHAKE)).timeout()
        return cls(seat.handshake_bound(source, bound), relay, stall, None, part, claim, None,
                   started, gone)


def transfer(worker: Worker, a: Attempt, source: Source, ask: Ask) -> None:
    """Ask ``source`` for one transfer, on every path: the request pushed once the
    handshake's first value is there, the handshake proving the digest (the manifest's,
    or a reshard plan's), then the tensors received under the watchdog. Into this
    rank's tensors (``ask.into`` None), from the first step of the part asked that this
    rank lacks (none: nothing asked), each step recorded as ``source``'s and reported to
    this rank's seat. A source that gives the transfer up (it closes) says so, and the
    transfer ends at once (:func:`_abandoned`)."""
    s, t, into = worker.settings, a.target, ask.into
    fields: dict[str, Any] = dict(zip(("part", "parts", "sub", "subs"), ask.part or (), strict=False))
    tensors: Mapping[str, torch.Tensor]
    if into is None:
        digest, tensors, bucket = t.manifest.digest, t.tensors, t.bucket(s, t.kind)
        steps, held = plan(tensors, bucket), a.rx.sources
        first = held.done if ask.part is None else held.lacking(part_steps(steps, ask.part))
        if first is None:
            return  # every step of the part is held
        start = fields["start"] = resume_point(steps, first)
        on_step: Callable[[int], None] | None = _recorder(a.rx, source.id)
    else:
        digest, tensors, bucket, on_step, start = into.digest, into.tensors, into.bucket, into.on_step, 0
        fields |= {"layout": into.layout, "group": into.group, "holder": into.holder}
    request = TransferRequest(
        transfer_id=uuid.uuid4().hex, receiver=worker.id, version=a.spec.version,
        manifest_digest=t.manifest.digest, transport=t.kind, device=t.device.type,
        claim=ask.claim, **fields)
    with _timed(a.timings, f"handshake{_suffix(request)}"):
        run_receiver(worker.registry, request.transfer_id, digest, ask.handshake,
                     after_ready=lambda: worker.registry.push_request(source.id, request.to_dict()),
                     gone=ask.gone)
    bound = ask.within.phase("transfer", ask.transfer_timeout)
    with _timed(a.timings, f"transfer{_suffix(request)}"):
        transport = receiver_transport(s, source.kind, source.address,
                                       transfer_scope(s.key("store"), request.transfer_id),
                                       device=t.device, registry=worker.registry)
        if ask.started is not None:
            ask.started(transport)
        run_guarded(transport, lambda tr: recv_tensors(tr, tensors, bucket, start=start, part=ask.part,
                                                        on_step=on_step),
                    bound.deadline, connect_deadline=bound.phase("connect", s.connect_timeout).deadline,
                    stall=ask.stall, abandoned=lambda: _abandoned(worker, request.transfer_id))


def _recorder(rx: Receiving, source: str) -> Callable[[int], None]:
    """Each step as it lands: recorded as ``source``'s, reported to this rank's seat."""
    sources, progress = rx.sources, rx.seat.progress if rx.seat is not None else None

    def on_step(k: int) -> None:
        sources.record(k, source)
        if progress is not None:
            progress.advance(k)
    return on_step


def _abandoned(worker: Worker, transfer_id: str) -> bool:
    """Whether the source gave ``transfer_id`` up (its notice); Redis trouble says nothing
    (the stall bound still ends a silent transfer)."""
    try:
        return abandoned(worker.registry, transfer_id)
    except RegistryError:
        return False


@contextlib.contextmanager
def _timed(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's seconds to ``timings[phase]``, whether or not it raised: a part
    asked again (a leaf whose parent moved, a re-attach) spends every try's wait."""
    began = _clock.perf()
    try:
        yield
    finally:
        timings[phase] = timings.get(phase, 0.0) + _clock.perf() - began


def _suffix(request: TransferRequest) -> str:
    return ("" if request.holder is None else f".{request.holder}") + (
        "" if request.parts is None else f".p{request.part}")


@contextlib.contextmanager
def claimed(worker: Worker, a: Attempt, peer: PeerInfo, *, share: str | None = None,
            until: Phase | None = None) -> Iterator[str]:
    """A send slot of ``peer`` held (renewed every third of ``claim_ttl``) while the
    block runs, released after. ``until`` None: one try, :class:`PeerBusy` when every
    slot is taken; else polled until the phase ``until`` is spent (:class:`NoPeerError`
    then). ``share``:
    the receiving group's token part (its ranks hold one slot together)."""
    s, reg = worker.settings, worker.registry
    while True:
        token = reg.claim(peer.peer_id, worker.id, peer.max_sends, s.claim_ttl, share=share)
        if token is not None:
            break
        if until is None:
            raise PeerBusy(peer.peer_id)
        if until.spent():
            raise NoPeerError(f"holder {peer.peer_id}: every send slot stayed claimed for {until.name}'s"
                              f" bound of {until.seconds:g} s")
        _clock.sleep(BUSY_POLL)
    try:
        with kept_claim(reg, peer.peer_id, token, s.claim_ttl, a.log):
            yield token
    finally:
        reg.release(peer.peer_id, token)  # a tidy-up: never raises (SignedStore.tidy)


@contextlib.contextmanager
def kept_claim(registry: Registry, peer_id: str, token: str, ttl: float, log: Any) -> Iterator[None]:
    """Renew the claim ``token`` every third of ``ttl`` while the block runs.

    The claim then lives exactly as long as its holder: a receiver that crashes stops
    renewing, and its slot frees itself within ``ttl``.
    """
    stop = threading.Event()

    def renew() -> None:
        while not _clock.wait(stop, ttl / 3):
            try:
                if not registry.renew_claim(peer_id, token, ttl):
                    log.warning("claim_lost", peer=peer_id)
                    return
            except RegistryError as e:
                log.warning("claim_renew_failed", peer=peer_id, error=str(e))

    thread = threading.Thread(target=renew, name="nccl-back-claim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(ttl)
