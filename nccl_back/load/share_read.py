"""A cooperative download's shares, one member's read of its share into its tensors,
and the proof that the members' shares together are the checkpoint.

:func:`shares` splits the checkpoint's bytes along the transfer plan's parts
(:func:`nccl_back.transport.parts.parts`): member ``i`` reads the bytes of the tensors
in part ``i``, so what it read is exactly what it then sends as part ``i``, and the
shares are as balanced as the parts. Every byte of every file is read by exactly one
member, so the members prove each file's CRC32C together without any of them reading
it whole: bytes no step carries (headers, padding, tensors the model does not load) go
to the member whose span ends where they start, keeping each member's reads few and
contiguous.

A member reads its spans as pieces, through ``storage_workers`` readers at once sharing
one bounded staging budget (:class:`~nccl_back.model.ranged.SpanReader`), as a whole
download's requests run: the bytes its part carries are copied straight into the
model's tensors, the rest only CRC-ed. It returns the CRC32C of every interval it read,
cut at every member's span boundaries so that two members' intervals are equal or
disjoint, plus one for each header it parsed: members derive their shares from the
headers they parsed, so a member that parsed other bytes than the header's reader read
fails the proof instead of reading the wrong spans unnoticed.

:func:`prove` combines every member's intervals into each file's CRC32C
(:func:`~nccl_back.model.crc.check_file`) and compares it with the one the version's
identity lists. When a file fails, :func:`blame` reads it again whole, cut at the same
points, and names the members whose intervals differ from storage's bytes; nobody, when
the file itself no longer matches its identity (changed at rest since it was listed).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import google_crc32c
import numpy as np
import torch

from nccl_back import _clock
from nccl_back.errors import CheckpointFormatError, ChecksumMismatchError
from nccl_back.model.checkpoint import ShardHeader, locate
from nccl_back.model.crc import Interval, check_file, crc32c_combine, file_crc
from nccl_back.model.identity import ModelSpec, Shard
from nccl_back.model.ranged import STAGE_BYTES, Span, SpanReader, cut_points
from nccl_back.model.storage import Storage
from nccl_back.transport.parts import parts

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step

#: How :func:`prove`'s errors name the readers of a file.
WHO = "members"
#: Waves of pieces a share's readers take at least. ``k`` readers at once share one
#: link, so a piece lands only after about ``k`` pieces' time: pieces of at most
#: ``1/(WAVES * k)`` of the share let its first steps go out within a quarter of its
#: read, not at its end (the elected worker's pull gives up on a part with no step
#: within the stall bound, and a share may take longer than that to read).
WAVES = 4
#: The smallest piece, one ranged request (a share of a few MiB need not cost more).
MIN_PIECE = 256 << 10


@dataclass(frozen=True)
class ShareRead:
    """What one member read: ``bytes`` from storage in ``seconds``, and the CRC32C of
    every interval it read (and of each header it parsed)."""

    member: int
    bytes: int
    seconds: float
    intervals: tuple[Interval, ...]


@dataclass(frozen=True)
class Blame:
    """Why a file failed :func:`prove`: the members whose intervals differ from the
    bytes storage serves, or ``changed_at_rest`` (the file differs from its identity)."""

    members: tuple[int, ...]
    changed_at_rest: bool


def shares(steps: Sequence[Step], where: Mapping[str, Span], sizes: Mapping[str, int],
           n: int) -> list[list[Span]]:
    """Each of ``n`` members' spans, in file order (files by name), adjacent ones merged.

    ``steps``: the plan over the tensors as the checkpoint names them; ``where``: each
    such tensor's bytes in its file, ``(uri, start, end)``; ``sizes``: every file of the
    checkpoint (each must be read by someone). :class:`CheckpointFormatError` if a
    step's tensor has no place, or its bytes are not its place's size, or two tensors
    overlap or leave their file. Pure: no I/O.
    """
    owner: dict[str, list[tuple[int, int, int]]] = {uri: [] for uri in sizes}
    for i, part in enumerate(parts(list(steps), n)):
        for k in part:
            for slot in steps[k].slots:
                uri, start, end = _place(slot.name, where, sizes)
                if steps[k].direct:  # one chunk of its tensor
                    lo = start + slot.offset
                    owner[uri].append((lo, lo + slot.nbytes, i))
                elif slot.nbytes != end - start:
                    raise CheckpointFormatError(
                        f"{slot.name}: {slot.nbytes} bytes in the plan, {end - start} in {uri}")
                else:
                    owner[uri].append((start, end, i))
    out: list[list[Span]] = [[] for _ in range(n)]
    for uri in sorted(owner):
        for lo, hi, i in _tiles(uri, sizes[uri], sorted(owner[uri])):
            out[i].append((uri, lo, hi))
    return [_merged(spans) for spans in out]


def _place(name: str, where: Mapping[str, Span], sizes: Mapping[str, int]) -> Span:
    if name not in where:
        raise CheckpointFormatError(f"{name}: in the plan but not in the checkpoint")
    uri, start, end = where[name]
    if uri not in sizes or not 0 <= start <= end <= sizes[uri]:
        raise CheckpointFormatError(f"{name}: bytes [{start}, {end}) outside {uri}")
    return uri, start, end


def _tiles(uri: str, size: int, owned: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``owned`` (sorted) extended to tile ``[0, size)``: each gap goes to the owner of
    the bytes before it (the first owner for a leading gap; member 0 for a file no step
    touches)."""
    tiles: list[tuple[int, int, int]] = []
    at = 0
    for lo, hi, i in owned:
        if lo < at:
            raise CheckpointFormatError(f"{uri}: tensors overlap at byte {lo}")
        if lo > at:
            tiles.append((at, lo, tiles[-1][2] if tiles else i))
        if hi > lo:
            tiles.append((lo, hi, i))
        at = max(at, hi)
    if at < size:
        tiles.append((at, size, tiles[-1][2] if tiles else 0))
    return tiles


def _merged(spans: Sequence[Span]) -> list[Span]:
    """``spans`` (in file order) with adjacent ones joined."""
    out: list[Span] = []
    for uri, lo, hi in spans:
        if out and out[-1][0] == uri and out[-1][2] == lo:
            out[-1] = (uri, out[-1][1], hi)
        else:
            out.append((uri, lo, hi))
    return out


def places(headers: Sequence[ShardHeader]) -> dict[str, Span]:
    """Each tensor's bytes in its file, ``(uri, start, end)``, by the name the model gives it."""
    return {name: (info.uri, info.start, info.end) for name, (_, info) in locate(headers).items()}


def read_share(storage: Storage, spec: ModelSpec, headers: Sequence[ShardHeader],
               steps: Sequence[Step], n: int, i: int, tensors: Mapping[str, torch.Tensor],
               stage_bytes: int = STAGE_BYTES,
               on_step: Callable[[int], None] | None = None) -> ShareRead:
    """Member ``i`` of ``n``: its share of ``spec``'s files into ``tensors`` (the
    model's, named as ``headers`` name them; those of other parts are left untouched).
    ``on_step(k)``: step ``k`` of part ``i`` has all its bytes in place (called from the
    readers' threads as they land, so the part goes out while the share is read: a
    share longer to read than the receiver's stall bound would otherwise look stalled)."""
    where = places(headers)
    every = shares(steps, where, {s.uri: s.size for s in spec.shards}, n)
    heads = [(h.uri, 0, len(h.raw)) for h in headers]
    cuts = cut_points([*heads, *(span for member in every for span in member)])
    landed = None if on_step is None else _Landed(steps, parts(list(steps), n)[i], where, tensors, on_step)
    return _read(storage, spec, headers, where, every[i], cuts, tensors, i, stage_bytes, landed)


def read_spans(storage: Storage, spec: ModelSpec, headers: Sequence[ShardHeader],
               spans: Sequence[Span], cuts: Mapping[str, Sequence[int]],
               tensors: Mapping[str, torch.Tensor], *, member: int) -> ShareRead:
    """``spans`` into the tensors they hold bytes of, every interval between ``cuts``
    CRC-ed: another member's spans read again after :func:`blame`."""
    return _read(storage, spec, headers, places(headers), spans, cuts, tensors, member, STAGE_BYTES)


def read_steps(storage: Storage, spec: ModelSpec, headers: Sequence[ShardHeader],
               steps: Sequence[Step], todo: Sequence[int], tensors: Mapping[str, torch.Tensor], *,
               member: int, on_step: Callable[[int], None] | None = None,
               stop: threading.Event | None = None) -> ShareRead:
    """The tensor bytes steps ``todo`` carry, into ``tensors``: a failed member's part,
    or a sub-part of it spread to this member (the elected worker proves every file
    from the bytes it then holds, and reads the bytes between tensors itself).
    ``on_step`` as for :func:`read_share`; ``stop`` set: no further piece is read (the
    steps not yet told are not)."""
    where = places(headers)
    spans: list[Span] = []
    for k in todo:
        for slot in steps[k].slots:
            uri, start, end = where[slot.name]
            lo = start + slot.offset if steps[k].direct else start
            spans.append((uri, lo, lo + slot.nbytes if steps[k].direct else end))
    merged = _merged(sorted(spans))
    landed = None if on_step is None else _Landed(steps, todo, where, tensors, on_step)
    return _read(storage, spec, headers, where, merged, cut_points(merged), tensors, member,
                 STAGE_BYTES, landed, stop)


def _read(storage: Storage, spec: ModelSpec, headers: Sequence[ShardHeader],
          where: Mapping[str, Span], spans: Sequence[Span], cuts: Mapping[str, Sequence[int]],
          tensors: Mapping[str, torch.Tensor], member: int, stage_bytes: int,
          landed: _Landed | None = None, stop: threading.Event | None = None) -> ShareRead:
    """``spans`` read as pieces by ``storage_workers`` readers at once, as a whole
    download's ranged requests are (one request at a time would leave a member's share
    at one connection's speed), sharing the ``stage_bytes`` staging budget; ``landed``
    told of each piece placed. ``stop`` set: each reader ends before its next piece."""
    start = _clock.perf()
    targets = _Targets(spans, tensors, where)
    k = max(1, storage.settings.storage_workers)
    total = sum(hi - lo for _, lo, hi in spans)
    step = max(1, min(stage_bytes // k, max(MIN_PIECE, total // (WAVES * k)),
                      max((hi - lo for _, lo, hi in spans), default=1)))
    pieces = [(uri, off, min(off + step, hi)) for uri, lo, hi in spans for off in range(lo, hi, step)]
    readers = [SpanReader(storage, spec.shards, _with(cuts, pieces), step)
               for _ in range(max(1, min(k, len(pieces))))]
    todo, lock, failed = iter(pieces), threading.Lock(), threading.Event()

    def run(reader: SpanReader) -> None:
        with torch.no_grad():  # thread-local: each reader's thread sets it
            while not failed.is_set() and (stop is None or not stop.is_set()):
                with lock:
                    piece = next(todo, None)
                if piece is None:
                    return
                try:
                    for off, buf in reader.read(*piece, step):
                        targets.place(piece[0], off, buf)
                        if landed is not None:
                            landed.placed(piece[0], off, off + len(buf))
                except BaseException:
                    failed.set()  # the others stop at their next piece
                    raise

    try:
        with ThreadPoolExecutor(len(readers), thread_name_prefix="nccl_back-share-read") as pool:
            for f in [pool.submit(run, r) for r in readers]:
                f.result()
        with torch.no_grad():
            targets.unstage()
    finally:
        for r in readers:
            r.close()
    heads = [Interval(h.uri, 0, len(h.raw), google_crc32c.value(h.raw)) for h in headers]
    read = _joined([iv for r in readers for iv in r.intervals], cut_points(spans), cuts)
    if landed is not None and (stop is None or not stop.is_set()):
        landed.rest()
    return ShareRead(member, sum(r.bytes for r in readers), _clock.perf() - start,
                     tuple(heads + read))


def _with(cuts: Mapping[str, Sequence[int]], pieces: Sequence[Span]) -> dict[str, list[int]]:
    """``cuts`` and every piece's bounds: each piece's intervals end within it, whichever
    reader reads it."""
    out = {uri: set(points) for uri, points in cuts.items()}
    for uri, points in cut_points(pieces).items():
        out.setdefault(uri, set()).update(points)
    return {uri: sorted(points) for uri, points in out.items()}


def _joined(intervals: Sequence[Interval], *bounds: Mapping[str, Sequence[int]]) -> list[Interval]:
    """``intervals`` (cut at the pieces' bounds too) joined back at every point not in
    ``bounds``: the intervals one reader would have CRC-ed, in file order."""
    keep = {(uri, p) for b in bounds for uri, points in b.items() for p in points}
    out: list[Interval] = []
    for iv in sorted(intervals, key=lambda x: (x.uri, x.start)):
        last = out[-1] if out else None
        if last is not None and last.uri == iv.uri and last.end == iv.start and (iv.uri, iv.start) not in keep:
            out[-1] = Interval(iv.uri, last.start, iv.end, crc32c_combine(last.crc, iv.crc, iv.end - iv.start))
        else:
            out.append(iv)
    return out


def prove(spec: ModelSpec, reads: Sequence[ShareRead]) -> None:
    """:class:`~nccl_back.errors.ChecksumMismatchError` naming the first file whose
    members' intervals do not combine into the CRC32C its identity lists (or leave
    bytes unread, or disagree on one interval)."""
    for shard in spec.shards:
        _prove(shard, reads)


def failing(spec: ModelSpec, reads: Sequence[ShareRead]) -> list[str]:
    """The files that do not prove (:func:`prove`)."""
    out = []
    for shard in spec.shards:
        try:
            _prove(shard, reads)
        except ChecksumMismatchError:
            out.append(shard.uri)
    return out


def _prove(shard: Shard, reads: Sequence[ShareRead]) -> None:
    check_file(shard.uri, shard.size, shard.crc32c,
               [(r.member, iv) for r in reads for iv in r.intervals if iv.uri == shard.uri], WHO)


def blame(storage: Storage, spec: ModelSpec, uri: str, reads: Sequence[ShareRead]) -> Blame:
    """Read file ``uri`` whole, CRC-ed between every member's cuts, and compare each
    member's intervals of it with those of storage's bytes."""
    shard = next(s for s in spec.shards if s.uri == uri)
    mine = [(r.member, iv) for r in reads for iv in r.intervals if iv.uri == uri]
    reader = SpanReader(storage, [shard], cut_points([(uri, iv.start, iv.end) for _, iv in mine]),
                        max(1, min(STAGE_BYTES, shard.size)))
    try:
        for _ in reader.read(uri, 0, shard.size, len(reader.stage)):
            pass
    finally:
        reader.close()
    if f"{file_crc(uri, shard.size, [(0, iv) for iv in reader.intervals], WHO):08x}" != shard.crc32c:
        return Blame((), changed_at_rest=True)
    served = {(iv.start, iv.end): iv.crc for iv in reader.intervals}
    return Blame(tuple(sorted({m for m, iv in mine if served.get((iv.start, iv.end)) != iv.crc})),
                 changed_at_rest=False)


class _Landed:
    """Which steps of a part have every byte in place, as a share read places them."""

    def __init__(self, steps: Sequence[Step], part: Sequence[int], where: Mapping[str, Span],
                 tensors: Mapping[str, torch.Tensor], on_step: Callable[[int], None]) -> None:
        self.on_step, self.lock = on_step, threading.Lock()
        self.left: dict[int, int] = {}
        self.told: set[int] = set()
        ranges: dict[str, list[tuple[int, int, int]]] = {}
        self.late: set[int] = set()  # a tensor staged until the read's end (unstage)
        for k in part:
            self.left[k] = 0
            for slot in steps[k].slots:
                uri, start, _ = where[slot.name]
                lo = slot.offset if steps[k].direct else 0
                ranges.setdefault(uri, []).append((start + lo, start + lo + slot.nbytes, k))
                self.left[k] += slot.nbytes
                if not tensors[slot.name].is_contiguous():
                    self.late.add(k)
        self.ranges = {uri: sorted(rs) for uri, rs in ranges.items()}
        self.starts = {uri: [r[0] for r in rs] for uri, rs in self.ranges.items()}

    def placed(self, uri: str, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of ``uri`` are in place (each byte once)."""
        rs, ready = self.ranges.get(uri, []), []
        with self.lock:
            for start, end, k in rs[max(bisect.bisect_right(self.starts.get(uri, []), lo) - 1, 0):]:
                if start >= hi:
                    break
                got = min(end, hi) - max(start, lo)
                if got > 0:
                    self.left[k] -= got
                    if self.left[k] == 0 and k not in self.late:
                        self.told.add(k)
                        ready.append(k)
        for k in ready:
            self.on_step(k)

    def rest(self) -> None:
        """The read ended: every step not told yet (staged tensors, empty steps)."""
        for k in sorted(self.left):
            if k not in self.told:
                self.on_step(k)


class _Target:
    """A tensor's bytes ``[start, end)`` of its file, and where they go: the tensor's
    own memory, or a staging copy for a tensor whose memory is not one run of bytes
    (the reader's buffers cut anywhere, mid-element too, so they cannot be scattered
    into its elements as they come, as a chunk of the plan is)."""

    def __init__(self, name: str, t: torch.Tensor, start: int, end: int) -> None:
        if t.numel() * t.element_size() != end - start:
            raise CheckpointFormatError(f"{name}: {t.numel() * t.element_size()} bytes in the"
                                        f" model, {end - start} in its checkpoint file")
        self.tensor, self.start, self.end = t, start, end
        self.staged = None if t.is_contiguous() else torch.empty(end - start, dtype=torch.uint8,
                                                                 device=t.device)
        self.bytes = self.staged if self.staged is not None else t.detach().reshape(-1).view(torch.uint8)


class _Targets:
    """The tensors with bytes in some spans, by file, sorted by their start."""

    def __init__(self, spans: Sequence[Span], tensors: Mapping[str, torch.Tensor],
                 where: Mapping[str, Span]) -> None:
        self.by_uri: dict[str, list[_Target]] = {}
        read: dict[str, list[tuple[int, int]]] = {}
        for uri, lo, hi in spans:
            read.setdefault(uri, []).append((lo, hi))
        for runs in read.values():
            runs.sort()
        for name, t in tensors.items():
            if name not in where or t.numel() == 0:
                continue
            uri, start, end = where[name]
            if _overlaps(read.get(uri, []), start, end):
                self.by_uri.setdefault(uri, []).append(_Target(name, t, start, end))
        for targets in self.by_uri.values():
            targets.sort(key=lambda x: x.start)
        self.starts = {uri: [x.start for x in xs] for uri, xs in self.by_uri.items()}

    def place(self, uri: str, off: int, buf: np.ndarray) -> None:
        """Copy the staged bytes at offset ``off`` of ``uri`` into every tensor they overlap."""
        targets = self.by_uri.get(uri, [])
        end = off + len(buf)
        for x in targets[max(bisect.bisect_right(self.starts.get(uri, []), off) - 1, 0):]:
            if x.start >= end:
                break
            lo, hi = max(x.start, off), min(x.end, end)
            if lo < hi:
                x.bytes[lo - x.start:hi - x.start].copy_(torch.from_numpy(buf[lo - off:hi - off]))

    def unstage(self) -> None:
        """Copy the staged bytes of tensors that are not one run of memory into them."""
        for xs in self.by_uri.values():
            for x in xs:
                if x.staged is not None:
                    x.tensor.copy_(x.staged.view(x.tensor.dtype).view(x.tensor.shape))


def _overlaps(runs: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    """Whether any of ``runs`` (sorted, disjoint) overlaps ``[start, end)``."""
    k = bisect.bisect_right(runs, (end, -1)) - 1  # the last run starting before ``end``
    return k >= 0 and runs[k][1] > start
