"""The one loop of rounds every peer path runs (:class:`Rounds`: the trees and the holders
in :mod:`.rounds`, the reshard in :mod:`.reshard`, the cooperative gather in
:mod:`.cooperative`), and what a receive pass (:class:`~.receive.Receive`) shares with
its rounds (:class:`Fill`: the load, its outcome so far, the stream-aware verification,
blame, the load's one budget)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nccl_back.errors import NoPeerError, PeerError, RegistryError, WeightVerificationError
from nccl_back.load import verify
from nccl_back.load.attempt import Attempt, Discovery, Reason, Worker
from nccl_back.load.pulls import Pull, Pulls
from nccl_back.load.verifier import PositionCheck
from nccl_back.load.verify import Verified
from nccl_back.transport import relay


@dataclass(frozen=True)
class Received:
    """A pass's outcome (a receive's, a reshard's): this rank's bytes verified, from
    ``peer_id`` (comma-separated: parts), and what their check found."""

    peer_id: str
    verified: Verified
    checked: PositionCheck | None = None
    """What a reshard's check in checkpoint coordinates covered."""
    found: Discovery | None = None
    """What the pass discovered again (a stream lost): the load's discovery from now on."""


@dataclass(frozen=True)
class NotReceived:
    """A pass's outcome (a receive's, a reshard's): no source served this rank, and why."""

    reason: Reason
    truth: dict[str, str] | None = None
    """A stream's truth the pass awaited (a later pass need not wait for it again)."""
    found: Discovery | None = None
    """What the pass discovered again (a stream lost): the load's discovery from now on."""


@dataclass
class Fill:
    """One pass filling this rank's tensors from peers in load ``a``: who filled them once
    they verified (``peer_id``, ``verified``) or why not (``reason``), from what the load
    held (a pass after a lost stream starts from the first one's). The service records
    the pass's outcome in the load; the pass itself writes only ``a.rx``."""

    worker: Worker
    a: Attempt
    peer_id: str | None = field(init=False)
    reason: Reason | None = field(init=False)
    found: Discovery = field(init=False)
    """What this pass knows of holders and the stream: the load's, or its own once it
    discovered again."""
    truth: dict[str, str] | None = field(init=False)
    """The truth this pass checks against (a stream's, once awaited)."""
    verified: Verified = field(init=False)

    def __post_init__(self) -> None:
        self.peer_id, self.reason, self.truth = self.a.peer_id, self.a.reason, self.a.truth
        self.found = self.a.found
        self.verified = Verified(self.a.truth, self.a.basis)

    def verify(self, deadline: float, by: Iterable[str]) -> WeightVerificationError | None:
        """A round's one verification (:meth:`check`): None once it passed (``peer_id``
        then names the sources ``by``); else its failure, for the caller to blame."""
        try:
            self.check(deadline)
        except WeightVerificationError as e:
            return e
        self.peer_id = ",".join(by)
        return None

    def check(self, deadline: float) -> None:
        """Verify what the last transfer left in this rank's tensors (a stream's truth
        awaited up to ``deadline``, once per pass); :class:`DamagedBytes` if it fails."""
        self.truth = verify.truth_for(self.worker, self.a, self.found, self.truth, deadline)
        self.verified = verify.check(self.worker, self.a, self.found, self.truth)

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

    @staticmethod
    def cause(error: WeightVerificationError) -> WeightVerificationError:
        """The integrity check's own error, the one a load reports (a
        :class:`~nccl_back.transport.relay.DamagedBytes` wraps it)."""
        return error.error if isinstance(error, relay.DamagedBytes) else error

    def budget_spent(self, last: BaseException | None) -> bool:
        """True (and ``reason`` set) once the load's peer budget is spent."""
        a, s = self.a, self.worker.settings
        if a.rx.budget is None or not a.rx.budget.spent():
            return False
        self.reason = NoPeerError(
            f"peer attempts spent their budget of {s.peer_budget:g} s (peer_budget)"
            + ("" if last is None else f"; last: {last}"))
        return True


class Rounds(abc.ABC):
    """The one loop every kind of source runs (:mod:`.rounds`, :mod:`.reshard`): a round's
    parts pulled at once (:meth:`pull`, each source asked through
    :func:`~.asking.transfer`), the kind's rule for a part that failed, one verification
    and blame; until a round verifies (True) or the kind has none left (False: the kind
    keeps why). A stream's truth that never came (its downloader died) fails the round's
    sources as a failed transfer does, and Redis's trouble ends the rounds with its
    reason: neither escapes the pass. A kind says what a round pulls (:meth:`round`, its
    send slots held in ``held``; None: no round left), whether every part landed
    (:meth:`landed`, given each part's error), how the bytes are checked (:meth:`verify`:
    the failure, else None), and what a round whose bytes had no truth (:meth:`untrue`),
    failed their check (:meth:`blamed`) or met Redis's trouble (:meth:`lost`, the last
    round) costs."""

    name = "nccl_back-part"
    abort = False
    """The first failed part aborts the others (:class:`~.pulls.Pulls`): a reshard's pieces
    are worth nothing without the rest. Else what the others land stays."""
    first: int | None = None
    """The last round's part that failed first (its cause, when ``abort``)."""

    def run(self) -> bool:
        while True:
            try:
                with contextlib.ExitStack() as held:  # a round's send slots
                    pulls = self.round(held)
                    if pulls is None:
                        return False
                    if not self.landed(self.pull(pulls)):
                        continue
                    try:
                        bad = self.verify()
                    except PeerError as e:  # a stream's truth never came: as a failed transfer
                        self.untrue(e)
                        continue
            except RegistryError as e:
                self.lost(e)
                return False
            if bad is None:
                return True
            self.blamed(bad)

    def pull(self, pulls: Sequence[Pull]) -> list[PeerError | RegistryError | None]:
        """A round's parts at once: what each failed with, a peer's or Redis's failure,
        else None (:attr:`first` the first to fail); anything else is raised."""
        runner = Pulls(abort=self.abort)
        failed: list[PeerError | RegistryError | None] = []
        for e in runner.run(pulls, self.name):
            if e is not None and not isinstance(e, (PeerError, RegistryError)):
                raise e
            failed.append(e)
        self.first = runner.first
        return failed

    @abc.abstractmethod
    def round(self, held: contextlib.ExitStack) -> list[Pull] | None: ...
    @abc.abstractmethod
    def landed(self, errors: list[PeerError | RegistryError | None]) -> bool: ...
    @abc.abstractmethod
    def verify(self) -> WeightVerificationError | None: ...
    @abc.abstractmethod
    def untrue(self, e: PeerError) -> None: ...
    @abc.abstractmethod
    def blamed(self, bad: WeightVerificationError) -> None: ...
    @abc.abstractmethod
    def lost(self, e: RegistryError) -> None: ...
