"""Resharding on NCCL: a TP=2 library group (two processes on the one GPU, each with
its own NCCL host id) receives its shards from a TP=1 holder on the same GPU.

``NB_GPU_REHEARSAL=1 python -m pytest tests/test_reshard_gpu.py`` runs it on CPU over
gloo: the harness, rehearsed before a device run.
"""

from __future__ import annotations

import pytest
import torch
from test_reshard import Fleet, fleet  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.timeout(240)
def test_a_tp2_group_reshards_from_a_tp1_holder_on_nccl(fleet: Fleet) -> None:  # noqa: F811
    """TP=1 holder -> TP=2 megatron group, three processes on the one GPU: each rank
    receives exactly its own shards, bit-exact, from the holder."""
    fleet.start(1, "plain", device=DEVICE)
    (h,) = fleet.reports(1)
    assert h["source"] == "storage" and h["identical"], h
    fleet.start(2, "megatron", device=DEVICE)
    tp2 = fleet.reports(2, timeout=150)
    for r in tp2:
        assert r["source"] == "peer" and r["identical"], [x["fallback_reason"] for x in tp2]
        assert r["bytes"] == r["own_bytes"], r
        assert r["peer_id"].startswith(f"g{h['group']}-0"), r
