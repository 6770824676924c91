"""Discovery: which holders this rank may receive from, and what to verify them against.

Owns the holder policy: a usable holder speaks this rank's transport on its device
kind, is not this worker, is reachable from here and holds this skeleton's manifest;
the registry orders them (least claimed first, ties at random). With nobody holding
the version, an announced stream of the elected downloader may feed this rank instead.
"""

from __future__ import annotations

from nccl_back.coord.registry import PeerInfo
from nccl_back.errors import (
    IncompatiblePeerError,
    ManifestMismatchError,
    NoPeerError,
    RegistryError,
    UntrustedRecordError,
)
from nccl_back.load.attempt import Absence, Attempt, Discovery, NoHolder, Worker
from nccl_back.transport.rendezvous_store import unreachable_reason


def discover(worker: Worker, a: Attempt) -> Discovery:
    """Usable peers and the ground-truth hashes for the verify mode, or why there are none."""
    version, man, s, reg = a.spec.version, a.target.manifest, worker.settings, worker.registry
    where = f"version {version[:12]} rank {a.rank}/{a.world}"
    try:
        rejected = reg.rejected
        peers = _others(worker, a)
        untrusted = reg.rejected - rejected  # peer entries (and index) skipped
        if not peers:
            # The elected downloader's stream first, as sees_peer looks: rejected
            # entries (a dead holder's key an attacker overwrote, an index of another
            # type) must not send to storage a waiter the single flight woke for it.
            stream = worker.cohorts.find_stream(a.replica(), a.rx.failed_streams)
            if stream is not None:
                # The elected downloader streams it; the ground truth comes at its end.
                return Discovery(stream=stream)
            if untrusted:
                return Discovery(reason=NoHolder(Absence.NOBODY_TRUSTED,
                    f"no trusted peer holds {where}:"
                    f" {untrusted} entries rejected (see record_rejected)"))
            return Discovery(reason=NoHolder(Absence.NOBODY_HOLDS, f"no live peer holds {where}"))
        usable = usable_peers(worker, a, peers)
        if not usable:
            t = a.target
            return Discovery(reason=IncompatiblePeerError(
                f"{len(peers)} peer(s) hold version {version[:12]} but none speaks"
                f" {t.kind} on {t.device.type} (theirs: {peers[0].transport} on {peers[0].device})"))
        matching = [p for p in usable if p.manifest_digest == man.digest]
        if not matching:
            return Discovery(reason=ManifestMismatchError(
                f"{len(usable)} peer(s) hold version {version[:12]} with a different manifest"
                f" (theirs {usable[0].manifest_digest[:12]}, ours {man.digest[:12]})"))
        if s.verify == "none":
            return Discovery(candidates=matching)
        try:
            stored = reg.get_ground_truth(version, a.rank, a.world, man.digest, worker.verifier.scheme)
        except UntrustedRecordError as e:
            return Discovery(reason=NoHolder(Absence.NO_TRUSTED_TRUTH,
                f"peers exist but the ground truth for manifest {man.digest[:12]} is not to"
                f" be trusted ({e}); waiting for a holder to replace it (single flight)"))
        if stored is None:
            return Discovery(reason=NoHolder(Absence.NO_TRUTH,
                f"peers exist but no ground-truth hashes for manifest {man.digest[:12]}"
                " to verify against; waiting for a holder to re-publish them (single flight)"))
        expected = worker.verifier.expected(stored)
        if not expected:
            return Discovery(reason=NoPeerError(
                f"ground truth has no {s.verify!r} hashes (set verify on the storage loader too)"))
        return Discovery(candidates=matching, truth=expected)
    except RegistryError as e:
        return Discovery(reason=e)


def holders(worker: Worker, a: Attempt) -> list[PeerInfo]:
    """The usable holders of this rank's manifest now (re-read while all are busy)."""
    found = worker.registry.find_peers(a.spec.version, a.rank, a.world)
    return [p for p in usable_peers(worker, a, found) if p.manifest_digest == a.target.manifest.digest]


def sees_peer(worker: Worker, a: Attempt) -> bool:
    """The single flight's question: is there something for discovery to find now (a
    holder with its ground truth, a stream, or a reason discovery will tell)? A holder
    without its ground truth is no peer yet: it re-publishes it."""
    found = discover(worker, a)
    if isinstance(found.reason, RegistryError):
        raise found.reason  # this rank cannot poll
    return not isinstance(found.reason, NoHolder)


def _others(worker: Worker, a: Attempt) -> list[PeerInfo]:
    """Live entries for this rank's version, but this worker's own."""
    return [p for p in worker.registry.find_peers(a.spec.version, a.rank, a.world)
            if not worker.server.holds(p.peer_id)]


def usable_peers(worker: Worker, a: Attempt, peers: list[PeerInfo]) -> list[PeerInfo]:
    """Peers this rank can talk to: same transport, same device kind, not itself,
    not at an address only its own machine reaches (said why, once per peer)."""
    t = a.target
    out = []
    for p in peers:
        if p.transport != t.kind or p.device != t.device.type or worker.server.holds(p.peer_id):
            continue
        why = unreachable_reason(worker.settings, p.address)
        if why is not None:
            a.log.warning("peer_unreachable", peer=p.peer_id, reason=why)
            continue
        out.append(p)
    return out
