"""Relay cohorts: receivers that arrive together form one pipelined relay, seated in two
binary trees (ARCHITECTURE.md, "The fan-out"; docs/design.md, "Fleets"; the receiving half is
:mod:`nccl_back.load.rounds`). A member forwards step k as soon as it holds it, while
step k+1 arrives. Each link is its own 2-rank communicator, so a dead member breaks its
links, not the cohort, and the same code runs on gloo and NCCL. A streamed download
(:func:`.endpoints.stream`) forwards step k once every tensor it carries passed its
shard's CRC32C (:class:`Fills`); a stream-fed link allows ``max(stall_timeout,
download_lease)`` between steps, since its pace is storage's.
"""

from nccl_back.coord.records import Member
from nccl_back.transport.relay.endpoints import (
    Replica,
    Seat,
    Share,
    Stream,
)
from nccl_back.transport.relay.forwarder import RelayServer
from nccl_back.transport.relay.seating import Cohorts, DamagedBytes
from nccl_back.transport.relay.state import (
    LINGER,
    RELAY_HANDSHAKE,
    STREAM_SENDS,
    Blame,
    Fills,
    Place,
    Progress,
    StepSources,
)

__all__ = [
    "Blame",
    "Cohorts",
    "DamagedBytes",
    "Fills",
    "StepSources",
    "LINGER",
    "Member",
    "Place",
    "Progress",
    "RELAY_HANDSHAKE",
    "RelayServer",
    "Replica",
    "STREAM_SENDS",
    "Seat",
    "Share",
    "Stream",
]
