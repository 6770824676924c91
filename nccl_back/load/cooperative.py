"""A cooperative first download: the members read their shares, the elected worker
gathers them, proves every file and streams the whole through the fan-out.

Member ``i`` of ``n`` (named in the elected worker's roster, :mod:`nccl_back.coord.election`)
announces a relay endpoint for this rank's part ``i`` of the plan and reads its share
from storage into its own tensors (:func:`~.share_read.read_share`), each step going
out as its bytes land; then it waits, like any waiter, for the elected worker's stream.

The elected worker reads part 0 while it pulls part ``i`` from each member
(:func:`~.asking.transfer`). A member that does not announce itself within
``claim_ttl`` (at most ``stall_timeout``), whose announcement lapses (renewed while its
endpoint lives, so a dead member is found within ``claim_ttl``, not after a connect
timeout), or whose transfer fails, costs its part's read, not the download: the part
is spread over the elected worker and the members still serving (:class:`_Spread`,
:class:`Rescues`), so a lost member costs the survivors about ``1/(n-1)`` of a share
each; a sub-part whose reader fails too is read here. Then every file is proven
against storage's CRC32C from the bytes held (:mod:`.held_proof`); a failing file's
blamed members' spans (:func:`~.share_read.blame`) are read again from storage and the
proof runs once more. Only then is the stream announced: a receiver's sampled check
need not catch one altered byte, and announced earlier its receivers' stall bounds
would run out during the gather.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.budget import Budget
from nccl_back.coord.records import Rescue
from nccl_back.errors import (
    ChecksumMismatchError,
    NcclBackError,
    NoPeerError,
    RegistryError,
    fallback_reason,
)
from nccl_back.load.asking import Ask, Into, Source, transfer
from nccl_back.load.attempt import Attempt, Worker
from nccl_back.load.held_proof import held_reads
from nccl_back.load.pulls import Pull, Pulls, watched
from nccl_back.load.share_read import (
    ShareRead,
    blame,
    failing,
    places,
    read_share,
    read_spans,
    read_steps,
    shares,
)
from nccl_back.model.checkpoint import ShardHeader, model_headers
from nccl_back.model.ranged import cut_points
from nccl_back.model.storage import Storage
from nccl_back.timing import ANNOUNCE_POLL
from nccl_back.timing import SHARE_WATCH_POLL as WATCH_POLL
from nccl_back.transport import Part, Step, Transport, part_steps, plan
from nccl_back.transport.relay import Share


def serve_share(worker: Worker, a: Attempt, share: Share, i: int, n: int) -> Rescues | None:
    """Member ``i`` of ``n``: read the share into this rank's tensors, letting the part go
    out through ``share`` (its announced endpoint), then read what the elected worker
    spreads to it of failed members' parts (the watch returned, with the bytes read:
    close it before anything else writes these tensors). Any failure ends the endpoint
    (requests are refused, so the elected worker reads the share itself) and is logged;
    nothing escapes."""
    began = _clock.perf()
    try:
        src = _Source.of(worker, a)
        # Each step goes out as its bytes land: the elected worker's pull sees steps
        # while the share is read, not only after (a long share would trip its stall bound).
        got = read_share(src.storage, a.spec, src.headers, src.steps, n, i, a.target.tensors,
                         on_step=lambda k: share.placed([k]))
    except Exception as e:  # noqa: BLE001 - a share is a speed-up: the elected worker reads it instead
        share.end(False, f"share unread: {e!r}"[:300])
        a.log.warning("download_share_failed", member=i, of=n, error=repr(e)[:300])
        return None
    a.timings["share"] = _clock.perf() - began
    a.log.info("download_share_read", member=i, of=n, bytes=got.bytes, seconds=round(got.seconds, 3))
    return Rescues(worker, a, share, src, i, n, got.bytes)


class Rescues:
    """Member ``i``'s watch, once its share is read, for failed members' parts the
    elected worker spread to it (:meth:`~nccl_back.coord.leases.LeaseRecords.download_rescues`,
    polled every ``WATCH_POLL``): it reads its sub-part of each into its tensors and its
    endpoint serves it, each step as it lands. Ends at :meth:`close` (the member's wait
    for the stream is over: its read stops before its next piece and is waited for, as
    the stream then writes these tensors) or with the endpoint. ``bytes``: what this
    member read from storage, its share and those sub-parts (final once closed)."""

    def __init__(self, worker: Worker, a: Attempt, share: Share, source: _Source, i: int,
                 n: int, read: int) -> None:
        self.worker, self.a, self.share, self.source, self.i, self.n = worker, a, share, source, i, n
        self.bytes = read
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="nccl-back-rescues")
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        # Slices not read by now never will be: the elected worker's sends of them, which
        # wait for their steps, end now (it reads those slices itself), not at their
        # deadline, long after this worker closed.
        self.share.end(False, "the member no longer reads spread parts")

    def _run(self) -> None:
        r, i, n = self.a.replica(), self.i, self.n
        done: set[int] = set()
        while not _clock.wait(self.stop, WATCH_POLL) and self.share.server.alive:
            try:
                spread = self.worker.registry.download_rescues(r.version, r.rank, r.world)
            except RegistryError:
                continue  # Redis trouble: the elected worker's pull reads the sub-part itself
            me = self.share.member.member_id
            for rescue in spread:
                if rescue.part in done or me not in rescue.by or not 0 < rescue.part < n:
                    continue
                done.add(rescue.part)
                if not self._serve(rescue, i, n, rescue.by.index(me)):
                    return

    def _serve(self, rescue: Rescue, i: int, n: int, s: int) -> bool:
        sub = (rescue.part, n, s, len(rescue.by))
        try:
            got = self.source.read(self.a, sub, i, self.stop, lambda k: self.share.placed([k]))
        except Exception as e:  # noqa: BLE001 - the elected worker's pull fails and it reads the sub-part
            self.share.end(False, f"spread part unread: {e!r}"[:300])
            self.a.log.warning("download_rescue_failed", part=rescue.part, sub=list(sub), error=repr(e)[:300])
            return False
        self.bytes += got.bytes
        self.a.log.info("download_rescue_read", part=rescue.part, sub=list(sub), bytes=got.bytes,
                        seconds=round(got.seconds, 3))
        return True


@dataclass(frozen=True)
class _Source:
    """Where a member's bytes come from: storage, the checkpoint's headers, this rank's plan."""

    storage: Storage
    headers: Sequence[ShardHeader]
    steps: list[Step]

    @classmethod
    def of(cls, worker: Worker, a: Attempt) -> _Source:
        storage, t = Storage(worker.settings), a.target
        return cls(storage, model_headers(storage, a.spec), plan(t.tensors, t.bucket(worker.settings, t.kind)))

    def read(self, a: Attempt, part: Part, member: int, stop: threading.Event | None = None,
             on_step: Callable[[int], None] | None = None) -> ShareRead:
        """The tensor bytes of ``part``'s steps into ``a``'s tensors (:func:`read_steps`)."""
        return read_steps(self.storage, a.spec, self.headers, self.steps,
                          part_steps(self.steps, part), a.target.tensors, member=member,
                          on_step=on_step, stop=stop)


@dataclass(frozen=True)
class Gathered:
    """What the elected worker's gather read from storage, and whose parts it read itself."""

    bytes: int
    read_for: tuple[int, ...]
    """Members whose share the elected worker read (silent, failed, or blamed)."""
    received: int = 0
    """Bytes of the parts the members sent (a blamed member's part too)."""


def gather_parts(worker: Worker, a: Attempt, n: int, held: int | None = None) -> Gathered:
    """The elected worker's rank: part 0 read, parts 1..n-1 pulled from the members at
    once, a failed member's share read here, then every file proven (the caller announces
    its stream only after). Raises :class:`ChecksumMismatchError` when a file does not
    prove even from storage's own bytes (changed since it was listed).

    ``held``: this worker took the download over as member ``held`` of the split after
    the worker elected first died: its own part is in its tensors already, so it reads
    part 0 (the dead worker's share) and pulls the other members' parts from the
    endpoints they still serve, the split unchanged (storage reads the checkpoint about
    once, not a second time)."""
    t, spec = a.target, a.spec
    src = _Source.of(worker, a)
    storage, headers, steps = src.storage, src.headers, src.steps
    every = shares(steps, places(headers), {sh.uri: sh.size for sh in spec.shards}, n)
    cuts = cut_points([span for member in every for span in member])
    others = [i for i in range(1, n) if i != held]
    spread = _Spread(worker, a, src, n, 0 if held is None else held, others)

    def own(_: object) -> None:
        spread.count(read=read_share(storage, spec, headers, steps, n, 0, t.tensors).bytes)

    pulls: list[Pull] = [own, *(functools.partial(spread.pull, i) for i in others)]
    for e in Pulls(abort=False).run(pulls, "nccl_back-share"):
        if e is not None:
            raise e  # not a member's failure (those are spread): this worker's own
    read_bytes = spread.read
    read_for = list(spread.failed)
    reads = held_reads(storage, spec, headers, steps, n, t.tensors)
    read_bytes += sum(r.bytes for r in reads)
    blamed = failing(spec, reads)
    if blamed:
        for uri in blamed:
            verdict = blame(storage, spec, uri, reads)
            if verdict.changed_at_rest:
                raise ChecksumMismatchError(f"{uri}: storage no longer serves the file its identity"
                                            " lists (changed since it was listed)")
            a.log.warning("download_member_blamed", file=uri, members=list(verdict.members))
            worker.metrics.record_verification_failure()
            for m in verdict.members:
                spans = [sp for sp in every[m] if sp[0] == uri]
                read_bytes += read_spans(storage, spec, headers, spans, cuts, t.tensors, member=m).bytes
                read_for.append(m)
        reads = held_reads(storage, spec, headers, steps, n, t.tensors)
        read_bytes += sum(r.bytes for r in reads)
        for uri in failing(spec, reads):
            raise ChecksumMismatchError(f"{uri}: does not prove after its blamed shares were read again")
    return Gathered(read_bytes, tuple(sorted(set(read_for))), spread.received)


def _pull(worker: Worker, a: Attempt, i: int, part: Part, bucket: int,
          started: Callable[[Transport], None]) -> None:
    """``part`` (its own, or a sub-part of a failed member's spread to it) from member
    ``i``'s endpoint into this rank's tensors."""
    n = part[1]
    s, t = worker.settings, a.target
    r = a.replica()
    # A named member announces at its next poll of the roster: one that has not within
    # the bound its announcement would then live is taken for dead.
    bound = min(s.claim_ttl, s.stall_timeout)
    deadline = _clock.monotonic() + bound
    member = None
    while member is None:
        member = worker.registry.download_member(r.version, r.rank, r.world, i)
        if member is None:
            if _clock.monotonic() >= deadline:
                raise NoPeerError(f"member {i} of {n} announced no endpoint within {bound:g} s"
                                  " (claim_ttl, at most stall_timeout)")
            _clock.sleep(ANNOUNCE_POLL)
    if not r.speaks(member):
        raise NoPeerError(f"member {i} of {n} speaks {member.transport}/{member.device}, not {t.kind}")
    announced = member.member_id

    def lost() -> bool:
        """The announcement lapsed or names another endpoint."""
        try:
            gone = worker.registry.download_member_lapsed(r.version, r.rank, r.world, i, announced)
        except RegistryError:
            return False  # Redis trouble says nothing of the member
        if gone:
            a.log.warning("download_member_lapsed", member=i, endpoint=announced)
        return gone

    with watched(lost, WATCH_POLL, f"nccl-back-watch-{i}", started) as (gone, on_start):
        try:
            # Not recorded as the receive's steps: the files' CRC32C prove them (held_proof).
            # The election's download, not a peer load: a budget of its own.
            within = Budget.of(s.transfer_timeout + s.single_flight_max_wait)
            transfer(worker, a, Source.member(member), Ask(
                s.handshake_timeout, within, max(s.stall_timeout, s.download_lease), part=part,
                into=Into(t.manifest.digest, t.tensors, bucket), started=on_start, gone=gone))
        except NcclBackError as e:
            if not gone.is_set():
                raise
            raise NoPeerError(f"member {i} of {n}: its announcement lapsed (not renewed within"
                              f" claim_ttl {s.claim_ttl:g} s: killed or stopped)") from e


class _Spread:
    """The elected worker's pulls of the members' parts, and what a failed member's part
    becomes: spread over this worker and the members that still serve (a record they
    poll, :class:`Rescues`), each sub-part pulled from its reader at once, and read here
    when that pull fails too (or when nobody else is left, or Redis is out of reach)."""

    def __init__(self, worker: Worker, a: Attempt, source: _Source, n: int, me: int,
                 others: list[int]) -> None:
        self.worker, self.a, self.source, self.n, self.me, self.others = worker, a, source, n, me, others
        self.bucket = a.target.bucket(worker.settings, a.target.kind)
        self.lock = threading.Lock()
        self.failed: list[int] = []
        self.rescues: list[Rescue] = []
        self.read = 0
        """Bytes this worker read: its own part and failed members' parts."""
        self.received = 0
        """Bytes of the parts (and sub-parts) the members sent."""

    def pull(self, i: int, started: Callable[[Transport], None]) -> None:
        """Member ``i``'s part, or, once it failed, that part spread."""
        try:
            _pull(self.worker, self.a, i, (i, self.n), self.bucket, started)
        except Exception as e:  # noqa: BLE001 - a member's failure costs its part's read, not the download
            self.a.log.warning("download_member_failed", member=i, of=self.n,
                               reason=fallback_reason(e) if isinstance(e, NcclBackError) else "other",
                               error=str(e)[:300])
            self._rescue(i)
            return
        self.count(received=self._bytes((i, self.n)))

    def _rescue(self, j: int) -> None:
        r = self.a.replica()
        with self.lock:
            self.failed.append(j)
            try:
                by = self._readers()
                if len(by) > 1:
                    self.rescues.append(Rescue(j, tuple(i for _, i in by)))
                    self.worker.registry.spread_download_parts(r.version, r.rank, r.world, self.rescues)
            except RegistryError as e:
                self.rescues = [x for x in self.rescues if x.part != j]
                self.a.log.warning("download_spread_failed", part=j, error=str(e))
                by = [(self.me, self.worker.id)]
        self.a.log.info("download_part_spread", part=j, by=[m for m, _ in by])
        subs = [(j, self.n, s, len(by)) if len(by) > 1 else (j, self.n) for s in range(len(by))]
        readers = [m for m, _ in by]

        def pull(m: int, sub: Part) -> Pull:
            if m == self.me:
                return lambda _: self.count(read=self.source.read(self.a, sub, j).bytes)
            return lambda started: _pull(self.worker, self.a, m, sub, self.bucket, started)

        errors = Pulls(abort=False).run([pull(m, sub) for m, sub in zip(readers, subs, strict=True)],
                                        f"nccl_back-spread-{j}")
        for m, sub, err in zip(readers, subs, errors, strict=True):
            if err is None:
                if m != self.me:
                    self.count(received=self._bytes(sub))
                continue
            if m == self.me:
                raise err
            self.a.log.warning("download_spread_part_failed", part=j, member=m, error=str(err)[:300])
            self.count(read=self.source.read(self.a, sub, j).bytes)

    def _readers(self) -> list[tuple[int, str]]:
        """``(member, id)`` of this worker and each member not failed whose endpoint is
        announced: the readers of a failed part, by the ids they serve it under."""
        r = self.a.replica()
        out = [(self.me, self.worker.id)]
        for m in self.others:
            if m not in self.failed:
                got = self.worker.registry.download_member(r.version, r.rank, r.world, m)
                if got is not None:
                    out.append((m, got.member_id))
        return out

    def _bytes(self, part: Part) -> int:
        return sum(self.source.steps[k].nbytes for k in part_steps(self.source.steps, part))

    def count(self, read: int = 0, received: int = 0) -> None:
        """Add bytes read here or received from members (from any pull's thread)."""
        with self.lock:
            self.read += read
            self.received += received
