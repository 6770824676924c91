"""Publication: after a load, this worker serves the weights to others (fan-out); after
a storage load its hashes become the version's ground truth.

Ground truth is never overwritten by a peer load, and a storage loader's hashes win
over a stored record that is untrusted or disagrees (they passed CRC32C against
storage). Publishing failures never fail a load: the weights are in place.
"""

from __future__ import annotations

from nccl_back import _clock
from nccl_back.coord.registry import encode_truth, truth_for_mode
from nccl_back.errors import RegistryError, UntrustedRecordError, WeightVerificationError
from nccl_back.load.attempt import Attempt, Env
from nccl_back.model import integrity, position_truth
from nccl_back.model.layout import trivial_layout
from nccl_back.result import LoadResult


def peer_loaded(env: Env, a: Attempt) -> LoadResult:
    """The verified peer load's result; this worker then serves the version too."""
    seconds = _clock.perf() - a.start
    man = a.target.manifest
    result = LoadResult(
        source="peer", version=a.spec.version, bytes=man.nbytes, seconds=seconds,
        peer_id=a.peer_id, verified=env.settings.verify != "none", timings=a.timings,
    )
    env.metrics.record_load("peer", man.nbytes, seconds)
    a.log.info("loaded", source="peer", peer=a.peer_id, seconds=round(seconds, 3),
               gbps=round(result.gbps, 3))
    try:
        env.server.publish(a.model, man, a.spec.version, a.rank, a.world, source="peer",
                           log=a.log, truth=encode_truth({env.settings.verify: a.truth})
                           if a.truth else None, model_name=a.spec.name,
                           layout=a.sharding.layout if a.sharding is not None else None)
    except Exception as e:
        # The weights are loaded and verified; only serving others is lost.
        a.log.warning("publish_failed", error=str(e))
    return result


def publish_stored(env: Env, a: Attempt, hashes: dict[str, str]) -> None:
    """After a storage load: claim the ground truth, then serve the version."""
    try:
        claim_ground_truth(env, a, hashes)
    except RegistryError as e:
        # Redis unreachable: the heartbeat stores the truth this worker holds (with
        # its entry) once Redis answers again.
        a.log.warning("ground_truth_deferred", error=str(e))
    positions = publish_positions(env, a)
    try:
        env.server.publish(a.model, a.target.manifest, a.spec.version, a.rank, a.world,
                           source="storage", log=a.log, truth=hashes or None,
                           model_name=a.spec.name, positions=positions,
                           layout=a.sharding.layout if a.sharding is not None else None)
    except Exception as e:  # the rendezvous could not start: serve nobody
        a.log.warning("publish_failed", error=str(e))


def publish_positions(env: Env, a: Attempt) -> position_truth.Macs | None:
    """After a storage load: the truth in checkpoint coordinates of the positions this
    rank holds (:mod:`nccl_back.model.position_truth`), so workers of any layout can
    reshard from it; and its layout, so senders and receivers derive the same plan.
    Returns the MACs (the heartbeat keeps them), None if they could not be made."""
    lay = a.sharding.layout if a.sharding is not None else None
    try:
        held = lay if lay is not None else trivial_layout(a.target.manifest)
        macs = position_truth.held_macs(held, a.target.tensors, env.settings.key("integrity"))
        env.registry.put_position_truth(a.spec.version, a.rank, a.world, held.digest, macs)
        if lay is not None:
            env.registry.put_layout(lay)
        return macs
    except Exception as e:  # only resharding receivers lose: the load is done
        a.log.warning("position_truth_not_published", error=str(e))
        return None


def claim_ground_truth(env: Env, a: Attempt, hashes: dict[str, str]) -> None:
    """Store our hashes as the ground truth; if a stored record is untrusted or
    disagrees with ours, ours win: this worker holds bytes that passed CRC32C
    against storage, so it replaces the record (and says so) instead of letting
    whoever wrote first keep every worker of the version from a verified peer load."""
    reg, version, digest = env.registry, a.spec.version, a.target.manifest.digest
    if reg.put_ground_truth(version, a.rank, a.world, digest, hashes):
        return
    try:
        existing = reg.get_ground_truth(version, a.rank, a.world, digest)
        if existing is None:
            return  # expired meanwhile; the next storage loader writes it
        integrity.compare(truth_for_mode(existing, "sampled"), truth_for_mode(hashes, "sampled"))
        return
    except (UntrustedRecordError, WeightVerificationError) as e:
        why = str(e)
    reg.replace_ground_truth(version, a.rank, a.world, digest, hashes)
    a.log.error("ground_truth_replaced", reason=why)
