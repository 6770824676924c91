"""A plan's steps cut into parts that several sources send to one receiver side by side
(the fan-out's trees each carry one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nccl_back.errors import TransferError
from nccl_back.transport_kinds import MAX_PARTS

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step

Part = tuple[int, int]
"""``(i, n)``: part ``i`` of the plan's steps split into ``n`` (:func:`parts`)."""


def parts(steps: list[Step], n: int) -> list[list[int]]:
    """The step indices cut into ``n`` runs of consecutive steps balanced by bytes, from
    the plan alone (both sides, and every member of a fan-out, cut alike).

    Part ``p`` ends at the unit boundary nearest to ``(p + 1) / n`` of the bytes (the
    earlier one on a tie), so each part is within one unit of an even share. The unit
    is a step, or every chunk of a tensor sent in place in several (a receiver stages a
    non-contiguous destination whole within one transfer). Consecutive runs, not
    interleaved steps, so that few layers have bytes in two parts (those at a cut, and
    those whose small tensors ride in a bucket across one): a layer that fails
    verification then mostly names its one sender.
    """
    if not 1 <= n <= MAX_PARTS:
        raise TransferError(f"parts={n}: must be 1 to {MAX_PARTS}")
    ends = [0]  # unit boundaries (step indices) and the bytes before each
    before = [0]
    for k, step in enumerate(steps):
        last = k + 1 == len(steps)
        if last or not (step.direct and steps[k + 1].direct
                        and steps[k + 1].slots[0].name == step.slots[0].name):
            ends.append(k + 1)
            before.append(before[-1] + sum(steps[j].nbytes for j in range(ends[-2], k + 1)))
    total, cuts = before[-1], [0]
    for p in range(1, n):
        b = min(range(len(ends)), key=lambda i: (abs(before[i] * n - p * total), i))
        cuts.append(max(cuts[-1], ends[b]))
    cuts.append(len(steps))
    return [list(range(cuts[p], cuts[p + 1])) for p in range(n)]
