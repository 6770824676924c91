"""Relay chains on NCCL: worker processes sharing the one GPU, each with its own NCCL
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
from test_relay import _four_in_a_chain, slow_ckpt  # noqa: F401  (a fixture)
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


@pytest.mark.timeout(180)
def test_a_holder_and_two_relay_members_on_nccl_are_bit_exact(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str  # noqa: F811
) -> None:
    """Holder -> m0 -> m1, three processes on the one GPU: both members end with
    verified, bit-identical weights from peers, the second from the first."""
    fleet = GpuFleet(slow_ckpt, redis_url, namespace, cache_dir)
    try:
        _, order, roles, _ = _four_in_a_chain(fleet, redis_url, namespace, n=2)
        reports = {r["role"]: r for r in (fleet.report(timeout=90) for _ in range(2))}
        for r in reports.values():
            _ok(r)
            assert r["source"] == "peer" and r["storage_bytes"] == 0, r
        assert reports[roles[1]]["peer_id"] == order[0], reports  # relayed by the first
    finally:
        fleet.close()


@pytest.mark.timeout(180)
def test_a_member_killed_mid_chain_on_nccl_the_one_below_reattaches(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str  # noqa: F811
) -> None:
    """Holder -> m0 -> m1 on the one GPU; m0 SIGKILLed mid-transfer: m1 re-attaches to
    the holder and ends with verified, bit-identical weights, within its deadlines."""
    fleet = GpuFleet(slow_ckpt, redis_url, namespace, cache_dir)
    victim: Any = None
    try:
        procs, order, roles, t0 = _four_in_a_chain(fleet, redis_url, namespace, n=2)
        victim = procs[roles[0]]
        time.sleep(0.8)  # the chain is flowing: ~40 % of the model has passed
        os.kill(victim.pid, signal.SIGKILL)
        r = fleet.report(timeout=90)
        _ok(r)
        assert r["role"] == roles[1] and r["source"] == "peer", r
        assert r["peer_id"] != order[0], r  # not from the dead member
        assert r["load_seconds"] < 2 * 20.0, r
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
        fleet.close()
