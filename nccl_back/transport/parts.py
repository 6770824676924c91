"""A plan's steps cut into parts that several sources send to one receiver side by side
(the fan-out's trees each carry one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nccl_back.coord.records import MAX_PARTS
from nccl_back.errors import TransferError

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step

Part = tuple[int, int]
"""``(i, n)``: part ``i`` of the plan's steps split into ``n`` (:func:`parts`)."""


def parts(steps: list[Step], n: int) -> list[list[int]]:
    """The step indices split into ``n`` parts balanced by bytes, each in step order,
    from the plan alone (both sides, and every member of a fan-out, cut alike).

    A tensor sent in place in several chunks is one unit, kept in one part: a receiver
    stages a non-contiguous destination whole within one transfer. Each unit, in plan
    order, goes to the part with the fewest bytes so far (the lowest index on a tie), so
    the parts advance through the model side by side and differ by at most one unit.
    """
    if not 1 <= n <= MAX_PARTS:
        raise TransferError(f"parts={n}: must be 1 to {MAX_PARTS}")
    out: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    unit: list[int] = []
    for k, step in enumerate(steps):
        unit.append(k)
        last = k + 1 == len(steps)
        if not (step.direct and not last and steps[k + 1].direct
                and steps[k + 1].slots[0].name == step.slots[0].name):
            i = min(range(n), key=lambda j: (load[j], j))
            out[i] += unit
            load[i] += sum(steps[j].nbytes for j in unit)
            unit = []
    return out
