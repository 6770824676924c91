"""The sending side of a worker: publication, heartbeat, serving transfer requests.

After a verified load the worker publishes itself in the registry (a heartbeat keeps
the entry alive, so a crashed worker vanishes within ``peer_ttl``) and answers
transfer requests in the background: for each request, the sender half of the
liveness handshake, then the guarded broadcast of its tensors. At most
``max_concurrent_sends`` at once. The model is only read, so a failed send leaves it
untouched and the worker goes on serving.

Requests come from Redis, so nothing in them is trusted: the registry hands over only
requests that verify and parse (:mod:`.records`), a request for another version or
transport is refused before anything is created, at most ``QUEUE_PER_SLOT`` requests
per send slot wait (more are dropped and counted), and the serve loop survives
anything a request or Redis does.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .auth import transfer_scope
from .config import Settings
from .errors import HandshakeTimeoutError, ManifestMismatchError, NcclBackError, RegistryError
from .handshake import run_sender
from .log import get_logger
from .metrics import Metrics, fallback_reason
from .registry import PeerInfo, Registry
from .skeleton import Manifest, Model, model_device
from .transport import Rendezvous, open_rendezvous, resolve_kind, run_guarded, send_tensors

#: Requests that may wait per send slot; a flood beyond it is dropped, not queued.
QUEUE_PER_SLOT = 4


@dataclass
class _Held:
    """A model this worker holds and serves."""

    model: Model
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    info: PeerInfo
    sends: ThreadPoolExecutor
    thread: threading.Thread | None = None
    active: int = 0
    queued: int = 0
    """Requests submitted and not finished (running or waiting for a slot)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    transports: set[Any] = field(default_factory=set)
    """Transports of in-flight sends, so a drain past its bound can abort them."""


class PeerServer:
    """Publishes the models a worker holds and serves them to receivers."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        metrics: Metrics,
        worker_id: str,
        *,
        corrupt_for_test: bool = False,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.worker_id = worker_id
        self._corrupt = corrupt_for_test
        self._held: dict[str, _Held] = {}
        self._rendezvous: dict[str, Rendezvous] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._log = get_logger("nccl_back.sender", worker=worker_id)

    @property
    def peers(self) -> list[PeerInfo]:
        """What this worker currently publishes."""
        return [h.info for h in self._held.values()]

    @property
    def active_sends(self) -> int:
        return sum(h.active for h in self._held.values())

    def holds(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is one of this worker's own entries (never its own peer)."""
        return peer_id in self._held

    def close(self) -> None:
        """Stop serving, withdraw every published entry, release sockets and threads."""
        self.withdraw()
        for held in list(self._held.values()):
            if held.thread is not None:
                held.thread.join(self.settings.redis_timeout + 2)
            # In-flight sends end within their own watchdog deadline.
            held.sends.shutdown(wait=True)
        if self._heartbeat is not None:
            self._heartbeat.join(self.settings.heartbeat_interval + self.settings.redis_timeout + 1)
        for rv in self._rendezvous.values():
            with contextlib.suppress(Exception):
                rv.close()
        self._rendezvous.clear()

    def abort_sends(self) -> int:
        """Abort every in-flight send's communicator (a drain past its bound).

        Receivers see a transfer error and fall back; this worker's weights are
        untouched. Returns how many sends were aborted.
        """
        n = 0
        for held in list(self._held.values()):
            with held.lock:
                transports = list(held.transports)
            for tr in transports:
                with contextlib.suppress(Exception):
                    tr.abort()
                    n += 1
        if n:
            self._log.warning("sends_aborted", count=n)
        return n

    def withdraw(self) -> None:
        """Stop accepting new transfers (drain): remove this worker from the registry.

        In-flight sends finish; :meth:`close` still has to be called.
        """
        self._stop.set()
        for held in list(self._held.values()):
            with contextlib.suppress(RegistryError):
                self.registry.withdraw(held.info.peer_id, held.info.version)
        self.metrics.set_ready(False)

    def publish(
        self, model: Model, tensors: dict[str, torch.Tensor], man: Manifest, version: str,
        rank: int, world: int, *, source: str, log: Any,
    ) -> PeerInfo:
        """Publish ``model`` (loaded and verified) and start serving it.

        Raises :class:`NcclBackError` (Redis unreachable, rendezvous not startable).
        """
        device = model_device(model)
        kind = resolve_kind(self.settings, device)
        with self._lock:
            rv = self._rendezvous.get(kind)
            if rv is None:
                rv = open_rendezvous(self.settings, kind, device=device, registry=self.registry)
                self._rendezvous[kind] = rv
        peer_id = f"{self.worker_id}-r{rank}-{uuid.uuid4().hex[:4]}"
        info = PeerInfo(
            peer_id=peer_id, version=version, rank=rank, world_size=world,
            manifest_digest=man.digest, transport=kind, address=rv.address, source=source,
            max_sends=self.settings.max_concurrent_sends,
        )
        if self._stop.is_set():
            # Withdrawn (draining) while this load ran: hold the weights, serve nobody.
            log.info("not_published_draining", peer=peer_id)
            return info
        held = _Held(model, tensors, man, info,
                     ThreadPoolExecutor(self.settings.max_concurrent_sends,
                                        thread_name_prefix=f"nccl-back-send-{rank}"))
        self.registry.publish_peer(info)
        self._held[peer_id] = held
        held.thread = threading.Thread(target=self._serve_loop, args=(held,), daemon=True,
                                       name=f"nccl-back-serve-{rank}")
        held.thread.start()
        if self._heartbeat is None or not self._heartbeat.is_alive():
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name="nccl-back-heartbeat")
            self._heartbeat.start()
        self.metrics.set_ready(True)
        log.info("published", peer=peer_id, transport=kind, address=rv.address, source=source)
        return info

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval):
            for held in list(self._held.values()):
                try:
                    self.registry.heartbeat(held.info)
                except RegistryError as e:
                    self._log.warning("heartbeat_failed", peer=held.info.peer_id, error=str(e))
            self.metrics.set_claims(self.active_sends)

    def _serve_loop(self, held: _Held) -> None:
        bound = QUEUE_PER_SLOT * held.info.max_sends
        while not self._stop.is_set():
            try:
                request = self.registry.pop_request(held.info.peer_id, timeout=0.5)
                if request is None or self._stop.is_set():
                    continue
                with held.lock:
                    full = held.queued >= bound
                    if not full:
                        held.queued += 1
                if full:
                    self.metrics.record_request_dropped()
                    self._log.warning("request_dropped", peer=held.info.peer_id, queued=bound,
                                      receiver=str(request.get("receiver")))
                    continue
                held.sends.submit(self._serve_one, held, request)
            except RegistryError as e:
                self._log.warning("serve_poll_failed", peer=held.info.peer_id, error=str(e))
                self._stop.wait(0.5)
            except Exception as e:  # the loop must outlive anything a request does
                self._log.error("serve_loop_error", peer=held.info.peer_id, error=repr(e))
                self._stop.wait(0.5)

    def _serve_one(self, held: _Held, request: dict[str, Any]) -> None:
        s = self.settings
        transfer_id = str(request.get("transfer_id", ""))
        log = self._log.bind(rank=held.info.rank, version=held.info.version[:12],
                             peer=str(request.get("receiver")), transfer_id=transfer_id)
        with held.lock:
            held.active += 1
        self.metrics.set_claims(self.active_sends)
        ok = False
        transport: Any = None
        try:
            if request.get("version") != held.info.version:
                raise ManifestMismatchError(
                    f"request for version {str(request.get('version'))[:12]}, this peer holds"
                    f" {held.info.version[:12]}"
                )
            if request.get("transport") != held.info.transport:
                raise ManifestMismatchError(
                    f"request for transport {request.get('transport')!r}, this peer serves"
                    f" {held.info.transport!r}"
                )
            run_sender(self.registry, transfer_id, held.manifest.digest, s.sender_handshake_timeout)
            scope = transfer_scope(s.key("store"), transfer_id)
            transport = self._rendezvous[held.info.transport].sender(scope)
            with held.lock:
                held.transports.add(transport)
            stats = run_guarded(
                transport,
                lambda tr: send_tensors(tr, held.tensors, s.bucket_bytes,
                                        corrupt_for_test=self._corrupt),
                time.monotonic() + s.transfer_timeout,
            )
            ok = True
            log.info("served", bytes=held.manifest.nbytes, gbps=round(stats.gbps, 3))
        except NcclBackError as e:
            if isinstance(e, HandshakeTimeoutError):
                self.metrics.record_handshake_timeout()
            log.warning("serve_failed", reason=fallback_reason(e), error=str(e))
        except Exception as e:  # a serving thread must never die silently
            log.error("serve_crashed", error=repr(e))
        finally:
            self.metrics.record_served(ok)
            with held.lock:
                held.active -= 1
                held.queued -= 1
                held.transports.discard(transport)
            self.metrics.set_claims(self.active_sends)
