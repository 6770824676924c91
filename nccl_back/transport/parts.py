"""A plan's steps cut into parts that several sources send to one receiver side by side
(the fan-out's trees each carry one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nccl_back.errors import TransferError
from nccl_back.transport_kinds import MAX_PARTS

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step

Part = tuple[int, ...]
"""``(i, n)``: part ``i`` of the plan's steps split into ``n`` (:func:`parts`); ``(i, n,
s, k)``: sub-part ``s`` of that part split into ``k`` alike (a failed member's part of a
cooperative download, spread over the others: :func:`part_steps`)."""


def parts(steps: list[Step], n: int) -> list[list[int]]:
    """The step indices cut into ``n`` runs of consecutive steps balanced by bytes, from
    the plan alone (every side cuts alike): part ``p`` ends at the step boundary nearest
    ``(p + 1) / n`` of the bytes (the earlier on a tie). Consecutive runs, not interleaved
    steps, so few layers have bytes in two parts: a failing layer mostly names one sender.
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


def part_steps(steps: list[Step], part: Part) -> list[int]:
    """The step indices of ``part``, in order (a sub-part: that part's steps cut again);
    :class:`TransferError` for a part that does not exist."""
    if len(part) not in (2, 4) or not all(0 <= part[j] < part[j + 1] for j in range(0, len(part), 2)):
        raise TransferError(f"part {list(part)}: no such part (i < n, and s < k for a sub-part)")
    todo = parts(steps, part[1])[part[0]]
    if len(part) == 4:
        todo = [todo[x] for x in parts([steps[k] for k in todo], part[3])[part[2]]]
    return todo
