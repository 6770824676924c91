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

    Part ``p`` ends at the step boundary nearest to ``(p + 1) / n`` of the bytes (the
    earlier one on a tie), so each part is within one step of an even share; a tensor
    sent in chunks may be cut between two (each chunk lands in place on its own, in a
    non-contiguous destination too). Consecutive runs, not interleaved steps, so that
    few layers have bytes in two parts (those at a cut, and those whose small tensors
    ride in a bucket across one): a layer that fails verification then mostly names its
    one sender.
    """
    if not 1 <= n <= MAX_PARTS:
        raise TransferError(f"parts={n}: must be 1 to {MAX_PARTS}")
    before = [0]  # the bytes before each step boundary
    for step in steps:
        before.append(before[-1] + step.nbytes)
    total, cuts = before[-1], [0]
    for p in range(1, n):
        b = min(range(len(before)), key=lambda i: (abs(before[i] * n - p * total), i))
        cuts.append(max(cuts[-1], b))
    cuts.append(len(steps))
    return [list(range(cuts[p], cuts[p + 1])) for p in range(n)]
