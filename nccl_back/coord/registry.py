"""The Redis registry: one object composed of the signed key-value layer
(:mod:`.signed_store`) and one class per record family (ARCHITECTURE.md lists them).

Every key lives under ``{namespace}:`` and carries a TTL, so a crashed worker leaves
nothing behind for long.
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
    """Typed access to the coordination keys in Redis (every record family); every Redis
    failure is raised as :class:`~nccl_back.errors.RegistryError`."""
