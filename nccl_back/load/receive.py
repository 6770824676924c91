"""The receive phase: one pass over this rank's sources within the load's one
:class:`~nccl_back.budget.Budget` (``peer_budget``): its seat's upstreams in its
cohort's two trees, or the stream feeding them, then holders (:mod:`.rounds`). Every
source is asked through :func:`~.asking.transfer`, every check goes through the Verifier
(:mod:`.verify`), and blame lands in :class:`~.fill.Fill`.
"""

from __future__ import annotations

from nccl_back.errors import NoPeerError
from nccl_back.load import rounds
from nccl_back.load.attempt import Absence, Discovery, NoHolder
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
            return Received(self.peer_id, self.verified, found=self._again())
        return NotReceived(self.reason or NoPeerError("no source served this rank"), self.truth,
                           self._again())

    def _again(self) -> Discovery | None:
        """What this pass discovered again, if it did."""
        return None if self.found is self.a.found else self.found

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
            if "peer_budget" not in s.caps and self.found.stream is not None:
                rx.start_budget(s).extend(s.single_flight_max_wait)
        if self.budget_spent(rx.relay_error):
            return
        seat = rx.seat = worker.cohorts.join(a.replica(), a.log)
        if seat is not None and rx.step_sources.done:
            seat.progress.complete(rx.step_sources.done)  # what an earlier pass left us
        try:
            if seat is not None and rounds.from_trees(self, seat, self.found.stream):
                return
            if self.budget_spent(rx.relay_error):
                return
            if self.reason is None and not self.found.candidates:
                # Fed by a stream that failed us: the downloader may have published since.
                found = self.found = discover(worker, a)
                self.reason, self.truth = found.reason, found.truth
                if not found.candidates and (found.reason is None or isinstance(found.reason, NoHolder)):
                    self.reason = NoHolder(
                        Absence.STREAM_LOST, f"the download streamed to this rank failed ({rx.relay_error}) and no"
                        " peer holds the version yet; back to the election")
            if self.reason is None:
                rounds.from_holders(self)
        finally:
            if seat is not None:
                seat.end(self.peer_id is not None, str(self.reason or ""))
