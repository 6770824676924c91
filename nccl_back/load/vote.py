"""The consensus between a worker's ranks at each phase boundary of a load.

Every rank runs a phase inside the service's ``caught`` (whatever it raises becomes its
vote, never an early exit that would leave the other ranks waiting in a collective),
then calls :func:`agree`: each rank's code (ok / no peer at all / peer load failed /
raised) reaches every rank through :func:`nccl_back.coord.consensus.gather`, and
every rank takes the same :class:`Decision` from the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_back.coord.consensus import gather
from nccl_back.errors import ConsensusError, NcclBackError
from nccl_back.load.attempt import Attempt, NoHolder

# One rank's code in a consensus round (the worst code decides).
OK, NOBODY, FAILED, RAISED = 0, 1, 2, 3
_WHAT = {NOBODY: "found no peer holding the version", FAILED: "could not load from a peer",
         RAISED: "raised an error"}


def code(a: Attempt) -> int:
    """This rank's vote, from what the service recorded in ``a``."""
    if a.error is not None:
        return RAISED
    if a.reason is None:
        return OK
    return NOBODY if isinstance(a.reason, NoHolder) else FAILED


@dataclass(frozen=True)
class Decision:
    """Every rank's code of one round (the same list on every rank)."""

    codes: list[int]

    @property
    def ok(self) -> bool:
        """Every rank can go on (or went on) from a peer."""
        return max(self.codes) == OK

    @property
    def nobody(self) -> bool:
        """The worst a rank found is nobody holding the version (go to the election)."""
        return max(self.codes) == NOBODY

    @property
    def failed(self) -> bool:
        """Some rank tried a peer and failed (``strict`` makes every rank raise)."""
        return FAILED in self.codes

    def why(self) -> ConsensusError:
        """Why the group goes to storage, for a rank that could have gone on."""
        worst = max(self.codes)
        r = self.codes.index(worst)
        return ConsensusError(f"rank {r} of this worker {_WHAT[worst]}", failed_rank=r)

    def strict_error(self, a: Attempt) -> Exception:
        """What every rank raises with ``strict`` after a failed peer load: the rank that
        failed its own reason, the others a :class:`ConsensusError` naming it."""
        if self.codes[a.rank] == FAILED and isinstance(a.reason, NcclBackError):
            return a.reason
        r = self.codes.index(FAILED)
        return ConsensusError(
            f"strict: rank {r} of this worker could not load from a peer; every rank raises",
            failed_rank=r,
        )


def agree(a: Attempt, what: str) -> Decision:
    """One consensus round after the phase ``what``; raises if any rank raised: the rank
    that did its own error, the others a :class:`ConsensusError` naming it."""
    codes = gather(code(a), a.group)
    raised = [r for r, c in enumerate(codes) if c == RAISED]
    if raised:
        if a.error is not None:
            raise a.error
        raise ConsensusError(
            f"rank {raised[0]} of this worker raised an error during {what};"
            " every rank stops (see that rank's error)", failed_rank=raised[0],
        )
    return Decision(codes)
