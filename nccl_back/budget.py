"""One deadline per load, split into phases: the bound on everything a load waits for.

A load's peer attempts share one :class:`Budget` (``Settings.peer_budget``, derived in
:mod:`nccl_back.timing` like every bound below but the fixed ones); each phase
takes a :class:`Phase` of it, bounded by the phase's own limit and by what is left of
the whole, so no phase can spend another's time and none can outlive the load:

========== ====================================== =====================================
phase      bound                                  work bounded by
========== ====================================== =====================================
discover   :data:`DISCOVER_SECONDS` (a reshard's) the peer index (``MAX_INDEX``), the
                                                  world keys a reshard reads
                                                  (``MAX_WORLD_KEYS``), world sizes
                                                  planned (``reshard.MAX_WORLDS``)
plan       within discover's                      the plan's cells and tests
                                                  (``reshard_plan.MAX_CELLS``,
                                                  ``MAX_TESTS``); a holder's before it
                                                  takes a send turn
claim      ``busy_wait``                          the holder's ``max_sends`` slots
transfer   ``transfer_timeout``, ``stall_timeout`` the watchdog
fetch      ``peer_budget`` (artifact sets),       ``MAX_ARTIFACT_BYTES``
           ``artifact_wait`` (header waits)
========== ====================================== =====================================

A spent phase raises :class:`~nccl_back.errors.BudgetSpentError` naming the phase and
its bound; the load then goes on as that phase's failure says (the next source, or
storage), never waits longer.
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.errors import BudgetSpentError
from nccl_back.timing import DISCOVER_SECONDS as DISCOVER_SECONDS  # imported from here by reshard


@dataclass(frozen=True)
class Phase:
    """One phase's share of a load's time."""

    name: str
    deadline: float
    """Monotonic time the phase must end by."""
    seconds: float
    """Its bound, for messages."""

    def left(self) -> float:
        return self.deadline - _clock.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0

    def check(self, doing: str = "") -> None:
        """Raise :class:`BudgetSpentError` once the phase's time is up."""
        if self.spent():
            what = f" ({doing})" if doing else ""
            raise BudgetSpentError(f"{self.name} spent its bound of {self.seconds:g} s{what}")


@dataclass
class Budget:
    """One load's deadline (monotonic) and the phases cut from it."""

    deadline: float
    seconds: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(_clock.monotonic() + seconds, seconds)

    def left(self) -> float:
        return self.deadline - _clock.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0

    def phase(self, name: str, seconds: float | None = None) -> Phase:
        """A phase bounded by ``seconds`` (None: only by the load) and by the load."""
        end = self.deadline if seconds is None else min(self.deadline, _clock.monotonic() + seconds)
        return Phase(name, end, self.seconds if seconds is None else min(seconds, self.seconds))

    def extend(self, seconds: float) -> None:
        """Allow ``seconds`` more (a stream-fed load waits for the whole download)."""
        self.deadline += seconds
        self.seconds += seconds
