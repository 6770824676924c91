"""Truth in checkpoint coordinates (model/position_truth.py, coord/layouts.py): what a
TP=1 storage load publishes verifies a TP=2 rank's slices and back; a changed sampled
element is caught; the records round-trip through real Redis and forged ones are
rejected."""

from __future__ import annotations

import pytest
import torch

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.errors import UntrustedRecordError, WeightVerificationError
from nccl_back.model import layout as L
from nccl_back.model import position_truth as T
from nccl_back.model import reshard_plan as P
from nccl_back.model.skeleton import Manifest, TensorEntry

KEY = b"k" * 32
CK = {"w": (64, 48), "o": (48, 64), "n": (48,)}


def _full() -> tuple[L.Layout, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    values = {n: torch.randn(s, generator=g) for n, s in CK.items()}
    man = Manifest(tuple(TensorEntry(n, s, "float32") for n, s in sorted(CK.items())))
    return L.layout_of(man, {}, CK), values


def _tp2(r: int, full: L.Layout, values: dict[str, torch.Tensor]) -> tuple[L.Layout, dict[str, torch.Tensor]]:
    man = Manifest((TensorEntry("n", (48,), "float32"), TensorEntry("o", (48, 32), "float32"),
                    TensorEntry("w", (32, 48), "float32")))
    lay = L.layout_of(man, {"w": L.column("w", r, 2, 64), "o": L.row("o", r, 2, 64)}, CK)
    tensors = {e.name: torch.empty(e.shape) for e in man.entries}
    P.unpack(P.plan(lay, [full]).moves, P.pack(P.plan(lay, [full]).moves, values), tensors)
    return lay, tensors


def test_tp1_truth_checks_tp2_slices_and_catches_a_change() -> None:
    full, values = _full()
    truth = T.held_macs(full, values, KEY)
    assert all(m is not None for ms in truth.values() for m in ms)
    for r in range(2):
        lay, tensors = _tp2(r, full, values)
        checked = T.check(lay, tensors, truth, KEY)
        assert checked > T.SAMPLES  # about half of w's and o's positions, all of n's
        # Change the element at one sampled position this rank holds: caught.
        pos = T.positions("w", CK["w"], KEY)
        y = [int(pos[j]) for j in range(len(pos)) if (int(pos[j]) // 48) // 32 == r][0]
        tensors["w"][(y // 48) - 32 * r, y % 48] += 1.0
        with pytest.raises(WeightVerificationError, match="w"):
            T.check(lay, tensors, truth, KEY)
    # Two TP=2 ranks' truths merged verify the TP=1 layout (the other direction).
    parts = [T.held_macs(*_tp2(r, full, values)[:1], _tp2(r, full, values)[1], KEY) for r in range(2)]
    assert T.check(full, values, T.merge(parts), KEY) == sum(len(v) for v in truth.values())
    with pytest.raises(WeightVerificationError, match="no truth"):
        T.check(full, values, parts[0], KEY)


def test_a_position_mac_is_keyed_blake2b_over_the_documented_fields() -> None:
    """Every MAC is BLAKE2b(key) over name, shape, j, flat index, length and raw bytes, so
    workers of any release that keeps this format check each other's truth."""
    import hashlib

    import numpy as np

    full, values = _full()
    macs = T.held_macs(full, values, KEY)
    pos = T.positions("w", CK["w"], KEY)
    raw = values["w"].reshape(-1).view(torch.uint8).reshape(-1, 4).numpy()
    for j in (0, len(pos) - 1):
        flat = int(pos[j])
        data = np.ascontiguousarray(raw[flat]).tobytes()
        want = hashlib.blake2b(f"w\0{list(CK['w'])}\0{j}\0{flat}\0{len(data)}\0".encode() + data,
                               digest_size=T.MAC_BYTES, key=KEY).hexdigest()
        assert macs["w"][j] == want


def test_records_round_trip_and_forgeries_are_rejected(redis_url: str) -> None:
    s = Settings(redis_url=redis_url, namespace="ct-test", secret="s" * 32)
    reg = Registry(s)
    full, values = _full()
    macs = T.held_macs(full, values, KEY)
    reg.put_layout(full)
    assert reg.get_layout(full.digest) == full
    assert reg.put_position_truth("v1", 0, 1, full.digest, macs)
    assert not reg.put_position_truth("v1", 0, 1, full.digest, macs)  # SET NX
    assert reg.get_position_truth("v1", 0, 1, full.digest) == macs
    forger = Registry(Settings(redis_url=redis_url, namespace="ct-test", secret="x" * 32))
    forger.put_layout(full)
    assert reg.get_layout(full.digest) is None
    reg.client.delete(reg.keys.position_truth("v2", 0, 1, full.digest))
    forger.put_position_truth("v2", 0, 1, full.digest, macs)
    with pytest.raises(UntrustedRecordError):
        reg.get_position_truth("v2", 0, 1, full.digest)
