"""Property tests of layouts and reshard plans (model/layout.py, model/reshard_plan.py).

For a random checkpoint and two random shardings of it (world sizes 1-3; splits along
any dim at random cut points, fused tensors concatenating slices of several sources,
padding, replicated tensors, single pieces concatenated along another dim than they
are sliced along): the plan from one sharding's holders to one rank of the other
covers every non-padding element of the receiver exactly once and padding never; its
boxes copied across, and the holders' payloads landed at the receiver, reproduce the
receiver's expected bytes exactly; the plan and its digest are deterministic. The
layout's canonical form round-trips through the Redis parser, and the parser turns
anything else into UntrustedRecordError.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccl_back.errors import UntrustedRecordError
from nccl_back.model import layout as L
from nccl_back.model import reshard_plan as P
from nccl_back.model.skeleton import Manifest, TensorEntry

pytestmark = pytest.mark.timeout(300)
PROPS = settings(max_examples=120, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = {"float32": torch.float32, "int16": torch.int16}


@st.composite
def checkpoints(draw: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    n = draw(st.integers(1, 4))
    out = {}
    # Often sources of one trailing shape and dtype (fusable, as q/k/v or gate/up are).
    tail = tuple(draw(st.lists(st.integers(1, 5), max_size=2))) if draw(st.booleans()) else None
    for i in range(n):
        if tail is not None:
            out[f"s{i}"] = ((draw(st.integers(1, 7)), *tail), "float32")
            continue
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        out[f"s{i}"] = (shape, draw(st.sampled_from(sorted(DTYPES))))
    return out


def _cuts(draw: Any, extent: int, world: int) -> list[tuple[int, int]]:
    if world == 1:
        return [(0, extent)]
    points = sorted(draw(st.sets(st.integers(1, extent - 1), min_size=world - 1,
                                 max_size=world - 1)))
    bounds = [0, *points, extent]
    return list(zip(bounds, bounds[1:], strict=False))


@st.composite
def schemes(draw: Any, ckpt: dict[str, tuple[tuple[int, ...], str]]) -> list[dict[str, Any]]:
    """One sharding: per rank, skeleton name -> (shape, dtype, TensorLayout)."""
    world = draw(st.integers(1, 3))
    ranks: list[dict[str, Any]] = [{} for _ in range(world)]
    names = sorted(ckpt)
    # Fuse some same-dtype sources of equal trailing shape along dim 0 (qkv, gate_up).
    fusable = [n for n in names if len(ckpt[n][0]) >= 1 and ckpt[n][0][0] >= world]
    fused: list[str] = []
    if len(fusable) >= 2 and draw(st.booleans()):
        first = fusable[0]
        fused = [n for n in fusable if ckpt[n][0][1:] == ckpt[first][0][1:]
                 and ckpt[n][1] == ckpt[first][1]]
        if len(fused) >= 2:
            pad = draw(st.integers(0, 2))
            cuts = {n: _cuts(draw, ckpt[n][0][0], world) for n in fused}
            for r in range(world):
                parts: list[L.Part] = [L.Piece(n, 0, *cuts[n][r]) for n in fused]
                if pad:
                    parts.append(L.Padding(pad))
                rows = sum(b - a for a, b in cuts_r(cuts, r)) + pad
                ranks[r]["fused"] = ((rows, *ckpt[first][0][1:]), ckpt[first][1], L.concat(0, *parts))
        else:
            fused = []
    for n in names:
        if n in fused:
            continue
        shape, dtype = ckpt[n]
        dims = [d for d, e in enumerate(shape) if e >= world]
        if world == 1 or not dims or draw(st.booleans()) is False:
            for r in range(world):
                ranks[r][n] = (shape, dtype, None)  # replicated, whole
            continue
        d = draw(st.sampled_from(dims))
        c = draw(st.integers(0, len(shape) - 1))  # the concat dim of a one-piece tensor
        for r, (a, b) in enumerate(_cuts(draw, shape[d], world)):
            s = list(shape)
            s[d] = b - a
            ranks[r][f"{n}.r"] = (tuple(s), dtype, L.TensorLayout(c, (L.Piece(n, d, a, b),)))
    return ranks


def cuts_r(cuts: dict[str, list[tuple[int, int]]], r: int) -> list[tuple[int, int]]:
    return [cuts[n][r] for n in sorted(cuts)]


def layout(rank: dict[str, Any], ckpt: dict[str, Any]) -> L.Layout:
    man = Manifest(tuple(TensorEntry(n, s, d) for n, (s, d, _) in sorted(rank.items())))
    described = {n: t for n, (_, _, t) in rank.items() if t is not None}
    return L.layout_of(man, described, {n: s for n, (s, _) in ckpt.items()})


def tensors_of(lay: L.Layout, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a rank of ``lay`` holds, built from the layout's meaning, not from a plan."""
    out = {}
    for name, shape, dtype, t in lay.tensors:
        parts = []
        for p in t.parts:
            if isinstance(p, L.Padding):
                pad = list(shape)
                pad[t.dim] = p.size
                parts.append(torch.zeros(pad, dtype=DTYPES[dtype]))
            else:
                src = values[p.source].reshape(-1) if not values[p.source].dim() else values[p.source]
                parts.append(src.narrow(p.dim, p.start, p.stop - p.start))
        out[name] = torch.cat(parts, t.dim).reshape(shape).contiguous()
    return out


def random_values(ckpt: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-30000, 30000, s, generator=g, dtype=torch.int32).to(DTYPES[d])
            for n, (s, d) in ckpt.items()}


@PROPS
@given(data=st.data())
def test_plan_fills_every_element_once_and_exactly(data: Any) -> None:
    ckpt = data.draw(checkpoints())
    recv_scheme = data.draw(schemes(ckpt))
    hold_scheme = data.draw(schemes(ckpt))
    r = data.draw(st.integers(0, len(recv_scheme) - 1))
    receiver = layout(recv_scheme[r], ckpt)
    holders = [layout(h, ckpt) for h in hold_scheme]
    plan = P.plan(receiver, holders)

    # Exactly once: count writes per element; padding never written.
    counts = {n: torch.zeros(s or (1,), dtype=torch.int32) for n, s, _, _ in receiver.tensors}
    for m in plan.moves:
        P._view(counts[m.dst], m.dst_box).add_(1)
    expect_once = tensors_of(receiver, {n: torch.ones(s, dtype=DTYPES[d])
                                        for n, (s, d) in ckpt.items()})
    for n, c in counts.items():
        assert torch.equal(c.reshape(-1), expect_once[n].reshape(-1).to(torch.int32)), n

    # Bit-exact: each holder's boxes copied straight across (apply_local).
    values = random_values(ckpt, data.draw(st.integers(0, 2**31)))
    held = [tensors_of(h, values) for h in holders]
    got = {n: torch.full(s, 7, dtype=DTYPES[d]) for n, s, d, _ in receiver.tensors}
    P.zero_padding(receiver, got)
    for k in range(len(holders)):
        P.apply_local(plan.for_holder(k), held[k], got)
    want = tensors_of(receiver, values)
    for n in want:
        assert got[n].reshape(-1).view(torch.uint8).tolist() == want[n].reshape(-1).view(torch.uint8).tolist(), n
    assert plan.nbytes() == sum(c.sum().item() * want[n].element_size() for n, c in counts.items())

    # Bit-exact as the transfer moves them too: the sender's per-move payload (views where
    # a box is contiguous) lands in the receiver's (views, else staged and copied in).
    landed = {n: torch.full(s, 7, dtype=DTYPES[d]) for n, s, d, _ in receiver.tensors}
    P.zero_padding(receiver, landed)
    for k in range(len(holders)):
        moves = plan.for_holder(k)
        sent = P.sent(moves, held[k])
        land = P.Landing(moves, landed, torch.device("cpu"))
        into = land.payload
        assert sorted(sent) == sorted(into)
        assert all(sent[n].shape == into[n].shape and sent[n].dtype == torch.uint8 for n in sent)
        for i, n in enumerate(sorted(sent)):
            into[n].copy_(sent[n])
            if i % 2:  # some placed as they arrive, the rest at the end
                land.place(n)
        land.finish()
    for n in want:
        assert landed[n].reshape(-1).view(torch.uint8).tolist() == want[n].reshape(-1).view(torch.uint8).tolist(), n

    # Deterministic: the same inputs give the same plan, whoever computes it.
    again = P.plan(L.parse(receiver.dumps()), [L.parse(h.dumps(), h.digest) for h in holders])
    assert again == plan and again.digest == plan.digest


@PROPS
@given(data=st.data())
def test_layout_round_trips_and_digest_is_content(data: Any) -> None:
    ckpt = data.draw(checkpoints())
    scheme = data.draw(schemes(ckpt))
    for rank in scheme:
        lay = layout(rank, ckpt)
        parsed = L.parse(lay.dumps(), lay.digest)
        assert parsed == lay and parsed.digest == lay.digest
        # Same content described in another insertion order: same digest.
        assert layout(dict(reversed(list(rank.items()))), ckpt).digest == lay.digest


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.sampled_from(["tensors", "sources", "x"]), inner, max_size=3),
                    max_leaves=20)


@PROPS
@given(value=JSON)
def test_parser_takes_anything(value: Any) -> None:
    with contextlib.suppress(UntrustedRecordError):
        L.parse(json.dumps(value))


@PROPS
@given(data=st.data())
def test_parser_takes_every_mutation(data: Any) -> None:
    ckpt = data.draw(checkpoints())
    lay = layout(data.draw(schemes(ckpt))[0], ckpt)
    doc = lay.to_json()
    item = data.draw(st.sampled_from(doc["tensors"]))
    field = data.draw(st.integers(0, 4))
    item[field] = data.draw(JSON)
    with contextlib.suppress(UntrustedRecordError):
        L.parse(json.dumps(doc))
    with pytest.raises(UntrustedRecordError):
        L.parse(lay.dumps(), "0" * 64)


def test_column_and_row_helpers_tp2_from_tp1() -> None:
    """The documented helpers: TP=2 ranks of column/row/fused weights behind one TP=1 holder."""
    ck = {"q": (8, 4), "k": (4, 4), "o": (4, 8)}
    full = L.layout_of(Manifest(tuple(TensorEntry(n, s, "float32") for n, s in ck.items())), {}, ck)
    assert full.trivial
    for r in range(2):
        qk = L.concat(0, L.shard("q", 0, r, 2, 8), L.shard("k", 0, r, 2, 4))
        man = Manifest((TensorEntry("o", (4, 4), "float32"), TensorEntry("qk", (6, 4), "float32")))
        lay = L.layout_of(man, {"qk": qk, "o": L.row("o", r, 2, 8)}, ck)
        p = P.plan(lay, [full])
        assert p.nbytes() == (6 * 4 + 4 * 4) * 4  # exactly its own shard
    with pytest.raises(L.LayoutError):
        L.shard("q", 0, 0, 3, 8)
    with pytest.raises(P.PlanError):
        half = L.layout_of(Manifest((TensorEntry("q", (4, 4), "float32"),)),
                           {"q": L.column("q", 0, 2, 8)}, ck)
        P.plan(full, [half])


def test_a_hostile_layout_costs_a_bounded_plan() -> None:
    """A holder layout that cuts a huge tensor into a fine grid (a record an attacker can
    write without a secret) makes plan() refuse within its work bound, in well under a
    second, instead of testing every cell against every piece."""
    import time as _time

    from nccl_back.model import layout as lay_mod
    from nccl_back.model.reshard_plan import PlanError, plan
    from nccl_back.model.skeleton import Manifest, TensorEntry

    n = 1 << 16
    shapes = {"w": (n, n)}
    receiver = lay_mod.layout_of(Manifest((TensorEntry("w", (n, n), "float32"),)), {}, shapes)
    rows = [lay_mod.Piece("w", 0, i * (n // 256), (i + 1) * (n // 256)) for i in range(256)]
    cols = [lay_mod.Piece("w", 1, i * (n // 256), (i + 1) * (n // 256)) for i in range(256)]
    hostile = lay_mod.Layout(
        tuple(sorted([(f"r{i}", (n // 256, n), "float32", lay_mod.TensorLayout(0, (p,)))
                      for i, p in enumerate(rows)]
                     + [(f"c{i}", (n, n // 256), "float32", lay_mod.TensorLayout(1, (p,)))
                        for i, p in enumerate(cols)])),
        (("w", (n, n)),))
    start = _time.monotonic()
    with pytest.raises(PlanError, match="more than"):
        plan(receiver, [hostile])
    assert _time.monotonic() - start < 2.0
