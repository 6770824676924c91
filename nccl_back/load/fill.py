"""What the receive loop (:class:`~.receive.Receive`) shares with its steps kept apart
(:mod:`.holders`, :mod:`.tree_parts`): the load, its outcome so far, blame, and the
load's one budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from nccl_back.errors import NoPeerError, WeightVerificationError
from nccl_back.load.attempt import Attempt, Reason, Worker
from nccl_back.transport import relay


@dataclass(frozen=True)
class Received:
    """A pass's outcome (a receive's, a reshard's): this rank's bytes verified, from
    ``peer_id`` (comma-separated: parts)."""

    peer_id: str


@dataclass(frozen=True)
class NotReceived:
    """A pass's outcome (a receive's, a reshard's): no source served this rank, and why."""

    reason: Reason


@dataclass
class Fill:
    """One pass filling this rank's tensors from peers in load ``a``: who filled them once
    they verified (``peer_id``) or why not (``reason``), from what the load held (a pass
    after a lost stream starts from the first one's)."""

    worker: Worker
    a: Attempt
    peer_id: str | None = field(init=False)
    reason: Reason | None = field(init=False)

    def __post_init__(self) -> None:
        self.peer_id, self.reason = self.a.peer_id, self.a.reason

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
        """True (and ``reason`` set) once the load's peer budget is spent."""
        a, s = self.a, self.worker.settings
        if a.rx.budget is None or not a.rx.budget.spent():
            return False
        self.reason = NoPeerError(
            f"peer attempts spent their budget of {s.peer_budget:g} s (peer_budget)"
            + ("" if last is None else f"; last: {last}"))
        return True
