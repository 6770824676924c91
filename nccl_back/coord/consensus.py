"""All-rank consensus over the worker's own process group.

If rank 0 of a worker goes peer to peer while rank 3 downloads, the group deadlocks in
its next collective, so every decision that changes the path is taken by all ranks
together. :func:`agree` is a unanimous vote (a failing rank votes no); :func:`gather`
carries every rank's small integer code, so all learn *which* rank failed and how;
:func:`gather_ints` a list of integers per rank. Nothing another rank sends is
unpickled, and every rank takes part in every round, whatever happened to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nccl_back.errors import ConsensusError

Group = Any  # a torch.distributed ProcessGroup, or None for a single-process worker


def rank_and_size(group: Group) -> tuple[int, int]:
    """This process's rank and the group's size; ``(0, 1)`` without a group."""
    if group is None:
        return 0, 1
    try:
        return dist.get_rank(group), dist.get_world_size(group)
    except Exception as e:  # torch raises RuntimeError/ValueError depending on version
        raise ConsensusError(f"cannot read rank/size of the worker's process group: {e}") from e


def vote_device(group: Group) -> torch.device:
    """Where a collective's tensors live: CUDA for NCCL, else the CPU."""
    if group is None:
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(vote: bool, group: Group) -> bool:
    """True only if every rank of ``group`` voted True (``all_reduce(MIN)``); a failing
    collective raises :class:`ConsensusError` (the caller must not pick a path alone)."""
    if group is None:
        return vote
    try:
        t = torch.tensor([1 if vote else 0], dtype=torch.int32, device=vote_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(int(t.item()))
    except Exception as e:
        raise ConsensusError(f"all_reduce(MIN) over the worker's group failed: {e}") from e


def gather(code: int, group: Group) -> list[int]:
    """Every rank's ``code`` (a non-negative int), indexed by rank, on every rank (a
    one-hot ``all_reduce(SUM)``); a failing collective raises :class:`ConsensusError`."""
    if code < 0:
        raise ValueError(f"code={code}: must be non-negative")
    if group is None:
        return [code]
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        t = torch.zeros(world, dtype=torch.int64, device=vote_device(group))
        t[rank] = code
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return [int(x) for x in t.cpu().tolist()]
    except Exception as e:
        raise ConsensusError(f"all_reduce over the worker's group failed: {e}") from e


#: Most integers one rank may send in :func:`gather_ints` (a rank's count sizes the
#: tensor every rank allocates).
MAX_INTS = 1 << 22


def gather_ints(values: Sequence[int] | None, group: Group) -> list[list[int] | None]:
    """Every rank's ``values`` (non-negative int64s, at most :data:`MAX_INTS`; None: this
    rank failed), indexed by rank, on every rank, through two fixed-shape collectives. A
    failing collective, or a count beyond the bound, raises :class:`ConsensusError`."""
    if values is not None and (len(values) > MAX_INTS or any(not 0 <= v < 1 << 63 for v in values)):
        raise ValueError(f"{len(values)} values: at most {MAX_INTS}, each in [0, 2**63)")
    if group is None:
        return [None if values is None else list(values)]
    counts = gather(0 if values is None else len(values) + 1, group)  # 0: failed
    if max(counts) > MAX_INTS + 1:
        bad = max(range(len(counts)), key=lambda r: counts[r])
        raise ConsensusError(f"rank {bad} of the worker's group sent a count of"
                             f" {counts[bad] - 1} integers, beyond {MAX_INTS}", failed_rank=bad)
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        t = torch.zeros((world, max(max(counts) - 1, 1)), dtype=torch.int64, device=vote_device(group))
        if values:
            t[rank, :len(values)] = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)  # each rank fills its own row
        rows = t.cpu().tolist()
    except Exception as e:
        raise ConsensusError(f"all_reduce over the worker's group failed: {e}") from e
    return [None if c == 0 else [int(x) for x in rows[r][:c - 1]] for r, c in enumerate(counts)]


def broadcast_from(tensor: torch.Tensor, src: int, group: Group) -> None:
    """``tensor`` from rank ``src`` of ``group`` into every rank's ``tensor`` (same size, on
    :func:`vote_device`); a failing collective raises :class:`ConsensusError`."""
    if group is None:
        return
    try:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    except Exception as e:
        raise ConsensusError(f"broadcast from rank {src} over the worker's group failed: {e}") from e
