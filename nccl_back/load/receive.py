"""The receive phase: the one loop over this rank's sources.

Relay upstreams first (this rank's seat's parents in its cohort's two trees, or the
stream of the elected downloader: :mod:`.tree_parts`), then holders in discovery's order (first several at once, a part
from each: :mod:`.holder_parts`). Every source is asked the same way (:func:`~.asking.transfer`:
one transfer request, the liveness handshake, the guarded transfer resuming at the
first step this rank lacks), every verification goes through the Verifier
(:mod:`.verify`), blame lands in one place (:class:`~.fill.Fill`), and every attempt of the load shares one
:class:`~nccl_back.budget.Budget` (``peer_budget``). A reshard (:mod:`.reshard`) pulls
its pieces through the same :func:`~.asking.transfer` and :func:`~.asking.claimed`.
"""

from __future__ import annotations

from nccl_back import _clock
from nccl_back.coord.records import Member
from nccl_back.errors import (
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    WeightVerificationError,
)
from nccl_back.load import holder_parts, tree_parts, verify
from nccl_back.load.asking import BUSY_POLL, Ask, Source, claimed, transfer
from nccl_back.load.attempt import Absence, NoHolder, PeerBusy
from nccl_back.load.discover import discover, holders
from nccl_back.load.fill import Fill, NotReceived, Received
from nccl_back.timing import MAX_PEER_ATTEMPTS
from nccl_back.transport import plan, relay


class Receive(Fill):
    """One pass of the receive phase on this rank: :meth:`run` says who served it, or why
    nobody did (the service records it in the load).

    Run twice when the first pass was fed by a stream that was lost: both passes
    share ``a.rx`` (one budget, and what the first one received and did not discard).
    """

    def run(self) -> Received | NotReceived:
        self._pass()
        if self.reason is None and self.peer_id is not None:
            return Received(self.peer_id)
        return NotReceived(self.reason or NoPeerError("no source served this rank"))

    def _pass(self) -> None:
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
            if self.reason is None and not a.found.candidates:
                # Fed by a stream that failed us: the downloader may have published since.
                a.discovered(discover(worker, a))
                self.reason = a.reason
                if not a.found.candidates and (a.reason is None or isinstance(a.reason, NoHolder)):
                    self.reason = NoHolder(
                        Absence.STREAM_LOST, f"the download streamed to this rank failed ({rx.relay_error}) and no"
                        " peer holds the version yet; back to the election")
            if self.reason is None:
                failed = holder_parts.from_holders_in_parts(self) | rx.failed
                try:
                    if self.peer_id is None and self.reason is None:
                        self._from_holders(failed)
                finally:
                    rx.failed |= failed
        finally:
            if seat is not None:
                seat.end(self.peer_id is not None, str(self.reason or ""))

    # -- relay upstreams ----------------------------------------------------------------

    def _from_trees(self, seat: relay.Seat, fed_by: Member | None) -> bool:
        """Receive this seat's two halves from its upstreams in the cohort's trees (then
        the stream ``fed_by``, or the cohort's holders), re-attaching further up when one
        fails, resuming at the first step we lack (:mod:`.tree_parts`). False: none
        served us by the relay's deadline: holders then go on from where we stopped."""
        s, rx = self.worker.settings, self.a.rx
        bound = s.transfer_timeout + s.handshake_timeout
        if fed_by is not None:  # we may wait for the whole download, as in the election
            bound += s.single_flight_max_wait
        # A cohort fed by a download moves at storage's pace: a step may take a shard's
        # download; a downloader that stops renewing its lease is given up on as long.
        stall = (max(s.stall_timeout, s.download_lease) if fed_by is not None
                 else s.stall_timeout)
        return tree_parts.from_trees(self, seat, fed_by, rx.peer_budget.phase("relay", bound), stall)

    # -- holders --------------------------------------------------------------------------

    def _from_holders(self, failed: set[str]) -> None:
        """Try holders until one transfer verifies; sets ``peer_id`` or ``reason``.

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
        budget = a.rx.peer_budget
        claim = budget.phase("claim", s.busy_wait)
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
                        transfer(worker, a, Source.peer(peer), Ask.holder(s, budget, token))
                        verify.check(worker, a, budget.deadline)
                    self.peer_id = peer.peer_id
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
                    self.failed(peer.peer_id, e)
                except RegistryError as e:
                    self.reason = e
                    return
                if len(failed) >= MAX_PEER_ATTEMPTS:
                    self.reason = last
                    return
            if busy == 0 or claim.spent():
                if busy:
                    last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                self.reason = last
                return
            _clock.sleep(BUSY_POLL)
            try:
                candidates = holders(worker, a)
            except RegistryError as e:
                self.reason = e
                return
