"""The sending side of a worker: publication, heartbeat, serving transfer requests
(docs/design.md, "Serving"), through the send path it shares with the relay (:mod:`.send`).

Requests come from Redis and are not trusted: at most ``QUEUE_PER_SLOT`` wait per send
slot (``SHARED_SENDS`` per shared claim token), more are dropped and counted.

Withdrawal is final: publication, heartbeats and withdrawal take one lock and the
heartbeat re-checks the stop flag under it, so no entry reappears after :meth:`withdraw`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.content import PositionTruth
from nccl_back.coord.records import TransferRequest, to_label
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import RegistryError
from nccl_back.log import get_logger
from nccl_back.metrics import Metrics
from nccl_back.model.layout import Layout, trivial_layout
from nccl_back.model.reshard_plan import Move, PlanError, plan, sent
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import Manifest, Model, model_device, named_tensors
from nccl_back.transport import Rendezvous, open_rendezvous, resolve_kind
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.send import ASKERS, HOLDER, Sends, answer, decline, refuse_queued

#: Requests that may wait per send slot; a flood beyond it is dropped, not queued.
QUEUE_PER_SLOT = 4
#: Sends of one claim token run side by side: the ranks of one group resharding from this
#: holder (together one model's bytes), or the parts a cohort's tree roots take.
SHARED_SENDS = 8


def worker_of(peer_id: str) -> str:
    """The worker an entry's ``peer_id`` (``{worker}-r{rank}-{4 hex}``) belongs to."""
    return peer_id.rsplit("-", 2)[0]


@dataclass
class _Served:
    """A model this worker holds and serves."""

    model: Model
    manifest: Manifest
    info: PeerInfo
    pool: ThreadPoolExecutor
    sends: Sends
    """Its sends (the shared send path), so a drain past its bound can abort them."""
    thread: threading.Thread | None = None
    active: int = 0
    queued: int = 0
    """Requests submitted and not finished (running or waiting for a slot)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    truth: dict[str, str] | None = None
    """The ground truth it holds (stored form), re-published by the heartbeat."""
    layout: Layout | None = None
    """Which pieces of the checkpoint it holds; None: every tensor whole."""
    positions: PositionTruth | None = None
    """Its truth in checkpoint coordinates, kept by the heartbeat like ``truth``."""
    shared: dict[str, int] = field(default_factory=dict)
    """Reshard requests queued or running, by the claim token their group shares."""
    plans: dict[tuple[str, str, int], tuple[tuple[Move, ...] | str, str]] = field(default_factory=dict)
    """Reshard moves (or why none) and the plan's digest, by (layout, group, holder)."""
    sending: dict[str, int] = field(default_factory=dict)
    """Sends running, by claim token (the ranks of one receiving group share one)."""
    turns: threading.Condition = field(default_factory=threading.Condition)
    """Guards ``sending``; notified when a send ends."""


class PeerServer:
    """Publishes the models a worker holds and serves them to receivers."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        metrics: Metrics,
        worker_id: str,
        pacer: Pacer | None = None,
        engine: str = "library",
    ) -> None:
        self.settings = settings
        self.engine = engine
        """What runs this worker (``library``, ``sidecar``, ``vllm-0.32.0`` ...), for ``status``."""
        self.pacer = pacer if pacer is not None else Pacer(settings.max_send_gbps)
        """The worker's send-rate cap, shared by every send and relay hop."""
        self.registry = registry
        self.metrics = metrics
        self.worker_id = worker_id
        self._served: dict[str, _Served] = {}
        self._rendezvous: dict[str, Rendezvous] = {}
        self._stop = threading.Event()
        """Withdrawn: nothing is published any more, requests are refused (or owed)."""
        self._done = threading.Event()
        """Closed: requests are no longer even read."""
        self._lock = threading.Lock()
        # Serialises every write of availability entries (publish, heartbeat, withdraw).
        self._entries_lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._owed: dict[str, float] = {}
        """Receivers owed a send, by when they would have asked (:meth:`owe`)."""
        self.askers: set[str] = set()
        """Receivers that asked this worker's holder entries (at most :data:`ASKERS`)."""
        self._serving: frozenset[str] = frozenset()
        """Receivers still served once withdrawn (a close's owed ones)."""
        self._log = get_logger("nccl_back.transport.sender", worker=worker_id)

    @property
    def peers(self) -> list[PeerInfo]:
        """What this worker currently publishes."""
        return [h.info for h in self._served.values()]

    @property
    def active_sends(self) -> int:
        return sum(h.active for h in self._served.values())

    def holds(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is one of this worker's own entries (never its own peer)."""
        return peer_id in self._served

    def served_tensors(self, peer_id: str) -> dict[str, torch.Tensor]:
        """The tensors a send of ``peer_id`` reads now (the model's current storage)."""
        return named_tensors(self._served[peer_id].model)[0]

    @property
    def sends(self) -> list[Sends]:
        """The sends of every model served, for a closing worker's drain."""
        return [served.sends for served in list(self._served.values())]

    def close(self) -> None:
        """Stop serving, withdraw every entry, abort sends in flight (a closing service
        drains them first), release sockets and threads."""
        self.withdraw()
        self._done.set()
        for served in list(self._served.values()):
            served.sends.abort()
            if served.thread is not None:
                with contextlib.suppress(RegistryError):  # else it sees the stop within a poll
                    self.registry.wake_requests(served.info.peer_id)
                served.thread.join(self.settings.redis_timeout + 2)
                # Asked meanwhile, and a wake-up nobody popped.
                refuse_queued(self.registry, served.info.peer_id, HOLDER, self._log)
            # Aborted sends end within their transport's abort (gloo: its per-call timeout).
            served.pool.shutdown(wait=True)
        if self._heartbeat is not None:
            self._heartbeat.join(self.settings.heartbeat_interval + self.settings.redis_timeout + 1)
        for rv in self._rendezvous.values():
            with contextlib.suppress(Exception):
                rv.close()
        self._rendezvous.clear()

    def owe(self, receivers: Iterable[str], seconds: float) -> None:
        """``receivers`` may ask within ``seconds``: a close meanwhile serves them."""
        until = _clock.monotonic() + seconds
        with self._lock:
            for r in receivers:
                self._owed[r] = max(until, self._owed.get(r, 0.0))

    @property
    def withdrawn(self) -> bool:
        """Whether :meth:`withdraw` ran (nothing of this worker is published any more)."""
        return self._stop.is_set()

    def loaded(self, workers: Collection[str]) -> set[str]:
        """Those of ``workers`` that now publish a version this worker serves, at its rank:
        they hold it and ask for nothing more. Redis trouble: all of them (nothing known
        to wait for)."""
        got: set[str] = set()
        try:
            for where in {(p.version, p.rank, p.world_size) for p in self.peers}:
                got.update(worker_of(p.peer_id) for p in self.registry.find_peers(*where))
        except RegistryError:
            return set(workers)
        return got & set(workers)

    def owed(self) -> frozenset[str]:
        """The receivers still owed a send (:meth:`owe`) whose time to ask has not passed."""
        now = _clock.monotonic()
        with self._lock:
            self._owed = {r: until for r, until in self._owed.items() if until > now}
            return frozenset(self._owed)

    def abort_sends(self) -> int:
        """Abort every in-flight send (a drain past its bound); how many were aborted."""
        n = sum(served.sends.abort() for served in list(self._served.values()))
        if n:
            self._log.warning("sends_aborted", count=n)
        return n

    def withdraw(self, *, serving: Collection[str] = ()) -> None:
        """Remove this worker from the registry (drain): in-flight sends finish, queued ones
        are refused but for ``serving`` (owed receivers); :meth:`close` is still due."""
        self._serving = frozenset(serving)
        with self._entries_lock:
            if self._stop.is_set():
                return  # withdrawn already: nothing of ours is published
            self._stop.set()
            for served in list(self._served.values()):
                with contextlib.suppress(RegistryError):
                    self.registry.withdraw(served.info.peer_id, served.info.version)
        self.metrics.set_ready(False)

    def publish(
        self, model: Model, man: Manifest, version: str, rank: int, world: int, *,
        source: str, log: Any, truth: dict[str, str] | None = None, model_name: str = "",
        layout: Layout | None = None, positions: PositionTruth | None = None,
    ) -> PeerInfo:
        """Publish ``model`` (loaded and verified) and start serving it.

        ``truth``, ``positions`` and ``layout`` (what the Verifier allows) are stored now
        and at every heartbeat, before the entry, so receivers never find this peer with
        nothing to verify against; while Redis is unreachable the heartbeat publishes
        them later. Raises :class:`NcclBackError` when the rendezvous cannot start.
        """
        device = model_device(model)
        kind = resolve_kind(self.settings, device)
        rv = self.rendezvous(kind, device)
        peer_id = f"{self.worker_id}-r{rank}-{uuid.uuid4().hex[:4]}"  # see worker_of
        info = PeerInfo(
            peer_id=peer_id, version=version, rank=rank, world_size=world,
            manifest_digest=man.digest, transport=kind, address=rv.address, source=source,
            max_sends=self.settings.max_concurrent_sends, device=device.type,
            host=to_label(socket.gethostname()), pid=os.getpid(), model=to_label(model_name),
            engine=to_label(self.engine), layout=layout.digest if layout is not None else "",
        )
        with self._entries_lock:
            if self._stop.is_set():
                # Withdrawn (draining) while this load ran: hold the weights, serve nobody.
                log.info("not_published_draining", peer=peer_id)
                return info
            s = self.settings
            # Read at send time: the model may have moved since publication.
            sends = Sends(HOLDER, s, self.registry, self.metrics, self.pacer, rv, man.digest, kind,
                          lambda: named_tensors(model)[0], s.transfer_timeout, s.stall_timeout)
            served = _Served(model, man, info,
                         ThreadPoolExecutor(s.max_concurrent_sends * SHARED_SENDS,
                                            thread_name_prefix=f"nccl-back-send-{rank}"),
                         sends, truth=truth, layout=layout, positions=positions)
            self._served[peer_id] = served
            try:
                self._keep(served)
            except Exception as e:
                # Redis unreachable now: the heartbeat publishes it once Redis answers.
                log.warning("publish_deferred", peer=peer_id, error=str(e))
        served.thread = threading.Thread(target=self._serve_loop, args=(served,), daemon=True,
                                       name=f"nccl-back-serve-{rank}")
        served.thread.start()
        if self._heartbeat is None or not self._heartbeat.is_alive():
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name="nccl-back-heartbeat")
            self._heartbeat.start()
        self.metrics.set_ready(True)
        log.info("published", peer=peer_id, transport=kind, address=rv.address, source=source)
        return info

    def rendezvous(self, kind: str, device: torch.device) -> Rendezvous:
        """This worker's sender endpoint for ``kind``, started on first use."""
        with self._lock:
            rv = self._rendezvous.get(kind)
            if rv is None:
                rv = open_rendezvous(self.settings, kind, device=device, registry=self.registry)
                self._rendezvous[kind] = rv
            return rv

    def _heartbeat_loop(self) -> None:
        while not _clock.wait(self._stop, self.settings.heartbeat_interval):
            for served in list(self._served.values()):
                with self._entries_lock:
                    if self._stop.is_set():  # withdrawn meanwhile: never re-publish
                        return
                    try:
                        self._keep(served)
                    except Exception as e:  # whatever Redis holds, the next beat comes
                        self._log.warning("heartbeat_failed", peer=served.info.peer_id, error=repr(e))
            self.metrics.set_claims(self.active_sends)

    def _keep(self, served: _Served) -> None:
        """Store (or refresh) all this holder publishes: truth, entry, position truth, layout."""
        self.registry.heartbeat(served.info, SCHEME, served.truth)
        if served.positions is not None or served.layout is not None:
            lay = served.layout or trivial_layout(served.manifest)
            self.registry.keep_positions(served.info.version, served.info.rank, served.info.world_size,
                                         lay, served.positions, store_layout=served.layout is not None)

    def _serve_loop(self, served: _Served) -> None:
        bound = QUEUE_PER_SLOT * served.info.max_sends
        log = self._log.bind(peer=served.info.peer_id)

        def enqueue(request: TransferRequest) -> None:
            if len(self.askers) < ASKERS:
                self.askers.add(request.receiver)
            token = _shared_token(request)
            with served.lock:
                if token is None:
                    full = served.queued - sum(served.shared.values()) >= bound
                else:  # the ranks of one group share a slot: up to SHARED_SENDS requests
                    full = served.shared.get(token, 0) >= SHARED_SENDS or (
                        token not in served.shared and len(served.shared) >= bound)
                if not full:
                    served.queued += 1
                    if token is not None:
                        served.shared[token] = served.shared.get(token, 0) + 1
            if full:
                self.metrics.record_request_dropped()
                log.warning("request_dropped", queued=bound, receiver=request.receiver)
                return
            served.pool.submit(self._serve_one, served, request)

        # Read until closed: a withdrawn worker still refuses (or serves an owed) request.
        answer(self.registry, served.info.peer_id, HOLDER, log, self._done, 0.5, enqueue)

    def _serve_one(self, served: _Served, request: TransferRequest) -> None:
        log = self._log.bind(rank=served.info.rank, version=served.info.version[:12],
                             peer=request.receiver, transfer_id=request.transfer_id)
        # Only reshard and part requests share a token's turn; others take their own.
        token = _shared_token(request)
        turn = token or request.transfer_id
        # Derived before the turn: a costly plan (a hostile layout record) must not hold
        # the send slot a genuine receiver waits for.
        moves, digest = self._reshard_moves(served, request) if request.layout is not None else ((), "")
        self._admit(served, turn)
        with served.lock:
            served.active += 1
        self.metrics.set_claims(self.active_sends)
        ok = False
        try:
            refusal = self._refusal(served, request)
            if refusal is not None:
                decline(self.registry, request, *refusal, log, HOLDER,
                        code=refusal[0], reason=refusal[1])
            elif isinstance(moves, str):
                decline(self.registry, request, "incompatible", moves, log, HOLDER,
                        code="layout_mismatch")
            elif request.layout is not None:
                # One byte tensor per move; the handshake proves the plan's digest, so a
                # receiver of a different plan refuses before data moves.
                pieces = moves
                log.info("resharding", plan=digest[:12], bytes=sum(m.nbytes for m in pieces))
                ok = served.sends.serve(request, log, digest=digest, tensors=lambda: sent(
                    pieces, named_tensors(served.model)[0])) is not None
            else:
                ok = served.sends.serve(request, log) is not None
        finally:
            if not ok and request.claim is not None:
                # Our side failed: free its slot now, not when the claim expires.
                self.registry.release(served.info.peer_id, request.claim)
            self.metrics.record_served(ok)
            with served.lock:
                served.active -= 1
                served.queued -= 1
                if token is not None:
                    served.shared[token] -= 1
                    if not served.shared[token]:
                        del served.shared[token]
            self._leave(served, turn)
            self.metrics.set_claims(self.active_sends)

    def _admit(self, served: _Served, turn: str) -> None:
        """Wait until the send of claim token ``turn`` may run: fewer than
        :data:`SHARED_SENDS` of that token run, or fewer than ``max_sends`` tokens do. At
        once while stopping (then declined as draining)."""
        with served.turns:
            while not self._stop.is_set():
                n = served.sending.get(turn, 0)
                if (0 < n < SHARED_SENDS) or (n == 0 and len(served.sending) < served.info.max_sends):
                    break
                served.turns.wait(0.5)
            served.sending[turn] = served.sending.get(turn, 0) + 1

    def _leave(self, served: _Served, turn: str) -> None:
        with served.turns:
            served.sending[turn] -= 1
            if not served.sending[turn]:
                del served.sending[turn]
            served.turns.notify_all()

    def _reshard_moves(self, served: _Served, request: TransferRequest
                       ) -> tuple[tuple[Move, ...] | str, str]:
        """This holder's moves for a receiver of another layout, or why there are none;
        derived once per (receiver layout, group, holder index)."""
        key = (request.layout or "", request.group or "", request.holder or 0)
        got = served.plans.get(key)
        if got is not None:
            return got
        mine = served.layout if served.layout is not None else trivial_layout(served.manifest)
        reg = self.registry
        receiver = reg.get_layout(request.layout) if request.layout else None
        group = reg.get_group(request.group) if request.group else None
        k = request.holder
        if receiver is None or group is None or k is None or k >= len(group) or group[k] != mine.digest:
            return "reshard: unknown layouts, or not this holder's", ""
        holders = [mine if d == mine.digest else reg.get_layout(d) for d in group]
        try:
            if any(h is None for h in holders):
                raise PlanError("a holder's layout is gone")
            p = plan(receiver, [h for h in holders if h is not None])
            out: tuple[Move, ...] | str = p.for_holder(k)
            digest = p.digest
        except PlanError as e:
            out, digest = f"reshard: {e}"[:200], ""
        if len(served.plans) >= 64:
            served.plans.clear()  # receivers of a few layouts: a bound, not a policy
        served.plans[key] = (out, digest)
        return out, digest

    def _refusal(self, served: _Served, request: TransferRequest) -> tuple[str, str] | None:
        """Why this request must not be served, as ``(code, message)``; None to serve it."""
        info = served.info
        if self._stop.is_set() and request.receiver not in self._serving:
            # Queued before the drain began: a drain reported done must stay done.
            return "draining", "the peer is draining"
        if request.version != info.version:
            return "version", (f"request for version {request.version[:12]},"
                               f" this peer holds {info.version[:12]}")
        device = info.device if request.device is None else request.device
        if request.transport != info.transport or device != info.device:
            return "incompatible", (
                f"request for {request.transport[:16]}/{str(request.device)[:16]},"
                f" this peer serves {info.transport}/{info.device}"
            )
        return None


def _shared_token(request: TransferRequest) -> str | None:
    """The claim token a reshard or part request shares with its group's others, if any."""
    shares = request.layout is not None or request.parts is not None
    return request.claim if shares and request.claim else None
