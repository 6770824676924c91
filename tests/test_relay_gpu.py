"""The relay's trees on NCCL: worker processes sharing the one GPU, each with its own NCCL
host id (``gpu_pair.nccl_env``: NCCL then links them through its socket transport on
loopback), the model on the GPU, so every transfer (holder to member, member to member)
is an NCCL one.

``NB_GPU_REHEARSAL=1 python -m pytest tests/test_relay_gpu.py`` runs the same scenarios
on CPU over gloo: the harness, rehearsed before a device run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import pytest
import torch
from gpu_pair import nccl_env
from test_relay import slow_ckpt  # noqa: F401  (a fixture)
from test_relay_trees import TREES, _release, _role, _seats
from test_service import Fleet, _ok

pytestmark = pytest.mark.gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class GpuFleet(Fleet):
    """A :class:`Fleet` whose workers hold the model on the GPU, each process with its
    own NCCL host id."""

    def start(self, role: str, *, settings: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("device", DEVICE)
        if DEVICE == "cuda":
            kwargs.setdefault("env", nccl_env(len(self.procs)))
        return super().start(role, settings=settings, **kwargs)


def _two_in_trees(fleet: Fleet, redis_url: str, namespace: str) -> tuple[dict[str, Any], list[str], float]:
    """A capped holder, then two members released together into one cohort's trees:
    their processes, member ids in seat order, and the release time."""
    # The holder sends at 0.4 MB/s: the 0.83 MB model takes ~2 s.
    fleet.start("holder", settings={"max_send_gbps": 0.0004})
    _ok(fleet.report())
    procs, t0 = _release(fleet, 2, TREES)
    return procs, _seats(redis_url, namespace, 2, t0), t0


@pytest.mark.timeout(180)
def test_a_holder_and_two_relay_members_on_nccl_are_bit_exact(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str  # noqa: F811
) -> None:
    """A holder and two members in the trees, three processes on the one GPU: both end
    with verified, bit-identical weights from peers, the second seat's tree-0 half
    relayed by the first."""
    fleet = GpuFleet(slow_ckpt, redis_url, namespace, cache_dir)
    try:
        _, order, _ = _two_in_trees(fleet, redis_url, namespace)
        reports = {r["role"]: r for r in (fleet.report(timeout=90) for _ in range(2))}
        for r in reports.values():
            _ok(r)
            assert r["source"] == "peer" and r["storage_bytes"] == 0, r
        assert order[0] in reports[_role(order[1])]["peer_id"].split(","), reports
    finally:
        fleet.close()


@pytest.mark.timeout(180)
def test_a_member_killed_mid_transfer_on_nccl_the_seat_below_reattaches(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str  # noqa: F811
) -> None:
    """A holder and two members in the trees on the one GPU; seat 0 (seat 1's parent in
    tree 0) SIGKILLed mid-transfer: seat 1 takes the rest of that half from the holder
    and ends with verified, bit-identical weights, within its deadlines."""
    fleet = GpuFleet(slow_ckpt, redis_url, namespace, cache_dir)
    victim: Any = None
    try:
        procs, order, _ = _two_in_trees(fleet, redis_url, namespace)
        victim = procs[_role(order[0])]
        time.sleep(0.8)  # the trees are flowing: ~40 % of the model has passed
        os.kill(victim.pid, signal.SIGKILL)
        r = fleet.report(timeout=90)
        _ok(r)
        assert r["role"] == _role(order[1]) and r["source"] == "peer", r
        assert any(p.startswith("holder-") for p in r["peer_id"].split(",")), r
        assert r["load_seconds"] < 2 * TREES["transfer_timeout"], r
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
        fleet.close()
