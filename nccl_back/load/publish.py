"""Publication: after a load, this worker serves the weights to others (fan-out), with
the truth the Verifier lets it publish (:meth:`~.verifier.Verifier.publishable`).

Ground truth is never overwritten by a peer load, and a storage loader's hashes win
over a stored record that is untrusted or disagrees (they passed CRC32C against
storage). Everything published is stored now and kept by the heartbeat
(:class:`~nccl_back.transport.sender.PeerServer`), so a Redis outage at publication
costs a heartbeat, never the publication. Publishing failures never fail a load: the
weights are in place.
"""

from __future__ import annotations

from nccl_back import _clock
from nccl_back.coord.content import PositionTruth
from nccl_back.coord.registry import encode_truth, truth_for_mode
from nccl_back.errors import RegistryError, UntrustedRecordError, WeightVerificationError
from nccl_back.load.attempt import Attempt, Worker
from nccl_back.load.verifier import SCHEME, Basis
from nccl_back.model import integrity
from nccl_back.model.layout import Layout, trivial_layout
from nccl_back.result import LoadResult


def peer_loaded(worker: Worker, a: Attempt, *, nbytes: int | None = None) -> LoadResult:
    """A peer load's result (``verified`` as its check says); this worker then serves
    the version too. ``nbytes``: what moved, if not the whole manifest (a reshard)."""
    seconds = _clock.perf() - a.start
    moved = a.target.manifest.nbytes if nbytes is None else nbytes
    result = LoadResult(
        source="peer", version=a.spec.version, bytes=moved, seconds=seconds,
        peer_id=a.peer_id, verified=a.basis is not Basis.NONE, timings=a.timings,
        storage_bytes=a.share_bytes, peer_bytes=moved,
    )
    worker.metrics.record_load("peer", moved, seconds)
    a.log.info("loaded", source="peer", peer=a.peer_id, resharded=nbytes is not None,
               verified=a.basis.value, seconds=round(seconds, 3), gbps=round(result.gbps, 3))
    publish(worker, a, "peer")
    return result


def publish_stored(worker: Worker, a: Attempt, hashes: dict[str, str]) -> None:
    """After a storage load: claim the ground truth, then serve the version."""
    try:
        claim_ground_truth(worker, a, hashes)
    except RegistryError as e:
        # Redis unreachable: the heartbeat stores the truth this worker holds (with
        # its entry) once Redis answers again.
        a.log.warning("ground_truth_deferred", error=str(e))
    publish(worker, a, "storage", hashes)


def publish(worker: Worker, a: Attempt, source: str, hashes: dict[str, str] | None = None) -> None:
    """Serve this rank's bytes with what the Verifier lets it publish for its basis:
    layer hashes (``hashes``: a storage load's, else re-published or computed), truth
    in checkpoint coordinates, and its layout."""
    v = worker.verifier
    may = v.publishable(a.basis)
    lay: Layout | None = a.sharding.layout if a.sharding is not None else None
    truth, positions = hashes, None
    try:
        if truth is None:
            by_mode: dict[str, dict[str, str]] = {}
            if may.layer_copy and a.truth:
                by_mode[v.mode] = a.truth  # exactly the hashes its bytes were checked against
            for mode in may.layer_modes:
                by_mode[mode] = (a.truth if mode == v.mode and a.truth else
                                 integrity.layer_hashes(a.model, mode=mode, key=v.key))  # type: ignore[arg-type]
            truth = encode_truth(by_mode) or None
        held = lay if lay is not None else trivial_layout(a.target.manifest)
        if may.positions:
            positions = v.position_truth(held, a.target.tensors, sums=may.marginal_sums)
        elif may.position_copy and a.checked is not None:
            positions = PositionTruth(held.digest, SCHEME, a.checked.macs)
    except Exception as e:  # only what others can check against is lost: serve anyway
        a.log.warning("truth_not_computed", error=str(e))
    try:
        worker.server.publish(a.model, a.target.manifest, a.spec.version, a.rank, a.world,
                           source=source, log=a.log, truth=truth, model_name=a.spec.name,
                           layout=lay, positions=positions)
    except Exception as e:  # the rendezvous could not start: serve nobody
        a.log.warning("publish_failed", error=str(e))


def claim_ground_truth(worker: Worker, a: Attempt, hashes: dict[str, str]) -> None:
    """Store our hashes as the ground truth; if a stored record is untrusted or
    disagrees with ours, ours win: this worker holds bytes that passed CRC32C
    against storage, so it replaces the record (and says so) instead of letting
    whoever wrote first keep every worker of the version from a verified peer load."""
    reg, version, digest = worker.registry, a.spec.version, a.target.manifest.digest
    scheme = worker.verifier.scheme
    if reg.put_ground_truth(version, a.rank, a.world, digest, scheme, hashes):
        return
    try:
        existing = reg.get_ground_truth(version, a.rank, a.world, digest, scheme)
        if existing is None:
            return  # expired meanwhile; the next storage loader writes it
        integrity.compare(truth_for_mode(existing, "sampled"), truth_for_mode(hashes, "sampled"))
        return
    except (UntrustedRecordError, WeightVerificationError) as e:
        why = str(e)
    reg.replace_ground_truth(version, a.rank, a.world, digest, scheme, hashes)
    a.log.error("ground_truth_replaced", reason=why)
