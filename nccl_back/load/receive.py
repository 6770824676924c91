"""The receive phase: the one loop over this rank's sources.

Relay upstreams first (this rank's seat's parents in its cohort's two trees, or the
stream of the elected downloader: :mod:`.tree_parts`), then holders in discovery's order (first several at once, a part
from each: :mod:`.holder_parts`). Every source is asked the same way (:func:`~.asking.transfer`:
one transfer request, the liveness handshake, the guarded transfer resuming at the
first step this rank lacks), every verification goes through the Verifier
(:mod:`.verify`), blame lands here, and every attempt of the load shares one
:class:`~nccl_back.budget.Budget` (``peer_budget``). A reshard (:mod:`.reshard`) pulls
its pieces through the same :func:`~.asking.transfer` and :func:`~.asking.claimed`.
"""

from __future__ import annotations

from collections.abc import Callable

from nccl_back import _clock
from nccl_back.coord.records import Member
from nccl_back.errors import (
    HandshakeTimeoutError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.load import holder_parts, tree_parts, verify
from nccl_back.load.asking import BUSY_POLL, claimed, new_request, transfer
from nccl_back.load.attempt import Absence, Attempt, NoHolder, PeerBusy, Worker
from nccl_back.load.discover import discover, holders
from nccl_back.timing import MAX_PEER_ATTEMPTS
from nccl_back.transport import (
    plan,
    relay,
)
from nccl_back.transport.broadcast import resume_point


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
            # covers that wait; one carved shorter (Settings.capped) bounds everything.
            rx.start_budget(s)
            if "peer_budget" not in s.caps and a.found.stream is not None:
                rx.start_budget(s).extend(s.single_flight_max_wait)
        if self.budget_spent(rx.relay_error):
            return
        seat = rx.seat = worker.cohorts.join(a.replica(), a.log)
        if seat is not None and rx.step_sources.done:
            seat.progress.complete(rx.step_sources.done)  # what an earlier pass left us
        try:
            if seat is not None and self._from_trees(seat, a.found.stream):
                return
            if self.budget_spent(rx.relay_error):
                return
            if a.reason is None and not a.found.candidates:
                # Fed by a stream that failed us: the downloader may have published since.
                a.discovered(discover(worker, a))
                if not a.found.candidates and (a.reason is None or isinstance(a.reason, NoHolder)):
                    a.reason = NoHolder(
                        Absence.STREAM_LOST, f"the download streamed to this rank failed ({rx.relay_error}) and no"
                        " peer holds the version yet; back to the election")
            if a.reason is None:
                failed = holder_parts.from_holders_in_parts(self) | rx.failed
                try:
                    if a.peer_id is None and a.reason is None:
                        self._from_holders(failed)
                finally:
                    rx.failed |= failed
        finally:
            if seat is not None:
                seat.end(a.peer_id is not None, str(a.reason or ""))

    # -- relay upstreams ----------------------------------------------------------------

    def _from_trees(self, seat: relay.Seat, fed_by: Member | None) -> bool:
        """Receive this seat's two halves from its upstreams in the cohort's trees (then
        the stream ``fed_by``, or the cohort's holders), re-attaching further up when one
        fails, resuming at the first step we lack (:mod:`.tree_parts`). False: none
        served us by the relay's deadline: holders then go on from where we stopped."""
        s, rx = self.worker.settings, self.a.rx
        deadline = _clock.monotonic() + s.transfer_timeout + s.handshake_timeout
        if fed_by is not None:  # we may wait for the whole download, as in the election
            deadline += s.single_flight_max_wait
        deadline = min(deadline, rx.deadline)
        # A cohort fed by a download moves at storage's pace: a step may take a shard's
        # download; a downloader that stops renewing its lease is given up on as long.
        stall = (max(s.stall_timeout, s.download_lease) if fed_by is not None
                 else s.stall_timeout)
        return tree_parts.from_trees(self, seat, fed_by, deadline, stall)

    # -- holders --------------------------------------------------------------------------

    def recorder(self, source: str) -> Callable[[int], None]:
        """What a transfer from ``source`` calls as each step lands: the step recorded as
        ``source``'s and reported to this rank's seat."""
        sources = self.a.rx.sources
        progress = self.a.rx.seat.progress if self.a.rx.seat is not None else None

        def on_step(k: int) -> None:
            sources.record(k, source)
            if progress is not None:
                progress.advance(k)
        return on_step

    def _from_holders(self, failed: set[str]) -> None:
        """Try holders until one transfer verifies; sets ``a.peer_id`` or ``a.reason``.

        A peer whose send slots are all claimed is not a failure: the receiver waits
        (re-discovering, so receivers that finished meanwhile become candidates) up to
        ``settings.busy_wait``. Real failures count towards :data:`~nccl_back.timing.MAX_PEER_ATTEMPTS`; a
        verification failure counts against the sources that sent the failing steps
        only: a holder that did not is asked again (it then sends what was discarded).
        """
        worker, a, s = self.worker, self.a, self.worker.settings
        # What failed already (a relay upstream, a tree's part, a verification) says why
        # when no holder is left to try.
        last: NcclBackError = a.rx.relay_error or NoPeerError(
            "no peer tried" if not failed else f"holders {sorted(failed)} failed their parts")
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
                if self.budget_spent(last):
                    return
                try:
                    with claimed(worker, a, peer) as token:
                        self.pull(peer.peer_id, peer.transport, peer.address, claim=token,
                                  handshake_timeout=max(min(s.handshake_timeout,
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
                if len(failed) >= MAX_PEER_ATTEMPTS:
                    a.reason = last
                    return
            if busy == 0 or _clock.monotonic() >= deadline:
                if busy:
                    last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                a.reason = last
                return
            _clock.sleep(BUSY_POLL)
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
        to this rank's seat), verify: :class:`DamagedBytes` if that fails."""
        worker, a, s, t = self.worker, self.a, self.worker.settings, self.a.target
        sources = a.rx.sources
        # Resume what earlier sources gave us (and verification did not discard).
        start = resume_point(plan(t.tensors, t.bucket(s, kind)), t.tensors, sources.done)
        request = new_request(worker, a, claim, start=start)
        transfer(worker, a, source, request, kind, address, digest=t.manifest.digest, tensors=t.tensors,
                 bucket=t.bucket(s, kind), start=start, on_step=self.recorder(source),
                 handshake_timeout=handshake_timeout, deadline=deadline, stall=stall,
                 transfer_timeout=transfer_timeout)
        verify.check(worker, a, deadline)

    def blame(self, error: WeightVerificationError, tried: str) -> set[str]:
        """Record a verification failure against the sources that sent failing bytes
        (``tried`` when they cannot be told); returns them. Suspects (one of them sent
        wrong bytes, the check cannot say which: :class:`~nccl_back.transport.relay.Blame`)
        are logged, not blamed: what they sent is gone, and a source implicated again
        is blamed then."""
        a = self.a
        blamed = set(error.blamed) if isinstance(error, relay.DamagedBytes) else {tried}
        a.rx.blamed |= blamed
        self.worker.metrics.record_verification_failure()
        for src in sorted(blamed):
            a.log.warning("peer_attempt_failed", peer=src, reason="verification_failed",
                          via=tried, error=str(error))
        if isinstance(error, relay.DamagedBytes) and error.suspects:
            a.log.warning("verification_unplaced", suspects=sorted(error.suspects), via=tried,
                          held_steps=a.rx.sources.done, error=str(error))
        if tried not in blamed:
            a.log.info("peer_attempt_retried", peer=tried, blamed=sorted(blamed),
                       held_steps=a.rx.sources.done)
        return blamed

    def budget_spent(self, last: BaseException | None) -> bool:
        """True (and ``a.reason`` set) once the load's peer budget is spent."""
        a, s = self.a, self.worker.settings
        if a.rx.budget is None or not a.rx.budget.spent():
            return False
        a.reason = NoPeerError(
            f"peer attempts spent their budget of {s.peer_budget:g} s (peer_budget)"
            + ("" if last is None else f"; last: {last}"))
        return True
