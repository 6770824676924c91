"""Asking one source for the weights, the same way on every path (a holder, a relay
upstream, a holder's part, a reshard's piece): a transfer request, the liveness
handshake, the guarded transfer; and a holder's send slot, claimed and renewed for as
long as the transfer runs.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import abandoned, run_receiver
from nccl_back.coord.records import TransferRequest
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import NoPeerError, RegistryError
from nccl_back.load.attempt import Attempt, PeerBusy, Worker
from nccl_back.timing import BUSY_POLL
from nccl_back.transport import Transport, receiver_transport, recv_tensors, run_guarded
from nccl_back.transport.parts import Part


def new_request(worker: Worker, a: Attempt, claim: str | None, **fields: Any) -> TransferRequest:
    """A fresh request from this rank for ``a``'s version (``claim``: the slot held)."""
    t = a.target
    return TransferRequest(
        transfer_id=uuid.uuid4().hex, receiver=worker.id, version=a.spec.version,
        manifest_digest=t.manifest.digest, transport=t.kind, device=t.device.type,
        claim=claim, **fields)


def transfer(worker: Worker, a: Attempt, source: str, request: TransferRequest, kind: str,
             address: str, *,
             digest: str, tensors: Mapping[str, torch.Tensor], bucket: int, start: int = 0,
             part: Part | None = None, on_step: Callable[[int], None] | None, handshake_timeout: float, deadline: float,
             stall: float, transfer_timeout: float | None = None,
             started: Callable[[Transport], None] | None = None,
             gone: threading.Event | None = None) -> None:
    """One transfer from ``source``, on every path: the request pushed once the
    handshake's first value is there, the handshake proving ``digest`` (the manifest's,
    or a reshard plan's), then ``tensors`` received under the watchdog from step
    ``start``. ``transfer_timeout``: a holder's transfer gets its own bound once the
    handshake is done (within ``deadline``); a relay upstream shares the chain's.
    ``started``: told the transport before data moves (a reshard aborts the others).
    ``gone``: set once the source is known dead (the handshake then ends at once; the
    caller aborts the transport ``started`` gave it). A source that gives the transfer up
    (it closes) says so, and the transfer ends at once (:func:`_abandoned`)."""
    s = worker.settings
    with _timed(a.timings, f"handshake{_suffix(request)}"):
        run_receiver(worker.registry, request.transfer_id, digest, handshake_timeout,
                     after_ready=lambda: worker.registry.push_request(source, request.to_dict()),
                     gone=gone)
    if transfer_timeout is not None:
        deadline = min(_clock.monotonic() + transfer_timeout, deadline)
    with _timed(a.timings, f"transfer{_suffix(request)}"):
        transport = receiver_transport(s, kind, address,
                                       transfer_scope(s.key("store"), request.transfer_id),
                                       device=a.target.device, registry=worker.registry)
        if started is not None:
            started(transport)
        run_guarded(transport, lambda tr: recv_tensors(tr, tensors, bucket, start=start, part=part,
                                                        on_step=on_step),
                    deadline, connect_deadline=min(_clock.monotonic() + s.connect_timeout, deadline),
                    stall=stall, abandoned=lambda: _abandoned(worker, request.transfer_id))


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
            until: float | None = None) -> Iterator[str]:
    """A send slot of ``peer`` held (renewed every third of ``claim_ttl``) while the
    block runs, released after. ``until`` None: one try, :class:`PeerBusy` when every
    slot is taken; else polled until ``until`` (:class:`NoPeerError` then). ``share``:
    the receiving group's token part (its ranks hold one slot together)."""
    s, reg = worker.settings, worker.registry
    while True:
        token = reg.claim(peer.peer_id, worker.id, peer.max_sends, s.claim_ttl, share=share)
        if token is not None:
            break
        if until is None:
            raise PeerBusy(peer.peer_id)
        if _clock.monotonic() >= until:
            raise NoPeerError(f"holder {peer.peer_id}: every send slot stayed claimed")
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
