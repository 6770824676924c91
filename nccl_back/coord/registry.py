"""The Redis registry: who holds which version, ground-truth hashes, send slots,
requests, the download lease, the relay's cohorts, handshake values.

:class:`Registry` is the one object the rest of the library holds; it is composed of
the signed key-value layer and one class per record family, each in its own module:

    store.py     SignedStore: client, error mapping, signing and verification, the
                 trust rules, get/set signed, compare-and-set, take-over, reject counts
    keys.py      Keys: the key schema (every key built and parsed there)
    scripts.py   every Lua script
    peers.py     peer entries and their index, the heartbeat, ``nccl-back status``
    truth.py     ground truth
    claims.py    send slots
    leases.py    the single-flight download lease
    cohorts.py   relay cohorts, chains, streamed downloads
    requests.py  transfer requests
    layouts.py   layout descriptions and truth in checkpoint coordinates (resharding)
    artifacts.py artifact sets (compile caches) and their per-model index

Every key lives under ``{namespace}:`` and carries a TTL, so a crashed worker leaves
nothing behind for long. Each kind of record read back is one
:class:`~nccl_back.errors.RecordKind` (the label it is rejected and counted under).
"""

from __future__ import annotations

from nccl_back.coord.artifact_records import ArtifactRecords
from nccl_back.coord.cohorts import CohortRecords
from nccl_back.coord.layouts import LayoutRecords
from nccl_back.coord.leases import LeaseRecords
from nccl_back.coord.peers import PeerRecords, PeerStatus
from nccl_back.coord.records import PeerInfo
from nccl_back.coord.truth import encode_truth, truth_for_mode

__all__ = ["PeerInfo", "PeerStatus", "Registry", "encode_truth", "truth_for_mode"]


class Registry(PeerRecords, LeaseRecords, CohortRecords, LayoutRecords, ArtifactRecords):
    """Typed access to the coordination keys in Redis (every record family).

    Every Redis failure (connection refused, timeout, auth error) is raised as
    :class:`~nccl_back.errors.RegistryError`, chained to the redis-py error, so callers
    fall back on one exception type.
    """

    def handshake_key(self, transfer_id: str, name: str) -> str:
        """A per-transfer key (handshake nonces, refusals), scoped by ``transfer_id``:
        the values themselves are plain signed records (:mod:`.handshake`)."""
        return self.keys.handshake(transfer_id, name)
