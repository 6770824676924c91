"""Every byte in checkpoint coordinates: keyed per-index sums that any layout can check.

``full`` verification must read every byte, also for a worker whose tensors are slices
of the checkpoint's (a tensor-parallel rank, a resharded load). Layer hashes cover one
skeleton's tensors, so they verify only that skeleton. What every layout can check is
a *marginal*: for checkpoint tensor ``S`` of shape ``(n_0, ..., n_k)`` and a dim ``d``,

    P_d[j] = sum over every element x with x[d] = j of  c(x) * v(x)   (mod 2**64)

with ``c(x) = prod_e g_e[x[e]]``, odd 64-bit weights ``g_e`` drawn from SHAKE-256 of the
integrity key, the name, the shape and the dim, and ``v(x)`` the element's raw bytes as
an integer (32-bit words combined with an odd keyed multiplier). A piece of a layout is
a slice ``[a, b)`` of ``S`` along one dim ``d`` (whole along the others), so it holds
exactly the elements of ``P_d[a:b]``: a worker holding it computes those sums from its
own bytes and compares them with the truth's, index by index. A worker holding ``S``
whole publishes ``P_d`` along every dim, so any later layout can check its cut.

What it catches: ``c(x)`` is odd, so a change ``delta`` of one element changes its sum
unless ``delta`` is a multiple of ``2**64``: never, for elements of at most 8 bytes.
Changes that cancel need the weights, which come from the secret: without it a payload
passes with probability at most about ``2**-(64 - t)`` when every changed difference is
a multiple of ``2**t`` (a flipped bfloat16 sign bit: ``t = 15``). Without a secret the
weights are public: a corruption check, as the other modes are then.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from nccl_back.errors import NoPeerError, UntrustedRecordError
from nccl_back.model.layout import Layout, Piece
from nccl_back.model.reshard_plan import held_pieces

Runs = dict[str, list[tuple[int, int, bytes]]]
"""Checkpoint tensor -> ``(dim, start, little-endian uint64 sums)`` (coord.content's)."""

#: Elements converted to 64-bit integers at once (bounds the scratch memory: 32 MiB).
_CHUNK = 1 << 22


class NotCheckable(NoPeerError):
    """The truth at hand has no sums for some piece this worker holds: its bytes cannot
    all be checked (a reason to load elsewhere, not a sign of damage)."""


def _weights(key: bytes | None, name: str, shape: tuple[int, ...], dim: int,
             device: torch.device) -> torch.Tensor:
    n = shape[dim]
    stream = hashlib.shake_256(b"nccl_back/marginals\0" + (key or b"") + b"\0"
                               + f"{name}\0{list(shape)}\0{dim}".encode())
    words = np.frombuffer(stream.digest(8 * n), dtype="<u8").view(np.int64) | 1
    return torch.from_numpy(words.copy()).to(device)


def _word_mul(key: bytes | None) -> int:
    digest = hashlib.shake_256(b"nccl_back/marginals-words\0" + (key or b"")).digest(8)
    return int.from_bytes(digest, "little", signed=True) | 1


def _values(chunk: torch.Tensor, mul: int) -> torch.Tensor:
    """The elements of ``chunk`` as int64 values of their raw bytes (any dtype)."""
    size = chunk.element_size()
    if size == 1:
        return chunk.view(torch.int8).to(torch.int64).bitwise_and_(0xFF)
    if size == 2:
        return chunk.view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)
    words = chunk.view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)
    per = size // 4
    words = words.reshape(*chunk.shape, per)
    out = words[..., per - 1].clone()
    for i in range(per - 2, -1, -1):  # Horner: w_0 + mul * (w_1 + mul * ...)
        out.mul_(mul).add_(words[..., i])
    return out


def _along(region: torch.Tensor, dim: int) -> Iterator[torch.Tensor]:
    """``region`` with ``dim`` first, in chunks of whole slices along it."""
    moved = region.movedim(dim, 0)
    per = max(moved[0].numel(), 1) if moved.shape[0] else 1
    step = max(_CHUNK // per, 1)
    for start in range(0, moved.shape[0], step):
        yield moved[start:start + step]


def sums(region: torch.Tensor, name: str, shape: tuple[int, ...], dim: int, start: int,
         key: bytes | None) -> np.ndarray:
    """``P_dim[start : start + region.shape[dim]]`` of checkpoint tensor ``name``
    (``shape``) from ``region``, its slice along ``dim`` from ``start`` (uint64)."""
    device = region.device
    mul = _word_mul(key)
    rest = [e for e in range(len(shape)) if e != dim]
    coeff = torch.ones((), dtype=torch.int64, device=device)
    for e in rest:  # the outer product of the other dims' weights, in their order
        coeff = (coeff.reshape(-1, 1) * _weights(key, name, shape, e, device).reshape(1, -1)).reshape(-1)
    own = _weights(key, name, shape, dim, device)[start:start + region.shape[dim]]
    out: list[torch.Tensor] = []
    for chunk in _along(region.detach(), dim):
        v = _values(chunk.contiguous(), mul).reshape(chunk.shape[0], -1)
        out.append(v.mul_(coeff.reshape(1, -1)).sum(dim=1))  # int64 wraps mod 2**64
    total = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=device)
    return (total * own).cpu().numpy().view(np.uint64)


def _regions(layout: Layout, tensors: Mapping[str, torch.Tensor]
             ) -> Iterator[tuple[str, tuple[int, ...], Piece, torch.Tensor]]:
    """Every piece ``layout`` holds: its source, the source's shape, the piece, and the
    piece's elements in ``tensors`` (shaped as the source sliced along the piece's dim)."""
    shapes = layout.source_shapes
    for name, t, off, p, tensor in held_pieces(layout, tensors):
        src = shapes[p.source] or (1,)
        want = tuple(p.stop - p.start if i == p.dim else n for i, n in enumerate(src))
        region = tensor.narrow(t.dim, off, p.stop - p.start)
        if tuple(region.shape) != want:
            raise NotCheckable(f"{name}: a piece of {p.source} is not a slice of its tensor")
        yield p.source, src, p, region


def held(layout: Layout, tensors: Mapping[str, torch.Tensor], key: bytes | None) -> Runs:
    """The sums a worker of ``layout`` publishes: along the cut dim of each piece, and
    along every dim of each checkpoint tensor it holds whole."""
    out: Runs = {}
    for source, shape, p, region in _regions(layout, tensors):
        whole = p.start == 0 and p.stop == shape[p.dim]
        dims = range(len(shape)) if whole else (p.dim,)
        runs = out.setdefault(source, [])
        for d in dims:
            start = p.start if d == p.dim else 0
            if not any(r[0] == d and r[1] == start for r in runs):
                runs.append((d, start, sums(region, source, shape, d, start, key).tobytes()))
    return out


class Truth:
    """Several publishers' sums merged, per (tensor, dim), index by index."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        """(values, which indices are known) per (tensor, dim)."""
        self._from: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
        """Who published which range, per (tensor, dim)."""

    def add(self, runs: Runs, publisher: str) -> None:
        """Merge one record; :class:`TruthConflict` where it disagrees with another."""
        for name, items in runs.items():
            for d, start, raw in items:
                new = np.frombuffer(raw, dtype="<u8")
                stop = start + len(new)
                values, known = self._runs.get((name, d), (np.zeros(0, np.uint64), np.zeros(0, bool)))
                if len(values) < stop:
                    values = np.concatenate([values, np.zeros(stop - len(values), np.uint64)])
                    known = np.concatenate([known, np.zeros(stop - len(known), bool)])
                seen = known[start:stop]
                if not np.array_equal(values[start:stop][seen], new[seen]):
                    others = {who for a, b, who in self._from.get((name, d), [])
                              if a < stop and start < b}
                    raise TruthConflict(f"two truth records disagree on {name} (dim {d}):"
                                        f" {publisher}'s and {sorted(others)}", {publisher, *others})
                values[start:stop] = new
                known[start:stop] = True
                self._runs[(name, d)] = (values, known)
                self._from.setdefault((name, d), []).append((start, stop, publisher))

    def get(self, name: str, dim: int, start: int, stop: int) -> np.ndarray | None:
        values, known = self._runs.get((name, dim), (np.zeros(0, np.uint64), np.zeros(0, bool)))
        if stop > len(known) or not known[start:stop].all():
            return None
        return values[start:stop]


class TruthConflict(UntrustedRecordError):
    """Two storage-rooted truth records disagree: one of them is not to be trusted, so
    neither publisher is used (a reason to skip them, not damage of these bytes);
    ``publishers`` names them where known."""

    def __init__(self, message: str, publishers: set[str] | None = None) -> None:
        super().__init__(message)
        self.publishers = frozenset(publishers or ())


def _want(truth: Truth, source: str, shape: tuple[int, ...], p: Piece) -> tuple[int, int, np.ndarray] | None:
    """The truth's sums for piece ``p`` as ``(dim, start, sums)``: along its cut dim, or
    (a piece holding ``source`` whole) along any dim the truth has whole."""
    want = truth.get(source, p.dim, p.start, p.stop)
    if want is not None:
        return p.dim, p.start, want
    if p.start == 0 and p.stop == shape[p.dim]:
        for d in range(len(shape)):
            want = truth.get(source, d, 0, shape[d])
            if want is not None:
                return d, 0, want
    return None


def uncovered(layout: Layout, truth: Truth) -> str | None:
    """Why ``truth`` cannot check every byte ``layout`` holds (None: it can)."""
    shapes = layout.source_shapes
    for _name, _shape, _dtype, t in layout.tensors:
        for p in t.parts:
            if isinstance(p, Piece) and _want(truth, p.source, shapes[p.source] or (1,), p) is None:
                return (f"no truth for every byte of {p.source}[{p.start}:{p.stop}] (dim {p.dim}):"
                        " its holders published no full sums for it")
    return None


def check(layout: Layout, tensors: Mapping[str, torch.Tensor], truth: Truth,
          key: bytes | None) -> tuple[int, list[str]]:
    """Compare every byte this layout holds with ``truth``: ``(elements checked, the
    checkpoint tensors whose sums differ)``; :class:`NotCheckable` when the truth lacks
    the sums of some piece."""
    checked, bad = 0, []
    for source, shape, p, region in _regions(layout, tensors):
        got = _want(truth, source, shape, p)
        if got is None:
            raise NotCheckable(f"no truth for every byte of {source}[{p.start}:{p.stop}] (dim"
                               f" {p.dim}): its holders published no full sums for it")
        d, start, want = got
        mine = sums(region, source, shape, d, start, key)
        checked += math.prod(region.shape)
        if not np.array_equal(mine, want):
            bad.append(source)
    return checked, sorted(set(bad))
