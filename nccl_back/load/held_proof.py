"""The elected worker's proof of a cooperative download, from the bytes it holds.

Once every member's part has landed, the elected worker proves each file against the
CRC32C storage lists trusting no member's report: the bytes of every tensor it holds
are CRC-ed from its own memory, and the few bytes no tensor holds (headers, padding,
tensors the model does not load) it reads from storage itself. A member's CRCs could
otherwise be chosen to cancel bytes it altered (CRC32C is linear). The intervals are
cut at every member's span boundaries and every tensor's, so a file that fails names,
through :func:`~.share_read.blame`, the members whose part of it differs.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import google_crc32c
import torch

from nccl_back import _clock
from nccl_back.load.share_read import ShareRead, places, shares
from nccl_back.model.checkpoint import ShardHeader
from nccl_back.model.crc import Interval
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import STAGE_BYTES, Span, SpanReader, cut_points, gaps
from nccl_back.model.storage import Storage

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step


def held_reads(storage: Storage, spec: ModelSpec, headers: Sequence[ShardHeader],
               steps: Sequence[Step], n: int, tensors: Mapping[str, torch.Tensor],
               stage_bytes: int = STAGE_BYTES) -> list[ShareRead]:
    """One :class:`ShareRead` per member ``i`` of ``n``: the CRC32C of the bytes of its
    share that ``tensors`` (the elected worker's, every part landed) hold, from memory;
    member 0's also holds the intervals no tensor holds, read from storage (its
    ``bytes``). :func:`~.share_read.prove` then checks every file."""
    start = _clock.perf()
    where = places(headers)
    every = shares(steps, where, {s.uri: s.size for s in spec.shards}, n)
    held = {name: where[name] for name, t in tensors.items() if name in where and t.numel()}
    cuts = cut_points([*(span for member in every for span in member), *held.values()])
    owner = _Owners(every)
    found: list[list[Interval]] = [[] for _ in range(n)]
    for name, (uri, lo, hi) in held.items():
        for iv in _memory_intervals(tensors[name], uri, lo, hi, cuts.get(uri, ()), stage_bytes):
            found[owner.of(uri, iv.start)].append(iv)
    rest = gaps(spec.shards, list(held.values()))
    stage = max(1, min(stage_bytes, max((b - a for _, a, b in rest), default=1)))
    reader = SpanReader(storage, spec.shards, cuts, stage)
    try:
        for uri, lo, hi in rest:
            for _ in reader.read(uri, lo, hi, stage):
                pass
    finally:
        reader.close()
    found[0].extend(reader.intervals)
    seconds = _clock.perf() - start
    return [ShareRead(i, reader.bytes if i == 0 else 0, seconds if i == 0 else 0.0, tuple(ivs))
            for i, ivs in enumerate(found)]


def _memory_intervals(t: torch.Tensor, uri: str, lo: int, hi: int, cuts: Sequence[int],
                      stage_bytes: int) -> list[Interval]:
    """CRC32C of the tensor's bytes (file bytes ``[lo, hi)`` of ``uri``) between ``cuts``,
    copied to the host in pieces of at most ``stage_bytes`` (a GPU tensor's too)."""
    raw = t.detach()
    raw = (raw if raw.is_contiguous() else raw.contiguous()).reshape(-1).view(torch.uint8)
    bounds = [lo, *(c for c in cuts if lo < c < hi), hi]
    out = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        crc = 0
        for off in range(a, b, stage_bytes):
            piece = raw[off - lo:min(b, off + stage_bytes) - lo].cpu().numpy()
            crc = google_crc32c.extend(crc, piece)
        out.append(Interval(uri, a, b, crc))
    return out


class _Owners:
    """Which member's share holds a byte of a file (shares tile every file)."""

    def __init__(self, every: Sequence[Sequence[Span]]) -> None:
        runs: dict[str, list[tuple[int, int]]] = {}
        for i, spans in enumerate(every):
            for uri, lo, _ in spans:
                runs.setdefault(uri, []).append((lo, i))
        self.runs = {uri: sorted(rs) for uri, rs in runs.items()}

    def of(self, uri: str, at: int) -> int:
        rs = self.runs[uri]
        return rs[bisect.bisect_right(rs, (at, 1 << 30)) - 1][1]
