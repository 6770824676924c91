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
is spread over the elected worker and the members still serving (:class:`_Gather`,
:class:`Rescues`), so a lost member costs the survivors about ``1/(n-1)`` of a share
each; a sub-part whose reader fails too is read here. Then every file is proven
against storage's CRC32C from the bytes held (:mod:`.held_proof`); a failing file's
blamed members' spans (:func:`~.share_read.blame`) are read again from storage and the
proof runs once more. Only then is the stream announced: a receiver's sampled check
need not catch one altered byte, and announced earlier its receivers' stall bounds
would run out during the gather.
"""

from __future__ import annotations

import contextlib
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
    PeerError,
    RegistryError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.load.asking import Ask, Into, Source, transfer
from nccl_back.load.attempt import Attempt, Worker
from nccl_back.load.fill import Rounds
from nccl_back.load.held_proof import held_reads
from nccl_back.load.pulls import Pull, watched
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
from nccl_back.model.ranged import Span, cut_points
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
    once, a failed member's share spread, then every file proven (:class:`_Gather`; the
    caller announces its stream only after). Raises :class:`ChecksumMismatchError` when a
    file does not prove even from storage's own bytes (changed since it was listed).

    ``held``: this worker took the download over as member ``held`` of the split after
    the worker elected first died: its own part is in its tensors already, so it reads
    part 0 (the dead worker's share) and pulls the other members' parts from the
    endpoints they still serve, the split unchanged (storage reads the checkpoint about
    once, not a second time)."""
    g = _Gather(worker, a, n, held)
    g.run()  # every file proven: a file that does not raises
    return Gathered(g.read, tuple(sorted(set(g.read_for))), g.received)


#: One pull of a gather's round: who reads ``part`` (a member's endpoint, or this
#: worker's own read from storage).
Item = tuple[int, Part]


class _Gather(Rounds):
    """The elected worker's gather, a kind of the one loop (:class:`~.fill.Rounds`).
    Round one reads part 0 here while it pulls each member's part. A failed member's
    part is then spread over this worker and the members that still serve (a record
    they poll, :class:`Rescues`), each sub-part pulled from its reader at once in the
    next round, and read here when that pull fails too (or when nobody else is left,
    or Redis is out of reach). The check proves every file from the bytes held
    (:func:`~.held_proof.held_reads`); a failing file's blamed members' spans
    (:func:`~.share_read.blame`) are read again from storage in one more round, and a
    file that still fails, or that storage itself no longer serves as listed, raises."""

    name = "nccl_back-share"

    def __init__(self, worker: Worker, a: Attempt, n: int, held: int | None) -> None:
        self.worker, self.a, self.n = worker, a, n
        self.src = src = _Source.of(worker, a)
        self.every = shares(src.steps, places(src.headers), {sh.uri: sh.size for sh in a.spec.shards}, n)
        self.cuts = cut_points([span for member in self.every for span in member])
        self.me = 0 if held is None else held
        self.bucket = a.target.bucket(worker.settings, a.target.kind)
        self.lock = threading.Lock()
        self.read = 0
        """Bytes this worker read: its own part, failed members' parts, the proofs."""
        self.received = 0
        """Bytes of the parts (and sub-parts) the members sent."""
        self.read_for: list[int] = []
        """Members whose share this worker read (silent, failed, or blamed)."""
        self.rescues: list[Rescue] = []
        self.items: list[Item] = [(self.me, (0, n)), *((i, (i, n)) for i in range(1, n) if i != held)]
        """The next round's pulls (none: no round left)."""
        self.stage = "parts"
        """What the round in flight pulls: "parts", "spread" (failed parts) or "reread"."""
        self.reads: list[ShareRead] = []
        self.failing: list[str] = []
        """The files the last check found failing (their CRC32C from the bytes held)."""
        self.spans: list[tuple[int, list[Span]]] = []
        """The blamed members' spans of those files: read again in the "reread" round."""

    def round(self, held: contextlib.ExitStack) -> list[Pull] | None:
        if self.stage == "reread":
            return [self._reread] if self.failing else None
        return [self._pull_of(m, part) for m, part in self.items] if self.items else None

    def _pull_of(self, m: int, part: Part) -> Pull:
        if m != self.me:
            return functools.partial(self._member, m, part)
        if part == (0, self.n):  # its own share (the first worker's, once taken over)
            return lambda _: self._count(read=read_share(self.src.storage, self.a.spec, self.src.headers,
                                                         self.src.steps, self.n, 0, self.a.target.tensors).bytes)
        return lambda _: self._count(read=self.src.read(self.a, part, part[0]).bytes)

    def _member(self, m: int, part: Part, started: Callable[[Transport], None]) -> None:
        try:
            _pull(self.worker, self.a, m, part, self.bucket, started)
        except (PeerError, RegistryError):
            raise
        except Exception as e:  # a member's failure costs its part's read, not the download
            raise PeerError(f"member {m} of {self.n}: {e!r}") from e
        self._count(received=sum(self.src.steps[k].nbytes for k in part_steps(self.src.steps, part)))

    def landed(self, errors: list[PeerError | RegistryError | None]) -> bool:
        """Round one: the failed members' parts spread (the next round). The spread
        round: a sub-part whose reader failed is read here. The "reread" round reads
        from storage only (its failure raises)."""
        if self.stage == "reread":
            return True
        failed = [(item, e) for item, e in zip(self.items, errors, strict=True) if e is not None]
        self.items = []
        if self.stage == "spread":
            for (m, sub), e in failed:
                self.a.log.warning("download_spread_part_failed", part=sub[0], member=m, error=str(e)[:300])
                self._count(read=self.src.read(self.a, sub, sub[0]).bytes)
            return True
        for (m, _), e in failed:
            self.a.log.warning("download_member_failed", member=m, of=self.n, reason=fallback_reason(e),
                               error=str(e)[:300])
        if not failed:
            return True
        self.stage, self.items = "spread", self._spread([part[0] for (_, part), _ in failed])
        return False

    def _spread(self, parts: list[int]) -> list[Item]:
        """Who reads which sub-part of the failed ``parts``: this worker and the members
        still serving, by the ids they serve it under (this worker alone once Redis is
        out of reach)."""
        r, n = self.a.replica(), self.n
        self.read_for += parts
        try:
            by = self._readers()
            if len(by) > 1:
                self.rescues += [Rescue(j, tuple(i for _, i in by)) for j in parts]
                self.worker.registry.spread_download_parts(r.version, r.rank, r.world, self.rescues)
        except RegistryError as e:
            self.rescues = [x for x in self.rescues if x.part not in parts]
            self.a.log.warning("download_spread_failed", parts=parts, error=str(e))
            by = [(self.me, self.worker.id)]
        items: list[Item] = []
        for j in parts:
            self.a.log.info("download_part_spread", part=j, by=[m for m, _ in by])
            items += [(m, (j, n, s, len(by)) if len(by) > 1 else (j, n)) for s, (m, _) in enumerate(by)]
        return items

    def _readers(self) -> list[tuple[int, str]]:
        """``(member, id)`` of this worker and each member not failed whose endpoint is
        announced."""
        r = self.a.replica()
        out = [(self.me, self.worker.id)]
        for m in range(1, self.n):
            if m != self.me and m not in self.read_for:
                got = self.worker.registry.download_member(r.version, r.rank, r.world, m)
                if got is not None:
                    out.append((m, got.member_id))
        return out

    def verify(self) -> WeightVerificationError | None:
        src, a = self.src, self.a
        reads = held_reads(src.storage, a.spec, src.headers, src.steps, self.n, a.target.tensors)
        self._count(read=sum(r.bytes for r in reads))
        self.reads, self.failing = reads, failing(a.spec, reads)
        return WeightVerificationError(", ".join(self.failing), set(self.failing)) if self.failing else None

    def blamed(self, bad: WeightVerificationError) -> None:
        """The blamed members' spans of each failing file, read again in the next round;
        a file storage itself no longer serves as listed, or that failed after that
        round, raises."""
        if self.stage == "reread":
            raise ChecksumMismatchError(f"{self.failing[0]}: does not prove after its blamed shares were"
                                        " read again")
        self.stage, self.spans = "reread", []
        for uri in self.failing:
            verdict = blame(self.src.storage, self.a.spec, uri, self.reads)
            if verdict.changed_at_rest:
                raise ChecksumMismatchError(f"{uri}: storage no longer serves the file its identity"
                                            " lists (changed since it was listed)")
            self.a.log.warning("download_member_blamed", file=uri, members=list(verdict.members))
            self.worker.metrics.record_verification_failure()
            for m in verdict.members:
                self.spans.append((m, [sp for sp in self.every[m] if sp[0] == uri]))
                self.read_for.append(m)

    def _reread(self, _started: object) -> None:
        src, a = self.src, self.a
        for m, spans in self.spans:
            self._count(read=read_spans(src.storage, a.spec, src.headers, spans, self.cuts,
                                        a.target.tensors, member=m).bytes)

    def untrue(self, e: PeerError) -> None:
        raise e  # no stream's truth here: the files' CRC32C prove the bytes

    def lost(self, e: RegistryError) -> None:
        raise e  # Redis's trouble in a member's pull is that member's failure, not this

    def _count(self, read: int = 0, received: int = 0) -> None:
        """Add bytes read here or received from members (from any pull's thread)."""
        with self.lock:
            self.read += read
            self.received += received


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
