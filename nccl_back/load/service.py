"""Receive / serve orchestration: :class:`WeightService`, whose ``load`` runs the
protocol's phases in order (:meth:`WeightService._run_phases` draws them; ARCHITECTURE.md,
"One load, end to end", names each phase's module).

Between the phases every rank takes part in a consensus round (:mod:`.vote`, over
:func:`nccl_back.coord.consensus.gather`): each rank's code (ok / no peer at all /
peer load failed / raised) reaches every rank, and every rank takes the same decision
from the same codes. So all ranks return the same ``source``, or all raise: a rank that
raised re-raises its own error, the others a :class:`ConsensusError` naming it.
``strict`` is decided from the same codes, after the round, so it too is all or nothing.

While the service is open, its :class:`~nccl_back.transport.sender.PeerServer` answers transfer
requests in the background and a heartbeat keeps its registry entries alive;
``close()`` withdraws them and drains the sends in flight, within a bound.
Every fallback is logged with its reason and returned in ``LoadResult.fallback_reason``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Iterator

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.auth import warn_unsigned
from nccl_back.coord.consensus import Group, rank_and_size
from nccl_back.coord.election import DownloadLease
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import ManifestMismatchError, NcclBackError
from nccl_back.load import heap, reshard, storage_phase
from nccl_back.load.attempt import Attempt, Target, Worker
from nccl_back.load.cooperative import Rescues, serve_share
from nccl_back.load.discover import discover
from nccl_back.load.fill import NotReceived, Received
from nccl_back.load.publish import peer_loaded
from nccl_back.load.ranged_group import RangedLoader
from nccl_back.load.receive import Receive
from nccl_back.load.single_flight import Flight, single_flight
from nccl_back.load.storage_phase import StorageLoad, load_checkpoint
from nccl_back.load.verifier import Basis, Verifier
from nccl_back.load.vote import Decision, agree
from nccl_back.log import get_logger
from nccl_back.metrics import Metrics
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import StorageLoader
from nccl_back.model.sharding import Sharding, sharding
from nccl_back.model.skeleton import Model, manifest
from nccl_back.result import LoadResult
from nccl_back.transport import relay
from nccl_back.transport.send import Owed, drain
from nccl_back.transport.sender import PeerServer

__all__ = ["StorageLoader", "WeightService"]


@contextlib.contextmanager
def caught(a: Attempt, phase: str) -> Iterator[None]:
    """Run the block; whatever it raises becomes this rank's vote (``a.error``), never an
    early exit that would leave the other ranks waiting in a collective."""
    try:
        yield
    except Exception as e:
        a.error = e
        a.log.error("rank_failed", phase=phase, error=repr(e))


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
        storage_loader: StorageLoader = load_checkpoint,
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
        self._cohorts = relay.Cohorts(self.settings, self.registry, self.worker_id, self._server,
                                      self.metrics)
        self._worker = Worker(self.settings, self.registry, self._server, self._cohorts, self.metrics,
                        self.worker_id, Verifier(self.settings.verify, self.settings.key("integrity")))
        self._closed = False
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
    def verifier(self) -> Verifier:
        """What "verified" means for this service's loads (``Settings.verify``, keyed by
        the fleet secret): every check of bytes in a model goes through it."""
        return self._worker.verifier

    @property
    def active_sends(self) -> int:
        """Transfers this worker is sending right now."""
        return self._server.active_sends

    def served_tensors(self, peer_id: str) -> dict[str, torch.Tensor]:
        """The tensors a send of this worker's entry ``peer_id`` would read now."""
        return self._server.served_tensors(peer_id)

    def load(self, model: Model, spec: ModelSpec, group: Group = None, *,
             sharding: Sharding | None = None) -> LoadResult:
        """Fill the skeleton ``model`` with ``spec``'s weights, from a peer if possible.

        ``group`` is the worker's own process group (tensor/pipeline parallel) or None.
        Every rank of the group must call ``load`` with its own sub-module skeleton; all
        of them return the same ``source`` or all raise (a rank that failed raises its
        own error, the others :class:`ConsensusError` naming it). Returns a verified
        :class:`LoadResult`. With ``Settings(strict=True)`` a failed peer load on any rank
        makes every rank raise instead of falling back (no peer at all is not a failure).

        ``sharding`` (:func:`nccl_back.sharding`): which pieces of the checkpoint this
        rank's skeleton holds. With it the rank can also load from holders of other
        layouts (world sizes), receiving only its pieces, and loads from storage by
        cutting them from the checkpoint; see docs/layouts.md.
        """
        self._check_open()
        rank, world = rank_and_size(group)
        a = Attempt(model, spec, group, rank, world,
                    log=self._log.bind(rank=rank, version=spec.version[:12]), start=_clock.perf(),
                    sharding=sharding)
        # A share is read by tensor names of the checkpoint, one rank at a time (ranks'
        # proofs are not combined yet), and served through a relay endpoint.
        a.cooperative = (world == 1 and sharding is None and self._storage_loader is load_checkpoint
                         and self._cohorts.enabled)
        try:
            with heap.kept_out():
                return self._run_phases(a)
        finally:
            if a.share is not None:
                a.share.end(True)
            if a.lease is not None:
                a.lease.release()

    def serve(self, model: Model, spec: ModelSpec, group: Group = None) -> PeerInfo:
        """Publish a model this worker already holds (loaded by its own code) and serve it.

        Never writes truth (its bytes were not checked here, :mod:`.verifier`): receivers
        verify what they get from this worker against the hashes of a storage load, as
        for any other peer.
        """
        self._check_open()
        rank, world = rank_and_size(group)
        log = self._log.bind(rank=rank, version=spec.version[:12])
        return self._server.publish(model, manifest(model), spec.version, rank, world,
                                    source="adopted", log=log, model_name=spec.name)

    def close(self) -> None:
        """Stop serving, withdraw every published entry, release sockets and threads.

        It drains first (:func:`~nccl_back.transport.send.drain`): it withdraws (no new
        request is taken, each is refused at once; relay endpoints say they stopped), lets
        the sends in flight (to holders' receivers, relay forwards, a download's stream to
        its followers) finish within :func:`~nccl_back.transport.send.drain_bound` of the
        bytes they have left (those bytes at ``DRAIN_FLOOR_GBPS``, 0.025 GB/s, or at
        ``max_send_gbps`` where lower, plus half a second; at most ``DRAIN_MAX``, 5 s),
        then aborts whatever remains, each receiver told at once (it moves on without
        waiting out its stall bound). The followers of a download this worker was elected
        to, which wait for it alone, are served while their time to ask lasts (the
        stream's linger) and they have not loaded: one yet to ask for ``DRAIN_ARRIVAL``
        (3 s), one whose transfer failed (it gave it up) as long again after that; all
        within ``DRAIN_MAX``. With nothing in flight or owed it waits for nothing.

        Once it returns, no registry entry of this worker reappears.
        """
        if self._closed:
            return
        self._closed = True
        # A worker withdrawn already (drained) takes no new transfer, owed or not.
        owed = frozenset() if self._server.withdrawn else self._server.owed()
        self._server.withdraw(serving=owed)
        sends = self._server.sends + self._cohorts.withdraw(owed)
        drain(sends, self.settings, self._log, Owed(
            owed, lambda: self._server.askers | self._cohorts.askers(), self._server.loaded,
        ) if owed else None)
        self._cohorts.close(self.settings.redis_timeout + 1)
        self._server.close()
        with contextlib.suppress(Exception):
            self.registry.close()
        self._log.info("closed")

    def abort_sends(self) -> int:
        """Abort every in-flight send (a drain past its bound); see :class:`PeerServer`."""
        return self._server.abort_sends()

    def withdraw(self) -> None:
        """Stop accepting new transfers (drain): remove this worker from the registry, and
        its relay endpoints from their cohorts.

        In-flight sends finish; queued ones are refused; :meth:`close` still has to be called.
        """
        self._server.withdraw()
        self._cohorts.withdraw()

    # -- one load, phase by phase ----------------------------------------------------------

    def _run_phases(self, a: Attempt) -> LoadResult:
        """The load's state machine. Each arrow follows a consensus round (:func:`agree`),
        so every rank of the worker takes the same one; a rank that raised ends every
        rank's load. A sharded skeleton (or a single-rank plain one facing holders of
        another layout only) may reshard, at most once per load.

        ::

            discover ──ok──────────────────────────────► receive ──ok──► serve (peer)
               │ not ok, sharded ──► reshard ──ok──► serve      │
               │                        └─ none covers us: on as if not tried
               │ nobody ──► elect ──ok──► receive               │ nobody (the stream
               │              │ (a member serves its share,     │  it was fed by is
               │              │  then waits again)              │  lost) ──► elect ──ok──► receive
               │              └─ else ─────────────────────┐    │ failed, sharded,
               │                                           │    │ not resharded ──► reshard
               └───────────────────────────────────────────┴────┴──► storage (the reason)

        ``storage`` loads (an elected worker streams its download), publishes the
        ground truth and serves; ``strict`` makes a failed peer load raise there instead.
        """
        worker = self._worker
        t = _clock.perf()
        with caught(a, "prepare"):
            a.prepared = Target.of(a.model, self.settings)
            worker.verifier.prepare(a.model)
            a.discovered(discover(worker, a))
        decision = agree(a, "discovery")
        sh = a.sharding or self._plain_sharding(a)
        layouts_tried = False
        if not decision.ok and sh is not None:  # no same-layout holder: other layouts?
            layouts_tried = True
            resharded = self._reshard(a, sh)
            if resharded is not None:
                return resharded
        if decision.nobody:  # some rank found nobody holding it: wait as a group, or download
            decision = self._elect(a)
        a.timings["discovery"] = _clock.perf() - t

        if decision.ok:
            decision = self._receive(a)
            if decision.nobody:  # the download streamed to some rank failed: elect once more
                t = _clock.perf()
                decision = self._elect(a)
                a.timings["discovery"] = _clock.perf() - t
                if decision.ok:
                    decision = self._receive(a)
            if decision.ok:  # every rank verified its bytes
                return peer_loaded(worker, a)
            if decision.failed and sh is not None and not layouts_tried:
                # The holders of this layout failed the group (one killed but still
                # listed, a broken transfer, bytes that failed verification): holders of
                # other layouts before storage. Every rank reshards, one whose own
                # receive went well too (the group loads one way); of the failed receive
                # only the peers that failed are kept (never asked again), and what the
                # reshard moves is checked on its own.
                a.truth, a.basis = None, Basis.NONE
                resharded = self._reshard(a, sh)
                if resharded is not None:
                    return resharded
        return self._storage(a, decision)

    def _reshard(self, a: Attempt, sh: Sharding) -> LoadResult | None:
        """From holders of other layouts: the load's result (a peer load, or storage
        after the reshard failed), or None when no holders cover every rank."""
        found = self._reshard_sources(a, sh)
        if found is None:
            return None
        decision = self._pass(a, "reshard", "reshard", lambda: reshard.run(self._worker, a, sh, found))
        if decision.ok:
            return peer_loaded(self._worker, a, nbytes=found.plan.nbytes())
        return self._storage(a, decision)

    def _reshard_sources(self, a: Attempt, sh: Sharding) -> reshard.ReshardSources | None:
        """Holders to reshard from on every rank, or on none (one vote): None when no
        holders cover every rank (this rank's earlier vote restored: the load goes on as
        without it)."""
        before, a.reason = a.reason, None
        found: reshard.ReshardSources | None = None
        began = _clock.perf()
        with caught(a, "reshard_discovery"):
            got = reshard.look(self._worker, a, sh)
            if isinstance(got, reshard.ReshardSources):
                found = got
            else:
                a.reason = got
        a.timings["reshard_discovery"] = _clock.perf() - began
        if not agree(a, "reshard discovery").ok:
            why = str(a.reason) if a.reason else "another rank found none"
            a.log.info("reshard_skipped", reason=why)
            a.reason = reshard.also(before, f"no reshard either: {why}")
            return None
        return reshard.shared(found, a.group)

    def _plain_sharding(self, a: Attempt) -> Sharding | None:
        """A single-rank plain skeleton of the checkpoint (every tensor whole) facing
        holders of another layout only: its trivial sharding, so it can reshard from
        them (only its pieces move, checked in checkpoint coordinates) instead of reading
        storage. None where it does not apply (an engine's own loader, a group, a
        skeleton that is not the checkpoint's tensors)."""
        if (a.world != 1 or self._storage_loader is not load_checkpoint
                or not isinstance(a.reason, ManifestMismatchError)):
            return None
        try:
            return sharding(a.model, a.spec, {}, self.settings)
        except NcclBackError as e:
            a.log.info("no_plain_reshard", reason=str(e))
            return None

    def _storage(self, a: Attempt, decision: Decision) -> LoadResult:
        """The group goes to storage (or, ``strict``, raises): a rank that could have
        gone on says which rank did not."""
        a.peer_id = None
        if a.reason is None:
            a.reason = decision.why()
        if self.settings.strict and decision.failed:
            raise decision.strict_error(a)
        w, loader = self._worker, self._loader(a)
        storage_phase.report(w, a)
        stored = StorageLoad()
        with caught(a, "load"):
            storage_phase.load_and_hash(w, a, loader, stored)
            a.basis = Basis.STORAGE
        try:
            agree(a, "storage load")
        except BaseException as e:
            storage_phase.failed(stored, e)
            raise
        return storage_phase.serve_stored(w, a, stored)

    def _loader(self, a: Attempt) -> StorageLoader:
        """A sharded skeleton reads only its own pieces, its ranks proving each file's
        CRC32C together (the default loader; :mod:`nccl_back.load.ranged_group`)."""
        sh = a.sharding
        if sh is None or self._storage_loader is not load_checkpoint:
            return self._storage_loader
        return RangedLoader(sh, a.group)

    def _elect(self, a: Attempt) -> Decision:
        flight = self._fly(a)
        if flight.outcome == "member":
            # Named in the elected worker's roster: read and serve the share, then wait,
            # as any waiter, for its stream (reading what it spreads to us meanwhile).
            rescues = self._serve_share(a)
            try:
                self._fly(a)
            finally:
                if rescues is not None:
                    rescues.close()
                    a.share_bytes = rescues.bytes
        return agree(a, "single flight")

    def _serve_share(self, a: Attempt) -> Rescues | None:
        """Member ``a.member``: announce its part's endpoint (kept in ``a.share``, ended
        when the load ends), then read and serve the share (:func:`serve_share`)."""
        if a.member is None:
            return None
        i, n = a.member
        share = self._cohorts.open_share(a.replica(), a.log, i)
        if share is None:
            return None
        a.share = share
        return serve_share(self._worker, a, share, i, n)

    def _fly(self, a: Attempt) -> Flight:
        """One wait in the single flight, its findings taken into ``a`` (rank 0 keeps the
        lease it polls in ``a.lease``, released when the load ends)."""
        w = self._worker
        if a.rank == 0:
            if a.lease is not None:
                a.lease.release()  # never held: a holder appeared, or another was elected
            a.lease = DownloadLease(w.registry, a.spec.version, a.world, w.id,
                                    self.settings.download_lease)
        flight = single_flight(w, a, a.lease)
        a.reason, a.error = flight.reason, a.error or flight.error
        a.member = flight.member or a.member
        if flight.outcome == "elected":
            a.elected, a.roster = True, flight.roster
        elif flight.outcome == "peer":
            with caught(a, "discover"):
                a.discovered(discover(w, a))
        return flight

    def _receive(self, a: Attempt) -> Decision:
        return self._pass(a, "receive_any", "peer load", lambda: Receive(self._worker, a).run())

    def _pass(self, a: Attempt, phase: str, what: str, run: Callable[[], Received | NotReceived]) -> Decision:
        """One pass from peers (a receive, a reshard): its outcome recorded, then the vote."""
        t = _clock.perf()
        with caught(a, phase):
            got = run()
            if got.found is not None:  # the pass discovered again (a stream lost)
                a.discovered(got.found)
            match got:
                case Received(peer_id=peer_id, verified=verified, checked=checked):
                    a.peer_id, a.basis = peer_id, verified.basis
                    if verified.truth is not None:
                        a.truth = verified.truth
                    if checked is not None:
                        a.checked = checked
                case NotReceived(reason=reason, truth=truth):
                    a.reason = reason
                    if truth is not None:  # a stream's, awaited: a later pass need not wait
                        a.truth = truth
        a.timings["peer"] = _clock.perf() - t
        return agree(a, what)

    def _check_open(self) -> None:
        if self._closed:
            raise NcclBackError("WeightService is closed")
        if self.settings.secret is None:
            warn_unsigned()  # once per process: this worker trusts whoever writes to Redis
