"""The storage load of a sharded skeleton, across the worker's ranks: each rank reads
only its own pieces (:mod:`nccl_back.model.ranged`), and the ranks prove every file's
CRC32C together, with no whole file on any rank.

Two collectives, entered by every rank whatever happened to it (so a rank that failed
never leaves the others waiting in a collective it skipped): the spans each rank will
read (so every rank cuts its interval CRCs at every rank's boundaries, and rank 0 also
reads what nobody needs, for its CRC only), then each rank's interval CRCs. Every rank
then checks every file the same way (:func:`~nccl_back.model.crc.check_file`): any
mismatch is the same :class:`~nccl_back.errors.ChecksumMismatchError`, naming the
file, on every rank, as a corrupted whole-file load raises on its rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.consensus import Group, exchange, rank_and_size
from nccl_back.errors import ConsensusError
from nccl_back.model.crc import check_file
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import RangedLoad, cut_points, gaps
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
        load = _attempt(lambda: RangedLoad(spec, self.sharding, Storage(settings)))
        spans = self._everyone(load, lambda ok: ok.spans)
        everyone = [s for rank_spans in spans for s in rank_spans]
        extra = gaps(spec.shards, everyone) if rank_and_size(self.group)[0] == 0 else []
        ran = _attempt(lambda: load.value.run(model, cut_points(everyone), extra))
        intervals = self._everyone(ran, lambda ok: ok[1])
        t = _clock.perf()
        for shard in spec.shards:
            check_file(shard.uri, shard.size, shard.crc32c,
                       [(r, iv) for r, ivs in enumerate(intervals) for iv in ivs if iv.uri == shard.uri])
        result: LoadResult = ran.value[0]
        timings = {**result.timings, "verify": _clock.perf() - t}
        return LoadResult("storage", spec.version, result.bytes, _clock.perf() - start,
                          timings=timings)

    def _everyone(self, mine: _Outcome, part: Callable[[Any], Any]) -> list[Any]:
        """Every rank's ``part`` of its outcome; raises (after the collective) this rank's
        error, or a :class:`ConsensusError` naming a rank that failed."""
        got = exchange(None if mine.error else part(mine.value), self.group)
        if mine.error is not None:
            raise mine.error
        failed = [r for r, g in enumerate(got) if g is None]
        if failed:
            raise ConsensusError(f"rank {failed[0]} of this worker failed its ranged storage"
                                 " load; every rank stops (see that rank's error)", failed_rank=failed[0])
        return got


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
