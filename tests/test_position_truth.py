"""Truth in checkpoint coordinates (model/position_truth.py, model/marginals.py,
coord/layouts.py): what a TP=1 storage load publishes verifies a TP=2 rank's slices and
back; a changed sampled element is caught, and with the full sums any changed element;
the records round-trip through real Redis and forged ones are rejected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.content import PositionTruth
from nccl_back.coord.registry import Registry
from nccl_back.errors import NoPeerError, UntrustedRecordError, WeightVerificationError
from nccl_back.load.verifier import Verifier, merge_macs
from nccl_back.model import layout as L
from nccl_back.model import marginals as M
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
    P.apply_local(P.plan(lay, [full]).moves, values, tensors)
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
    parts = {f"r{r}": PositionTruth("x", "nb1", T.held_macs(*_tp2(r, full, values)[:1],
                                                           _tp2(r, full, values)[1], KEY))
             for r in range(2)}
    assert T.check(full, values, merge_macs(parts), KEY) == sum(len(v) for v in truth.values())
    with pytest.raises(NoPeerError, match="no truth"):
        T.check(full, values, parts["r0"].macs, KEY)


def test_full_sums_of_tp1_check_every_byte_of_tp2_slices_and_back() -> None:
    """The full sums a TP=1 holder publishes check every element a TP=2 rank holds (one
    changed element anywhere is caught, not only at sampled positions), and two TP=2
    ranks' sums check the TP=1 layout."""
    full, values = _full()
    v = Verifier("full", KEY)
    tp1 = v.position_truth(full, values)
    for r in range(2):
        lay, tensors = _tp2(r, full, values)
        checked = v.check_positions(lay, tensors, {"h": tp1})
        assert checked.elements == sum(t.numel() for t in tensors.values())
        sampled = set(T.positions("o", CK["o"], KEY).tolist())
        flat = next(f for f in range(48 * 64) if f not in sampled and (f % 64) // 32 == r)
        tensors["o"][flat // 64, flat % 64 - 32 * r] *= -1  # not a sampled position
        with pytest.raises(WeightVerificationError, match="differ in 1 tensors: \\['o'\\]"):
            v.check_positions(lay, tensors, {"h": tp1})
        Verifier("sampled", KEY).check_positions(lay, tensors, {"h": tp1})  # sampled misses it
    ranks = {f"r{r}": v.position_truth(*_tp2(r, full, values)) for r in range(2)}
    assert v.check_positions(full, values, ranks).elements == sum(t.numel() for t in values.values())
    with pytest.raises(NoPeerError, match="no truth for"):
        v.check_positions(full, values, {"r0": ranks["r0"]})


def test_two_publishers_that_disagree_are_named_not_mistaken_for_damage() -> None:
    """Sums or MACs of two publishers that disagree raise TruthConflict (an untrusted
    record, naming both), never a verification failure of the receiver's bytes."""
    full, values = _full()
    v = Verifier("full", KEY)
    good = v.position_truth(full, values)
    bad_values = {n: t.clone() for n, t in values.items()}
    bad_values["w"][0, 0] += 1
    bad = v.position_truth(full, bad_values)
    lay, tensors = _tp2(0, full, values)
    with pytest.raises(M.TruthConflict, match="disagree") as info:
        v.check_positions(lay, tensors, {"a": good, "b": bad})
    assert isinstance(info.value, UntrustedRecordError) and not isinstance(info.value, WeightVerificationError)
    assert info.value.publishers == {"a", "b"}


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(0, 47 * 63), st.integers(1, 255), st.integers(0, 7))
def test_full_sums_catch_any_changed_byte_of_any_dtype(dtype: torch.dtype, flat: int, xor: int,
                                                       byte: int) -> None:
    """Any change of any one byte of any element, in any dtype, changes the sums."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (48 * 64 * 16,), dtype=torch.uint8, generator=g)
    size = torch.empty((), dtype=dtype).element_size()
    w = raw[: 48 * 64 * size].view(dtype).reshape(48, 64)
    shapes = {"w": (48, 64)}
    man = Manifest((TensorEntry("w", (48, 64), str(dtype).removeprefix("torch.")),))
    lay = L.layout_of(man, {}, shapes)
    v = Verifier("full", KEY)
    truth = v.position_truth(lay, {"w": w}, sums=True)
    changed = w.clone()
    changed.view(torch.uint8).reshape(-1)[flat * size + byte % size] ^= xor
    if torch.equal(changed.view(torch.uint8), w.view(torch.uint8)):
        return
    assert M.held(lay, {"w": changed}, KEY) != truth.marginals


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
    truth = Verifier("full", KEY).position_truth(full, values)
    reg.put_layout(full)
    assert reg.get_layout(full.digest) == full
    assert reg.put_position_truth("v1", 0, 1, truth)
    assert not reg.put_position_truth("v1", 0, 1, truth)  # SET NX
    assert reg.get_position_truth("v1", 0, 1, full.digest, "nb1") == truth
    forger = Registry(Settings(redis_url=redis_url, namespace="ct-test", secret="x" * 32))
    forger.put_layout(full)
    assert reg.get_layout(full.digest) is None
    reg.client.delete(reg.keys.of(schema.POSITION_TRUTH, "v2", 0, 1, full.digest, "nb1"))
    forger.put_position_truth("v2", 0, 1, truth)
    with pytest.raises(UntrustedRecordError):
        reg.get_position_truth("v2", 0, 1, full.digest, "nb1")


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_full_sums_check_slices_of_a_three_dim_tensor_and_a_vector(cut: int) -> None:
    """A whole holder's sums check a slice of a 3-dim tensor along any dim, and a vector;
    one changed element of either is caught."""
    shapes = {"c": (4, 6, 8), "b": (10,)}
    g = torch.Generator().manual_seed(3)
    values = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    man = Manifest(tuple(TensorEntry(n, s, "float32") for n, s in sorted(shapes.items())))
    whole = L.layout_of(man, {}, shapes)
    v = Verifier("full", KEY)
    truth = v.position_truth(whole, values)
    half = shapes["c"][cut] // 2
    part_shape = tuple(half if i == cut else n for i, n in enumerate(shapes["c"]))
    man2 = Manifest((TensorEntry("b", (10,), "float32"), TensorEntry("c", part_shape, "float32")))
    lay = L.layout_of(man2, {"c": L.TensorLayout(cut, (L.Piece("c", cut, half, 2 * half),))}, shapes)
    mine = {"b": values["b"].clone(), "c": values["c"].narrow(cut, half, half).clone()}
    assert v.check_positions(lay, mine, {"h": truth}).elements == 10 + mine["c"].numel()
    for name in ("c", "b"):
        changed = {n: t.clone() for n, t in mine.items()}
        changed[name].view(-1)[-1] += 1.0
        with pytest.raises(WeightVerificationError, match=f"'{name}'"):
            v.check_positions(lay, changed, {"h": truth})
