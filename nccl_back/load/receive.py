"""The receive phase: the one loop over this rank's sources.

Relay upstreams first (a member before this rank in its cohort, or the stream of the
elected downloader; the relay only offers them, :meth:`~nccl_back.transport.relay.
Cohorts.upstreams`), then holders in discovery's order. Every source is asked the same
way (:func:`transfer`: one transfer request, the liveness handshake, the guarded
transfer resuming at the first step this rank lacks), every verification goes through
the Verifier (:mod:`.verify`), blame lands here, and every attempt of the load shares
one :class:`~nccl_back.budget.Budget` (``peer_budget``). A reshard
(:mod:`.reshard`) pulls its pieces through the same :func:`transfer` and
:func:`claimed`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.records import Member, TransferRequest
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import (
    HandshakeTimeoutError,
    IncompatiblePeerError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.load import verify
from nccl_back.load.attempt import Attempt, NobodyHolds, PeerBusy, StreamLost, Worker
from nccl_back.load.discover import discover, holders
from nccl_back.load.pulls import Pulls
from nccl_back.transport import (
    Transport,
    plan,
    receiver_transport,
    recv_tensors,
    relay,
    run_guarded,
)
from nccl_back.transport.broadcast import resume_point
from nccl_back.transport.parts import Part
from nccl_back.transport.parts import parts as split
from nccl_back.transport.relay import RELAY_HANDSHAKE
from nccl_back.transport.store import unreachable_reason

#: Seconds between two passes over holders whose send slots are all claimed.
_BUSY_POLL = 0.05


class Receive:
    """One pass of the receive phase on this rank. Sets ``a.peer_id`` or ``a.reason``.

    Run twice when the first pass was fed by a stream that was lost: both passes
    share ``a.rx`` (one budget, and what the first one received and did not discard).
    """

    def __init__(self, worker: Worker, a: Attempt) -> None:
        self.worker, self.a = worker, a

    def run(self) -> None:
        worker, a, s, rx = self.worker, self.a, self.worker.settings, self.a.rx
        if rx.step_sources is None:
            rx.step_sources = relay.StepSources(plan(a.target.tensors, a.target.bucket(s, a.target.kind)))
        if rx.budget is None:
            # One budget for every peer attempt of this load: holders, relay upstreams,
            # the stream and the pass after a lost stream. A stream-fed load may wait
            # for the whole download, as the election would have: the automatic budget
            # covers that wait; one set by the operator bounds everything.
            rx.start_budget(s)
            if s.peer_budget == 0 and a.found.stream is not None:
                rx.start_budget(s).extend(s.single_flight_max_wait)
        if self._budget_spent(rx.relay_error):
            return
        chain = rx.chain = worker.cohorts.join(a.replica(), a.log)
        if chain is not None and rx.step_sources.done:
            chain.progress.complete(rx.step_sources.done)  # what an earlier pass left us
        try:
            if chain is not None and self._from_upstreams(chain, a.found.stream):
                return
            if self._budget_spent(rx.relay_error):
                return
            if a.reason is None and not a.found.candidates:
                # Fed by a stream that failed us: the downloader may have published since.
                a.discovered(discover(worker, a))
                if not a.found.candidates and (a.reason is None or isinstance(a.reason, NobodyHolds)):
                    a.reason = StreamLost(
                        f"the download streamed to this rank failed ({rx.relay_error}) and no"
                        " peer holds the version yet; back to the election")
            if a.reason is None:
                failed = self._from_holders_in_parts()
                if a.peer_id is None and a.reason is None:
                    self._from_holders(failed)
        finally:
            if chain is not None:
                chain.end(a.peer_id is not None, str(a.reason or ""))

    # -- relay upstreams ----------------------------------------------------------------

    def _from_upstreams(self, chain: relay.Chain, fed_by: Member | None) -> bool:
        """Receive from the nearest live member upstream of us (then the stream
        ``fed_by``), re-attaching further up when one fails, resuming at the first step
        we lack. False: nobody upstream (the head of a cohort no stream feeds), or none
        served us by the chain's deadline: holders then go on from where we stopped."""
        worker, a, s, rx = self.worker, self.a, self.worker.settings, self.a.rx
        if chain.position == 0 and fed_by is None:
            return False
        deadline = _clock.monotonic() + s.transfer_timeout + s.receiver_handshake_timeout
        if fed_by is not None:  # we may wait for the whole download, as in the election
            deadline += s.single_flight_max_wait
        deadline = min(deadline, rx.deadline)
        # A chain fed by a download moves at storage's pace: a step may take a shard's
        # download; a downloader that stops renewing its lease is given up on as long.
        stall = (max(s.relay_stall_timeout, s.download_lease) if fed_by is not None
                 else s.relay_stall_timeout)
        while _clock.monotonic() < deadline:
            try:
                upstreams = worker.cohorts.upstreams(chain, fed_by)
            except RegistryError as e:
                a.log.warning("cohort_read_failed", error=str(e))
                return False
            if not upstreams:
                return False
            member = upstreams[0]
            try:
                why = (f"speaks {member.transport} on {member.device}" if not a.replica().speaks(member)
                       else unreachable_reason(s, member.address))
                if why is not None:  # not worth a handshake: the next one now
                    raise IncompatiblePeerError(f"cohort member {member.member_id}: {why}")
                self.pull(member.member_id, member.transport, member.address,
                          handshake_timeout=min(s.receiver_handshake_timeout, RELAY_HANDSHAKE,
                                                max(deadline - _clock.monotonic(), 0.001)),
                          deadline=deadline, stall=stall)
                a.peer_id = member.member_id
                return True
            except WeightVerificationError as e:
                # Whoever sent the failing steps is never asked again and what it sent is
                # gone: the next upstream (or a holder) sends it again.
                chain.failed.update(self.blame(e, member.member_id))
                rx.relay_error = e.error if isinstance(e, relay.DamagedBytes) else e
            except PeerError as e:
                chain.failed.add(member.member_id)
                rx.relay_error = e
                if isinstance(e, HandshakeTimeoutError):
                    worker.metrics.record_handshake_timeout()
                a.log.warning("relay_upstream_failed", peer=member.member_id,
                              held_steps=chain.progress.done, reason=fallback_reason(e), error=str(e))
            except RegistryError as e:
                a.log.warning("relay_upstream_failed", peer=member.member_id, error=str(e))
                return False
            if fed_by is not None and fed_by.member_id in chain.failed:
                rx.failed_streams.add(fed_by.member_id)
        return False

    # -- holders --------------------------------------------------------------------------

    def _from_holders_in_parts(self) -> set[str]:
        """Part ``i`` of ``n`` from each of ``n`` idle holders at once (``holder_parts``),
        into this rank's tensors, then one verification: ``a.peer_id`` names those whose
        parts landed.

        Not tried when fewer than two holders have a free send slot now, when this rank
        holds steps already, or when members are seated below it (their chain moves at
        this rank's send cap whatever it receives at, and the holders' other slots serve
        other cohorts' heads). A failed part leaves what landed, and its remainder comes
        from a holder whose part landed; with none left, the one-holder loop resumes at
        the first step this rank lacks, without the holders returned (those that failed).
        Failed verification blames the one holder that sent the failing layers; when
        they came from several (a layer at a cut, or damage in more than one part), none.
        """
        worker, a, s, rx = self.worker, self.a, self.worker.settings, self.a.rx
        if s.holder_parts < 2 or rx.sources.sources() or self._seated_below():
            return set()
        with contextlib.ExitStack() as held:
            picked: list[tuple[PeerInfo, str]] = []
            for peer in a.found.candidates:
                if len(picked) == s.holder_parts or self._budget_spent(None):
                    break
                if peer.peer_id in rx.blamed:
                    continue
                try:
                    picked.append((peer, held.enter_context(claimed(worker, a, peer))))
                except PeerBusy:
                    continue
                except RegistryError:
                    break
            if len(picked) < 2:
                return set()  # the claims taken go back as the block ends
            n = len(picked)
            a.log.info("holder_parts", peers=[p.peer_id for p, _ in picked])
            # Not aborted on a failure: what the other parts land stays (see Pulls).
            errors = Pulls(abort=False).run(
                [functools.partial(self._part, peer, token, (i, n))
                 for i, (peer, token) in enumerate(picked)], "nccl_back-part")
            for i, ((peer, _), e) in enumerate(zip(picked, errors, strict=True)):
                if e is not None:
                    self._part_failed(peer, i, e)
            failed = {peer.peer_id for (peer, _), e in zip(picked, errors, strict=True) if e is not None}
            # A failed part's remainder comes from a holder whose own part landed (its
            # slot still held), from the first step of it this rank lacks: the parts that
            # landed are not sent again.
            done = [(peer, token) for (peer, token), e in zip(picked, errors, strict=True) if e is None]
            lost = [i for i, e in enumerate(errors) if e is not None]
            while lost and done and not self._budget_spent(None):
                try:
                    self._part(*done[0], (lost[0], n), lambda _tr: None)
                    lost.pop(0)
                except (PeerError, RegistryError) as e:
                    self._part_failed(done[0][0], lost[0], e)
                    failed.add(done.pop(0)[0].peer_id)
        if lost:
            return failed
        try:
            verify.check(worker, a, rx.deadline)
        except WeightVerificationError as e:
            blamed = e.blamed if isinstance(e, relay.DamagedBytes) else frozenset()
            if len(blamed) == 1:
                self.blame(e, next(iter(blamed)))
                return failed
            # The failing layers came from several holders (a layer at a cut, or damage
            # in more than one part): none is blamed, what they sent is gone, and the
            # one-holder loop tells them apart.
            worker.metrics.record_verification_failure()
            a.log.warning("holder_parts_unplaced", peers=sorted(blamed), error=str(e))
            return failed
        a.peer_id = ",".join(p.peer_id for p, _ in done)
        return set()

    def _part_failed(self, peer: PeerInfo, i: int, e: BaseException) -> None:
        """Log part ``i``'s failure at holder ``peer``; anything but a peer's or Redis's
        failure is a bug, raised."""
        if not isinstance(e, (PeerError, RegistryError)):
            raise e
        if isinstance(e, HandshakeTimeoutError):
            self.worker.metrics.record_handshake_timeout()
        self.a.log.warning("peer_attempt_failed", peer=peer.peer_id, part=i,
                           reason=fallback_reason(e), error=str(e))

    def _part(self, peer: PeerInfo, claim: str, part: Part,
              started: Callable[[Transport], None]) -> None:
        """Part ``part`` of the steps from holder ``peer`` (its slot ``claim`` held), from
        the first step of it this rank lacks."""
        worker, a, s, t = self.worker, self.a, self.worker.settings, self.a.target
        steps = plan(t.tensors, t.bucket(s, peer.transport))
        first = a.rx.sources.lacking(split(steps, part[1])[part[0]])
        if first is None:
            return  # every step of it is held
        start = resume_point(steps, t.tensors, first)
        request = new_request(worker, a, claim, start=start, part=part[0], parts=part[1])
        transfer(worker, a, peer.peer_id, request, peer.transport, peer.address,
                 digest=t.manifest.digest, tensors=t.tensors, bucket=t.bucket(s, peer.transport),
                 start=start, part=part, on_step=self._recorder(peer.peer_id),
                 handshake_timeout=max(min(s.receiver_handshake_timeout, a.rx.left()), 0.001),
                 deadline=a.rx.deadline, transfer_timeout=s.transfer_timeout, stall=s.stall_timeout,
                 started=started)

    def _seated_below(self) -> bool:
        """Whether a member is seated below this rank in its relay chain (unknown: yes)."""
        chain = self.a.rx.chain
        if chain is None:
            return False
        try:
            return bool(self.worker.registry.chain_members(chain.seat.chain, chain.position + 1,
                                                           chain.position + 1))
        except RegistryError:
            return True

    def _recorder(self, source: str) -> Callable[[int], None]:
        """What a transfer from ``source`` calls as each step lands: the step recorded as
        ``source``'s and reported to this rank's chain."""
        sources = self.a.rx.sources
        progress = self.a.rx.chain.progress if self.a.rx.chain is not None else None

        def on_step(k: int) -> None:
            sources.record(k, source)
            if progress is not None:
                progress.advance(k)
        return on_step

    def _from_holders(self, failed: set[str]) -> None:
        """Try holders until one transfer verifies; sets ``a.peer_id`` or ``a.reason``.

        A peer whose send slots are all claimed is not a failure: the receiver waits
        (re-discovering, so receivers that finished meanwhile become candidates) up to
        ``settings.busy_wait``. Real failures count towards ``max_peer_attempts``; a
        verification failure counts against the sources that sent the failing steps
        only: a holder that did not is asked again (it then sends what was discarded).
        """
        worker, a, s = self.worker, self.a, self.worker.settings
        last: NcclBackError = NoPeerError("no peer tried" if not failed else
                                          f"holders {sorted(failed)} failed their parts")
        deadline = min(_clock.monotonic() + s.busy_wait, a.rx.deadline)
        candidates = a.found.candidates
        while True:
            busy = 0
            i = 0
            while i < len(candidates):
                peer = candidates[i]
                if peer.peer_id in failed or peer.peer_id in a.rx.blamed:
                    i += 1
                    continue
                if self._budget_spent(last):
                    return
                try:
                    with claimed(worker, a, peer) as token:
                        self.pull(peer.peer_id, peer.transport, peer.address, claim=token,
                                  handshake_timeout=max(min(s.receiver_handshake_timeout,
                                                            a.rx.left()), 0.001),
                                  deadline=a.rx.deadline, transfer_timeout=s.transfer_timeout,
                                  stall=s.stall_timeout)  # a silent peer costs the stall bound
                    a.peer_id = peer.peer_id
                    return
                except PeerBusy:
                    busy += 1
                    i += 1
                    continue
                except WeightVerificationError as e:
                    last = e.error if isinstance(e, relay.DamagedBytes) else e
                    if peer.peer_id not in self.blame(e, peer.peer_id):
                        continue  # the same holder again, from the first discarded step
                    failed.add(peer.peer_id)
                    i += 1
                except PeerError as e:
                    last = e
                    failed.add(peer.peer_id)
                    i += 1
                    if isinstance(e, HandshakeTimeoutError):
                        worker.metrics.record_handshake_timeout()
                    a.log.warning("peer_attempt_failed", peer=peer.peer_id,
                                  reason=fallback_reason(e), error=str(e))
                except RegistryError as e:
                    a.reason = e
                    return
                if len(failed) >= s.max_peer_attempts:
                    a.reason = last
                    return
            if busy == 0 or _clock.monotonic() >= deadline:
                if busy:
                    last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                a.reason = last
                return
            _clock.sleep(_BUSY_POLL)
            try:
                candidates = holders(worker, a)
            except RegistryError as e:
                a.reason = e
                return

    # -- one source -------------------------------------------------------------------------

    def pull(self, source: str, kind: str, address: str, *, handshake_timeout: float,
             deadline: float, stall: float, claim: str | None = None,
             transfer_timeout: float | None = None) -> None:
        """Request a transfer from ``source`` from the first step this rank lacks, prove
        it alive (handshake), receive (each step recorded as ``source``'s and reported
        to this rank's chain), verify: :class:`DamagedBytes` if that fails."""
        worker, a, s, t = self.worker, self.a, self.worker.settings, self.a.target
        sources = a.rx.sources
        # Resume what earlier sources gave us (and verification did not discard).
        start = resume_point(plan(t.tensors, t.bucket(s, kind)), t.tensors, sources.done)
        request = new_request(worker, a, claim, start=start)
        transfer(worker, a, source, request, kind, address, digest=t.manifest.digest, tensors=t.tensors,
                 bucket=t.bucket(s, kind), start=start, on_step=self._recorder(source),
                 handshake_timeout=handshake_timeout, deadline=deadline, stall=stall,
                 transfer_timeout=transfer_timeout)
        verify.check(worker, a, deadline)

    def blame(self, error: WeightVerificationError, tried: str) -> set[str]:
        """Record a verification failure against the sources that sent the failing steps
        (``tried`` when they cannot be told); returns them."""
        a = self.a
        blamed = set(error.blamed) if isinstance(error, relay.DamagedBytes) else {tried}
        a.rx.blamed |= blamed
        self.worker.metrics.record_verification_failure()
        for src in sorted(blamed):
            a.log.warning("peer_attempt_failed", peer=src, reason="verification_failed",
                          via=tried, error=str(error))
        if tried not in blamed:
            a.log.info("peer_attempt_retried", peer=tried, blamed=sorted(blamed),
                       held_steps=a.rx.sources.done)
        return blamed

    def _budget_spent(self, last: BaseException | None) -> bool:
        """True (and ``a.reason`` set) once the load's peer budget is spent."""
        a, s = self.a, self.worker.settings
        if a.rx.budget is None or not a.rx.budget.spent():
            return False
        a.reason = NoPeerError(
            f"peer attempts spent their budget of {s.peer_budget_seconds:g} s (peer_budget)"
            + ("" if last is None else f"; last: {last}"))
        return True


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
             started: Callable[[Transport], None] | None = None) -> None:
    """One transfer from ``source``, on every path: the request pushed once the
    handshake's first value is there, the handshake proving ``digest`` (the manifest's,
    or a reshard plan's), then ``tensors`` received under the watchdog from step
    ``start``. ``transfer_timeout``: a holder's transfer gets its own bound once the
    handshake is done (within ``deadline``); a relay upstream shares the chain's.
    ``started``: told the transport before data moves (a reshard aborts the others)."""
    s = worker.settings
    began = _clock.perf()
    run_receiver(worker.registry, request.transfer_id, digest, handshake_timeout,
                 after_ready=lambda: worker.registry.push_request(source, request.to_dict()))
    a.timings[f"handshake{_suffix(request)}"] = _clock.perf() - began
    if transfer_timeout is not None:
        deadline = min(_clock.monotonic() + transfer_timeout, deadline)
    began = _clock.perf()
    transport = receiver_transport(s, kind, address, transfer_scope(s.key("store"), request.transfer_id),
                                   device=a.target.device, registry=worker.registry)
    if started is not None:
        started(transport)
    run_guarded(transport, lambda tr: recv_tensors(tr, tensors, bucket, start=start, part=part,
                                                    on_step=on_step),
                deadline, connect_deadline=min(_clock.monotonic() + s.connect_timeout, deadline),
                stall=stall)
    a.timings[f"transfer{_suffix(request)}"] = _clock.perf() - began


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
        _clock.sleep(_BUSY_POLL)
    try:
        with kept_claim(reg, peer.peer_id, token, s.claim_ttl, a.log):
            yield token
    finally:
        with contextlib.suppress(RegistryError):
            reg.release(peer.peer_id, token)


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
