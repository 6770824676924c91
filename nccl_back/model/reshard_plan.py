"""The reshard plan: which boxes of which holder tensors fill which boxes of a receiver's.

Both ends compute it from the same inputs — the receiver's :class:`~.layout.Layout`
and one layout per holder rank — and nothing else, so they derive the same
:class:`Plan` with the same :attr:`Plan.digest`; the digest travels in the handshake,
so a mismatch is a refusal before data moves, never bytes in the wrong buffer.

How: every piece is a box of its checkpoint tensor (full but along the piece's dim).
For each piece of the receiver, the boxes of the holders' pieces of the same source
(and dtype) cut it into a grid of cells; each cell goes to one holder piece containing
it (the first in sorted order, rotated by the cell's position so replicated tensors are
spread over holders, deterministically); a cell no holder has makes the plan impossible
(:class:`PlanError`). Cells of one owner are merged back into boxes, and every box is
translated into holder and receiver coordinates (layouts map elements by translation,
so a box stays a box). The receiver's pieces tile its tensors, so every non-padding
element is filled exactly once; padding is filled by nothing.

:func:`sent` and :class:`Landing` are one holder's moves as a transfer's payload, one
byte tensor per move, the box itself wherever it is one contiguous run of memory (a
slice along the first dim of a contiguous tensor), so most bytes are neither packed by
the sender nor copied again by the receiver.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nccl_back.errors import SkeletonError
from nccl_back.model.layout import Layout, Padding, Piece, TensorLayout
from nccl_back.model.skeleton import dtype_from_name

Box = tuple[tuple[int, int], ...]
"""Half-open ``(start, stop)`` per dim."""


#: Cells one plan may cut the receiver's pieces into, and cell-by-piece tests it may
#: make: real tensor-parallel plans need a few per piece; a hostile layout record (no
#: secret needed without one) would otherwise cost minutes of a receiver's or a
#: holder's time.
MAX_CELLS = 1 << 15
MAX_TESTS = 1 << 21


class PlanError(SkeletonError):
    """The holders' layouts do not hold every element the receiver's needs (or would
    need more work than :data:`MAX_CELLS` allows to say which)."""


@dataclass(frozen=True, order=True)
class Move:
    """``dst[dst_box] = holders[holder][src][src_box]`` (boxes of equal shape)."""

    holder: int
    dst: str
    dst_box: Box
    src: str
    src_box: Box
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(b - a for a, b in self.dst_box) * self.itemsize


@dataclass(frozen=True)
class Plan:
    """Every move, sorted by (holder, receiver tensor, box): the order bytes travel in."""

    moves: tuple[Move, ...]
    receiver: str
    holders: tuple[str, ...]
    """The layout digests it was computed from."""

    @property
    def digest(self) -> str:
        body = json.dumps([self.receiver, list(self.holders),
                           [[m.holder, m.dst, m.dst_box, m.src, m.src_box, m.itemsize]
                            for m in self.moves]], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    def for_holder(self, k: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.holder == k)

    def nbytes(self, k: int | None = None) -> int:
        """Bytes moved (from holder ``k``, or from all)."""
        return sum(m.nbytes for m in self.moves if k is None or m.holder == k)

    @property
    def used(self) -> tuple[int, ...]:
        """The holders this plan receives anything from."""
        return tuple(sorted({m.holder for m in self.moves}))


@dataclass(frozen=True)
class _HeldPiece:
    """One piece somewhere: its box in source coordinates, and where it lives."""

    order: tuple[int, str, int]
    tensor: str
    box: Box
    shift: tuple[int, ...]
    """Tensor coordinates = source coordinates + shift."""


def _pieces(layout: Layout, k: int) -> dict[tuple[str, str], list[_HeldPiece]]:
    """(source, dtype) -> the pieces ``layout`` holds of it, as boxes of the source."""
    shapes = layout.source_shapes
    out: dict[tuple[str, str], list[_HeldPiece]] = {}
    for name, _shape, dtype, t in layout.tensors:
        for j, (off, p) in enumerate(offsets(t)):
            if isinstance(p, Padding):
                continue
            src = shapes[p.source] or (1,)
            box = tuple((p.start, p.stop) if i == p.dim else (0, d) for i, d in enumerate(src))
            shift = [0] * len(src)
            shift[p.dim] -= p.start
            shift[t.dim] += off
            out.setdefault((p.source, dtype), []).append(_HeldPiece((k, name, j), name, box, tuple(shift)))
    return out


def offsets(t: TensorLayout) -> list[tuple[int, Piece | Padding]]:
    out, off = [], 0
    for p in t.parts:
        out.append((off, p))
        off += p.size if isinstance(p, Padding) else p.stop - p.start
    return out


def held_pieces(layout: Layout, tensors: Mapping[str, torch.Tensor]
                ) -> Iterator[tuple[str, TensorLayout, int, Piece, torch.Tensor]]:
    """Every checkpoint piece ``layout`` places in ``tensors``: its skeleton tensor's
    name and layout, its offset along that layout's dim, the piece, and the tensor (a
    scalar as one element)."""
    for name, _shape, _dtype, t in layout.tensors:
        tensor = tensors[name].reshape(1) if tensors[name].dim() == 0 else tensors[name]
        for off, p in offsets(t):
            if not isinstance(p, Padding):
                yield name, t, off, p, tensor


def plan(receiver: Layout, holders: Sequence[Layout]) -> Plan:
    """The moves that fill ``receiver`` from ``holders`` (index = holder rank);
    :class:`PlanError` if the holders lack an element it needs, or disagree with it
    on a checkpoint tensor's shape."""
    mine = receiver.source_shapes
    held: dict[tuple[str, str], list[_HeldPiece]] = {}
    for k, h in enumerate(holders):
        for src, shape in h.sources:
            if src in mine and mine[src] != shape:
                raise PlanError(f"holder {k} says {src} is {list(shape)}, the receiver {list(mine[src])}")
        for key, pieces in _pieces(h, k).items():
            held.setdefault(key, []).extend(pieces)
    moves: list[Move] = []
    work = _Work()
    for (source, dtype), wanted in sorted(_pieces(receiver, -1).items()):
        candidates = sorted(held.get((source, dtype), []), key=lambda h: h.order)
        itemsize = dtype_from_name(dtype).itemsize
        for want in wanted:
            for owner, box in _cover(want, candidates, work):
                moves.append(Move(owner.order[0], want.tensor, _shifted(box, want.shift),
                                  owner.tensor, _shifted(box, owner.shift), itemsize))
    return Plan(tuple(sorted(moves)), receiver.digest, tuple(h.digest for h in holders))


class _Work:
    """What one plan has spent of its bounds."""

    def __init__(self) -> None:
        self.cells = 0
        self.tests = 0

    def add(self, cells: int, candidates: int) -> None:
        self.cells += cells
        self.tests += cells * max(candidates, 1)
        if self.cells > MAX_CELLS or self.tests > MAX_TESTS:
            raise PlanError(f"the layouts cut the receiver into more than {MAX_CELLS} cells"
                            f" ({MAX_TESTS} tests): no real layout does")


def _cover(want: _HeldPiece, candidates: list[_HeldPiece], work: _Work) -> list[tuple[_HeldPiece, Box]]:
    """``want``'s box, cut into boxes each owned by one candidate containing it."""
    clipped = [(c, b) for c in candidates if (b := _clip(c.box, want.box)) is not None]
    cuts = []
    for i, (lo, hi) in enumerate(want.box):
        points = {lo, hi} | {p for _, b in clipped for p in b[i]}
        cuts.append(sorted(points))
    work.add(math.prod(len(c) - 1 for c in cuts), len(clipped))
    spread = zlib.crc32(want.tensor.encode())
    owned: dict[int, list[Box]] = {}
    for n, cell in enumerate(itertools.product(*(zip(c, c[1:], strict=False) for c in cuts))):
        having = [i for i, (_, b) in enumerate(clipped) if _inside(cell, b)]
        if not having:
            raise PlanError(f"no holder has {want.tensor} elements {list(map(list, cell))}"
                            f" (source coordinates)")
        owned.setdefault(having[(spread + n) % len(having)], []).append(cell)
    return [(clipped[i][0], box) for i in sorted(owned) for box in _merge(owned[i])]


def _clip(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _inside(cell: Box, box: Box) -> bool:
    return all(b0 <= c0 and c1 <= b1 for (c0, c1), (b0, b1) in zip(cell, box, strict=True))


def _merge(cells: list[Box]) -> list[Box]:
    """Join boxes that differ in one dim only, where they touch, until none do: a sweep
    per dim (boxes equal in the other dims, in order along it), repeated until nothing
    joins; O(n log n) per sweep, whatever the cells."""
    boxes = sorted(cells)
    changed = True
    while changed and boxes:
        changed = False
        for d in range(len(boxes[0])):
            rows: dict[Box, list[tuple[int, int]]] = {}
            for b in boxes:
                rows.setdefault(b[:d] + b[d + 1:], []).append(b[d])
            out: list[Box] = []
            for rest, spans in rows.items():
                spans.sort()
                lo, hi = spans[0]
                for a, z in spans[1:]:
                    if a == hi:
                        hi, changed = z, True
                    else:
                        out.append(rest[:d] + ((lo, hi),) + rest[d:])
                        lo, hi = a, z
                out.append(rest[:d] + ((lo, hi),) + rest[d:])
            boxes = sorted(out)
    return boxes


def _shifted(box: Box, shift: tuple[int, ...]) -> Box:
    return tuple((lo + s, hi + s) for (lo, hi), s in zip(box, shift, strict=True))


# -- applying one holder's moves ---------------------------------------------------------


def _view(t: torch.Tensor, box: Box) -> torch.Tensor:
    t = t.reshape(1) if t.dim() == 0 else t
    return t[tuple(slice(lo, hi) for lo, hi in box)]


def apply_local(moves: Sequence[Move], src: Mapping[str, torch.Tensor],
                dst: Mapping[str, torch.Tensor]) -> None:
    """Fill the receiver's tensors ``dst`` from one holder's ``src`` in this process
    (any devices): each move's box copied straight across."""
    for m in moves:
        _strided_copy(_view(dst[m.dst], m.dst_box), _view(src[m.src], m.src_box))


def place(m: Move, rows: tuple[int, int], chunk: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the part of ``m`` whose source rows (dim 0) are in ``rows`` from ``chunk``
    (those rows of the source, as read from a file) into the receiver's tensor: the
    ranged storage load places each staged chunk of a checkpoint tensor this way."""
    lo, hi = max(m.src_box[0][0], rows[0]), min(m.src_box[0][1], rows[1])
    if lo >= hi:
        return
    shift = m.dst_box[0][0] - m.src_box[0][0]  # a move is a translation: same in every row
    src_box = ((lo - rows[0], hi - rows[0]), *m.src_box[1:])
    _strided_copy(_view(tensors[m.dst], ((lo + shift, hi + shift), *m.dst_box[1:])),
                  _view(chunk, src_box))


def _name(i: int) -> str:
    return f"{i:06d}"  # sorted names = plan order (the broadcast visits names sorted)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat byte view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def sent(moves: Sequence[Move], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sender's payload for ``moves``: each box's bytes, a view where the box is
    contiguous, else a contiguous copy. Only read."""
    out = {}
    for i, m in enumerate(moves):
        box = _view(tensors[m.src], m.src_box)
        out[_name(i)] = _bytes(box if box.is_contiguous() else box.contiguous())
    return out


class Landing:
    """The receiver's payload for one holder's moves (what :func:`sent` sends lands in
    it), and the copies into place of the boxes that are not one contiguous run: those
    arrive in a staging tensor and are placed as soon as their bytes are in
    (:meth:`place`, while later ones still arrive), the rest by :meth:`finish`."""

    def __init__(self, moves: Sequence[Move], tensors: Mapping[str, torch.Tensor],
                 device: torch.device) -> None:
        self.payload: dict[str, torch.Tensor] = {}
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, m in enumerate(moves):
            dst = _view(tensors[m.dst], m.dst_box)
            if dst.is_contiguous():
                self.payload[_name(i)] = _bytes(dst)
            else:
                tmp = torch.empty(m.nbytes, dtype=torch.uint8, device=device)
                self.payload[_name(i)] = tmp
                self._staged[_name(i)] = (dst, tmp)

    @property
    def staged(self) -> frozenset[str]:
        """Payload names whose bytes are copied into place after they arrive."""
        return frozenset(self._staged)

    def place(self, name: str) -> None:
        """Copy payload ``name``'s staged bytes into place (once; nothing if not staged)."""
        got = self._staged.pop(name, None)
        if got is not None:
            dst, tmp = got
            _strided_copy(dst, tmp.view(dst.dtype).view(dst.shape))

    def finish(self) -> None:
        """Place every staged box not placed yet."""
        for name in list(self._staged):
            self.place(name)


def _strided_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` into a strided CPU view with one thread (numpy, through an
    integer view of the same width): torch's threaded copy leaves OpenMP threads spinning
    beside the transport's (see :func:`nccl_back.transport.broadcast._copy`)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(dst.element_size())
    if dst.device.type != "cpu" or src.device.type != "cpu" or ints is None:
        dst.copy_(src)
        return
    np.copyto(dst.view(ints).numpy(), src.view(ints).numpy())


def zero_padding(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> None:
    """Zero what maps to nothing (a padded vocabulary's rows): no peer sends it, and
    a receiver's bytes then do not depend on who it received from."""
    for name, _shape, _dtype, t in layout.tensors:
        for off, p in offsets(t):
            if isinstance(p, Padding):
                tensors[name].narrow(t.dim, off, p.size).zero_()
