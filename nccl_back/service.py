"""Receive / serve orchestration: the protocol's layers put together.

``WeightService.load(model, spec, group)`` on each rank of a worker:

1. *Discovery* — live peers holding ``spec.version`` for this rank (registry), the
   ground-truth hashes, and whether their manifest matches this skeleton's.
2. *Single flight* — when nobody holds the version yet, one worker per version and
   rank is elected (a Redis lease) to download; the others wait, bounded, for a peer.
3. *Consensus* — every rank votes; ``all_reduce(MIN)``; unless all found a usable
   peer, all load from storage.
4. *Peer attempts* — claim a send slot, liveness handshake, guarded transfer,
   verification against the ground truth; on failure the next peer.
5. *Consensus again* — unless every rank succeeded, every rank loads from storage,
   so the group ends in one consistent state.
6. *Publication* — after a storage load the hashes become the ground truth (never
   overwritten); after a verified peer load the worker serves others too (fan-out).

While the service is open, its :class:`~nccl_back.sender.PeerServer` answers transfer
requests in the background and a heartbeat keeps its registry entries alive;
``close()`` withdraws them.
Every fallback is logged with its reason and returned in ``LoadResult.fallback_reason``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from typing import Any

import torch

from . import integrity
from .auth import transfer_scope
from .config import Settings
from .consensus import Group, agree, rank_and_size
from .election import DownloadLease, wait_for_peer_or_lease
from .errors import (
    ConsensusError,
    HandshakeTimeoutError,
    ManifestMismatchError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    UntrustedRecordError,
    WeightVerificationError,
)
from .handshake import run_receiver
from .identity import ModelSpec
from .loader import load_from_storage
from .log import get_logger
from .metrics import Metrics, fallback_reason
from .registry import PeerInfo, Registry
from .result import LoadResult
from .sender import PeerServer
from .skeleton import Manifest, Model, manifest, model_device, named_tensors
from .transport import (
    receiver_transport,
    recv_tensors,
    run_guarded,
)

MODES_KEY_SEP = "|"


class NobodyHolds(NoPeerError):
    """No live peer holds the version at all (the first worker of a rollout)."""


class NobodyTrusted(NobodyHolds, UntrustedRecordError):
    """Entries for the version exist, but none could be trusted (all were rejected)."""


class PeerBusy(Exception):
    """Internal: every send slot of this peer is claimed (wait, don't count a failure)."""


def _truth_hashes(all_hashes: dict[str, str], mode: str) -> dict[str, str]:
    """The ``mode`` part of stored ground truth (keys are ``"{mode}|{layer}"``)."""
    prefix = mode + MODES_KEY_SEP
    return {k[len(prefix):]: v for k, v in all_hashes.items() if k.startswith(prefix)}


class WeightService:
    """Loads weights from a peer (storage as fallback) and serves them while open.

    Use as a context manager, or call :meth:`close`. Thread-safe for one ``load`` at a
    time per rank; serving runs in background threads.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        metrics: Metrics | None = None,
        worker_id: str | None = None,
        registry: Registry | None = None,
        corrupt_sends_for_test: bool = False,
    ) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self.metrics = metrics if metrics is not None else Metrics()
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.registry = registry if registry is not None else Registry(self.settings)
        self.registry.on_untrusted = self.metrics.record_untrusted
        self._server = PeerServer(self.settings, self.registry, self.metrics, self.worker_id,
                                  corrupt_for_test=corrupt_sends_for_test)
        self._closed = False
        self._log = get_logger("nccl_back.service", worker=self.worker_id)

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

    def load(self, model: Model, spec: ModelSpec, group: Group = None) -> LoadResult:
        """Fill the skeleton ``model`` with ``spec``'s weights, from a peer if possible.

        ``group`` is the worker's own process group (tensor/pipeline parallel) or None.
        Every rank of the group must call ``load`` with its own sub-module skeleton.
        Returns a verified :class:`LoadResult`. With ``Settings(strict=True)`` a failed
        peer load raises instead of falling back (having no peer at all is not a failure).
        """
        if self._closed:
            raise NcclBackError("WeightService is closed")
        start = time.perf_counter()
        rank, world = rank_and_size(group)
        man = manifest(model)
        tensors, _ = named_tensors(model)
        log = self._log.bind(rank=rank, version=spec.version[:12])
        timings: dict[str, float] = {}

        t = time.perf_counter()
        candidates, truth, reason = self._discover(spec.version, rank, world, man)
        lease: DownloadLease | None = None
        if isinstance(reason, NobodyHolds):
            lease = DownloadLease(self.registry, spec.version, rank, world, self.worker_id,
                                  self.settings.download_lease)
            candidates, truth, reason = self._single_flight(lease, spec.version, rank, world, man)
        timings["discovery"] = time.perf_counter() - t
        try:
            return self._load(model, spec, group, man, tensors, rank, world, candidates, truth,
                              reason, start, timings, log)
        finally:
            if lease is not None:
                lease.release()

    def _single_flight(
        self, lease: DownloadLease, version: str, rank: int, world: int, man: Manifest
    ) -> tuple[list[PeerInfo], dict[str, str] | None, NcclBackError | None]:
        """Nobody holds the version: wait for the elected downloader, or be it."""
        s = self.settings
        waited = time.monotonic()

        def peer_appeared() -> bool:
            return any(not self._server.holds(p.peer_id)
                       for p in self.registry.find_peers(version, rank, world))

        try:
            outcome = wait_for_peer_or_lease(lease, peer_appeared, s.single_flight_wait)
        except RegistryError as e:
            return [], None, e
        if outcome == "peer":
            self._log.info("single_flight_peer_appeared", version=version[:12], rank=rank,
                           waited=round(time.monotonic() - waited, 3))
            return self._discover(version, rank, world, man)
        if outcome == "elected":
            return [], None, NobodyHolds(
                f"no live peer holds version {version[:12]} rank {rank}/{world};"
                " this worker was elected to download it (single flight)"
            )
        return [], None, NoPeerError(
            f"waited {s.single_flight_wait:g} s (single_flight_wait) for the elected downloader"
            " to publish; downloading too"
        )

    def _load(
        self,
        model: Model,
        spec: ModelSpec,
        group: Group,
        man: Manifest,
        tensors: dict[str, torch.Tensor],
        rank: int,
        world: int,
        candidates: list[PeerInfo],
        truth: dict[str, str] | None,
        reason: NcclBackError | None,
        start: float,
        timings: dict[str, float],
        log: Any,
    ) -> LoadResult:
        if not agree(reason is None, group) and reason is None:
            reason = ConsensusError("another rank of this worker found no usable peer")

        peer_id: str | None = None
        if reason is None:
            t = time.perf_counter()
            peer_id, reason = self._receive_any(model, tensors, man, spec.version, rank, world,
                                                candidates, truth, log, timings)
            timings["peer"] = time.perf_counter() - t
            if not agree(reason is None, group) and reason is None:
                reason = ConsensusError("another rank of this worker failed its peer load")
                peer_id = None

        if reason is None and peer_id is not None:
            seconds = time.perf_counter() - start
            result = LoadResult(
                source="peer", version=spec.version, bytes=man.nbytes, seconds=seconds,
                peer_id=peer_id, verified=self.settings.verify != "none", timings=timings,
            )
            self.metrics.record_load("peer", man.nbytes, seconds)
            log.info("loaded", source="peer", peer=peer_id, seconds=round(seconds, 3),
                     gbps=round(result.gbps, 3))
            try:
                self._server.publish(model, tensors, man, spec.version, rank, world, source="peer",
                              log=log)
            except NcclBackError as e:
                # The weights are loaded and verified; only serving others is lost.
                log.warning("publish_failed", error=str(e))
            return result

        return self._storage_fallback(model, spec, man, tensors, rank, world, reason, start,
                                      timings, log)

    def serve(self, model: Model, spec: ModelSpec, group: Group = None) -> PeerInfo:
        """Publish a model this worker already holds (loaded by its own code) and serve it.

        Never writes ground truth: receivers verify what they get from this worker
        against the hashes of a storage load, as for any other peer.
        """
        if self._closed:
            raise NcclBackError("WeightService is closed")
        rank, world = rank_and_size(group)
        tensors, _ = named_tensors(model)
        log = self._log.bind(rank=rank, version=spec.version[:12])
        return self._server.publish(model, tensors, manifest(model), spec.version, rank, world,
                             source="adopted", log=log)

    def close(self) -> None:
        """Stop serving, withdraw every published entry, release sockets and threads."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        with contextlib.suppress(Exception):
            self.registry.close()
        self._log.info("closed")

    def abort_sends(self) -> int:
        """Abort every in-flight send (a drain past its bound); see :class:`PeerServer`."""
        return self._server.abort_sends()

    def withdraw(self) -> None:
        """Stop accepting new transfers (drain): remove this worker from the registry.

        In-flight sends finish; :meth:`close` still has to be called.
        """
        self._server.withdraw()

    # -- receive ------------------------------------------------------------------------

    def _discover(
        self, version: str, rank: int, world: int, man: Manifest
    ) -> tuple[list[PeerInfo], dict[str, str] | None, NcclBackError | None]:
        """Usable peers, the ground-truth hashes for the verify mode, or why there are none."""
        try:
            rejected = self.registry.rejected
            peers = [p for p in self.registry.find_peers(version, rank, world)
                     if not self._server.holds(p.peer_id)]
            if not peers and self.registry.rejected > rejected:
                return [], None, NobodyTrusted(
                    f"no trusted peer holds version {version[:12]} rank {rank}/{world}:"
                    f" {self.registry.rejected - rejected} entries rejected (see record_rejected)"
                )
            if not peers:
                return [], None, NobodyHolds(
                    f"no live peer holds version {version[:12]} rank {rank}/{world}"
                )
            matching = [p for p in peers if p.manifest_digest == man.digest]
            if not matching:
                return [], None, ManifestMismatchError(
                    f"{len(peers)} peer(s) hold version {version[:12]} with a different manifest"
                    f" (theirs {peers[0].manifest_digest[:12]}, ours {man.digest[:12]})"
                )
            if self.settings.verify == "none":
                return matching, None, None
            stored = self.registry.get_ground_truth(version, rank, world)
            if stored is None:
                return [], None, NoPeerError("peers exist but no ground-truth hashes to verify against")
            digest, hashes = stored
            if digest != man.digest:
                return [], None, ManifestMismatchError(
                    f"ground truth was computed for manifest {digest[:12]}, ours is {man.digest[:12]}"
                )
            expected = _truth_hashes(hashes, self.settings.verify)
            if not expected:
                return [], None, NoPeerError(
                    f"ground truth has no {self.settings.verify!r} hashes (set verify on the storage loader too)"
                )
            return matching, expected, None
        except RegistryError as e:
            return [], None, e

    def _receive_any(
        self,
        model: Model,
        tensors: dict[str, torch.Tensor],
        man: Manifest,
        spec_version: str,
        rank: int,
        world: int,
        candidates: list[PeerInfo],
        truth: dict[str, str] | None,
        log: Any,
        timings: dict[str, float],
    ) -> tuple[str | None, NcclBackError | None]:
        """Try peers until one transfer verifies; returns ``(peer_id, None)`` or ``(None, why)``.

        A peer whose send slots are all claimed is not a failure: the receiver waits
        (re-discovering, so receivers that finished meanwhile become candidates) up to
        ``settings.busy_wait``. Real failures count towards ``max_peer_attempts``.
        """
        s = self.settings
        last: NcclBackError = NoPeerError("no peer tried")
        failed: set[str] = set()
        deadline = time.monotonic() + s.busy_wait
        # All attempts together: fake or stalling peers cannot cost more than this.
        budget = time.monotonic() + s.peer_budget_seconds
        while True:
            busy = 0
            for peer in candidates:
                if peer.peer_id in failed:
                    continue
                if time.monotonic() >= budget:
                    return None, NoPeerError(
                        f"peer attempts spent their budget of {s.peer_budget_seconds:g} s"
                        f" (peer_budget); last: {last}"
                    )
                try:
                    self._receive_from(peer, model, tensors, man, truth, timings, budget)
                    return peer.peer_id, None
                except PeerBusy:
                    busy += 1
                    continue
                except (PeerError, WeightVerificationError) as e:
                    last = e
                    failed.add(peer.peer_id)
                    if isinstance(e, WeightVerificationError):
                        self.metrics.record_verification_failure()
                    if isinstance(e, HandshakeTimeoutError):
                        self.metrics.record_handshake_timeout()
                    log.warning("peer_attempt_failed", peer=peer.peer_id,
                                reason=fallback_reason(e), error=str(e))
                    if len(failed) >= s.max_peer_attempts:
                        return None, last
                except RegistryError as e:
                    return None, e
            if busy == 0 or time.monotonic() >= min(deadline, budget):
                if busy:
                    last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                return None, last
            time.sleep(0.05)
            try:
                found = self.registry.find_peers(spec_version, rank, world)
            except RegistryError as e:
                return None, e
            candidates = [p for p in found
                          if p.manifest_digest == man.digest and not self._server.holds(p.peer_id)]

    def _receive_from(
        self,
        peer: PeerInfo,
        model: Model,
        tensors: dict[str, torch.Tensor],
        man: Manifest,
        truth: dict[str, str] | None,
        timings: dict[str, float],
        budget: float,
    ) -> None:
        s = self.settings
        device = model_device(model)
        claim_ttl = s.receiver_handshake_timeout + s.transfer_timeout + 5
        token = self.registry.claim(peer.peer_id, self.worker_id, peer.max_sends, claim_ttl)
        if token is None:
            raise PeerBusy(peer.peer_id)
        try:
            transfer_id = uuid.uuid4().hex
            request = {
                "transfer_id": transfer_id,
                "receiver": self.worker_id,
                "version": peer.version,
                "manifest_digest": man.digest,
                "transport": peer.transport,
            }
            t = time.perf_counter()
            run_receiver(
                self.registry, transfer_id, man.digest,
                max(min(s.receiver_handshake_timeout, budget - time.monotonic()), 0.001),
                after_ready=lambda: self.registry.push_request(peer.peer_id, request),
            )
            timings["handshake"] = time.perf_counter() - t
            t = time.perf_counter()
            scope = transfer_scope(s.key("store"), transfer_id)
            transport = receiver_transport(
                s, peer.transport, peer.address, scope, device=device, registry=self.registry
            )
            run_guarded(
                transport,
                lambda tr: recv_tensors(tr, tensors, s.bucket_bytes),
                min(time.monotonic() + s.transfer_timeout, budget),
            )
            timings["transfer"] = time.perf_counter() - t
            if truth is not None:
                t = time.perf_counter()
                actual = integrity.layer_hashes(model, mode=s.verify, key=s.key("integrity"))  # type: ignore[arg-type]
                integrity.compare(truth, actual)
                timings["verify"] = time.perf_counter() - t
        finally:
            with contextlib.suppress(RegistryError):
                self.registry.release(peer.peer_id, token)

    # -- storage ------------------------------------------------------------------------

    def _claim_ground_truth(
        self, version: str, rank: int, world: int, man: Manifest, hashes: dict[str, str], log: Any
    ) -> None:
        """Store our hashes as the ground truth; if a stored record is untrusted or
        disagrees with ours (same manifest), ours win: this worker holds bytes that
        passed CRC32C against storage, so it replaces the record and says so."""
        reg = self.registry
        if reg.put_ground_truth(version, rank, world, man.digest, hashes):
            return
        try:
            existing = reg.get_ground_truth(version, rank, world)
        except UntrustedRecordError as e:
            existing, why = None, f"untrusted: {e}"
        else:
            if existing is None or existing[0] != man.digest:
                return  # expired meanwhile, or another skeleton flavour's: leave it
            try:
                integrity.compare(_truth_hashes(existing[1], "sampled"), _truth_hashes(hashes, "sampled"))
                return
            except WeightVerificationError as e:
                why = f"disagrees with storage: {e}"
        reg.replace_ground_truth(version, rank, world, man.digest, hashes)
        log.error("ground_truth_replaced", reason=why)

    def _storage_fallback(
        self,
        model: Model,
        spec: ModelSpec,
        man: Manifest,
        tensors: dict[str, torch.Tensor],
        rank: int,
        world: int,
        reason: NcclBackError | None,
        start: float,
        timings: dict[str, float],
        log: Any,
    ) -> LoadResult:
        code = fallback_reason(reason) if reason is not None else "other"
        if self.settings.strict and reason is not None and not isinstance(reason, NobodyHolds):
            raise reason
        if reason is not None:
            self.metrics.record_fallback(code)
            log.warning("fallback_to_storage", reason=code, detail=str(reason))
        t = time.perf_counter()
        stored = load_from_storage(model, spec, settings=self.settings)
        timings["storage"] = time.perf_counter() - t
        timings.update({f"storage.{k}": v for k, v in stored.timings.items()})
        t = time.perf_counter()
        key = self.settings.key("integrity")
        hashes = {f"sampled{MODES_KEY_SEP}{k}": v
                  for k, v in integrity.layer_hashes(model, mode="sampled", key=key).items()}
        if self.settings.verify == "full":
            hashes.update({f"full{MODES_KEY_SEP}{k}": v
                           for k, v in integrity.layer_hashes(model, mode="full", key=key).items()})
        timings["hash"] = time.perf_counter() - t
        seconds = time.perf_counter() - start
        detail = f"{code}: {reason}" if reason is not None else None
        result = LoadResult(
            source="storage", version=spec.version, bytes=stored.bytes, seconds=seconds,
            fallback_reason=detail, verified=True, timings=timings,
        )
        self.metrics.record_load("storage", stored.bytes, seconds)
        log.info("loaded", source="storage", seconds=round(seconds, 3), gbps=round(result.gbps, 3))
        try:
            self._claim_ground_truth(spec.version, rank, world, man, hashes, log)
            self._server.publish(model, tensors, man, spec.version, rank, world, source="storage", log=log)
        except NcclBackError as e:  # Redis gone, rendezvous port taken: serve nobody
            log.warning("publish_failed", error=str(e))
        return result
