"""A cooperative first download: the members read their shares, the elected worker
gathers them, proves every file and streams the whole through the fan-out.

Member ``i`` of ``n`` (named in the elected worker's roster, :mod:`nccl_back.coord.election`)
announces a relay endpoint for this rank's part ``i`` of the plan (only the elected
worker reads where), reads its share from storage into its own tensors
(:func:`~.share_read.read_share`), each step of the part going out as its bytes land;
then it waits, like any waiter, for the elected worker's stream.

The elected worker reads part 0 and, at the same time, pulls part ``i`` from each member
(the transfer every path uses, :func:`~.asking.transfer`). A member that does not
announce itself within ``claim_ttl`` (at most ``relay_stall_timeout``), whose
announcement lapses (it is renewed while
the member's endpoint lives: a member killed or stopped is found within ``claim_ttl``,
not after a handshake or connect timeout), or whose transfer fails, costs its share,
not the download: the elected worker reads that share itself. Then it proves every file
against the CRC32C storage lists from the bytes it holds (:mod:`.held_proof`); a file
that fails is blamed (:func:`~.share_read.blame`), the blamed members' spans of it read
again from storage, and the proof run once more. Only then is its stream announced
(as a storage load's stream forwards a tensor only once its file's CRC32C passed: a
receiver's sampled verification need not catch one altered byte; announced earlier,
its receivers' stall bounds would run out during the gather), and only then are the
layer hashes computed, as after any download. Forwarding each file's steps as soon as
that file proves is the pipelining still to do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.errors import (
    ChecksumMismatchError,
    NcclBackError,
    NoPeerError,
    RegistryError,
    fallback_reason,
)
from nccl_back.load.asking import new_request, transfer
from nccl_back.load.attempt import Attempt, Worker
from nccl_back.load.held_proof import held_reads
from nccl_back.load.pulls import Pull, Pulls, watched
from nccl_back.load.share_read import WHO, ShareRead, blame, places, read_share, read_spans
from nccl_back.load.shares import shares
from nccl_back.model.checkpoint import model_headers
from nccl_back.model.crc import check_file
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import cut_points
from nccl_back.model.storage import Storage
from nccl_back.transport import Transport, plan
from nccl_back.transport.parts import parts

#: Seconds between two looks for a member's announcement.
ANNOUNCE_POLL = 0.05
#: Seconds between two looks at a member's announcement while its part is pulled.
WATCH_POLL = 0.25


def serve_share(worker: Worker, a: Attempt) -> None:
    """Member ``a.member``: announce this rank's part, read the share into its tensors,
    let the part go out. Any failure ends the endpoint (requests are refused, so the
    elected worker reads the share itself) and is logged; nothing escapes."""
    if a.member is None:
        return
    i, n = a.member
    share = worker.cohorts.open_share(a.replica(), a.log, i)
    if share is None:
        return
    a.share = share
    s, t = worker.settings, a.target
    began = _clock.perf()
    try:
        storage = Storage(s)
        steps = plan(t.tensors, t.bucket(s, t.kind))
        # Each step goes out as its bytes land: the elected worker's pull sees steps
        # while the share is read, not only after (a long share would trip its stall bound).
        got = read_share(storage, a.spec, model_headers(storage, a.spec), steps, n, i, t.tensors,
                         on_step=lambda k: share.placed([k]))
    except Exception as e:  # noqa: BLE001 - a share is a speed-up: the elected worker reads it instead
        share.end(False, f"share unread: {e!r}"[:300])
        a.log.warning("download_share_failed", member=i, of=n, error=repr(e)[:300])
        return
    a.timings["share"] = _clock.perf() - began
    a.share_bytes = got.bytes
    a.log.info("download_share_read", member=i, of=n, bytes=got.bytes, seconds=round(got.seconds, 3))


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
    s, t, spec = worker.settings, a.target, a.spec
    storage = Storage(s)
    headers = model_headers(storage, spec)
    steps = plan(t.tensors, t.bucket(s, t.kind))
    every = shares(steps, places(headers), {sh.uri: sh.size for sh in spec.shards}, n)
    cuts = cut_points([span for member in every for span in member])
    read_bytes = 0

    def own(_: object) -> None:
        nonlocal read_bytes
        got = read_share(storage, spec, headers, steps, n, 0, t.tensors)
        read_bytes += got.bytes

    def pull(i: int) -> Pull:
        return lambda started: _pull(worker, a, i, n, t.bucket(s, t.kind), started)

    others = [i for i in range(1, n) if i != held]
    errors = Pulls(abort=False).run([own, *(pull(i) for i in others)], "nccl_back-share")
    if errors[0] is not None:
        raise errors[0]
    cut = parts(steps, n)
    received = sum(steps[k].nbytes for i, e in zip(others, errors[1:], strict=True) if e is None
                   for k in cut[i])
    read_for: list[int] = []
    for i, e in zip(others, errors[1:], strict=True):
        if e is None:
            continue
        a.log.warning("download_member_failed", member=i, of=n,
                      reason=fallback_reason(e) if isinstance(e, NcclBackError) else "other",
                      error=str(e)[:300])
        read_bytes += read_spans(storage, spec, headers, every[i], cuts, t.tensors, member=i).bytes
        read_for.append(i)
    reads = held_reads(storage, spec, headers, steps, n, t.tensors)
    read_bytes += sum(r.bytes for r in reads)
    blamed = _failing(spec, reads)
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
        for uri in _failing(spec, reads):
            raise ChecksumMismatchError(f"{uri}: does not prove after its blamed shares were read again")
    return Gathered(read_bytes, tuple(sorted(set(read_for))), received)


def _pull(worker: Worker, a: Attempt, i: int, n: int, bucket: int,
          started: Callable[[Transport], None]) -> None:
    """Part ``i`` from member ``i``'s endpoint into this rank's tensors."""
    s, t = worker.settings, a.target
    r = a.replica()
    # A named member announces at its next poll of the roster: one that has not within
    # the bound its announcement would then live is taken for dead.
    bound = min(s.claim_ttl, s.relay_stall_timeout)
    deadline = _clock.monotonic() + bound
    member = None
    while member is None:
        member = worker.registry.download_member(r.version, r.rank, r.world, i)
        if member is None:
            if _clock.monotonic() >= deadline:
                raise NoPeerError(f"member {i} of {n} announced no endpoint within {bound:g} s"
                                  " (claim_ttl, at most relay_stall_timeout)")
            _clock.sleep(ANNOUNCE_POLL)
    if not r.speaks(member):
        raise NoPeerError(f"member {i} of {n} speaks {member.transport}/{member.device}, not {t.kind}")
    request = new_request(worker, a, None, part=i, parts=n)
    with _watched(worker, a, i, member.member_id, started) as (gone, on_start):
        try:
            transfer(worker, a, member.member_id, request, member.transport, member.address,
                     digest=t.manifest.digest, tensors=t.tensors, bucket=bucket, part=(i, n),
                     on_step=None,
                     handshake_timeout=s.receiver_handshake_timeout,
                     deadline=_clock.monotonic() + s.transfer_timeout + s.single_flight_max_wait,
                     stall=max(s.relay_stall_timeout, s.download_lease),
                     started=on_start, gone=gone)
        except NcclBackError as e:
            if not gone.is_set():
                raise
            raise NoPeerError(f"member {i} of {n}: its announcement lapsed (not renewed within"
                              f" claim_ttl {s.claim_ttl:g} s: killed or stopped)") from e


def _watched(worker: Worker, a: Attempt, i: int, member_id: str,
             started: Callable[[Transport], None],
             ) -> contextlib.AbstractContextManager[tuple[threading.Event, Callable[[Transport], None]]]:
    """Member ``i``'s announcement watched while the block pulls its part (:func:`watched`):
    lost once it lapsed or names another endpoint."""
    r = a.replica()

    def lost() -> bool:
        try:
            now = worker.registry.download_member(r.version, r.rank, r.world, i)
        except RegistryError:
            return False  # Redis trouble says nothing of the member
        if now is None or now.member_id != member_id:
            a.log.warning("download_member_lapsed", member=i, endpoint=member_id)
            return True
        return False

    return watched(lost, WATCH_POLL, f"nccl-back-watch-{i}", started)


def _failing(spec: ModelSpec, reads: Sequence[ShareRead]) -> list[str]:
    """The files whose held bytes do not prove."""
    out = []
    for shard in spec.shards:
        try:
            check_file(shard.uri, shard.size, shard.crc32c,
                       [(r.member, iv) for r in reads for iv in r.intervals if iv.uri == shard.uri],
                       WHO)
        except ChecksumMismatchError:
            out.append(shard.uri)
    return out

