"""What the ranks of a ranged storage load tell each other, as plain integers.

A rank's :class:`~nccl_back.model.ranged.Needs` and its interval CRCs travel as one
list of non-negative integers each (:func:`nccl_back.coord.consensus.gather_ints`), not
as pickles: bytes from another process can then only ever be integers, and these
decoders check every one against what this rank knows itself (the spec's shards and
their sizes, the checkpoint's tensor names) before anything uses it. Files and tensors
are named by their index in ``spec.shards`` and in the checkpoint's sorted names, which
every rank of the load holds alike.

Layouts (every field a non-negative integer):

* needs: ``stage_bytes, H, (shard, start, end) * H, S, (name, shard, start, row_bytes,
  lo, hi) * S``;
* intervals: ``(shard, start, end, crc) * n``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from nccl_back.model.crc import Interval
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import Need, Needs, Span

#: Bound on any byte count or offset read back (8 EiB would not fit a signed int64).
_MAX = 1 << 62


class _Reader:
    """The integers of one message, read in order, each checked as it is taken."""

    def __init__(self, values: Sequence[int], spec: ModelSpec) -> None:
        self._values: Iterator[int] = iter(values)
        self._left = len(values)
        self.spec = spec

    def take(self, what: str, below: int = _MAX) -> int:
        if self._left <= 0:
            raise ValueError(f"ends before its {what}")
        self._left -= 1
        v = next(self._values)
        if not 0 <= v < below:
            raise ValueError(f"{what} {v} outside [0, {below})")
        return v

    def count(self, what: str, width: int) -> int:
        """A count of ``width``-integer records that the rest of the message can hold."""
        return self.take(what, self._left // width + 1)

    def at(self) -> tuple[str, int, int]:
        """A file (by index) and an offset within it: ``(uri, offset, file size)``."""
        shard = self.spec.shards[self.take("file index", len(self.spec.shards))]
        return shard.uri, self.take("offset", shard.size + 1), shard.size

    def span(self) -> Span:
        uri, start, size = self.at()
        end = self.take("span end", size + 1)
        if end < start:
            raise ValueError(f"span [{start}, {end}) of {uri} runs backwards")
        return uri, start, end

    def done(self) -> None:
        if self._left:
            raise ValueError(f"{self._left} integers past its end")


def encode_needs(needs: Needs, spec: ModelSpec, names: Sequence[str]) -> list[int]:
    """``needs`` as integers (``names``: the checkpoint's tensor names, sorted)."""
    shard = {s.uri: i for i, s in enumerate(spec.shards)}
    name = {n: i for i, n in enumerate(names)}
    out = [needs.stage_bytes, len(needs.heads)]
    for uri, start, end in needs.heads:
        out += [shard[uri], start, end]
    out.append(len(needs.sources))
    for n in needs.sources:
        out += [name[n.name], shard[n.uri], n.start, n.row_bytes, n.lo, n.hi]
    return out


def decode_needs(values: Sequence[int], spec: ModelSpec, names: Sequence[str]) -> Needs:
    """The :class:`Needs` ``values`` encode; :class:`ValueError` naming what is wrong."""
    r = _Reader(values, spec)
    stage = r.take("staging size")
    heads: list[Span] = [r.span() for _ in range(r.count("header count", 3))]
    sources: list[Need] = []
    for _ in range(r.count("tensor count", 6)):
        name = names[r.take("tensor index", len(names))]
        uri, start, size = r.at()
        row_bytes, lo, hi = r.take("row size"), r.take("first row"), r.take("end row")
        if lo > hi or start + hi * row_bytes > size:
            raise ValueError(f"rows [{lo}, {hi}) of {name} ({row_bytes} B each from byte"
                             f" {start}) outside {uri} ({size} B)")
        sources.append(Need(name, uri, start, row_bytes, lo, hi))
    r.done()
    return Needs(tuple(heads), tuple(sources), stage)


def encode_intervals(intervals: Sequence[Interval], spec: ModelSpec) -> list[int]:
    """``intervals`` as integers."""
    shard = {s.uri: i for i, s in enumerate(spec.shards)}
    return [v for iv in intervals for v in (shard[iv.uri], iv.start, iv.end, iv.crc)]


def decode_intervals(values: Sequence[int], spec: ModelSpec) -> list[Interval]:
    """The intervals ``values`` encode; :class:`ValueError` naming what is wrong."""
    if len(values) % 4:
        raise ValueError(f"{len(values)} integers: not whole (file, start, end, crc) records")
    r = _Reader(values, spec)
    out = []
    for _ in range(len(values) // 4):
        uri, start, end = r.span()
        out.append(Interval(uri, start, end, r.take("CRC32C", 1 << 32)))
    return out
