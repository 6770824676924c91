"""Receive / serve orchestration: the protocol's layers put together.

``WeightService.load(model, spec, group)`` on each rank of a worker:

1. *Discovery* — live peers holding ``spec.version`` for this rank that speak this
   rank's transport on its device kind (registry), the ground-truth hashes of this
   skeleton flavour, and whether the peers' manifest matches this skeleton's.
2. *Single flight* — when some rank finds nobody holding the version, the worker as a
   whole waits: its rank 0 tries the download lease, and one collective per poll tells
   every rank whether all of them see a peer or rank 0 was elected (election.py).
3. *Peer attempts* — claim a send slot (short TTL, renewed while the attempt runs),
   liveness handshake, guarded transfer (a short connect deadline, then the transfer's),
   verification against the ground truth; on failure the next peer.
4. *Storage* — unless every rank succeeded, every rank loads from storage.
5. *Publication* — after a storage load the hashes become the ground truth (never
   overwritten); after a verified peer load the worker serves others too (fan-out).

Between the phases every rank takes part in a consensus round
(:func:`nccl_back.coord.consensus.gather`): each rank's code (ok / no peer at all / peer load
failed / raised) reaches every rank, and every rank takes the same decision from the
same codes. So all ranks return the same ``source``, or all raise: a rank that raised
re-raises its own error, the others a :class:`ConsensusError` naming it. ``strict`` is
decided from the same codes, after the round, so it too is all or nothing.

While the service is open, its :class:`~nccl_back.transport.sender.PeerServer` answers transfer
requests in the background and a heartbeat keeps its registry entries alive;
``close()`` withdraws them.
Every fallback is logged with its reason and returned in ``LoadResult.fallback_reason``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nccl_back.config import Settings
from nccl_back.coord.auth import transfer_scope, warn_unsigned
from nccl_back.coord.consensus import Group, gather, rank_and_size
from nccl_back.coord.election import DownloadLease, elect
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.registry import PeerInfo, Registry, encode_truth, truth_for_mode
from nccl_back.errors import (
    ConsensusError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    ManifestMismatchError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    TransferTimeoutError,
    UntrustedRecordError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.log import get_logger
from nccl_back.metrics import Metrics
from nccl_back.model import integrity
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import Manifest, Model, manifest, model_device, named_tensors
from nccl_back.result import LoadResult
from nccl_back.transport import (
    payload_bytes,
    plan,
    receiver_transport,
    recv_tensors,
    relay,
    resolve_kind,
    run_guarded,
)
from nccl_back.transport.broadcast import resume_point
from nccl_back.transport.sender import PeerServer
from nccl_back.transport.store import unreachable_reason

# One rank's code in a consensus round (the worst code decides).
OK, NOBODY, FAILED, RAISED = 0, 1, 2, 3
_WHAT = {NOBODY: "found no peer holding the version", FAILED: "could not load from a peer",
         RAISED: "raised an error"}

#: Fills a skeleton from storage: ``(model, spec, settings) -> LoadResult``. The default
#: reads the checkpoint; an engine adapter passes its engine's own loader.
StorageLoader = Callable[[Model, ModelSpec, Settings], LoadResult]


def _load_checkpoint(model: Model, spec: ModelSpec, settings: Settings,
                     on_filled: Callable[[str], None] | None = None) -> LoadResult:
    return load_from_storage(model, spec, settings=settings, on_filled=on_filled)


class NobodyHolds(NoPeerError):
    """No live peer holds the version at all (the first worker of a rollout)."""


class NobodyTrusted(NobodyHolds, UntrustedRecordError):
    """Entries for the version exist, but none could be trusted (all were rejected)."""


class NoTruth(NobodyHolds):
    """Peers hold the version, but the ground truth to verify them against is missing
    (Redis lost its data, a failover to an empty replica): the worker waits in the
    single flight while the holders re-publish it (every heartbeat), rather than read
    storage, as every worker of a rollout would."""


class NoTrustedTruth(NoTruth, UntrustedRecordError):
    """Peers hold the version, but the ground-truth record is not to be trusted (forged,
    wrong type): skipped and waited out like a missing one; holders replace it."""


class StreamLost(NobodyHolds):
    """The download streamed to this rank failed and nobody holds the version yet: the
    worker goes back to the election (single flight) once more."""


class DamagedBytes(WeightVerificationError):
    """Verification failed after a transfer; ``blamed`` names the sources (holders, relay
    members, a stream) that sent the steps carrying the failing layers. What they sent
    was discarded, so the next source sends it again. Internal: what a load reports
    (or raises with ``strict``) is :attr:`error`, the integrity check's own error."""

    def __init__(self, error: WeightVerificationError, blamed: set[str]) -> None:
        super().__init__(str(error))
        self.error = error
        self.blamed = frozenset(blamed)


class PeerBusy(Exception):
    """Internal: every send slot of this peer is claimed (wait, don't count a failure)."""


@dataclass
class _Attempt:
    """One ``load`` on this rank: its inputs and what each phase found."""

    model: Model
    spec: ModelSpec
    group: Group
    rank: int
    world: int
    log: Any
    start: float
    timings: dict[str, float] = field(default_factory=dict)
    man: Manifest | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    kind: str = ""
    """Transport this rank speaks (``gloo``/``nccl``), from its device and settings."""
    candidates: list[PeerInfo] = field(default_factory=list)
    truth: dict[str, str] | None = None
    reason: NcclBackError | None = None
    """Why this rank cannot (or could not) load from a peer; None while it can."""
    error: Exception | None = None
    """What this rank raised unexpectedly; every rank then stops."""
    peer_id: str | None = None
    lease: DownloadLease | None = None
    stored_bytes: int = 0
    chain: relay.Chain | None = None
    """This rank's seat in a cohort (relay chain) while it receives."""
    elected: bool = False
    """This worker was elected to download (single flight): it streams its download."""
    stream: relay.Member | None = None
    """The elected downloader's stream this rank's cohort is fed from (no holder yet)."""
    failed_streams: set[str] = field(default_factory=set)
    """Streams that failed this rank (never tried again, nor counted as a peer)."""
    relay_error: NcclBackError | None = None
    """The last upstream failure in a relay chain (the reason if nothing else serves us)."""
    held: relay.Held | None = None
    """Which source put each step in this rank's tensors, kept across every peer
    attempt of the load (resume point, and whom to blame when verification fails)."""
    budget: float | None = None
    """Monotonic deadline shared by every peer attempt of the load (``peer_budget``)."""
    blamed: set[str] = field(default_factory=set)
    """Sources that sent bytes which failed verification (never tried again)."""

    @property
    def code(self) -> int:
        if self.error is not None:
            return RAISED
        if self.reason is None:
            return OK
        return NOBODY if isinstance(self.reason, NobodyHolds) else FAILED

    def bucket(self, settings: Settings, kind: str) -> int:
        """This rank's step size over ``kind``: derived from its tensors, as the sender's."""
        return settings.bucket_for(kind, payload_bytes(self.tensors))

    @property
    def holding(self) -> relay.Held:
        """:attr:`held`, once the receive phase has started."""
        if self.held is None:
            raise NcclBackError("internal: the receive phase never started")
        return self.held

    @property
    def manifest(self) -> Manifest:
        if self.man is None:
            raise NcclBackError("internal: the skeleton's manifest was never computed")
        return self.man


class WeightService:
    """Loads weights from a peer (storage as fallback) and serves them while open.

    Use as a context manager, or call :meth:`close`. Thread-safe for one ``load`` at a
    time per rank; serving runs in background threads. ``engine`` says what runs this
    worker (``library``, ``sidecar``, ``vllm-0.32.0`` ...): ``nccl-back status`` shows it
    with the host, the process id and the model's name.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        metrics: Metrics | None = None,
        worker_id: str | None = None,
        registry: Registry | None = None,
        storage_loader: StorageLoader = _load_checkpoint,
        engine: str = "library",
    ) -> None:
        self._storage_loader = storage_loader
        self.settings = settings if settings is not None else Settings.from_env()
        self.metrics = metrics if metrics is not None else Metrics()
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.registry = registry if registry is not None else Registry(self.settings)
        self.registry.on_untrusted = self.metrics.record_untrusted
        self._server = PeerServer(self.settings, self.registry, self.metrics, self.worker_id,
                                  engine=engine)
        self._closed = False
        self._relays: list[relay.RelayServer] = []
        self._relay_lock = threading.Lock()
        self._log = get_logger("nccl_back.load.service", worker=self.worker_id)

    # -- public API ---------------------------------------------------------------------

    def __enter__(self) -> WeightService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peers(self) -> list[PeerInfo]:
        """What this worker currently publishes."""
        return self._server.peers

    @property
    def active_sends(self) -> int:
        """Transfers this worker is sending right now."""
        return self._server.active_sends

    def served_tensors(self, peer_id: str) -> dict[str, torch.Tensor]:
        """The tensors a send of this worker's entry ``peer_id`` would read now."""
        return self._server.served_tensors(peer_id)

    def load(self, model: Model, spec: ModelSpec, group: Group = None) -> LoadResult:
        """Fill the skeleton ``model`` with ``spec``'s weights, from a peer if possible.

        ``group`` is the worker's own process group (tensor/pipeline parallel) or None.
        Every rank of the group must call ``load`` with its own sub-module skeleton; all
        of them return the same ``source`` or all raise (a rank that failed raises its
        own error, the others :class:`ConsensusError` naming it). Returns a verified
        :class:`LoadResult`. With ``Settings(strict=True)`` a failed peer load on any rank
        makes every rank raise instead of falling back (no peer at all is not a failure).
        """
        if self._closed:
            raise NcclBackError("WeightService is closed")
        if self.settings.secret is None:
            warn_unsigned()  # once per process: this worker trusts whoever writes to Redis
        rank, world = rank_and_size(group)
        a = _Attempt(model, spec, group, rank, world,
                     log=self._log.bind(rank=rank, version=spec.version[:12]),
                     start=time.perf_counter())
        try:
            return self._load(a)
        finally:
            if a.lease is not None:
                a.lease.release()

    def serve(self, model: Model, spec: ModelSpec, group: Group = None) -> PeerInfo:
        """Publish a model this worker already holds (loaded by its own code) and serve it.

        Never writes ground truth: receivers verify what they get from this worker
        against the hashes of a storage load, as for any other peer.
        """
        if self._closed:
            raise NcclBackError("WeightService is closed")
        if self.settings.secret is None:
            warn_unsigned()  # once per process: this worker trusts whoever writes to Redis
        rank, world = rank_and_size(group)
        log = self._log.bind(rank=rank, version=spec.version[:12])
        return self._server.publish(model, manifest(model), spec.version, rank, world,
                                    source="adopted", log=log, model_name=spec.name)

    def close(self) -> None:
        """Stop serving, withdraw every published entry, release sockets and threads.

        Once it returns, no registry entry of this worker reappears.
        """
        if self._closed:
            return
        self._closed = True
        with self._relay_lock:
            relays, self._relays = self._relays, []
        for r in relays:
            r.close(self.settings.redis_timeout + 1)
        self._server.close()
        with contextlib.suppress(Exception):
            self.registry.close()
        self._log.info("closed")

    def abort_sends(self) -> int:
        """Abort every in-flight send (a drain past its bound); see :class:`PeerServer`."""
        return self._server.abort_sends()

    def withdraw(self) -> None:
        """Stop accepting new transfers (drain): remove this worker from the registry.

        In-flight sends finish; queued ones are refused; :meth:`close` still has to be called.
        """
        self._server.withdraw()

    # -- the phases -----------------------------------------------------------------------

    def _load(self, a: _Attempt) -> LoadResult:
        t = time.perf_counter()
        self._step(a, self._prepare)
        codes = self._round(a, "discovery")
        # Twice at most: again when the download streamed to us failed (StreamLost).
        for _ in range(2):
            if max(codes) == NOBODY:
                self._single_flight(a)
                codes = self._round(a, "single flight")
            a.timings["discovery"] = time.perf_counter() - t
            if max(codes) != OK:
                break
            t = time.perf_counter()
            self._step(a, self._receive_any)
            a.timings["peer"] = time.perf_counter() - t
            codes = self._round(a, "peer load")
            if max(codes) == OK:
                return self._peer_loaded(a)
            if max(codes) != NOBODY:  # NOBODY now: some rank's stream was lost
                break
            t = time.perf_counter()

        self._follow(a, codes)
        if self.settings.strict and FAILED in codes:
            self._raise_strict(a, codes)
        return self._storage(a)

    def _step(self, a: _Attempt, phase: Callable[[_Attempt], None]) -> None:
        """Run ``phase``; whatever it raises becomes this rank's vote, never an early exit."""
        try:
            phase(a)
        except Exception as e:
            a.error = e
            a.log.error("rank_failed", phase=phase.__name__.strip("_"), error=repr(e))

    def _round(self, a: _Attempt, what: str) -> list[int]:
        """One consensus round: every rank's code, on every rank; raise if any rank raised."""
        codes = gather(a.code, a.group)
        raised = [r for r, c in enumerate(codes) if c == RAISED]
        if raised:
            if a.error is not None:
                raise a.error
            raise ConsensusError(
                f"rank {raised[0]} of this worker raised an error during {what};"
                " every rank stops (see that rank's error)", failed_rank=raised[0],
            )
        return codes

    def _follow(self, a: _Attempt, codes: list[int]) -> None:
        """The group goes to storage: a rank that could have gone on says which rank didn't."""
        a.peer_id = None
        if a.reason is None:
            worst = max(codes)
            r = codes.index(worst)
            a.reason = ConsensusError(f"rank {r} of this worker {_WHAT[worst]}", failed_rank=r)

    def _raise_strict(self, a: _Attempt, codes: list[int]) -> None:
        if codes[a.rank] == FAILED and a.reason is not None:
            raise a.reason
        r = codes.index(FAILED)
        raise ConsensusError(
            f"strict: rank {r} of this worker could not load from a peer; every rank raises",
            failed_rank=r,
        )

    def _prepare(self, a: _Attempt) -> None:
        a.man = manifest(a.model)
        a.tensors, _ = named_tensors(a.model)
        a.device = model_device(a.model)
        a.kind = resolve_kind(self.settings, a.device)
        self._discover(a)

    def _single_flight(self, a: _Attempt) -> None:
        """Some rank found nobody holding the version: wait as a group, or download."""
        if a.error is not None:
            return
        s = self.settings
        version = a.spec.version
        if a.rank == 0:
            a.lease = DownloadLease(self.registry, version, a.world, self.worker_id, s.download_lease)
        waited = time.monotonic()

        def sees_peer() -> bool:
            peers = [p for p in self.registry.find_peers(version, a.rank, a.world)
                     if not self._server.holds(p.peer_id)]
            if not peers:
                return self._find_stream(a) is not None
            matching = [p for p in self._usable(peers, a)
                        if a.man is not None and p.manifest_digest == a.man.digest]
            if not matching or s.verify == "none" or a.man is None:
                return True  # discovery says what is wrong (or that nothing is)
            # A holder without its ground truth is no peer yet: it re-publishes it.
            try:
                return self.registry.get_ground_truth(version, a.rank, a.world, a.man.digest) is not None
            except UntrustedRecordError:
                return False

        # Holders re-publish their entry and truth at every heartbeat, over whatever
        # Redis lost or an attacker wrote there: while entries exist that cannot be used
        # (rejected, or no truth to verify them), this worker downloads only once a live
        # holder would have re-published (within peer_ttl, or it counts as dead). The
        # single flight still holds: one of the waiters takes the lease.
        after = s.peer_ttl if isinstance(a.reason, (NoTruth, NobodyTrusted)) else 0.0
        outcome, who, error = elect(a.lease, sees_peer, a.group, a.rank, s, lease_after=after)
        waited = round(time.monotonic() - waited, 3)
        if outcome == "peer":
            a.log.info("single_flight_peer_appeared", waited=waited)
            self._step(a, self._discover)
        elif outcome == "elected":
            a.log.info("single_flight_elected", waited=waited)
            a.elected = True
            if isinstance(a.reason, NobodyHolds):
                # Same class: "nobody trusted" keeps its own fallback reason.
                a.reason = type(a.reason)(
                    f"{a.reason}; this worker was elected to download it (single flight)"
                )
        elif outcome == "timeout":
            a.reason = NoPeerError(
                f"waited {waited:g} s (single_flight_wait {s.single_flight_wait:g} s, at most"
                f" single_flight_max_wait {s.single_flight_max_wait:g} s while the elected"
                " downloader lives) for it to publish; downloading too"
            )
        elif error is not None:  # this rank could not poll; the others follow it
            if isinstance(error, NcclBackError):
                a.reason = error
            else:
                a.error = error
        else:
            a.log.warning("single_flight_rank_failed", failed_rank=who)

    # -- receive ------------------------------------------------------------------------

    def _discover(self, a: _Attempt) -> None:
        """Usable peers and the ground-truth hashes for the verify mode, or why there are none."""
        a.candidates, a.truth, a.reason, a.stream = [], None, None, None
        version, man, s = a.spec.version, a.manifest, self.settings
        try:
            rejected = self.registry.rejected
            peers = [p for p in self.registry.find_peers(version, a.rank, a.world)
                     if not self._server.holds(p.peer_id)]
            if not peers and self.registry.rejected > rejected:
                a.reason = NobodyTrusted(
                    f"no trusted peer holds version {version[:12]} rank {a.rank}/{a.world}:"
                    f" {self.registry.rejected - rejected} entries rejected (see record_rejected)"
                )
                return
            if not peers:
                a.stream = self._find_stream(a)
                if a.stream is None:
                    a.reason = NobodyHolds(
                        f"no live peer holds version {version[:12]} rank {a.rank}/{a.world}"
                    )
                # else: the elected downloader streams it; ground truth comes at its end
                return
            usable = self._usable(peers, a)
            if not usable:
                a.reason = IncompatiblePeerError(
                    f"{len(peers)} peer(s) hold version {version[:12]} but none speaks"
                    f" {a.kind} on {a.device.type} (theirs: {peers[0].transport} on {peers[0].device})"
                )
                return
            matching = [p for p in usable if p.manifest_digest == man.digest]
            if not matching:
                a.reason = ManifestMismatchError(
                    f"{len(usable)} peer(s) hold version {version[:12]} with a different manifest"
                    f" (theirs {usable[0].manifest_digest[:12]}, ours {man.digest[:12]})"
                )
                return
            if s.verify == "none":
                a.candidates = matching
                return
            try:
                stored = self.registry.get_ground_truth(version, a.rank, a.world, man.digest)
            except UntrustedRecordError as e:
                a.reason = NoTrustedTruth(
                    f"peers exist but the ground truth for manifest {man.digest[:12]} is not to"
                    f" be trusted ({e}); waiting for a holder to replace it (single flight)"
                )
                return
            if stored is None:
                a.reason = NoTruth(
                    f"peers exist but no ground-truth hashes for manifest {man.digest[:12]}"
                    " to verify against; waiting for a holder to re-publish them (single flight)"
                )
                return
            expected = truth_for_mode(stored, s.verify)
            if not expected:
                a.reason = NoPeerError(
                    f"ground truth has no {s.verify!r} hashes (set verify on the storage loader too)"
                )
                return
            a.candidates, a.truth = matching, expected
        except RegistryError as e:
            a.reason = e

    def _find_stream(self, a: _Attempt) -> relay.Member | None:
        """The elected downloader's stream of this rank's flavour, if one is announced,
        speaks our transport and has not failed us (cohorts only: it feeds a chain)."""
        if self.settings.cohort_max_size <= 1 or a.man is None:
            return None
        raw = self.registry.get_stream(a.spec.version, a.rank, a.world, a.man.digest)
        if raw is None:
            return None
        try:
            m = relay.parse_member(raw)
        except UntrustedRecordError as e:
            a.log.warning("stream_record_skipped", reason=str(e))
            return None
        if (m.member_id in a.failed_streams or m.member_id.startswith(self.worker_id + "-")
                or m.transport != a.kind or m.device != a.device.type):
            return None
        return m

    def _usable(self, peers: list[PeerInfo], a: _Attempt) -> list[PeerInfo]:
        """Peers this rank can talk to: same transport, same device kind, not itself,
        not at an address only its own machine reaches (said why, once per peer)."""
        out = []
        for p in peers:
            if p.transport != a.kind or p.device != a.device.type or self._server.holds(p.peer_id):
                continue
            why = unreachable_reason(self.settings, p.address)
            if why is not None:
                a.log.warning("peer_unreachable", peer=p.peer_id, reason=why)
                continue
            out.append(p)
        return out

    def _receive_any(self, a: _Attempt) -> None:
        """Receive through this rank's cohort (relay chain) if it has one upstream of
        us, else from holders; sets ``a.peer_id`` or ``a.reason``.

        Called twice when the first pass was fed by a stream that was lost: both passes
        share one budget and what the first one received (and did not discard)."""
        s = self.settings
        if a.held is None:
            a.held = relay.Held(plan(a.tensors, a.bucket(s, a.kind)))
        if a.budget is None:
            # One budget for every peer attempt of this load: holders, relay upstreams,
            # the stream and the pass after a lost stream. A stream-fed load may wait
            # for the whole download, as the election would have: the automatic budget
            # covers that wait; one set by the operator bounds everything.
            wait = s.single_flight_max_wait if s.peer_budget == 0 and a.stream is not None else 0.0
            a.budget = time.monotonic() + s.peer_budget_seconds + wait
        if self._budget_spent(a, a.relay_error):
            return
        chain = self._join_cohort(a)
        a.chain = chain
        if chain is not None and a.held.done:
            chain.progress.advance(a.held.done - 1)  # what an earlier pass left us
        try:
            if (chain is not None and (chain.position > 0 or a.stream is not None)
                    and self._receive_relayed(chain, a)):
                return
            if self._budget_spent(a, a.relay_error):
                return
            if a.reason is None and not a.candidates:
                # Fed by a stream that failed us: the downloader may have published since.
                self._discover(a)
                if not a.candidates and (a.reason is None or isinstance(a.reason, NobodyHolds)):
                    a.reason = StreamLost(
                        f"the download streamed to this rank failed ({a.relay_error}) and no"
                        " peer holds the version yet; back to the election")
            if a.reason is None:
                self._receive_from_holders(a)
        finally:
            if chain is not None:
                chain.end(a.peer_id is not None, str(a.reason or ""))

    def _join_cohort(self, a: _Attempt) -> relay.Chain | None:
        """A seat in the current cohort for this rank, or None (cohorts off, or Redis or
        the rendezvous failed: then this rank receives on its own, as without cohorts)."""
        s = self.settings
        if s.cohort_max_size <= 1:
            return None
        try:
            chain = relay.join(self._relay_place(a))
        except NcclBackError as e:
            a.log.warning("cohort_join_failed", error=str(e))
            return None
        self._track(chain.server)
        return chain

    def _relay_place(self, a: _Attempt) -> relay.Place:
        """Where this rank's relay endpoints live (raises if the rendezvous fails)."""
        return relay.Place(
            self.settings, self.registry, self._server.rendezvous(a.kind, a.device),
            self.worker_id, a.spec.version, a.rank, a.world, a.manifest.digest, a.kind,
            a.device, a.tensors, self._server.pacer, a.log, self.metrics,
        )

    def _track(self, server: relay.RelayServer) -> None:
        """Keep ``server`` for :meth:`close` (dropping the endpoints that stopped)."""
        with self._relay_lock:
            self._relays = [r for r in self._relays if r.alive] + [server]

    def _receive_relayed(self, chain: relay.Chain, a: _Attempt) -> bool:
        """Receive from the nearest live member upstream of us, re-attaching further up
        when one fails (resuming at the first step we lack). False: none could serve us
        by the chain's deadline; the caller tries holders, from where we stopped."""
        s = self.settings
        deadline = time.monotonic() + s.transfer_timeout + s.receiver_handshake_timeout
        if a.stream is not None:  # we may wait for the whole download, as in the election
            deadline += s.single_flight_max_wait
        deadline = min(deadline, a.budget if a.budget is not None else deadline)
        while time.monotonic() < deadline:
            try:
                upstreams = chain.upstreams()
            except RegistryError as e:
                a.log.warning("cohort_read_failed", error=str(e))
                return False
            if a.stream is not None and a.stream.member_id not in chain.failed:
                upstreams.append(a.stream)  # the cohort's source, or past every member
            if not upstreams:
                return False
            member = upstreams[0]
            try:
                if member.transport != a.kind or member.device != a.device.type:
                    raise IncompatiblePeerError(
                        f"cohort member {member.member_id} speaks {member.transport} on {member.device}")
                why = unreachable_reason(s, member.address)
                if why is not None:  # not worth a handshake: try the next one now
                    raise IncompatiblePeerError(f"cohort member {member.member_id}: {why}")
                self._receive_from_member(member, chain, a, deadline)
                a.peer_id = member.member_id
                return True
            except WeightVerificationError as e:
                # Whoever sent the failing steps is never asked again and what it sent
                # is gone: the next upstream (or a holder) sends it again.
                blamed = self._blame(a, e, member.member_id)
                chain.failed.update(blamed)
                if a.stream is not None and a.stream.member_id in blamed:
                    a.failed_streams.add(a.stream.member_id)
                a.relay_error = e.error if isinstance(e, DamagedBytes) else e
            except PeerError as e:
                chain.failed.add(member.member_id)
                a.relay_error = e
                if a.stream is not None and member.member_id == a.stream.member_id:
                    a.failed_streams.add(member.member_id)
                if isinstance(e, HandshakeTimeoutError):
                    self.metrics.record_handshake_timeout()
                a.log.warning("relay_upstream_failed", peer=member.member_id,
                              held_steps=chain.progress.done, reason=fallback_reason(e),
                              error=str(e))
            except RegistryError as e:
                a.log.warning("relay_upstream_failed", peer=member.member_id, error=str(e))
                return False
        return False

    def _receive_from_member(self, member: relay.Member, chain: relay.Chain, a: _Attempt,
                             deadline: float) -> None:
        s = self.settings
        transfer_id = uuid.uuid4().hex
        start = resume_point(plan(a.tensors, a.bucket(s, a.kind)), a.tensors, a.holding.done)
        request = {
            "transfer_id": transfer_id, "receiver": self.worker_id, "version": a.spec.version,
            "manifest_digest": a.manifest.digest, "transport": a.kind, "device": a.device.type,
            "start": start,
        }
        t = time.perf_counter()
        run_receiver(
            self.registry, transfer_id, a.manifest.digest,
            min(s.receiver_handshake_timeout, relay.RELAY_HANDSHAKE,
                max(deadline - time.monotonic(), 0.001)),
            after_ready=lambda: self.registry.push_request(member.member_id, request),
        )
        a.timings["handshake"] = time.perf_counter() - t
        # A chain fed by a download moves at storage's pace: a step may take a shard's
        # download; a downloader that stops renewing its lease is given up on as long.
        stall = (max(s.relay_stall_timeout, s.download_lease) if a.stream is not None
                 else s.relay_stall_timeout)
        self._transfer(a, member.member_id, member.transport, member.address, transfer_id,
                       start=start, deadline=deadline, stall=stall)

    def _receive_from_holders(self, a: _Attempt) -> None:
        """Try peers until one transfer verifies; sets ``a.peer_id`` or ``a.reason``.

        A peer whose send slots are all claimed is not a failure: the receiver waits
        (re-discovering, so receivers that finished meanwhile become candidates) up to
        ``settings.busy_wait``. Real failures count towards ``max_peer_attempts``; a
        verification failure counts against the sources that sent the failing steps
        only: a holder that did not is asked again (it then sends what was discarded).
        """
        s = self.settings
        last: NcclBackError = NoPeerError("no peer tried")
        failed: set[str] = set()
        deadline = time.monotonic() + s.busy_wait
        candidates = a.candidates
        while True:
            busy = 0
            i = 0
            while i < len(candidates):
                peer = candidates[i]
                if peer.peer_id in failed or peer.peer_id in a.blamed:
                    i += 1
                    continue
                if self._budget_spent(a, last):
                    return
                try:
                    self._receive_from(peer, a)
                    a.peer_id = peer.peer_id
                    return
                except PeerBusy:
                    busy += 1
                    i += 1
                    continue
                except WeightVerificationError as e:
                    last = e.error if isinstance(e, DamagedBytes) else e
                    if peer.peer_id not in self._blame(a, e, peer.peer_id):
                        continue  # the same holder again, from the first discarded step
                    failed.add(peer.peer_id)
                    i += 1
                    if len(failed) >= s.max_peer_attempts:
                        a.reason = last
                        return
                except PeerError as e:
                    last = e
                    failed.add(peer.peer_id)
                    i += 1
                    if isinstance(e, HandshakeTimeoutError):
                        self.metrics.record_handshake_timeout()
                    a.log.warning("peer_attempt_failed", peer=peer.peer_id,
                                  reason=fallback_reason(e), error=str(e))
                    if len(failed) >= s.max_peer_attempts:
                        a.reason = last
                        return
                except RegistryError as e:
                    a.reason = e
                    return
            if busy == 0 or time.monotonic() >= min(deadline, a.budget or deadline):
                if busy:
                    last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                a.reason = last
                return
            time.sleep(0.05)
            try:
                found = self.registry.find_peers(a.spec.version, a.rank, a.world)
            except RegistryError as e:
                a.reason = e
                return
            candidates = [p for p in self._usable(found, a) if p.manifest_digest == a.manifest.digest]

    def _budget_spent(self, a: _Attempt, last: BaseException | None) -> bool:
        """True (and ``a.reason`` set) once the load's peer budget is spent."""
        if a.budget is None or time.monotonic() < a.budget:
            return False
        a.reason = NoPeerError(
            f"peer attempts spent their budget of {self.settings.peer_budget_seconds:g} s"
            f" (peer_budget); last: {last}"
        )
        return True

    def _blame(self, a: _Attempt, e: WeightVerificationError, tried: str) -> set[str]:
        """Record a verification failure against the sources that sent the failing steps
        (``tried`` when they cannot be told); returns them."""
        blamed = set(e.blamed) if isinstance(e, DamagedBytes) else {tried}
        a.blamed |= blamed
        self.metrics.record_verification_failure()
        for src in sorted(blamed):
            a.log.warning("peer_attempt_failed", peer=src, reason="verification_failed",
                          via=tried, error=str(e))
        if tried not in blamed:
            a.log.info("peer_attempt_retried", peer=tried, blamed=sorted(blamed),
                       held_steps=a.holding.done)
        return blamed

    def _receive_from(self, peer: PeerInfo, a: _Attempt) -> None:
        s = self.settings
        budget = a.budget if a.budget is not None else time.monotonic() + s.peer_budget_seconds
        token = self.registry.claim(peer.peer_id, self.worker_id, peer.max_sends, s.claim_ttl)
        if token is None:
            raise PeerBusy(peer.peer_id)
        try:
            with _kept(self.registry, peer.peer_id, token, s.claim_ttl, a.log):
                transfer_id = uuid.uuid4().hex
                # Resume what earlier sources gave us (and verification did not discard).
                start = resume_point(plan(a.tensors, a.bucket(s, peer.transport)),
                                     a.tensors, a.holding.done)
                request = {
                    "transfer_id": transfer_id,
                    "receiver": self.worker_id,
                    "version": peer.version,
                    "manifest_digest": a.manifest.digest,
                    "transport": a.kind,
                    "device": a.device.type,
                    "claim": token,
                    "start": start,
                }
                t = time.perf_counter()
                run_receiver(
                    self.registry, transfer_id, a.manifest.digest,
                    max(min(s.receiver_handshake_timeout, budget - time.monotonic()), 0.001),
                    after_ready=lambda: self.registry.push_request(peer.peer_id, request),
                )
                a.timings["handshake"] = time.perf_counter() - t
                self._transfer(a, peer.peer_id, peer.transport, peer.address, transfer_id,
                               start=start,
                               deadline=min(time.monotonic() + s.transfer_timeout, budget))
        finally:
            with contextlib.suppress(RegistryError):
                self.registry.release(peer.peer_id, token)

    def _transfer(self, a: _Attempt, source: str, kind: str, address: str, transfer_id: str,
                  *, start: int, deadline: float, stall: float | None = None) -> None:
        """The guarded transfer from ``source`` from step ``start`` (each step recorded as
        ``source``'s and reported to this rank's chain), then verification against the
        ground truth: :class:`DamagedBytes` if it fails."""
        s = self.settings
        t = time.perf_counter()
        transport = receiver_transport(s, kind, address, transfer_scope(s.key("store"), transfer_id),
                                       device=a.device, registry=self.registry)
        held = a.holding
        progress = a.chain.progress if a.chain is not None else None

        def on_step(k: int) -> None:
            held.record(k, source)
            if progress is not None:
                progress.advance(k)

        now = time.monotonic()
        run_guarded(
            transport,
            lambda tr: recv_tensors(tr, a.tensors, a.bucket(s, kind), start=start, on_step=on_step),
            deadline,
            connect_deadline=min(now + s.connect_timeout, deadline),
            # Every path: a silent peer costs the stall bound, not the deadline.
            stall=s.stall_timeout if stall is None else stall,
        )
        a.timings["transfer"] = time.perf_counter() - t
        if a.truth is None and a.stream is not None and s.verify != "none":
            t = time.perf_counter()
            a.truth = self._await_truth(a, deadline)
            a.timings["await_truth"] = time.perf_counter() - t
        if a.truth is not None:
            t = time.perf_counter()
            self._verify(a, a.truth)
            a.timings["verify"] = time.perf_counter() - t

    def _verify(self, a: _Attempt, truth: dict[str, str]) -> None:
        """Compare the tensors with ``truth``; on a mismatch, never forward what this rank
        holds again, discard what the guilty sources sent, raise :class:`DamagedBytes`."""
        s = self.settings
        actual = integrity.layer_hashes(a.model, mode=s.verify,  # type: ignore[arg-type]
                                        key=s.key("integrity"))
        try:
            integrity.compare(truth, actual)
        except WeightVerificationError as e:
            if a.chain is not None:
                # Downstream members may hold some of these bytes already: their links
                # end now and this endpoint refuses every later request.
                a.chain.progress.fail(f"verification failed: {e}")
            bad = {k for k in truth.keys() | actual.keys() if truth.get(k) != actual.get(k)}
            blamed = a.holding.blame(bad, integrity.layer_of)
            a.holding.discard(blamed)
            raise DamagedBytes(e, blamed) from e

    def _await_truth(self, a: _Attempt, deadline: float, poll: float = 0.05) -> dict[str, str]:
        """The ground truth a streaming downloader publishes once its load is complete
        (it hashes what it streamed); :class:`TransferError` if none comes by ``deadline``
        or the stream's downloader gave up (its relay endpoint is gone)."""
        version, digest, mode = a.spec.version, a.manifest.digest, self.settings.verify
        reg = self.registry
        # Only to read whether a (trusted) downloader holds the lease: a value there that
        # is not to be trusted counts as nobody, never as a reason to wait or raise.
        lease = DownloadLease(reg, version, a.world, self.worker_id, self.settings.download_lease)
        while True:
            # Read "still loading" before the truth: the downloader writes the truth before
            # it drops its stream record and releases its lease, so no truth after "gone"
            # means none is coming.
            loading = (reg.get_stream(version, a.rank, a.world, digest) is not None
                       or lease.holder() is not None)
            stored = reg.get_ground_truth(version, a.rank, a.world, digest)
            expected = truth_for_mode(stored, mode) if stored is not None else {}
            if expected:
                return expected
            if not loading or time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    f"the downloader streamed version {version[:12]} but published no {mode!r}"
                    " ground truth " + ("by the deadline" if loading else "before it stopped")
                    + ": nothing to verify against")
            time.sleep(poll)

    def _peer_loaded(self, a: _Attempt) -> LoadResult:
        seconds = time.perf_counter() - a.start
        man = a.manifest
        result = LoadResult(
            source="peer", version=a.spec.version, bytes=man.nbytes, seconds=seconds,
            peer_id=a.peer_id, verified=self.settings.verify != "none", timings=a.timings,
        )
        self.metrics.record_load("peer", man.nbytes, seconds)
        a.log.info("loaded", source="peer", peer=a.peer_id, seconds=round(seconds, 3),
                   gbps=round(result.gbps, 3))
        try:
            self._server.publish(a.model, man, a.spec.version, a.rank, a.world, source="peer",
                                 log=a.log, truth=encode_truth({self.settings.verify: a.truth})
                                 if a.truth else None, model_name=a.spec.name)
        except Exception as e:
            # The weights are loaded and verified; only serving others is lost.
            a.log.warning("publish_failed", error=str(e))
        return result

    # -- storage ------------------------------------------------------------------------

    def _storage(self, a: _Attempt) -> LoadResult:
        reason = a.reason
        code = fallback_reason(reason) if reason is not None else "other"
        if reason is not None:
            self.metrics.record_fallback(code)
            if a.elected and isinstance(reason, NobodyHolds):
                # Nothing went wrong: the first worker of a version must download it.
                a.log.info("first_of_version", reason=code, detail=str(reason))
            else:
                a.log.warning("fallback_to_storage", reason=code, detail=str(reason))
        hashes: dict[str, str] = {}
        stream = self._open_stream(a) if a.elected else None

        def load(a: _Attempt) -> None:
            t = time.perf_counter()
            if stream is not None:
                stored = _load_checkpoint(a.model, a.spec, self.settings, on_filled=stream.filled)
                stream.loaded()
            else:
                stored = self._storage_loader(a.model, a.spec, self.settings)
            a.timings["storage"] = time.perf_counter() - t
            a.timings.update({f"storage.{k}": v for k, v in stored.timings.items()})
            a.stored_bytes = stored.bytes
            t = time.perf_counter()
            key = self.settings.key("integrity")
            by_mode = {"sampled": integrity.layer_hashes(a.model, mode="sampled", key=key)}
            if self.settings.verify == "full":
                by_mode["full"] = integrity.layer_hashes(a.model, mode="full", key=key)
            hashes.update(encode_truth(by_mode))
            a.timings["hash"] = time.perf_counter() - t

        self._step(a, load)
        try:
            self._round(a, "storage load")
        except BaseException as e:
            if stream is not None:
                stream.end(False, f"the download failed: {e!r}"[:300])
            raise
        seconds = time.perf_counter() - a.start
        detail = f"{code}: {reason}" if reason is not None else None
        result = LoadResult(
            source="storage", version=a.spec.version, bytes=a.stored_bytes, seconds=seconds,
            fallback_reason=detail, verified=True, timings=a.timings,
        )
        self.metrics.record_load("storage", a.stored_bytes, seconds)
        a.log.info("loaded", source="storage", seconds=round(seconds, 3), gbps=round(result.gbps, 3))
        self._publish_stored(a, hashes)
        if stream is not None:  # the truth is out: receivers of the stream can verify
            stream.end(True)
        # Every rank has published (or logged why not) before rank 0 lets go of the
        # download lease: waiters then find every rank's peer at once.
        gather(OK, a.group)
        return result

    def _open_stream(self, a: _Attempt) -> relay.Stream | None:
        """Stream this rank's download to waiting workers' cohorts, or None: cohorts off,
        an engine's own storage loader (it may rewrite tensors after loading them, and
        reports no per-tensor fills), or the announcement failed (logged)."""
        s = self.settings
        if a.error is not None or s.cohort_max_size <= 1 or self._storage_loader is not _load_checkpoint:
            return None
        try:
            stream = relay.stream(self._relay_place(a))
        except NcclBackError as e:
            a.log.warning("stream_not_announced", error=str(e))
            return None
        self._track(stream.server)
        return stream

    def _publish_stored(self, a: _Attempt, hashes: dict[str, str]) -> None:
        version, man = a.spec.version, a.manifest
        try:
            self._claim_ground_truth(a, hashes)
        except RegistryError as e:
            # Redis unreachable: the heartbeat stores the truth this worker holds (with
            # its entry) once Redis answers again.
            a.log.warning("ground_truth_deferred", error=str(e))
        try:
            self._server.publish(a.model, man, version, a.rank, a.world, source="storage", log=a.log,
                                 truth=hashes or None, model_name=a.spec.name)
        except Exception as e:  # the rendezvous could not start: serve nobody
            a.log.warning("publish_failed", error=str(e))


    def _claim_ground_truth(self, a: _Attempt, hashes: dict[str, str]) -> None:
        """Store our hashes as the ground truth; if a stored record is untrusted or
        disagrees with ours, ours win: this worker holds bytes that passed CRC32C
        against storage, so it replaces the record (and says so) instead of letting
        whoever wrote first keep every worker of the version from a verified peer load."""
        reg, version, man = self.registry, a.spec.version, a.manifest
        if reg.put_ground_truth(version, a.rank, a.world, man.digest, hashes):
            return
        try:
            existing = reg.get_ground_truth(version, a.rank, a.world, man.digest)
            if existing is None:
                return  # expired meanwhile; the next storage loader writes it
            integrity.compare(truth_for_mode(existing, "sampled"), truth_for_mode(hashes, "sampled"))
            return
        except (UntrustedRecordError, WeightVerificationError) as e:
            why = str(e)
        reg.replace_ground_truth(version, a.rank, a.world, man.digest, hashes)
        a.log.error("ground_truth_replaced", reason=why)


@contextlib.contextmanager
def _kept(registry: Registry, peer_id: str, token: str, ttl: float, log: Any) -> Iterator[None]:
    """Renew the claim ``token`` every third of ``ttl`` while the block runs.

    The claim then lives exactly as long as its holder: a receiver that crashes stops
    renewing, and its slot frees itself within ``ttl``.
    """
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 3):
            try:
                if not registry.renew_claim(peer_id, token, ttl):
                    log.warning("claim_lost", peer=peer_id)
                    return
            except RegistryError as e:
                log.warning("claim_renew_failed", peer=peer_id, error=str(e))

    thread = threading.Thread(target=renew, name="nccl-back-claim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(ttl)
