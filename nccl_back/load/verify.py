"""The load's verification step: whose truth the bytes are checked against, the check
itself (the Verifier's, :mod:`.verifier`), and what a mismatch does to the sources
that sent them.

The truth is discovery's (the hashes a storage load published) or, for a rank fed by
a streamed download, the hashes that downloader publishes once its load is complete.
A mismatch blames only the sources of the failing bytes: a failing layer's bytes that
came from two sources (a layer cut by a part boundary) are put on the one that alone sent
another failing layer, else both are suspects, blamed only if implicated again
(:class:`~nccl_back.transport.relay.StepSources`); what they sent is discarded. A relay
member forwards bytes before it checks them, so each member's own check is recorded (a
signed verdict), and a member whose own check failed is only a suspect for the wrong bytes
it forwarded: its receivers cannot tell it from the member that sent it them otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.coord.election import DownloadLease
from nccl_back.errors import (
    RegistryError,
    TransferTimeoutError,
    UntrustedRecordError,
    WeightVerificationError,
)
from nccl_back.load.attempt import Attempt, Discovery, Worker
from nccl_back.load.verifier import Basis
from nccl_back.model import integrity
from nccl_back.timing import VERDICT_POLL as _POLL
from nccl_back.timing import VERDICT_WAIT
from nccl_back.transport.relay import DamagedBytes


@dataclass(frozen=True)
class Verified:
    """What a check of this rank's bytes found: the truth they were compared with (None:
    nothing to check) and how the rank knows they are the checkpoint's."""

    truth: dict[str, str] | None
    basis: Basis


def truth_for(worker: Worker, a: Attempt, found: Discovery, truth: dict[str, str] | None,
              deadline: float) -> dict[str, str] | None:
    """The truth to check against: ``truth`` (what the pass knows), else, for a rank fed
    by a stream (``found``), the one its downloader publishes (``verify`` "none": none)."""
    if truth is None and found.stream is not None and worker.verifier.mode != "none":
        t = _clock.perf()
        truth = await_truth(worker, a, deadline)
        a.timings["await_truth"] = _clock.perf() - t
    return truth


def check(worker: Worker, a: Attempt, found: Discovery, truth: dict[str, str] | None) -> Verified:
    """Verify what the last transfer left in this rank's tensors against ``truth`` (None:
    nothing to check, and nothing this rank may publish as truth); :class:`DamagedBytes`
    if it fails."""
    if truth is None:
        return Verified(None, Basis.NONE)
    t = _clock.perf()
    layers(worker, a, found, truth)
    a.timings["verify"] = _clock.perf() - t
    return Verified(truth, worker.verifier.basis())


def layers(worker: Worker, a: Attempt, found: Discovery, truth: dict[str, str]) -> None:
    """Compare the tensors' layer hashes with ``truth`` (from the sources ``found``
    names, and relay members); on a mismatch, never forward
    what this rank holds again, discard what the guilty and suspected sources sent,
    raise :class:`DamagedBytes`."""
    seat = a.rx.seat
    # Only a member's first check speaks for all it forwarded: a failed one ends its
    # forwarding for good, so a later pass must not overwrite it.
    first = seat is not None and seat.progress.failed is None
    try:
        worker.verifier.check_layers(a.model, truth)
    except WeightVerificationError as e:
        if seat is not None:
            if first:
                _verdict(worker, a, seat.member.member_id, ok=False)
            # Downstream members may hold some of these bytes already: their links
            # end now and this endpoint refuses every later request.
            seat.progress.fail(f"verification failed: {e}")
        sources = a.rx.sources
        blame = sources.blame(set(e.bad), integrity.layer_of)
        blame = sources.forwarded(blame, _forwarders(worker, a, found, blame.guilty))
        sources.discard(blame.sources)
        raise DamagedBytes(e, blame.guilty, blame.suspects) from e
    if first and seat is not None:
        _verdict(worker, a, seat.member.member_id, ok=True)


def _verdict(worker: Worker, a: Attempt, member_id: str, *, ok: bool) -> None:
    """Record this member's own check for its receivers (:func:`_forwarders`), for as
    long as its cohort lives; without Redis they blame it as before."""
    s = worker.settings
    try:
        worker.registry.put_verdict(member_id, ok, s.transfer_timeout + s.busy_wait)
    except RegistryError as e:
        a.log.warning("relay_verdict_unwritten", ok=ok, error=str(e))


def _forwarders(worker: Worker, a: Attempt, found: Discovery, guilty: frozenset[str]) -> set[str]:
    """Those of the relay members in ``guilty`` whose own check failed (their verdicts,
    awaited up to :data:`VERDICT_WAIT`): they forwarded wrong bytes they were sent. A
    holder serves only checked bytes, the stream its download: neither is asked."""
    members = set(guilty) - {p.peer_id for p in found.candidates}
    if found.stream is not None:
        members.discard(found.stream.member_id)
    if a.rx.seat is None or not members:
        return set()
    end = _clock.monotonic() + VERDICT_WAIT
    while True:
        try:
            said = worker.registry.verdicts(sorted(members))
        except RegistryError as e:
            a.log.warning("relay_verdicts_unread", members=sorted(members), error=str(e))
            return set()
        if len(said) == len(members) or _clock.monotonic() >= end:
            forwarders = {m for m, ok in said.items() if not ok}
            if forwarders:
                a.log.warning("verification_forwarded", members=sorted(forwarders),
                              unheard=sorted(members - said.keys()))
            return forwarders
        _clock.sleep(_POLL)


def await_truth(worker: Worker, a: Attempt, deadline: float) -> dict[str, str]:
    """The ground truth a streaming downloader publishes once its load is complete
    (it hashes what it streamed); :class:`TransferError` if none comes by ``deadline``
    or neither the download's lease nor its stream endpoint lives (the downloader gave up
    or died)."""
    version, digest, verifier = a.spec.version, a.target.manifest.digest, worker.verifier
    reg = worker.registry
    # Only to read whether a (trusted) downloader holds the lease: a value there that
    # is not to be trusted counts as nobody, never as a reason to wait or raise.
    lease = DownloadLease(reg, version, a.world, worker.id, worker.settings.download_lease)
    while True:
        # Read "still loading" before the truth: the downloader writes the truth before
        # it releases its lease and its stream endpoint stops, so no truth once neither
        # lives means none is coming. The endpoint's liveness mark, not its record: the
        # record, announced for a whole download's wait, outlives a killed downloader.
        stream = reg.get_stream(version, a.rank, a.world, digest)
        loading = (stream is not None and not reg.lapsed(stream.member_id)) or lease.holder() is not None
        try:
            stored = reg.get_ground_truth(version, a.rank, a.world, digest, verifier.scheme)
        except UntrustedRecordError:  # rejected (said why): the downloader replaces it
            stored = None
        expected = verifier.expected(stored) if stored is not None else {}
        if expected:
            return expected
        if not loading or _clock.monotonic() >= deadline:
            raise TransferTimeoutError(
                f"the downloader streamed version {version[:12]} but published no"
                f" {verifier.mode!r} ground truth " + ("by the deadline" if loading else
                                                       "before it stopped")
                + ": nothing to verify against")
        _clock.sleep(_POLL)
