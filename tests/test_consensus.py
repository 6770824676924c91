"""All-rank consensus: all_reduce(MIN) over a real 2-rank gloo group in 2 processes."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch.distributed as dist
from groups import CTX  # forked from a server with torch imported (see tests/groups.py)

from nccl_back.coord.consensus import agree, gather, gather_ints, rank_and_size
from nccl_back.dev.servers import free_port


def _rank_main(rank: int, port: int, votes: list[bool], out: mp.Queue) -> None:  # type: ignore[type-arg]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=20),
    )
    try:
        group = dist.group.WORLD
        out.put((rank, rank_and_size(group), agree(votes[rank], group),
                 gather(rank * 2 + int(votes[rank]), group)))
    finally:
        dist.destroy_process_group()


def _run(votes: list[bool]) -> dict[int, tuple[tuple[int, int], bool]]:
    q = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_rank_main, args=(r, port, votes, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    gathered: list[list[int]] = []
    for _ in procs:
        rank, rs, decision, codes = q.get(timeout=60)
        results[rank] = (rs, decision)
        gathered.append(codes)
    for p in procs:
        p.join(10)
    # gather(): every rank learns every rank's code, in rank order.
    expected = [r * 2 + int(v) for r, v in enumerate(votes)]
    assert gathered == [expected, expected], gathered
    return results


def test_single_process_vote_decides() -> None:
    """Without a group the worker's own vote is the decision."""
    assert agree(True, None) is True
    assert agree(False, None) is False
    assert rank_and_size(None) == (0, 1)
    assert gather(3, None) == [3]


@pytest.mark.timeout(90)
def test_unanimous_yes_and_one_no() -> None:
    """Two ranks agree only when both vote yes (one no: both decide no); gather gives every rank every code."""
    yes = _run([True, True])
    assert yes == {0: ((0, 2), True), 1: ((1, 2), True)}
    split = _run([True, False])
    assert split == {0: ((0, 2), False), 1: ((1, 2), False)}


def _ints_main(rank: int, port: int, sends: list[list[int] | None], out: mp.Queue) -> None:  # type: ignore[type-arg]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=20),
    )
    try:
        out.put((rank, gather_ints(sends[rank], dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sends", [[[3, 1 << 62, 0], None], [[], [7]]], ids=["one-failed", "empty"])
def test_every_rank_gets_every_ranks_integers_or_none_for_a_failed_rank(
        sends: list[list[int] | None]) -> None:
    """gather_ints over two real ranks: each rank's integers (a failed rank's None) reach
    every rank intact, in rank order."""
    q = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_ints_main, args=(r, port, sends, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert got == {0: sends, 1: sends}


def test_gather_ints_refuses_integers_it_cannot_carry() -> None:
    """Negative integers or ones beyond int64 are refused before any collective."""
    assert gather_ints([1, 2], None) == [[1, 2]]
    assert gather_ints(None, None) == [None]
    with pytest.raises(ValueError, match=r"each in \[0, 2\*\*63\)"):
        gather_ints([-1], None)
    with pytest.raises(ValueError, match=r"each in \[0, 2\*\*63\)"):
        gather_ints([1 << 63], None)
