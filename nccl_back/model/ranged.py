"""The ranged storage load of a sharded skeleton: each rank reads only the byte spans
of the checkpoint tensors its pieces come from, through one bounded staging buffer.

Per checkpoint tensor the rank's layout needs, the span is the rows (dim 0) its pieces
cover: a column-parallel slice is a contiguous sub-span of a row-major tensor, a piece
along another dim needs every row, so the tensor's whole span. Spans are read in
chunks of whole rows into the staging buffer and copied straight into the rank's
tensors by the moves of :func:`~.reshard_plan.plan` (:func:`~.reshard_plan.place`).

A checkpoint tensor more than one rank needs rows of (a piece along dim 1, a
replicated tensor) is read once by the group: :func:`schedule` gives each rank one
block of its rows to read, and the caller hands each chunk to every rank.

No rank reads a whole file, so no rank can check a file's CRC32C alone. Instead each
rank returns the CRC32C of every elementary interval it read (its spans cut at every
rank's boundaries, which the caller gathers first: :func:`cut_points`), plus one for
each header it parsed, and the rank that reads the bytes nobody needs (:func:`gaps`:
tensors nobody holds) returns theirs. The load layer gathers them all and checks each
file (:func:`~.crc.check_file`): this module never talks to other ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import google_crc32c
import numpy as np
import torch

from nccl_back import _clock
from nccl_back.errors import StorageError
from nccl_back.model.checkpoint import TensorInfo, locate, model_headers
from nccl_back.model.crc import Interval
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import open_shard, read_exact
from nccl_back.model.reshard_plan import Move, place, plan, zero_padding
from nccl_back.model.sharding import Sharding
from nccl_back.model.skeleton import Model, named_tensors
from nccl_back.model.storage import Shard, Storage, parse_uri
from nccl_back.result import LoadResult

#: The staging buffer's size: big enough that a remote read is one efficient request,
#: small beside any rank's share of a real model.
STAGE_BYTES = 64 << 20

Span = tuple[str, int, int]
"""``(uri, start, end)``: bytes ``[start, end)`` of one file."""


@dataclass(frozen=True)
class Need:
    """Rows ``[lo, hi)`` of checkpoint tensor ``name`` (``row_bytes`` each, its data at
    byte ``start`` of ``uri``), as one rank's layout needs them."""

    name: str
    uri: str
    start: int
    row_bytes: int
    lo: int
    hi: int

    def span(self, lo: int, hi: int) -> Span:
        return (self.uri, self.start + lo * self.row_bytes, self.start + hi * self.row_bytes)


@dataclass(frozen=True)
class Needs:
    """What one rank will read, before it reads any tensor byte: exchanged by the group."""

    heads: tuple[Span, ...]
    sources: tuple[Need, ...]
    stage_bytes: int


@dataclass(frozen=True)
class Chunk:
    """Rows ``rows`` of shared tensor ``need.name``, read by rank ``owner`` (part of
    its block ``block``) and handed to every rank."""

    need: Need
    owner: int
    block: tuple[int, int]
    rows: tuple[int, int]
    step: int
    """Rows per chunk of the block."""

    @property
    def nbytes(self) -> int:
        return (self.rows[1] - self.rows[0]) * self.need.row_bytes


@dataclass(frozen=True)
class Schedule:
    """Who reads what: every rank derives the same from the same :class:`Needs`."""

    needs: tuple[Needs, ...]
    shared: tuple[tuple[Need, tuple[tuple[int, int, int], ...], int], ...]
    """Per shared tensor: its rows (the union of every rank's), ``(rank, lo, hi)`` per
    non-empty block, and the rows per chunk."""

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n.name for n, _, _ in self.shared)

    def reads(self, rank: int) -> list[Span]:
        """The spans rank ``rank`` reads: headers, its own rows of unshared tensors, its blocks."""
        mine = self.needs[rank]
        out = list(mine.heads) + [n.span(n.lo, n.hi) for n in mine.sources
                                  if n.name not in self.names and n.hi > n.lo]
        return out + [n.span(lo, hi) for n, blocks, _ in self.shared for k, lo, hi in blocks if k == rank]

    @property
    def every_read(self) -> list[Span]:
        return [s for r in range(len(self.needs)) for s in self.reads(r)]

    def chunks(self) -> Iterator[Chunk]:
        """Every shared chunk, in the one order every rank hands them over in."""
        for need, blocks, step in self.shared:
            for owner, lo, hi in blocks:
                for a in range(lo, hi, step):
                    yield Chunk(need, owner, (lo, hi), (a, min(a + step, hi)), step)

    @property
    def chunk_bytes(self) -> int:
        return max((min(step, hi - lo) * n.row_bytes for n, blocks, step in self.shared
                    for _, lo, hi in blocks), default=0)


def schedule(needs: Sequence[Needs]) -> Schedule:
    """Split every tensor whose rows more than one rank needs (overlapping row spans)
    into one contiguous block per rank, balanced by bytes (rows ``[lo, hi)``, the union
    of the ranks' spans, cut at ``lo + n*k // world``), chunked by the smallest staging
    size; a tensor's row geometry is the lowest rank's (if ranks parsed different
    headers, the header CRCs fail the load)."""
    world = len(needs)
    stage = min((n.stage_bytes for n in needs), default=STAGE_BYTES)
    by_name: dict[str, list[Need]] = {}
    for n in needs:
        for s in n.sources:
            by_name.setdefault(s.name, []).append(s)
    shared = []
    for name, held in sorted(by_name.items()):
        spans = sorted((s.lo, s.hi) for s in held)
        if held[0].row_bytes == 0 or not any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)):
            continue
        lo, hi = spans[0][0], max(h for _, h in spans)
        first = held[0]
        union = Need(name, first.uri, first.start, first.row_bytes, lo, hi)
        rows = hi - lo
        blocks = tuple((k, lo + rows * k // world, lo + rows * (k + 1) // world) for k in range(world)
                       if rows * (k + 1) // world > rows * k // world)
        shared.append((union, blocks, max(stage // max(first.row_bytes, 1), 1)))
    return Schedule(tuple(needs), tuple(shared))


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor, the rows of it this rank reads, and the moves fed by them."""

    info: TensorInfo
    need: Need
    moves: tuple[Move, ...]


class RangedLoad:
    """One rank's ranged load: what it will read (:attr:`needs`, known from its layout
    and the headers before any tensor byte is read); then, given the group's
    :class:`Schedule`, :meth:`begin`, :meth:`read_own`, the shared chunks
    (:meth:`read_chunk` or :meth:`buffer`, then :meth:`place`) and :meth:`finish`."""

    def __init__(self, spec: ModelSpec, sharding: Sharding, storage: Storage,
                 stage_bytes: int = STAGE_BYTES) -> None:
        self.spec, self.sharding, self.storage = spec, sharding, storage
        self.stage_cap = stage_bytes
        self.headers = model_headers(storage, spec)
        located = locate(self.headers)
        by_source: dict[str, list[Move]] = {}
        for m in plan(sharding.layout, [sharding.whole]).moves:
            by_source.setdefault(m.src, []).append(m)
        self.sources = [_source(located[name][1], moves) for name, moves in sorted(by_source.items())]
        self._by_name = {s.info.name: s for s in self.sources}

    @property
    def needs(self) -> Needs:
        """The headers this rank parsed (their CRCs come from the bytes it read them as,
        so ranks must agree on them) and the rows of each checkpoint tensor it needs."""
        heads = tuple((h.uri, 0, len(h.raw)) for h in self.headers)
        return Needs(heads, tuple(s.need for s in self.sources), self.stage_cap)

    @property
    def spans(self) -> list[Span]:
        """The file bytes this rank would read alone (no tensor shared with another rank)."""
        return schedule([self.needs]).reads(0)

    def begin(self, model: Model, cuts: Mapping[str, Sequence[int]], sched: Schedule,
              rank: int, extra: Sequence[Span] = ()) -> None:
        """Open the staging buffer (big enough for this rank's reads, ``extra`` and
        every shared chunk) for a load into ``model``, CRC-ing intervals cut at ``cuts``."""
        self._start = _clock.perf()
        self._tensors = named_tensors(model)[0]
        self._shared = sched.names
        spans = [*extra, *sched.reads(rank)[len(self.headers):]]
        row = max((s.need.row_bytes for s in self.sources), default=0)
        stage = max(min(self.stage_cap, max((hi - lo for _, lo, hi in spans), default=0)), row,
                    sched.chunk_bytes, 1)
        self._reader = SpanReader(self.storage, self.spec.shards, cuts, stage)
        self._block: Iterator[tuple[int, np.ndarray]] | None = None
        self._intervals = [Interval(h.uri, 0, len(h.raw), google_crc32c.value(h.raw))
                           for h in self.headers]

    def read_own(self, extra: Sequence[Span] = ()) -> None:
        """Read the rows of unshared tensors into place, and ``extra`` for their CRC only."""
        reader = self._reader
        with torch.no_grad():
            for s in self.sources:
                if s.info.name not in self._shared:
                    self._fill(reader, s, self._tensors)
        for uri, lo, hi in extra:
            for _ in reader.read(uri, lo, hi, len(reader.stage)):
                pass

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The staging buffer's first ``nbytes`` (bytes), where another rank's chunk lands."""
        return torch.from_numpy(self._reader.stage[:nbytes])

    def read_chunk(self, c: Chunk) -> torch.Tensor:
        """Read chunk ``c`` of this rank's own block into the staging buffer (its
        intervals CRC-ed across the whole block); valid until the next read."""
        n = c.need
        if c.rows[0] == c.block[0]:
            self._block = self._reader.read(*n.span(*c.block), c.step * n.row_bytes)
        if self._block is None:
            raise ValueError(f"chunk {c.rows} of {n.name} read before its block's first")
        off, buf = next(self._block)
        if (off, len(buf)) != (n.span(*c.rows)[1], c.nbytes):
            raise ValueError(f"{n.name}: staged bytes at {off} ({len(buf)}), the chunk says"
                             f" {n.span(*c.rows)[1]} ({c.nbytes}): staging smaller than a chunk?")
        if c.rows[1] == c.block[1]:
            for _ in self._block:  # the block's last interval CRC
                pass
            self._block = None
        return torch.from_numpy(buf)

    def place(self, c: Chunk, chunk: torch.Tensor) -> None:
        """Copy what this rank needs of chunk ``c`` (its bytes, on any device) into place."""
        s = self._by_name.get(c.need.name)
        if s is None:
            return
        shape = s.info.shape or (1,)
        rows = chunk.view(s.info.dtype).view((c.rows[1] - c.rows[0], *shape[1:]))
        with torch.no_grad():
            for m in s.moves:
                place(m, c.rows, rows, self._tensors)

    def finish(self) -> tuple[LoadResult, list[Interval]]:
        """Close the files; the load (``bytes``: read from storage) and every interval's CRC."""
        reader = self._reader
        reader.close()
        zero_padding(self.sharding.layout, self._tensors)
        seconds = _clock.perf() - self._start
        result = LoadResult("storage", self.spec.version, reader.bytes, seconds,
                            timings={"read": reader.seconds, "copy": seconds - reader.seconds},
                            storage_bytes=reader.bytes)
        return result, self._intervals + reader.intervals

    def run(self, model: Model, cuts: Mapping[str, Sequence[int]],
            extra: Sequence[Span] = ()) -> tuple[LoadResult, list[Interval]]:
        """This rank's load alone (nothing shared): :attr:`spans` into ``model``'s tensors
        and ``extra`` for their CRC only."""
        self.begin(model, cuts, schedule([self.needs]), 0, extra)
        try:
            self.read_own(extra)
        finally:
            self._reader.close()
        return self.finish()

    def _fill(self, reader: SpanReader, s: _Source, tensors: Mapping[str, torch.Tensor]) -> None:
        """Read ``s``'s rows in chunks of whole rows and place each chunk's moves."""
        need = s.need
        uri, lo, hi = need.span(need.lo, need.hi)
        if hi <= lo:
            return
        step = max(len(reader.stage) // need.row_bytes, 1) * need.row_bytes
        shape = s.info.shape or (1,)
        for off, buf in reader.read(uri, lo, hi, step):
            first = need.lo + (off - lo) // need.row_bytes
            n = len(buf) // need.row_bytes
            chunk = torch.from_numpy(buf).view(s.info.dtype).view((n, *shape[1:]))
            for m in s.moves:
                place(m, (first, first + n), chunk, tensors)


def _source(info: TensorInfo, moves: list[Move]) -> _Source:
    shape = info.shape or (1,)
    lo, hi = min(m.src_box[0][0] for m in moves), max(m.src_box[0][1] for m in moves)
    row_bytes = info.nbytes // shape[0] if shape[0] else 0
    return _Source(info, Need(info.name, info.uri, info.start, row_bytes, lo, hi), tuple(moves))


class SpanReader:
    """Ranged reads into one staging buffer, through the storage seam (local files with
    positional reads), counting bytes and CRC-ing each elementary interval read."""

    def __init__(self, storage: Storage, shards: Sequence[Shard],
                 cuts: Mapping[str, Sequence[int]], stage_bytes: int) -> None:
        self.storage, self.cuts = storage, cuts
        self.shards = {s.uri: s for s in shards}
        self.stage = np.empty(stage_bytes, dtype=np.uint8)
        self.fds: dict[str, int] = {}
        self.intervals: list[Interval] = []
        self.bytes = 0
        self.seconds = 0.0

    def read(self, uri: str, start: int, end: int, step: int) -> Iterator[tuple[int, np.ndarray]]:
        """Bytes ``[start, end)`` in chunks of ``step`` (file offset, staged bytes; each
        valid until the next), CRC-ing the elementary intervals between ``cuts[uri]``."""
        bounds = [start, *(c for c in self.cuts.get(uri, ()) if start < c < end), end]
        crc, b = 0, 1
        for off in range(start, end, step):
            buf = self.stage[:min(step, end - off)]
            t = _clock.perf()
            self._read_into(uri, buf, off)
            self.seconds += _clock.perf() - t
            self.bytes += len(buf)
            pos = off
            while pos < off + len(buf):
                stop = min(bounds[b], off + len(buf))
                # A numpy array, not a memoryview: google_crc32c is several times slower on those.
                crc = google_crc32c.extend(crc, buf[pos - off:stop - off])
                pos = stop
                if pos == bounds[b]:
                    self.intervals.append(Interval(uri, bounds[b - 1], pos, crc))
                    crc, b = 0, b + 1
            yield off, buf

    def _read_into(self, uri: str, dest: np.ndarray, start: int) -> None:
        loc = parse_uri(uri)
        if loc.is_local:
            read_exact(self._fd(uri, loc.path), dest, start, loc.path, self.shards[uri].size)
            return
        got = self.storage.backend(loc).fetch_into(loc, dest.data, start)
        if got != len(dest):
            raise StorageError(f"{uri}: received {got} bytes at {start}, expected {len(dest)}")

    def _fd(self, uri: str, path: str) -> int:
        if uri not in self.fds:
            self.fds[uri] = open_shard(path, self.shards[uri].size)
        return self.fds[uri]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def cut_points(spans: Sequence[Span]) -> dict[str, list[int]]:
    """Every rank's span boundaries, by file: where each rank cuts its interval CRCs, so
    that two ranks' intervals are equal or disjoint."""
    out: dict[str, set[int]] = {}
    for uri, lo, hi in spans:
        out.setdefault(uri, set()).update((lo, hi))
    return {uri: sorted(points) for uri, points in out.items()}


def gaps(shards: Sequence[Shard], spans: Sequence[Span]) -> list[Span]:
    """The bytes of ``shards`` no span covers (header-less tails, tensors nobody
    holds): what one rank reads for their CRC only, so every byte is proven."""
    out = []
    for s in shards:
        at = 0
        for lo, hi in sorted((lo, hi) for uri, lo, hi in spans if uri == s.uri):
            if lo > at:
                out.append((s.uri, at, lo))
            at = max(at, hi)
        if at < s.size:
            out.append((s.uri, at, s.size))
    return out
