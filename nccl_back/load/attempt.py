"""One ``load`` on one rank: what is fixed for it, what its phases produce, and the
reasons a rank gives for not loading from a peer.

Every phase returns what it found (:class:`Discovery`, :class:`~.single_flight.Flight`,
:class:`~.fill.Received` / :class:`~.fill.NotReceived`, a reshard's sources, a member's
share): only the service (:mod:`.service`) writes the :class:`Attempt`, the phases read
it. The one part a phase writes is ``rx`` (:class:`Receiving`), the receive pass's own
state across its passes (:mod:`.fill`, :mod:`.rounds`, :mod:`.asking`).
A rank that found nobody to load from says why with a :class:`NoHolder` (not an
error: its vote sends the worker to the election); :class:`Worker` is what the
service lends every phase.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from nccl_back.budget import Budget
from nccl_back.config import Settings
from nccl_back.coord.consensus import Group
from nccl_back.coord.election import DownloadLease
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import NcclBackError, StrEnum, fallback_reason
from nccl_back.load.verifier import Basis, PositionCheck, Verifier
from nccl_back.metrics import Metrics
from nccl_back.model.identity import ModelSpec
from nccl_back.model.sharding import Sharding
from nccl_back.model.skeleton import Manifest, Model, manifest, model_device, named_tensors
from nccl_back.transport import payload_bytes, relay, resolve_kind
from nccl_back.transport.sender import PeerServer

# -- why a rank does not load from a peer (internal reasons) ------------------------------


class Absence(StrEnum):
    """Why a rank found nobody to load from: not a failure (its vote is "nobody", and the
    worker goes to the election), so not an error either; each value its own case."""

    NOBODY_HOLDS = "nobody_holds"
    """No live peer holds the version at all (the first worker of a rollout)."""
    NOBODY_TRUSTED = "nobody_trusted"
    """Entries for the version exist, but none could be trusted (all were rejected)."""
    NO_TRUTH = "no_truth"
    """Peers hold the version, but the ground truth to verify them against is missing
    (Redis lost its data, a failover to an empty replica): the worker waits in the
    single flight while the holders re-publish it (every heartbeat), rather than read
    storage, as every worker of a rollout would."""
    NO_TRUSTED_TRUTH = "no_trusted_truth"
    """Peers hold the version, but the ground-truth record is not to be trusted (forged,
    wrong type): skipped and waited out like a missing one; holders replace it."""
    STREAM_LOST = "stream_lost"
    """The download streamed to this rank failed and nobody holds the version yet: the
    worker goes back to the election (single flight) once more."""
    NO_LAYOUT_COVER = "no_layout_cover"
    """No live holders of any layout cover this rank's pieces (or their truth is
    missing, disagrees, or does not cover what the Verifier must check)."""


@dataclass(frozen=True)
class NoHolder:
    """A rank's reason for finding nobody to load from: what it found (:class:`Absence`)
    and the detail a fallback reports."""

    absence: Absence
    detail: str

    def __str__(self) -> str:
        return self.detail

    @property
    def code(self) -> str:
        """Its :data:`~nccl_back.errors.FALLBACK_REASONS` code."""
        untrusted = self.absence in (Absence.NOBODY_TRUSTED, Absence.NO_TRUSTED_TRUTH)
        return "untrusted_record" if untrusted else "no_peer"

    @property
    def waits_for_holders(self) -> bool:
        """Entries exist that cannot be used yet: the election downloads only once a live
        holder would have re-published them (within ``peer_ttl``)."""
        return self.absence in (Absence.NOBODY_TRUSTED, Absence.NO_TRUTH,
                                Absence.NO_TRUSTED_TRUTH)

    def also(self, more: str) -> NoHolder:
        return dataclasses.replace(self, detail=f"{self.detail}; {more}")


Reason = NcclBackError | NoHolder
"""A rank's vote against loading from a peer: nobody to load from, or what failed."""


def reason_code(reason: Reason) -> str:
    """The fallback code of ``reason`` (metric label, prefix of ``fallback_reason``)."""
    return reason.code if isinstance(reason, NoHolder) else fallback_reason(reason)


class PeerBusy(Exception):
    """Every send slot of this peer is claimed (wait, don't count a failure)."""


# -- what the phases share ----------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    """This worker's long-lived parts, which the service lends every phase of a load: its
    settings, its connections, its server and cohorts, its metrics, its id, its verifier."""

    settings: Settings
    registry: Registry
    server: PeerServer
    cohorts: relay.Cohorts
    metrics: Metrics
    id: str
    verifier: Verifier


@dataclass(frozen=True)
class Target:
    """What this rank fills, read from its skeleton before discovery."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    device: torch.device
    kind: str
    """Transport this rank speaks (``gloo``/``nccl``), from its device and settings."""

    @classmethod
    def of(cls, model: Model, settings: Settings) -> Target:
        device = model_device(model)
        return cls(manifest(model), named_tensors(model)[0], device, resolve_kind(settings, device))

    def bucket(self, settings: Settings, kind: str) -> int:
        """This rank's step size over ``kind``: derived from its tensors, as the sender's."""
        return settings.bucket_for(kind, payload_bytes(self.tensors))


@dataclass(frozen=True)
class Discovery:
    """What discovery found: holders to try (best first) and the ground truth to verify
    them against, or the stream feeding this rank, or why there is neither."""

    candidates: list[PeerInfo] = field(default_factory=list)
    truth: dict[str, str] | None = None
    stream: relay.Member | None = None
    """The elected downloader's stream this rank's cohort is fed from (no holder yet)."""
    reason: Reason | None = None


@dataclass
class Receiving:
    """What the receive phase keeps across its passes (a pass after a lost stream
    resumes the first one's bytes, within the same budget): the pass's own state, which
    it alone writes (a reshard reads what failed it). Defined here, not beside
    :class:`~.fill.Fill`, because the :class:`Attempt` that holds it is."""

    step_sources: relay.StepSources | None = None
    """Which source put each step in this rank's tensors (resume point, and whom to
    blame when verification fails)."""
    budget: Budget | None = None
    """The deadline shared by every peer attempt of the load (``peer_budget``)."""
    blamed: set[str] = field(default_factory=set)
    """Sources that sent bytes which failed verification (never tried again)."""
    failed: set[str] = field(default_factory=set)
    """Holders that failed this rank (no answer, a broken transfer): a reshard after the
    receive does not ask them again."""
    failed_streams: set[str] = field(default_factory=set)
    """Streams that failed this rank (never tried again, nor counted as a peer)."""
    relay_error: NcclBackError | None = None
    """The last upstream failure in the relay (the reason if nothing else serves us)."""
    seat: relay.Seat | None = None
    """This rank's seat in a cohort's trees while it receives."""

    def start_budget(self, settings: Settings) -> Budget:
        """The load's peer budget, started by its first peer attempt."""
        if self.budget is None:
            self.budget = Budget.of(settings.peer_budget)
        return self.budget

    @property
    def peer_budget(self) -> Budget:
        """The load's peer budget, which every bound of its peer work is carved from."""
        if self.budget is None:
            raise NcclBackError("internal: the load's peer budget never started")
        return self.budget

    @property
    def sources(self) -> relay.StepSources:
        if self.step_sources is None:
            raise NcclBackError("internal: the receive phase never started")
        return self.step_sources


@dataclass
class Attempt:
    """One ``load`` on this rank: its inputs, then what each phase found, recorded by
    the service alone (``rx`` excepted: the receive pass's own)."""

    # Fixed for the load.
    model: Model
    spec: ModelSpec
    group: Group
    rank: int
    world: int
    log: Any
    start: float
    sharding: Sharding | None = None
    """Which pieces of the checkpoint this rank's skeleton holds (a tensor-parallel
    library model); None: every tensor whole."""
    # What the phases produce, in their order.
    prepared: Target | None = None
    found: Discovery = field(default_factory=Discovery)
    truth: dict[str, str] | None = None
    """The ground truth to verify against: discovery's, or a stream's once published."""
    basis: Basis = Basis.NONE
    """How this rank knows its bytes are the checkpoint's (what it may publish)."""
    checked: PositionCheck | None = None
    """What a check in checkpoint coordinates covered (a reshard's)."""
    lease: DownloadLease | None = None
    """Rank 0's download lease of the last single-flight wait (released when the load ends)."""
    cooperative: bool = False
    """This rank can take part in a cooperative download (one rank, the checkpoint's own
    tensors, cohorts on): it joins the download group and may be named a member."""
    member: tuple[int, int] | None = None
    """``(i, n)``: the cooperative download's roster named this worker member ``i`` of
    ``n`` (known on every rank); None when it was not named."""
    share: relay.Share | None = None
    """This member's endpoint serving its part (ended when the load ends)."""
    share_bytes: int = 0
    """Bytes this member read from storage for its share."""
    roster: list[str] | None = None
    """The members this worker, elected, named (itself first); None without a roster."""
    elected: bool = False
    """This worker was elected to download (single flight): it streams its download."""
    rx: Receiving = field(default_factory=Receiving)
    peer_id: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # This rank's vote in the next consensus round.
    reason: Reason | None = None
    """Why this rank cannot (or could not) load from a peer; None while it can."""
    error: Exception | None = None
    """What this rank raised unexpectedly; every rank then stops."""

    @property
    def target(self) -> Target:
        if self.prepared is None:
            raise NcclBackError("internal: the skeleton was never read")
        return self.prepared

    def discovered(self, found: Discovery) -> None:
        """Take ``found`` as what this rank knows of holders (and its vote)."""
        self.found, self.truth, self.reason = found, found.truth, found.reason

    def replica(self) -> relay.Replica:
        """This rank's copy as cohort records key it."""
        t = self.target
        return relay.Replica(self.spec.version, self.rank, self.world, t.manifest.digest,
                             t.kind, t.device, t.tensors)
