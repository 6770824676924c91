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


def part_steps(steps: list[Step], part: Part) -> list[int]:
    """The step indices of ``part``, in order: a part of :func:`parts`, or a sub-part,
    that part's own steps cut by :func:`parts` again (both sides cut alike).
    :class:`TransferError` for a part that does not exist."""
    if len(part) not in (2, 4) or not all(0 <= part[j] < part[j + 1] for j in range(0, len(part), 2)):
        raise TransferError(f"part {list(part)}: no such part (i < n, and s < k for a sub-part)")
    todo = parts(steps, part[1])[part[0]]
    if len(part) == 4:
        todo = [todo[x] for x in parts([steps[k] for k in todo], part[3])[part[2]]]
    return todo
