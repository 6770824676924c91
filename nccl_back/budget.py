"""One deadline per load, split into phases: the bound on everything a load waits for.

A load's peer attempts share one :class:`Budget` (``Settings.peer_budget``); each phase
takes a :class:`Phase` of it (and may carve sub-phases), bounded by its own limit and by
what is left of the whole, so no phase spends another's time or outlives the load.
Phases, their bounds, and where (from what) they are carved:

- reshard discovery: :data:`DISCOVER_SECONDS`; ``reshard.find`` (the load), covering
  world keys read, world sizes planned, each plan's cells and tests;
- relay: ``transfer_timeout + handshake_timeout`` (``+ single_flight_max_wait``
  stream-fed); ``rounds.from_trees`` (the load): a seat's both parts;
- claim: ``busy_wait``; the holders' loop, a reshard's holder (the load), a tree's
  holder (the relay);
- handshake: ``handshake_timeout`` (a relay upstream: at most ``RELAY_HANDSHAKE``,
  never 0); ``asking.Ask`` (the load, or the relay);
- transfer: a holder's ``transfer_timeout``; ``asking.transfer`` (within the ``Ask``);
- connect: ``connect_timeout``; ``asking.transfer``.

A cooperative download's member part (the election's, not a peer load) has its own
budget, ``transfer_timeout + single_flight_max_wait``. A spent phase raises naming
itself and its bound (:meth:`Phase.check`: :class:`~nccl_back.errors.BudgetSpentError`);
the load then goes on to the next source or storage, never waits longer. Waits that
are no share of a load keep their own bounds (``VERDICT_WAIT``, ``artifact_wait``...).
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.errors import BudgetSpentError
from nccl_back.timing import DISCOVER_SECONDS as DISCOVER_SECONDS  # imported from here by reshard

#: The least a wait is given (:meth:`Span.timeout`): a wait of 0 would end before its first try.
MIN_TIMEOUT = 0.001


class Span:
    """A deadline and its bound: a :class:`Budget` or a :class:`Phase` of one, and
    what is carved from it."""

    deadline: float
    """Monotonic time it must end by."""
    seconds: float
    """Its bound, for messages."""

    def left(self) -> float:
        return self.deadline - _clock.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0

    def timeout(self) -> float:
        """What is left, as a wait's timeout: at least :data:`MIN_TIMEOUT`."""
        return max(self.left(), MIN_TIMEOUT)

    def phase(self, name: str, seconds: float | None = None) -> Phase:
        """A phase bounded by ``seconds`` from now (None: only by this) and by this."""
        end = self.deadline if seconds is None else min(self.deadline, _clock.monotonic() + seconds)
        return Phase(name, end, self.seconds if seconds is None else min(seconds, self.seconds))


@dataclass(frozen=True)
class Phase(Span):
    """One phase's share of a load's time."""

    name: str
    deadline: float
    seconds: float

    def check(self, doing: str = "") -> None:
        """Raise :class:`BudgetSpentError` once the phase's time is up."""
        if self.spent():
            what = f" ({doing})" if doing else ""
            raise BudgetSpentError(f"{self.name} spent its bound of {self.seconds:g} s{what}")


@dataclass
class Budget(Span):
    """One load's deadline (monotonic) and the phases cut from it."""

    deadline: float
    seconds: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(_clock.monotonic() + seconds, seconds)

    def extend(self, seconds: float) -> None:
        """Allow ``seconds`` more (a stream-fed load waits for the whole download)."""
        self.deadline += seconds
        self.seconds += seconds
