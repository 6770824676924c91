"""The one send path of every endpoint that answers transfer requests.

A holder (:class:`~nccl_back.transport.sender.PeerServer`) and a relay endpoint
(:class:`~nccl_back.transport.relay.RelayServer`) differ only in a :class:`Role` (metrics
label, event names) and the fields of :class:`Sends`. A closing worker's sends past
:func:`drain_bound` are aborted with a notice on their handshake key
(:func:`~nccl_back.coord.handshake.abandon`): the receiver need not wait out its stall bound.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import abandon, refuse, run_sender
from nccl_back.coord.records import TransferRequest
from nccl_back.coord.registry import Registry
from nccl_back.errors import HandshakeTimeoutError, NcclBackError, RegistryError, fallback_reason
from nccl_back.metrics import Metrics
from nccl_back.timing import (
    DRAIN_ARRIVAL,
    DRAIN_FLOOR_GBPS,
    DRAIN_GRACE,
    DRAIN_MAX,
    DRAIN_OWED_POLL,
    DRAIN_POLL,
)
from nccl_back.transport.broadcast import TransferStats, moved_bytes, payload_bytes, send_tensors
from nccl_back.transport.channel import Rendezvous, Transport
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.parts import Part
from nccl_back.transport.watchdog import run_guarded


@dataclass(frozen=True)
class Role:
    """Who sends: the metrics' ``role`` label and its event names (dashboards know them)."""

    name: str
    done: str
    failed: str
    crashed: str
    refused: str
    poll_failed: str
    loop_error: str
    counts_handshake_timeouts: bool
    """Whether a sender handshake timeout counts in ``handshake_timeouts`` (holders only)."""


HOLDER = Role("holder", done="served", failed="serve_failed", crashed="serve_crashed",
              refused="request_refused", poll_failed="serve_poll_failed",
              loop_error="serve_loop_error", counts_handshake_timeouts=True)
RELAY = Role("relay", done="relayed", failed="relay_failed", crashed="relay_crashed",
             refused="relay_request_refused", poll_failed="relay_poll_failed",
             loop_error="relay_loop_error", counts_handshake_timeouts=False)


def answer(
    registry: Registry,
    key: str,
    role: Role,
    log: Any,
    stop: threading.Event,
    poll: float,
    handle: Callable[[TransferRequest], None],
    done: Callable[[], bool] | None = None,
) -> None:
    """Hand each request pushed to ``key`` to ``handle`` until ``stop`` is set (or
    ``done()``), looking every ``poll`` seconds; a failure is logged and waited out, since
    the loop must outlive anything a request or Redis does."""
    while not stop.is_set() and not (done is not None and done()):
        try:
            request = registry.pop_request(key, timeout=poll)
            if request is None:
                continue
            if stop.is_set():  # popped while stopping: nobody serves it, said at once
                decline(registry, request, "draining", "the endpoint is closing", log, role,
                        reason="closing")
                continue
            handle(request)
        except RegistryError as e:
            log.warning(role.poll_failed, error=str(e))
            _clock.wait(stop, poll)
        except Exception as e:
            log.error(role.loop_error, error=repr(e))
            _clock.wait(stop, poll)


def decline(registry: Registry, request: TransferRequest, code: str, message: str,
            log: Any, role: Role, /, **fields: Any) -> None:
    """Refuse ``request`` (``code``: one of :data:`~nccl_back.coord.handshake.REFUSALS`)
    before anything is created; best effort (without Redis the handshake times out)."""
    log.warning(role.refused, **fields)
    with contextlib.suppress(RegistryError):
        refuse(registry, request.transfer_id, code, message)


#: Receivers an endpoint remembers as having asked (a close's drain waits for the owed
#: ones that have not); beyond it, a flood of made-up receivers is not remembered.
ASKERS = 1024
#: Requests a closing endpoint refuses from its queue; more (a flood) are dropped.
REFUSED_AT_CLOSE = 16


def refuse_queued(registry: Registry, key: str, role: Role, log: Any) -> None:
    """Refuse the requests queued for the closing endpoint ``key``, then drop the queue."""
    empty = 0
    with contextlib.suppress(RegistryError):
        for _ in range(REFUSED_AT_CLOSE):
            request = registry.pop_request(key, timeout=0)
            if request is None:
                empty += 1  # empty, or a wake-up left there: one more look
                if empty == 2:
                    break
                continue
            decline(registry, request, "draining", "the endpoint closed", log, role, reason="closed")
    with contextlib.suppress(RegistryError):
        registry.drop_requests(key)


def drain_bound(nbytes: int, settings: Settings) -> float:
    """Seconds a drain waits for sends with ``nbytes`` left: those bytes at the slower of
    :data:`DRAIN_FLOOR_GBPS` and ``max_send_gbps`` (when set), plus :data:`DRAIN_GRACE`,
    capped at :data:`DRAIN_MAX`."""
    gbps = DRAIN_FLOOR_GBPS if settings.max_send_gbps <= 0 else min(settings.max_send_gbps,
                                                                     DRAIN_FLOOR_GBPS)
    return min(DRAIN_MAX, DRAIN_GRACE + nbytes / (gbps * 1e9))


@dataclass
class Owed:
    """The receivers a closing worker still serves (the followers of its download) and
    what it can learn of them."""

    receivers: frozenset[str]
    asked: Callable[[], set[str]]
    """Those that asked one of its endpoints so far."""
    loaded: Callable[[frozenset[str]], set[str]]
    """Those of the given ones that hold the version now (published it)."""

    def awaited(self, elapsed: float, failed: Mapping[str, float]) -> bool:
        """Whether one is still to be served ``elapsed`` seconds into the drain, unless it
        loaded: one that never asked, for :data:`DRAIN_ARRIVAL`; one whose last send
        failed at ``failed[receiver]`` (it gave the transfer up: its tree parent moved, a
        handshake timed out) asks again, for :data:`DRAIN_ARRIVAL` after that."""
        now = _clock.monotonic()
        due = {r for r in self.receivers & failed.keys() if now - failed[r] < DRAIN_ARRIVAL}
        if elapsed < DRAIN_ARRIVAL:
            due |= self.receivers - self.asked()
        # Redis last, and only for those still due: most looks end without it.
        return bool(due) and bool(due - self.loaded(frozenset(due)))


def drain(sends: Iterable[Sends], settings: Settings, log: Any, owed: Owed | None = None) -> int:
    """Let the sends of withdrawn endpoints finish, then abort the rest and refuse later
    requests; how many were aborted.

    Sends get :func:`drain_bound` of their bytes left from when each began; ``owed``
    receivers still to be served (:meth:`Owed.awaited`, looked at every
    :data:`DRAIN_OWED_POLL`) are waited for. Never more than :data:`DRAIN_MAX`.
    """
    sends = list(sends)
    start = _clock.monotonic()
    deadline, flying, said = start, 0, False
    looked, waiting = start - DRAIN_OWED_POLL, False
    while True:
        now = _clock.monotonic()
        n = sum(s.in_flight for s in sends)
        if owed is not None and now - looked >= DRAIN_OWED_POLL:
            failed: dict[str, float] = {}
            for s in sends:
                for r, t in s.failed().items():
                    failed[r] = max(t, failed.get(r, t))
            looked, waiting = now, owed.awaited(now - start, failed)
        if n > flying:  # a send began (an owed receiver asked): its bytes' bound from now
            left = sum(s.bytes_left() for s in sends)
            deadline = max(deadline, now + drain_bound(left, settings))
            if not said:
                log.info("draining", sends=n, bytes_left=left, owed=waiting,
                         bound=round(deadline - start, 3))
                said = True
        flying = n
        if not (n or waiting) or now >= start + DRAIN_MAX or (not waiting and now >= deadline):
            break
        _clock.sleep(DRAIN_POLL)
    aborted = sum(s.abort() for s in sends)
    if aborted:
        log.warning("drain_bound_passed", aborted=aborted, seconds=round(now - start, 3))
    return aborted


@dataclass
class _Flight:
    """One send from its request on: what it reads, what it has sent, its transport."""

    read: Callable[[], Mapping[str, torch.Tensor]]
    start: int
    part: Part | None
    bucket: int | None = None
    """Set once its payload is planned; None: not past its handshake yet."""
    sent: int = 0
    """Bytes it issued so far."""
    transport: Transport | None = None
    abandoned: bool = False
    """Aborted by :meth:`Sends.abort` (perhaps before its transport existed)."""


@dataclass
class Sends:
    """One endpoint's sends: what they read, how they are bounded, those in flight."""

    role: Role
    settings: Settings
    registry: Registry
    metrics: Metrics
    pacer: Pacer
    """The worker's send-rate cap, shared by every send and relay hop."""
    rendezvous: Rendezvous
    digest: str
    """The manifest digest the handshake proves to the receiver."""
    kind: str
    """The transport kind (it sets the bucket size)."""
    tensors: Callable[[], Mapping[str, torch.Tensor]]
    """Read at each send, so a model re-pointed later (the hand-off arena) is not kept twice."""
    timeout: float
    """Seconds a whole send may take."""
    stall: float | None = None
    """Seconds without a completed step before the send is aborted; None: unbounded."""
    ready: Callable[[int, float], None] | None = None
    """``ready(step, deadline)`` returns once the step's bytes are in place (a relay
    forwards what it is still receiving); None: everything already is."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Guards the fields below."""
    _flights: dict[str, _Flight] = field(default_factory=dict, repr=False)
    """Sends from their request on, by transfer id."""
    _closed: bool = False
    """Aborted: later requests are refused."""
    _failed: dict[str, float] = field(default_factory=dict, repr=False)
    """When each receiver's last send failed (cleared by one that completes; at most
    :data:`ASKERS` receivers): it may ask again, which a close waits for."""

    @property
    def in_flight(self) -> int:
        """Sends running (in their handshake or past it)."""
        with self._lock:
            return len(self._flights)

    def failed(self) -> dict[str, float]:
        """When each receiver whose last send failed saw it fail (monotonic seconds)."""
        with self._lock:
            return dict(self._failed)

    def bytes_left(self) -> int:
        """Bytes the sends in flight have still to issue."""
        with self._lock:
            flights = list(self._flights.values())
        left = 0
        for f in flights:
            with contextlib.suppress(Exception):  # a payload that no longer plans: nothing to wait for
                payload = f.read()
                bucket = f.bucket or self.settings.bucket_for(self.kind, payload_bytes(payload))
                left += max(0, moved_bytes(payload, bucket, f.start, f.part) - f.sent)
        return left

    def abort(self) -> int:
        """Abort every send in flight, each receiver told at once, and refuse later
        requests; how many were aborted."""
        with self._lock:
            self._closed = True
            flights = dict(self._flights)
            for f in flights.values():
                f.abandoned = True
        for transfer_id, f in flights.items():
            self._abandon(transfer_id)
            if f.transport is not None:
                with contextlib.suppress(Exception):
                    f.transport.abort()
        return len(flights)

    def abort_one(self, transfer_id: str) -> bool:
        """Abort one send its receiver gave up on (no notice); False if not past its handshake."""
        with self._lock:
            f = self._flights.get(transfer_id)
            tr = f.transport if f is not None else None
        if tr is None:
            return False
        with contextlib.suppress(Exception):
            tr.abort()
        return True

    def _abandon(self, transfer_id: str) -> None:
        """Tell the receiver of ``transfer_id`` this side gave it up (best effort)."""
        with contextlib.suppress(RegistryError):
            abandon(self.registry, transfer_id)

    def serve(self, request: TransferRequest, log: Any, *, digest: str | None = None,
              tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> TransferStats | None:
        """Send ``request``'s transfer from the step it asks for; the stats, or None when
        it failed (logged, counted, never raised). ``digest`` and ``tensors`` replace the
        endpoint's (a reshard's plan digest and packed pieces)."""
        s = self.settings
        digest = self.digest if digest is None else digest
        read = self.tensors if tensors is None else tensors
        start = request.start or 0
        part = request.steps_part
        flight = _Flight(read, start, part)
        with self._lock:
            closed = self._closed
            if not closed:
                self._flights[request.transfer_id] = flight
        if closed:  # asked after a close or a drain ended: said at once
            decline(self.registry, request, "draining", "the endpoint is closing", log, self.role,
                    reason="closing")
            return None
        try:
            run_sender(self.registry, request.transfer_id, digest, s.sender_handshake)
            transport = self.rendezvous.sender(transfer_scope(s.key("store"), request.transfer_id))
            with self._lock:
                flight.transport = transport
                abandoned = flight.abandoned
            if abandoned:  # aborted during the handshake, which may have overwritten the notice
                self._abandon(request.transfer_id)
                with contextlib.suppress(Exception):
                    transport.close()
                log.warning(self.role.failed, reason="closing", error="aborted before the transfer began")
                return None
            now = _clock.monotonic()
            deadline = now + self.timeout
            wait = self.ready
            ready = None if wait is None else (lambda k: wait(k, deadline))

            def pace(nbytes: int) -> None:
                self.pacer.take(nbytes)
                flight.sent += nbytes

            def send(tr: Transport) -> TransferStats:
                payload = read()
                flight.bucket = bucket = s.bucket_for(self.kind, payload_bytes(payload))
                return send_tensors(tr, payload, bucket, start=start, part=part, ready=ready,
                                    pace=pace)

            with self.metrics.sending(self.role.name):
                stats = run_guarded(transport, send, deadline,
                                    connect_deadline=now + s.connect_timeout, stall=self.stall)
            self.metrics.record_sent(self.role.name, stats.bytes, stats.seconds)
            log.info(self.role.done, start=start, part=part, bytes=stats.bytes,
                     gbps=round(stats.gbps, 3))
            with self._lock:
                self._failed.pop(request.receiver, None)
            return stats
        except NcclBackError as e:
            if isinstance(e, HandshakeTimeoutError) and self.role.counts_handshake_timeouts:
                self.metrics.record_handshake_timeout()
            log.warning(self.role.failed, reason=fallback_reason(e), error=str(e))
        except Exception as e:  # a serving thread must never die silently
            log.error(self.role.crashed, error=repr(e))
        finally:
            with self._lock:
                self._flights.pop(request.transfer_id, None)
        with self._lock:
            if request.receiver in self._failed or len(self._failed) < ASKERS:
                self._failed[request.receiver] = _clock.monotonic()
        return None
