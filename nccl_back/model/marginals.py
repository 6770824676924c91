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


class Scratch:
    """One reused int64 buffer for the values of a chunk: fresh memory pays a page
    fault per 4 KiB on its first write (about 10x the conversion itself)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.int64)

    def take(self, n: int, device: torch.device) -> torch.Tensor:
        if self.buf.numel() < n or self.buf.device != device:
            self.buf = torch.empty(max(n, _CHUNK), dtype=torch.int64, device=device)
        return self.buf[:n]


def _values(chunk: torch.Tensor, mul: int, scratch: Scratch) -> torch.Tensor:
    """The elements of ``chunk`` as int64 values of their raw bytes (any dtype), in
    ``scratch`` where they fit one word."""
    size = chunk.element_size()
    if size <= 4:
        word, mask = {1: (torch.int8, 0xFF), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF)}[size]
        out = scratch.take(chunk.numel(), chunk.device).view(chunk.shape)
        return out.copy_(chunk.view(word)).bitwise_and_(mask)
    words = chunk.view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)
    per = size // 4
    words = words.reshape(*chunk.shape, per)
    out = words[..., per - 1].clone()
    for i in range(per - 2, -1, -1):  # Horner: w_0 + mul * (w_1 + mul * ...)
        out.mul_(mul).add_(words[..., i])
    return out


def _contract(v: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """``v @ coeff`` in int64 (wrapping mod 2**64): the integer ``mv`` on CPU, a
    multiply-and-sum elsewhere (CUDA has no integer ``mv``); the same bits either way."""
    if v.device.type == "cpu":
        return torch.mv(v, coeff)
    return (v * coeff.reshape(1, -1)).sum(dim=1)


def sums(region: torch.Tensor, name: str, shape: tuple[int, ...], dims: tuple[int, ...],
         start: int, cut: int, key: bytes | None, scratch: Scratch) -> dict[int, np.ndarray]:
    """``{d: P_d}`` of checkpoint tensor ``name`` (``shape``) from ``region``, its slice
    along dim ``cut`` from ``start`` (whole along the others), for each ``d`` in ``dims``
    (``cut`` itself: ``P_cut[start : start + extent]``; any other: only where the slice
    is the whole tensor). The region is read in chunks of rows (its outer dim, as it lies
    in memory), each converted once whatever the number of dims asked for (uint64)."""
    device = region.device
    mul = _word_mul(key)
    weights = {e: _weights(key, name, shape, e, device) for e in range(len(shape))}
    weights[cut] = weights[cut][start:start + region.shape[cut]]
    flat = region.detach().reshape(region.shape[0], -1)  # dim 0 by the others, in memory order
    inner = _inner(weights, 0, device)
    rows = flat.shape[0]
    step = max(_CHUNK // max(flat.shape[1], 1), 1)
    along: list[torch.Tensor] = []
    across: torch.Tensor | None = None
    two_d = len(shape) == 2
    for lo in range(0, rows, step):
        v = _values(flat[lo:lo + step].contiguous(), mul, scratch).reshape(-1, flat.shape[1])
        if 0 in dims:
            along.append(_contract(v, inner))
        if two_d and 1 in dims:
            part = _contract(v.t(), weights[0][lo:lo + step].contiguous())
            across = part if across is None else across + part
    out: dict[int, np.ndarray] = {}
    if 0 in dims:
        out[0] = (torch.cat(along) * weights[0]).cpu().numpy().view(np.uint64)
    if across is not None:
        out[1] = (across * weights[1]).cpu().numpy().view(np.uint64)
    for d in dims:  # a later dim of a tensor of three or more dims: a pass of its own
        if d not in out:
            if d != cut and tuple(region.shape) != tuple(shape):
                raise NotCheckable(f"{name}: sums along dim {d} need the whole tensor")
            out[d] = _along(region, d, weights, mul, scratch)
    return out


def _inner(weights: dict[int, torch.Tensor], skip: int, device: torch.device) -> torch.Tensor:
    """Every dim's weights but ``skip``'s multiplied out, flat in memory order."""
    inner = torch.ones(1, dtype=torch.int64, device=device)
    for e in sorted(weights):
        if e != skip:
            inner = (inner.reshape(-1, 1) * weights[e].reshape(1, -1)).reshape(-1)
    return inner


def _along(region: torch.Tensor, d: int, weights: dict[int, torch.Tensor], mul: int,
           scratch: Scratch) -> np.ndarray:
    """``P_d`` with dim ``d`` moved first (a copy per chunk: tensors of three or more
    dims, rare in checkpoints)."""
    inner = _inner(weights, d, region.device)
    moved = region.detach().movedim(d, 0)
    step = max(_CHUNK // max(moved[0].numel(), 1), 1)
    parts = [_contract(_values(moved[lo:lo + step].contiguous(), mul, scratch).reshape(
        min(step, moved.shape[0] - lo), -1), inner) for lo in range(0, moved.shape[0], step)]
    total = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=region.device)
    return (total * weights[d]).cpu().numpy().view(np.uint64)


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
    scratch = Scratch()
    for source, shape, p, region in _regions(layout, tensors):
        whole = p.start == 0 and p.stop == shape[p.dim]
        runs = out.setdefault(source, [])
        dims = tuple(d for d in (range(len(shape)) if whole else (p.dim,))
                     if not any(r[0] == d and r[1] == (p.start if d == p.dim else 0) for r in runs))
        for d, got in sorted(sums(region, source, shape, dims, p.start, p.dim, key, scratch).items()):
            runs.append((d, p.start if d == p.dim else 0, got.tobytes()))
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
    scratch = Scratch()
    for source, shape, p, region in _regions(layout, tensors):
        got = _want(truth, source, shape, p)
        if got is None:
            raise NotCheckable(f"no truth for every byte of {source}[{p.start}:{p.stop}] (dim"
                               f" {p.dim}): its holders published no full sums for it")
        d, _start, want = got
        mine = sums(region, source, shape, (d,), p.start, p.dim, key, scratch)[d]
        checked += math.prod(region.shape)
        if not np.array_equal(mine, want):
            bad.append(source)
    return checked, sorted(set(bad))
