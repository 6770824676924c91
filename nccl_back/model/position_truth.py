"""Truth in checkpoint coordinates: keyed MACs at sampled logical positions.

Layer hashes (:mod:`.integrity`) cover one skeleton's tensors, so they only verify a
receiver of exactly that skeleton. A worker of another layout holds other slices of
the same checkpoint tensors; what it can check must not depend on any layout. So:

- For every checkpoint tensor ``S`` (logical shape, dtype), :data:`SAMPLES` flat
  positions are drawn by SHAKE-128 of the integrity key, the name and the shape: a
  pure function, the same for every worker, unpredictable without the key.
- The truth holds, per position ``j``, a MAC: the first :data:`MAC_BYTES` of keyed
  BLAKE2b over ``(name, shape, j, flat index, the element's raw bytes)``. Each
  position is checkable alone, so a worker holding any slice checks exactly the
  positions inside its pieces; positions a publisher does not hold are ``None``.

What it catches: a holder (or anything on the wire) that changes a fraction ``f`` of a
receiver's slice passes with probability about ``(1 - f) ** m`` where ``m`` is the
number of sampled positions inside that slice (``SAMPLES / tp`` for a TP rank of a
sharded tensor, all of them for a replicated one); with the secret, positions and MACs
cannot be predicted or forged (forging one position's MAC: 2^-32). Raw bytes are
compared, so a NaN payload or a flipped sign bit counts. What it misses: changes
outside the sampled positions (it is a sample, like ``sampled`` mode); without a secret
the positions are public, so it is then a corruption check only.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from nccl_back.errors import NoPeerError, WeightVerificationError
from nccl_back.model.layout import Layout
from nccl_back.model.reshard_plan import held_pieces

#: Positions sampled per checkpoint tensor (a TP=8 rank of a sharded one checks ~16).
SAMPLES = 128
#: Bytes of one position's MAC.
MAC_BYTES = 4

Macs = dict[str, list[str | None]]
"""Checkpoint tensor -> one hex MAC per sampled position (None: not held)."""


def positions(name: str, shape: tuple[int, ...], key: bytes | None) -> np.ndarray:
    """The flat positions sampled from checkpoint tensor ``name`` (int64, length
    ``min(SAMPLES, numel)``; all of them for a small tensor)."""
    numel = math.prod(shape)
    if numel <= SAMPLES:
        return np.arange(numel, dtype=np.int64)
    stream = hashlib.shake_128(b"" if key is None else len(key).to_bytes(2, "little") + key)
    stream.update(f"positions\0{name}\0{list(shape)}".encode())
    picks = np.frombuffer(stream.digest(8 * SAMPLES), dtype="<u8") % np.uint64(numel)
    return picks.astype(np.int64)


def _prefix(key: bytes | None, name: str, shape: tuple[int, ...]) -> Any:
    """The keyed BLAKE2b state after ``(name, shape)``: copied per position, so the key
    block and the name are hashed once per tensor, not once per position."""
    h = hashlib.blake2b(digest_size=MAC_BYTES, key=key or b"")
    h.update(f"{name}\0{list(shape)}\0".encode())
    return h


def _mac(prefix: Any, j: int, flat: int, data: bytes) -> str:
    h = prefix.copy()
    h.update(b"%d\0%d\0%d\0" % (j, flat, len(data)))
    h.update(data)
    return str(h.hexdigest())


def held_macs(layout: Layout, tensors: Mapping[str, torch.Tensor], key: bytes | None) -> Macs:
    """The MACs of every sampled position ``layout``'s tensors hold (``None`` where they
    hold none): what a storage loader publishes, and what a receiver compares."""
    shapes = layout.source_shapes
    out: Macs = {}
    for _name, t, off, p, tensor in held_pieces(layout, tensors):
        src = shapes[p.source] or (1,)
        pos = positions(p.source, shapes[p.source], key)
        macs = out.setdefault(p.source, [None] * len(pos))
        prefix = _prefix(key, p.source, shapes[p.source])
        y = np.stack(np.unravel_index(pos, src)) if len(pos) else np.zeros((len(src), 0), np.int64)
        inside = (y[p.dim] >= p.start) & (y[p.dim] < p.stop)
        js = np.nonzero(inside)[0]
        if not len(js):
            continue
        x = y[:, js].copy()
        x[p.dim] -= p.start
        x[t.dim] += off
        index = tuple(torch.from_numpy(row).to(tensor.device) for row in x)
        values = tensor[index].contiguous().cpu()
        raw = values.view(torch.uint8).reshape(len(js), -1).numpy()
        for n, j in enumerate(js.tolist()):
            macs[j] = _mac(prefix, j, int(pos[j]), raw[n].tobytes())
    return out


class NoPositionTruth(NoPeerError):
    """The truth at hand has no MAC for some position this worker holds: those bytes
    cannot be checked (a reason to load elsewhere, not a sign of damage)."""


def check(layout: Layout, tensors: Mapping[str, torch.Tensor], truth: Macs,
          key: bytes | None) -> int:
    """Compare every sampled position this layout holds with ``truth``; returns how many
    were checked. :class:`WeightVerificationError` as :func:`compare`."""
    return compare(held_macs(layout, tensors, key), truth)


def compare(mine: Macs, truth: Macs) -> int:
    """Compare held MACs (:func:`held_macs`) with ``truth``; returns how many were
    checked. :class:`WeightVerificationError` naming the first tensors that differ, or a
    held position the truth has no MAC for (nothing to verify it against)."""
    bad, missing, checked = [], [], 0
    for name in sorted(mine):
        want = truth.get(name)
        for j, m in enumerate(mine[name]):
            if m is None:
                continue
            if want is None or j >= len(want) or want[j] is None:
                missing.append(name)
                break
            checked += 1
            if want[j] != m:
                bad.append(name)
                break
    if bad:
        raise WeightVerificationError(f"checkpoint positions differ in {len(bad)} tensors: {bad[:5]}",
                                      set(bad))
    if missing:
        raise NoPositionTruth(f"no truth for positions held of {missing[:5]}")
    return checked
