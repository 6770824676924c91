"""Cohorts: receivers that arrive together form one pipelined relay, seated in two
binary trees.

With whole 2-rank copies, N receivers of one holder need a binomial tree of
⌈log2(N+1)⌉ rounds. Instead, receivers of the same version, rank and manifest that
arrive at most ``cohort_window`` seconds after the previous arrival join one *cohort*
(at most ``Settings.cohort_limit`` members, then the next cohort starts), seated in
arrival order. The seats form two binary trees (:func:`.topology.seat_upstreams`):
seat p forwards in tree p mod 2 only, each tree carries one half of the steps, every
seat takes both halves at once from its two parents, and the cohort's source (a
holder, or the stream below) sends one half to each root (each from its own idle
holder where there are several); depth grows with log2 of the cohort. A member
forwards step k (a bucket, :mod:`.transport.broadcast`) as soon as step k is in its
own tensors, while step k+1 arrives, so a cohort takes about one transfer plus one
step per level. A late arrival is seated as a leaf and its parents forward what they
already hold at link speed and then follow; so a rolling start (workers arriving one
by one, less than a window apart) joins the trees in flight instead of queueing for a
holder's send slot. Each link is a separate 2-rank communicator (not one NCCL
communicator for the cohort) because a member that dies then breaks its links, not
the whole cohort, and the same code runs on gloo and NCCL. The receiving half is
:mod:`nccl_back.load.tree_parts`.

Failure: a member whose upstream link fails (the upstream died: gloo raises in
~0.3 s; or stalled: no step within ``stall_timeout``) re-attaches to the
nearest member further up its tree, then to the source, resuming at the first step
of that half it lacks; only then does it go to holders, then storage, with the
reason. Its own children wait on its progress meanwhile and never notice. A member
that gives up fails its children's links at once, so they re-attach too. Every member
verifies what it got against the ground truth, as any receiver does. A member whose
verification fails forwards nothing more (its endpoint refuses every request while it
lingers); a member below it, which may hold some of those bytes, finds them in its own
verification, blames the sources that sent the failing bytes (:class:`StepSources`:
not every source of a failing layer), discards what they sent and receives it again
from someone else.

Streamed downloads (single flight). The worker elected to download a version
announces a relay endpoint of its own (:func:`stream`) before it reads storage, and
tells it which tensors are in place as the storage loader fills them (each after its
shard's CRC32C passed): step k can be forwarded once every tensor it carries is
(:class:`Fills`; steps follow sorted names, as checkpoints are sharded, so progress is
a prefix). Waiting workers that see the stream record join a cohort as usual and its
roots receive from the stream, so the cohort finishes about one bucket per level after
the download does, instead of after the download, the publication and a whole relayed
transfer. The stream's receivers have no ground truth yet: they verify against the
hashes the downloader publishes once its load is complete. If the download fails, its
stream fails and its receivers go back to the election (another worker downloads, or
the first one publishes); a stream-fed link allows ``max(stall_timeout,
download_lease)`` between steps, since its pace is storage's.

Registry (keys built by :class:`~nccl_back.coord.keys.Keys`)::

    ns:cohort:{v}:{r}:{w}:{d}                 hash {n, epoch}; TTL cohort_window,
                                              renewed by every arrival
    ns:cohort:{v}:{r}:{w}:{d}:{epoch}:{c}     list of member records, in seat order
                                              (the schema's kind ``chain``)
    ns:stream:{v}:{r}:{w}:{d}                 the downloader's member record; dropped
                                              when its load ends (TTL as a bound)

A member record (JSON, parsed by :func:`nccl_back.coord.records.member`) names where to reach the
member's relay endpoint: ``{"member_id", "address", "transport", "device"}``; the
member answers relay requests pushed to ``ns:req:{member_id}`` with the usual
liveness handshake.
"""

from nccl_back.coord.records import Member
from nccl_back.transport.relay.endpoints import (
    Endpoints,
    Replica,
    Seat,
    Share,
    Stream,
    join,
    stream,
)
from nccl_back.transport.relay.forwarder import RelayServer
from nccl_back.transport.relay.seating import Cohorts, DamagedBytes, Sender
from nccl_back.transport.relay.state import (
    LINGER,
    MAX_RELAY_SENDS,
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
    "MAX_RELAY_SENDS",
    "Member",
    "Endpoints",
    "Place",
    "Progress",
    "RELAY_HANDSHAKE",
    "RelayServer",
    "Replica",
    "STREAM_SENDS",
    "Seat",
    "Sender",
    "Share",
    "Stream",
    "join",
    "stream",
]
