"""The storage load of a sharded skeleton, across the worker's ranks: each rank reads
only its own pieces (:mod:`nccl_back.model.ranged`), tensors several ranks need are read
once by the group and handed over, and the ranks prove every file's CRC32C together,
with no whole file on any rank.

Collectives, entered by every rank whatever happened to it (a rank that failed never
leaves the others waiting in a collective it skipped): what each rank needs (so every
rank derives the same :func:`~nccl_back.model.ranged.schedule`, rank 0 also reading
what nobody needs, for its CRC only); one broadcast per shared chunk from the rank that
read it, in the schedule's order (a rank whose read failed still sends, and only then
says so; over NCCL through one device buffer of a chunk's size, over gloo straight from
the staging buffer); then each rank's interval CRCs. Every rank then checks every file
the same way (:func:`~nccl_back.model.crc.check_file`), so a mismatch is the same
:class:`~nccl_back.errors.ChecksumMismatchError` on every rank. Nothing is reported
loaded before that proof passed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.consensus import Group, broadcast_from, gather_ints, rank_and_size, vote_device
from nccl_back.errors import ConsensusError
from nccl_back.model.crc import check_file
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import RangedLoad, Schedule, cut_points, gaps, schedule
from nccl_back.model.ranged_wire import (
    decode_intervals,
    decode_needs,
    encode_intervals,
    encode_needs,
)
from nccl_back.model.sharding import Sharding
from nccl_back.model.skeleton import Model
from nccl_back.model.storage import Storage
from nccl_back.result import LoadResult


class RangedLoader:
    """A :class:`~nccl_back.model.loader.StorageLoader` for one rank of a sharded
    skeleton; ``LoadResult.bytes`` is the bytes this rank read from storage."""

    def __init__(self, sharding: Sharding, group: Group) -> None:
        self.sharding, self.group = sharding, group

    def __call__(self, model: Model, spec: ModelSpec, settings: Settings, /) -> LoadResult:
        start = _clock.perf()
        rank = rank_and_size(self.group)[0]
        load = _attempt(lambda: RangedLoad(spec, self.sharding, Storage(settings)))
        names = [e.name for e in self.sharding.checkpoint.entries]  # sorted, alike on every rank
        sched = schedule(self._everyone(
            load, lambda ok: encode_needs(ok.needs, spec, names),
            lambda ints: decode_needs(ints, spec, names), "needs"))
        everyone = sched.every_read
        extra = gaps(spec.shards, everyone) if rank == 0 else []
        ran = _attempt(lambda: load.value.begin(model, cut_points(everyone), sched, rank, extra))
        if ran.error is None:
            ran = _attempt(lambda: load.value.read_own(extra))
        t = _clock.perf()
        ran = self._share(load.value, sched, rank, ran)
        shared = _clock.perf() - t
        if ran.error is None:
            ran = _attempt(load.value.finish)
        intervals = self._everyone(ran, lambda ok: encode_intervals(ok[1], spec),
                                   lambda ints: decode_intervals(ints, spec), "interval CRCs")
        t = _clock.perf()
        for shard in spec.shards:
            check_file(shard.uri, shard.size, shard.crc32c,
                       [(r, iv) for r, ivs in enumerate(intervals) for iv in ivs if iv.uri == shard.uri])
        result: LoadResult = ran.value[0]
        timings = {**result.timings, "shared": shared, "verify": _clock.perf() - t}
        return LoadResult("storage", spec.version, result.bytes, _clock.perf() - start,
                          timings=timings, storage_bytes=result.bytes)

    def _share(self, load: RangedLoad, sched: Schedule, rank: int, ran: _Outcome) -> _Outcome:
        """Every shared chunk from its reader to every rank, placed where this rank needs
        it. Every rank enters every broadcast: after a failure it sends or receives
        bytes it then ignores, and its error waits for the interval exchange."""
        if not sched.shared:
            return ran
        device = vote_device(self.group)
        cap = sched.chunk_bytes
        staged = torch.empty(cap, dtype=torch.uint8, device=device) if device.type != "cpu" else None
        for c in sched.chunks():
            buf: torch.Tensor | None = None
            if ran.error is None:
                got = _attempt(partial(load.read_chunk, c) if c.owner == rank
                               else partial(load.buffer, c.nbytes))
                ran, buf = (ran, got.value) if got.error is None else (got, None)
            if staged is not None:  # an NCCL group: the chunk travels in device memory
                wire = staged[:c.nbytes]
                if buf is not None and c.owner == rank:
                    wire.copy_(buf)
            else:
                wire = buf if buf is not None else torch.empty(c.nbytes, dtype=torch.uint8)
            broadcast_from(wire, c.owner, self.group)
            if ran.error is None:
                ran = _attempt(partial(load.place, c, wire))
        return ran

    def _everyone(self, mine: _Outcome, encode: Callable[[Any], list[int]],
                  decode: Callable[[list[int]], Any], what: str) -> list[Any]:
        """Every rank's part of its outcome (``encode``-d as integers on the sending rank,
        ``decode``-d and checked on this one); raises (after the collective) this rank's
        error, or a :class:`ConsensusError` naming a rank that failed or sent integers
        that do not decode."""
        sent = _attempt(lambda: encode(mine.value)) if mine.error is None else mine
        got = gather_ints(None if sent.error else sent.value, self.group)
        if sent.error is not None:
            raise sent.error
        failed = [r for r, g in enumerate(got) if g is None]
        if failed:
            raise ConsensusError(f"rank {failed[0]} of this worker failed its ranged storage"
                                 " load; every rank stops (see that rank's error)", failed_rank=failed[0])
        out = []
        for r, ints in enumerate(got):
            try:
                out.append(decode(ints or []))
            except ValueError as e:
                raise ConsensusError(f"rank {r} of this worker sent {what} that do not decode:"
                                     f" {e}", failed_rank=r) from e
        return out


class _Outcome:
    """A value, or the error that stood in its way."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


def _attempt(fn: Callable[[], Any]) -> _Outcome:
    """``fn()``'s value, or its error: held until every rank has entered the collective."""
    try:
        return _Outcome(fn())
    except Exception as e:
        return _Outcome(error=e)
