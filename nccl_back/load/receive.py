"""The receive phase: the one loop over this rank's sources.

Relay upstreams first (this rank's seat's parents in its cohort's two trees, or the
stream of the elected downloader: :mod:`.tree_parts`), then holders in discovery's
order (:mod:`.holders`: first several at once, a part from each). Every source is asked the same way (:func:`~.asking.transfer`:
one transfer request, the liveness handshake, the guarded transfer resuming at the
first step this rank lacks), every verification goes through the Verifier
(:mod:`.verify`), blame lands in one place (:class:`~.fill.Fill`), and every attempt of the load shares one
:class:`~nccl_back.budget.Budget` (``peer_budget``). A reshard (:mod:`.reshard`) pulls
its pieces through the same :func:`~.asking.transfer` and :func:`~.asking.claimed`.
"""

from __future__ import annotations

from nccl_back.coord.records import Member
from nccl_back.errors import NoPeerError
from nccl_back.load import holders, tree_parts
from nccl_back.load.attempt import Absence, NoHolder
from nccl_back.load.discover import discover
from nccl_back.load.fill import Fill, NotReceived, Received
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
                holders.from_holders(self)
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
