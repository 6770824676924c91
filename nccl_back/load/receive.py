"""The receive phase: this rank's bytes from its cohort's upstream or from holders.

Relay or direct: a rank with someone upstream of it in its cohort (a member before
it, or the stream of the elected downloader) receives through the relay
(:meth:`nccl_back.transport.relay.Cohorts.receive`); otherwise, or when no upstream
could serve it, from holders in discovery's order. Every source, relayed or direct,
is asked the same way (:meth:`Receive.pull`: one transfer request, the liveness
handshake, the guarded transfer resuming at the first step this rank lacks, then
verification), and every attempt of the load shares one budget (``peer_budget``).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from nccl_back import _clock
from nccl_back.coord import records
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import (
    HandshakeTimeoutError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.load import verify
from nccl_back.load.attempt import Attempt, Env, NobodyHolds, PeerBusy, StreamLost
from nccl_back.load.discover import discover, holders
from nccl_back.transport import plan, receiver_transport, recv_tensors, relay, run_guarded
from nccl_back.transport.broadcast import resume_point

#: Seconds between two passes over holders whose send slots are all claimed.
_BUSY_POLL = 0.05


class Receive:
    """One pass of the receive phase on this rank (the :class:`~nccl_back.transport.relay.Link`
    its cohort pulls through). Sets ``a.peer_id`` or ``a.reason``.

    Run twice when the first pass was fed by a stream that was lost: both passes
    share ``a.rx`` (one budget, and what the first one received and did not discard).
    """

    def __init__(self, env: Env, a: Attempt) -> None:
        self.env, self.a = env, a

    def run(self) -> None:
        env, a, s, rx = self.env, self.a, self.env.settings, self.a.rx
        if rx.held is None:
            rx.held = relay.Held(plan(a.target.tensors, a.target.bucket(s, a.target.kind)))
        if rx.budget is None:
            # One budget for every peer attempt of this load: holders, relay upstreams,
            # the stream and the pass after a lost stream. A stream-fed load may wait
            # for the whole download, as the election would have: the automatic budget
            # covers that wait; one set by the operator bounds everything.
            fed = s.peer_budget == 0 and a.found.stream is not None
            rx.budget = _clock.monotonic() + s.peer_budget_seconds + (
                s.single_flight_max_wait if fed else 0.0)
        if self._budget_spent(rx.relay_error):
            return
        chain = rx.chain = env.cohorts.join(a.replica(), a.log)
        if chain is not None and rx.held.done:
            chain.progress.advance(rx.held.done - 1)  # what an earlier pass left us
        try:
            if chain is not None:
                relayed = env.cohorts.receive(chain, a.replica(), a.found.stream, self,
                                              rx.budget, a.log)
                if relayed.stream_failed and a.found.stream is not None:
                    rx.failed_streams.add(a.found.stream.member_id)
                if relayed.error is not None:
                    rx.relay_error = relayed.error
                if relayed.source is not None:
                    a.peer_id = relayed.source
                    return
            if self._budget_spent(rx.relay_error):
                return
            if a.reason is None and not a.found.candidates:
                # Fed by a stream that failed us: the downloader may have published since.
                a.discovered(discover(env, a))
                if not a.found.candidates and (a.reason is None or isinstance(a.reason, NobodyHolds)):
                    a.reason = StreamLost(
                        f"the download streamed to this rank failed ({rx.relay_error}) and no"
                        " peer holds the version yet; back to the election")
            if a.reason is None:
                self._from_holders()
        finally:
            if chain is not None:
                chain.end(a.peer_id is not None, str(a.reason or ""))

    def _from_holders(self) -> None:
        """Try holders until one transfer verifies; sets ``a.peer_id`` or ``a.reason``.

        A peer whose send slots are all claimed is not a failure: the receiver waits
        (re-discovering, so receivers that finished meanwhile become candidates) up to
        ``settings.busy_wait``. Real failures count towards ``max_peer_attempts``; a
        verification failure counts against the sources that sent the failing steps
        only: a holder that did not is asked again (it then sends what was discarded).
        """
        env, a, s = self.env, self.a, self.env.settings
        last: NcclBackError = NoPeerError("no peer tried")
        failed: set[str] = set()
        deadline = _clock.monotonic() + s.busy_wait
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
                    self._from_holder(peer)
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
                    if len(failed) >= s.max_peer_attempts:
                        a.reason = last
                        return
                except PeerError as e:
                    last = e
                    failed.add(peer.peer_id)
                    i += 1
                    if isinstance(e, HandshakeTimeoutError):
                        env.metrics.record_handshake_timeout()
                    a.log.warning("peer_attempt_failed", peer=peer.peer_id,
                                  reason=fallback_reason(e), error=str(e))
                    if len(failed) >= s.max_peer_attempts:
                        a.reason = last
                        return
                except RegistryError as e:
                    a.reason = e
                    return
            budget = a.rx.budget
            if busy == 0 or _clock.monotonic() >= min(deadline, budget or deadline):
                if busy:
                    last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                a.reason = last
                return
            _clock.sleep(_BUSY_POLL)
            try:
                candidates = holders(env, a)
            except RegistryError as e:
                a.reason = e
                return

    def _from_holder(self, peer: PeerInfo) -> None:
        """One holder: claim a send slot (renewed while the transfer runs), then pull."""
        s, reg, a = self.env.settings, self.env.registry, self.a
        budget = a.rx.budget if a.rx.budget is not None else _clock.monotonic() + s.peer_budget_seconds
        token = reg.claim(peer.peer_id, self.env.worker_id, peer.max_sends, s.claim_ttl)
        if token is None:
            raise PeerBusy(peer.peer_id)
        try:
            with kept_claim(reg, peer.peer_id, token, s.claim_ttl, a.log):
                self.pull(peer.peer_id, peer.transport, peer.address, claim=token,
                          handshake_timeout=max(min(s.receiver_handshake_timeout,
                                                    budget - _clock.monotonic()), 0.001),
                          deadline=budget, transfer_timeout=s.transfer_timeout,
                          stall=s.stall_timeout)  # a silent peer costs the stall bound
        finally:
            with contextlib.suppress(RegistryError):
                reg.release(peer.peer_id, token)

    def pull(self, source: str, kind: str, address: str, *, handshake_timeout: float,
             deadline: float, stall: float, claim: str | None = None,
             transfer_timeout: float | None = None) -> None:
        """Request a transfer from ``source`` from the first step this rank lacks, prove
        it alive (handshake), receive (each step recorded as ``source``'s and reported
        to this rank's chain), verify: :class:`DamagedBytes` if that fails.

        ``claim``: the send slot claimed at a holder. ``transfer_timeout``: a holder's
        transfer gets its own bound once the handshake is done (within ``deadline``);
        a relay upstream shares the chain's ``deadline``."""
        env, a, s, t = self.env, self.a, self.env.settings, self.a.target
        held = a.rx.holding
        transfer_id = uuid.uuid4().hex
        # Resume what earlier sources gave us (and verification did not discard).
        start = resume_point(plan(t.tensors, t.bucket(s, kind)), t.tensors, held.done)
        request = records.TransferRequest(
            transfer_id=transfer_id, receiver=env.worker_id, version=a.spec.version,
            manifest_digest=t.manifest.digest, transport=t.kind, device=t.device.type,
            claim=claim, start=start,
        ).to_dict()
        began = _clock.perf()
        run_receiver(env.registry, transfer_id, t.manifest.digest, handshake_timeout,
                     after_ready=lambda: env.registry.push_request(source, request))
        a.timings["handshake"] = _clock.perf() - began
        if transfer_timeout is not None:
            deadline = min(_clock.monotonic() + transfer_timeout, deadline)

        began = _clock.perf()
        transport = receiver_transport(s, kind, address,
                                       transfer_scope(s.key("store"), transfer_id),
                                       device=t.device, registry=env.registry)
        progress = a.rx.chain.progress if a.rx.chain is not None else None

        def on_step(k: int) -> None:
            held.record(k, source)
            if progress is not None:
                progress.advance(k)

        run_guarded(
            transport,
            lambda tr: recv_tensors(tr, t.tensors, t.bucket(s, kind), start=start, on_step=on_step),
            deadline,
            connect_deadline=min(_clock.monotonic() + s.connect_timeout, deadline),
            stall=stall,
        )
        a.timings["transfer"] = _clock.perf() - began
        verify.check(env, a, deadline)

    def blame(self, error: WeightVerificationError, tried: str) -> set[str]:
        """Record a verification failure against the sources that sent the failing steps
        (``tried`` when they cannot be told); returns them."""
        a = self.a
        blamed = set(error.blamed) if isinstance(error, relay.DamagedBytes) else {tried}
        a.rx.blamed |= blamed
        self.env.metrics.record_verification_failure()
        for src in sorted(blamed):
            a.log.warning("peer_attempt_failed", peer=src, reason="verification_failed",
                          via=tried, error=str(error))
        if tried not in blamed:
            a.log.info("peer_attempt_retried", peer=tried, blamed=sorted(blamed),
                       held_steps=a.rx.holding.done)
        return blamed

    def _budget_spent(self, last: BaseException | None) -> bool:
        """True (and ``a.reason`` set) once the load's peer budget is spent."""
        a, s = self.a, self.env.settings
        if a.rx.budget is None or _clock.monotonic() < a.rx.budget:
            return False
        a.reason = NoPeerError(
            f"peer attempts spent their budget of {s.peer_budget_seconds:g} s"
            f" (peer_budget); last: {last}"
        )
        return True


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
