"""The ranged storage load of a sharded skeleton: each rank reads only the byte spans
of the checkpoint tensors its pieces come from, through one bounded staging buffer.

Per checkpoint tensor the rank's layout needs, the span is the rows (dim 0) its pieces
cover: a column-parallel slice is a contiguous sub-span of a row-major tensor, a piece
along another dim needs every row, so the tensor's whole span. Spans are read in
chunks of whole rows into the staging buffer (reused; :data:`STAGE_BYTES`, or one row
if a row is larger) and each chunk's part of every move of
:func:`~.reshard_plan.plan` (this layout from a whole-checkpoint holder) is copied
straight into the rank's tensors (:func:`~.reshard_plan.place`).

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
from nccl_back.errors import CheckpointFormatError, ShardNotFoundError, StorageError
from nccl_back.model.checkpoint import TensorInfo, locate, model_headers
from nccl_back.model.crc import Interval
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import read_exact
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
class _Source:
    """One checkpoint tensor this rank reads rows ``rows`` of, and the moves fed by them."""

    info: TensorInfo
    rows: tuple[int, int]
    row_bytes: int
    moves: tuple[Move, ...]

    @property
    def span(self) -> Span:
        return (self.info.uri, self.info.start + self.rows[0] * self.row_bytes,
                self.info.start + self.rows[1] * self.row_bytes)


class RangedLoad:
    """One rank's ranged load: what it will read (:attr:`spans`, known from its layout
    and the headers before any tensor byte is read), then :meth:`run`."""

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

    @property
    def spans(self) -> list[Span]:
        """The file bytes this rank reads into its tensors, and the headers it parsed
        (their CRCs come from the bytes it read them as, so ranks must agree on them)."""
        heads = [(h.uri, 0, len(h.raw)) for h in self.headers]
        return heads + [s.span for s in self.sources if s.span[2] > s.span[1]]

    def run(self, model: Model, cuts: Mapping[str, Sequence[int]],
            extra: Sequence[Span] = ()) -> tuple[LoadResult, list[Interval]]:
        """Read this rank's spans into ``model``'s tensors, and ``extra`` for their CRC
        only; return the load (``bytes``: bytes read from storage) and the CRC32C of
        every elementary interval read, cut at ``cuts`` (uri -> offsets)."""
        start = _clock.perf()
        tensors = named_tensors(model)[0]
        reader = _Reader(self.storage, self.spec.shards, cuts, self._stage_bytes(extra))
        try:
            intervals = [Interval(h.uri, 0, len(h.raw), google_crc32c.value(h.raw))
                         for h in self.headers]
            with torch.no_grad():
                for s in self.sources:
                    self._fill(reader, s, tensors)
            for uri, lo, hi in extra:
                for _ in reader.read(uri, lo, hi, len(reader.stage)):
                    pass
        finally:
            reader.close()
        zero_padding(self.sharding.layout, tensors)
        seconds = _clock.perf() - start
        result = LoadResult("storage", self.spec.version, reader.bytes, seconds,
                            timings={"read": reader.seconds, "copy": seconds - reader.seconds})
        return result, intervals + reader.intervals

    def _stage_bytes(self, extra: Sequence[Span]) -> int:
        longest = max([hi - lo for _, lo, hi in [*extra, *(s.span for s in self.sources)]], default=0)
        row = max((s.row_bytes for s in self.sources), default=0)
        return max(min(self.stage_cap, longest), row, 1)

    def _fill(self, reader: _Reader, s: _Source, tensors: Mapping[str, torch.Tensor]) -> None:
        """Read ``s``'s rows in chunks of whole rows and place each chunk's moves."""
        uri, lo, hi = s.span
        if hi <= lo:
            return
        step = max(len(reader.stage) // s.row_bytes, 1) * s.row_bytes
        shape = s.info.shape or (1,)
        for off, buf in reader.read(uri, lo, hi, step):
            first = s.rows[0] + (off - lo) // s.row_bytes
            n = len(buf) // s.row_bytes
            chunk = torch.from_numpy(buf).view(s.info.dtype).view((n, *shape[1:]))
            for m in s.moves:
                place(m, (first, first + n), chunk, tensors)


def _source(info: TensorInfo, moves: list[Move]) -> _Source:
    shape = info.shape or (1,)
    rows = (min(m.src_box[0][0] for m in moves), max(m.src_box[0][1] for m in moves))
    return _Source(info, rows, info.nbytes // shape[0] if shape[0] else 0, tuple(moves))


class _Reader:
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
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as e:
                raise ShardNotFoundError(f"shard {path!r} does not exist") from e
            self.fds[uri] = fd
            if (size := os.fstat(fd).st_size) != self.shards[uri].size:
                raise CheckpointFormatError(f"{path}: {size} bytes, its identity says"
                                            f" {self.shards[uri].size} (changed since fingerprinted?)")
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
