"""All-rank consensus: all_reduce(MIN) over a real 2-rank gloo group in 2 processes."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch.distributed as dist

from nccl_back.coord.consensus import agree, gather, rank_and_size
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
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, votes, q)) for r in range(2)]
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
