"""Relay cohorts: receivers that arrive together form one pipelined relay, seated in two
binary trees (ARCHITECTURE.md, "The fan-out"; the receiving half is
:mod:`nccl_back.load.rounds`).

A member forwards step k as soon as it holds it, while step k+1 arrives. Each link is its
own 2-rank communicator, so a dead member breaks its links, not the cohort, and the same
code runs on gloo and NCCL.

Failure: a member whose upstream dies or stalls re-attaches to the nearest member further
up its tree, then to the source, resuming at the first step it lacks; only then holders,
then storage. A member that gives up fails its children's links at once so they
re-attach too. A member whose verification fails forwards nothing more; one below it
blames only the sources of the failing steps (:class:`StepSources`) and receives those
again from someone else.

Streamed downloads: the worker elected to download announces a relay endpoint
(:func:`.endpoints.stream`) before it reads storage and forwards step k once every
tensor it carries passed its shard's CRC32C (:class:`Fills`), so a waiting cohort
finishes about one bucket per level after the download. Its receivers verify against
the hashes the downloader publishes at the end; a stream-fed link allows
``max(stall_timeout, download_lease)`` between steps, since its pace is storage's.
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
