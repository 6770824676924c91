"""A plan's steps cut into parts that several sources send to one receiver side by side
(the fan-out's trees each carry one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nccl_back.errors import TransferError
from nccl_back.model.integrity import layer_of
from nccl_back.transport_kinds import MAX_PARTS

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step

Part = tuple[int, int]
"""``(i, n)``: part ``i`` of the plan's steps split into ``n`` (:func:`parts`)."""


def parts(steps: list[Step], n: int) -> list[list[int]]:
    """The step indices split into ``n`` parts balanced by bytes, each in step order,
    from the plan alone (both sides, and every member of a fan-out, cut alike).

    The unit is a layer (:func:`~nccl_back.model.integrity.layer_of`), with every step
    that carries any of its tensors (a bucket holding two layers joins them): all of a
    layer's bytes come from one source, so a layer that fails verification names that
    source alone, and a tensor sent in chunks (staged whole within one transfer) stays
    in one part. Each unit, in plan order, goes to the part with the fewest bytes so
    far (the lowest index on a tie), so the parts advance through the model side by
    side and differ by at most one unit.
    """
    if not 1 <= n <= MAX_PARTS:
        raise TransferError(f"parts={n}: must be 1 to {MAX_PARTS}")
    unit = list(range(len(steps)))  # union-find over steps: a step joins its layers' unit

    def root(k: int) -> int:
        while unit[k] != k:
            unit[k] = unit[unit[k]]
            k = unit[k]
        return k

    first: dict[str, int] = {}
    for k, step in enumerate(steps):
        for slot in step.slots:
            j = first.setdefault(layer_of(slot.name), k)
            a, b = sorted((root(j), root(k)))
            unit[b] = a
    members: dict[int, list[int]] = {}
    for k in range(len(steps)):
        members.setdefault(root(k), []).append(k)
    out: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for ks in members.values():  # in the order of their first steps
        i = min(range(n), key=lambda j: (load[j], j))
        out[i] += ks
        load[i] += sum(steps[k].nbytes for k in ks)
    return [sorted(p) for p in out]
