"""Layouts: which pieces of which checkpoint tensors each skeleton tensor holds.

A tensor-parallel rank holds *pieces* of the checkpoint: a column-parallel weight is
rows ``[r*n/w, (r+1)*n/w)`` of the checkpoint tensor, a fused ``qkv`` is the
concatenation along dim 0 of such slices of ``q``, ``k`` and ``v``, a padded vocabulary
ends in rows that map to nothing. A :class:`TensorLayout` says so for one skeleton
tensor: a concatenation along ``dim`` of :class:`Piece` s (a slice along one dim of one
logical checkpoint tensor) and :class:`Padding`. A skeleton tensor without one is the
whole checkpoint tensor of its name.

A :class:`Layout` is that description for every tensor of one rank's skeleton, checked
against the checkpoint's shapes (:func:`layout_of`). Its canonical JSON and
:attr:`Layout.digest` depend only on what is held, so two workers holding the same
pieces have the same digest; :mod:`.reshard_plan` computes what one layout needs from
others. :func:`parse` reads a layout from Redis: untrusted input, bounded, into the
typed record or :class:`~nccl_back.errors.UntrustedRecordError`.

Element mapping (pure translation, which keeps every plan a set of boxes): element ``x``
of a skeleton tensor in the part ``j`` that starts at ``off`` along ``dim`` is element
``y`` of the piece's source, ``y = x`` but ``y[dim] -= off`` and then
``y[piece.dim] += piece.start``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from nccl_back import bounded_json
from nccl_back.errors import SkeletonError, UntrustedRecordError

if TYPE_CHECKING:
    # Not at run time: the coordination layer parses layouts in processes that never
    # import torch (``nccl-back status``), and skeleton.py imports it.
    from nccl_back.model.skeleton import Manifest

#: Bytes of a layout record's JSON (a 100-layer model's is ~100 KiB).
MAX_LAYOUT_BYTES = 4 << 20
#: Tensors (and sources) one layout may name; parts one tensor may concatenate.
MAX_TENSORS = 1 << 16
MAX_PARTS = 256
MAX_DIMS = 8
MAX_EXTENT = 1 << 40


class LayoutError(SkeletonError):
    """A layout description that does not fit its skeleton or the checkpoint."""


@dataclass(frozen=True)
class Piece:
    """``source[..., start:stop, ...]``: a slice along ``dim`` of a checkpoint tensor."""

    source: str
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class Padding:
    """``size`` entries along the concatenation dim that hold no checkpoint element."""

    size: int


Part: TypeAlias = "Piece | Padding"


@dataclass(frozen=True)
class TensorLayout:
    """One skeleton tensor: its ``parts`` concatenated along ``dim``."""

    dim: int
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Layout:
    """Every tensor of one rank's skeleton as pieces of the checkpoint.

    ``tensors``: skeleton name -> (shape, dtype, layout); ``sources``: every checkpoint
    tensor a piece names -> its logical shape. Both sorted by name.
    """

    tensors: tuple[tuple[str, tuple[int, ...], str, TensorLayout], ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]

    def to_json(self) -> dict[str, Any]:
        """The canonical form (what :attr:`digest` hashes and :func:`parse` reads)."""
        return {
            "tensors": [[n, list(s), d, t.dim, [_part_json(p) for p in t.parts]]
                        for n, s, d, t in self.tensors],
            "sources": [[n, list(s)] for n, s in self.sources],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 hex of the canonical JSON: equal iff the same pieces are held (computed
        once: a layout is immutable)."""
        return hashlib.sha256(self.dumps().encode()).hexdigest()

    @property
    def source_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.sources)

    def tensor(self, name: str) -> TensorLayout:
        for n, _, _, t in self.tensors:
            if n == name:
                return t
        raise LayoutError(f"layout has no tensor {name!r}")

    @property
    def trivial(self) -> bool:
        """Every tensor is the whole checkpoint tensor of its name (a plain skeleton)."""
        return all(len(t.parts) == 1 and isinstance(p := t.parts[0], Piece) and p.source == n
                   and p.start == 0 and p.stop == (s or (1,))[p.dim] for n, s, _, t in self.tensors)


def whole(name: str, shape: Sequence[int]) -> TensorLayout:
    """The whole checkpoint tensor ``name`` (a scalar: dim 0 of a 1-element view)."""
    return TensorLayout(0, (Piece(name, 0, 0, int(shape[0]) if shape else 1),))


def shard(source: str, dim: int, rank: int, world: int, size: int) -> Piece:
    """The ``rank``-th of ``world`` equal contiguous slices along ``dim`` of ``source``
    (whose extent along ``dim`` is ``size``)."""
    if world < 1 or not 0 <= rank < world or size % world:
        raise LayoutError(f"{source}: cannot split {size} into {world} equal slices (rank {rank})")
    n = size // world
    return Piece(source, dim, rank * n, (rank + 1) * n)


def column(source: str, rank: int, world: int, size: int) -> TensorLayout:
    """A column-parallel weight (or bias): rows split across ranks (dim 0)."""
    return TensorLayout(0, (shard(source, 0, rank, world, size),))


def row(source: str, rank: int, world: int, size: int) -> TensorLayout:
    """A row-parallel weight: input columns split across ranks (dim 1)."""
    return TensorLayout(1, (shard(source, 1, rank, world, size),))


def concat(dim: int, *parts: Part) -> TensorLayout:
    """A fused tensor (``qkv``, ``gate_up``): ``parts`` concatenated along ``dim``."""
    return TensorLayout(dim, tuple(parts))


def layout_of(man: Manifest, described: Mapping[str, TensorLayout],
              checkpoint: Mapping[str, Sequence[int]]) -> Layout:
    """The full layout of a skeleton whose manifest is ``man``: ``described`` for the
    tensors it names, the whole checkpoint tensor of its name for the others.

    ``checkpoint``: logical shape of every checkpoint tensor (from the safetensors headers). Raises :class:`LayoutError` for a description that
    names no skeleton tensor or no checkpoint tensor, or does not tile its tensor.
    """
    entries = {e.name: e for e in man.entries}
    unknown = sorted(set(described) - set(entries))
    if unknown:
        raise LayoutError(f"layout describes tensors the skeleton lacks: {unknown[:5]}")
    tensors = []
    used: dict[str, tuple[int, ...]] = {}
    for name in sorted(entries):
        e = entries[name]
        t = described.get(name) or whole(name, e.shape)
        shapes = {p.source: tuple(int(d) for d in checkpoint[p.source])
                  for p in t.parts if isinstance(p, Piece) and p.source in checkpoint}
        check_tensor(name, e.shape, t, shapes)
        used.update(shapes)
        tensors.append((name, tuple(e.shape), e.dtype, t))
    return Layout(tuple(tensors), tuple(sorted(used.items())))


def check_tensor(name: str, shape: Sequence[int], t: TensorLayout,
                 sources: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`LayoutError` unless ``t``'s parts tile a tensor of ``shape``."""
    shape = tuple(shape) or (1,)  # a scalar is its own 1-element piece
    if not 0 <= t.dim < len(shape) or not 1 <= len(t.parts) <= MAX_PARTS:
        raise LayoutError(f"{name}: dim {t.dim} or {len(t.parts)} parts do not fit {list(shape)}")
    total = 0
    for p in t.parts:
        if isinstance(p, Padding):
            if p.size < 1:
                raise LayoutError(f"{name}: padding of {p.size}")
            total += p.size
            continue
        src = sources.get(p.source)
        if src is None:
            raise LayoutError(f"{name}: no checkpoint tensor {p.source!r}")
        src = src or (1,)
        if len(src) != len(shape) or not 0 <= p.dim < len(src) or not 0 <= p.start < p.stop <= src[p.dim]:
            raise LayoutError(f"{name}: piece {p} does not fit {p.source} {list(src)}")
        piece = list(src)
        piece[p.dim] = p.stop - p.start
        other = [d for i, d in enumerate(piece) if i != t.dim]
        if other != [d for i, d in enumerate(shape) if i != t.dim]:
            raise LayoutError(f"{name}: piece {p} of shape {piece} does not fit {list(shape)}"
                              f" along dim {t.dim}")
        total += piece[t.dim]
    if total != shape[t.dim]:
        raise LayoutError(f"{name}: parts add up to {total} along dim {t.dim}, not {shape[t.dim]}")


def trivial_layout(man: Manifest) -> Layout:
    """A plain skeleton's layout: every tensor whole (what a holder without one holds)."""
    return layout_of(man, {}, {e.name: e.shape for e in man.entries})


def _part_json(p: Part) -> list[Any]:
    return [None, p.size] if isinstance(p, Padding) else [p.source, p.dim, p.start, p.stop]


# -- reading one from Redis ----------------------------------------------------------------


def parse(raw: str | bytes | Mapping[str, Any], digest: str | None = None) -> Layout:
    """A layout read from Redis, checked: bounded, typed, every tensor tiled by its parts
    and, given ``digest``, hashing to it (the key it was stored under). Anything else
    is :class:`UntrustedRecordError`."""
    try:
        data = raw if isinstance(raw, Mapping) else bounded_json.loads(
            raw, max_bytes=MAX_LAYOUT_BYTES, max_depth=5)
        if not isinstance(data, Mapping) or set(data) != {"tensors", "sources"}:
            raise ValueError("expected an object with tensors and sources")
        sources = tuple((_name(n), _shape(s)) for n, s in _list(data["sources"], 2))
        shapes = dict(sources)
        tensors = []
        from nccl_back.model.skeleton import dtype_from_name  # torch: see the imports

        for item in _list(data["tensors"], 5):
            name, shape, dtype, dim, parts = item
            dtype_from_name(_name(dtype))
            tl = TensorLayout(_int(dim, MAX_DIMS), tuple(_part(p) for p in _list(parts, None)))
            check_tensor(_name(name), _shape(shape), tl, shapes)
            tensors.append((name, _shape(shape), dtype, tl))
        layout = Layout(tuple(tensors), sources)
    except (ValueError, TypeError, SkeletonError) as e:
        raise UntrustedRecordError(f"layout record: {e}") from e
    if [t[0] for t in layout.tensors] != sorted({t[0] for t in layout.tensors}) or \
            [s[0] for s in sources] != sorted(shapes):
        raise UntrustedRecordError("layout record: names not sorted and unique")
    if digest is not None and layout.digest != digest:
        raise UntrustedRecordError(f"layout record hashes to {layout.digest[:12]}, not {digest[:12]}")
    return layout


def _list(v: Any, width: int | None) -> list[Any]:
    if not isinstance(v, list) or len(v) > MAX_TENSORS:
        raise ValueError("expected a bounded list")
    if width is not None and any(not isinstance(x, list) or len(x) != width for x in v):
        raise ValueError(f"expected lists of {width}")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= 512:
        raise ValueError(f"bad name {str(v)[:40]!r}")
    return v


def _int(v: Any, bound: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < bound:
        raise ValueError(f"bad integer {str(v)[:20]}")
    return v


def _shape(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        raise ValueError("bad shape")
    shape = tuple(_int(d, MAX_EXTENT) for d in v)
    if math.prod(shape) >= MAX_EXTENT:
        raise ValueError("shape too large")
    return shape


def _part(v: Any) -> Part:
    if isinstance(v, list) and len(v) == 2 and v[0] is None:
        return Padding(_int(v[1], MAX_EXTENT))
    if not isinstance(v, list) or len(v) != 4:
        raise ValueError("bad part")
    return Piece(_name(v[0]), _int(v[1], MAX_DIMS), _int(v[2], MAX_EXTENT), _int(v[3], MAX_EXTENT))
