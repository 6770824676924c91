"""The one send path of every endpoint that answers transfer requests.

A published holder (:class:`~nccl_back.transport.sender.PeerServer`) and a relay
member's endpoint (:class:`~nccl_back.transport.relay.RelayServer`) answer requests
the same way; this module is that way, written once. What differs is a parameter:
:class:`Role` (the metrics label and the names of the events) and the fields of
:class:`Sends` (which tensors, the deadline and stall bound, when a step is ready).

- :func:`answer`: the polling loop. Pops the requests pushed to the endpoint's key,
  parses each (:func:`~nccl_back.coord.records.request`, the one place a request's
  fields are read) and hands it on; it outlives anything a request or Redis does.
- :func:`decline`: a refusal through the handshake, so the receiver moves on at once.
- :meth:`Sends.serve`: the sender's half of the liveness handshake, then the guarded
  send in the transfer's scope, tracked so a close or a drain can abort it, counted
  and logged; it never raises.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import refuse, run_sender
from nccl_back.coord.records import TransferRequest
from nccl_back.coord.registry import Registry
from nccl_back.errors import HandshakeTimeoutError, NcclBackError, RegistryError, fallback_reason
from nccl_back.metrics import Metrics
from nccl_back.transport.base import Rendezvous, Transport
from nccl_back.transport.broadcast import TransferStats, payload_bytes, send_tensors
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.watchdog import run_guarded


@dataclass(frozen=True)
class Role:
    """Who sends: the metrics' ``role`` label (:data:`~nccl_back.metrics.SEND_ROLES`)
    and the names of its events, which operators and dashboards already know."""

    name: str
    done: str
    failed: str
    crashed: str
    refused: str
    poll_failed: str
    loop_error: str
    counts_handshake_timeouts: bool
    """Whether a sender handshake that timed out is counted in ``handshake_timeouts``
    (a holder's are; a relay endpoint's are not: the counter speaks of holders)."""


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
    ``done()`` says the endpoint has nothing left to serve).

    Waits at most ``poll`` seconds per look, so ``stop`` is seen that often. A failed
    poll or handler is logged and waited out for ``poll`` seconds: the loop must outlive
    anything a request or Redis does.
    """
    while not stop.is_set() and not (done is not None and done()):
        try:
            request = registry.pop_request(key, timeout=poll)
            if request is None or stop.is_set():  # popped while stopping: nobody serves it
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
    """Refuse ``request`` (``code``: a :data:`~nccl_back.coord.handshake.REFUSALS`)
    before anything is created, so its receiver moves on at once; logs ``fields``.

    Best effort: when Redis cannot take the refusal, the receiver's handshake times out,
    as it would have without one.
    """
    log.warning(role.refused, **fields)
    with contextlib.suppress(RegistryError):
        refuse(registry, request.transfer_id, code, message)


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
    """Read at each send, never at publication: whoever re-points the model's storage
    afterwards (the sidecar's hand-off arena) leaves one copy in memory, not two."""
    timeout: float
    """Seconds a whole send may take."""
    stall: float | None = None
    """Seconds without a completed step before the send is aborted; None: unbounded."""
    ready: Callable[[int, float], None] | None = None
    """``ready(step, deadline)`` returns once the step's bytes are in place (a relay
    forwards what it is still receiving); None: everything already is."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _transports: dict[str, Transport] = field(default_factory=dict, repr=False)
    """Sends past their handshake, by transfer id."""

    def abort(self) -> int:
        """Abort every send in flight (the receivers fall back; the tensors are only
        read, so nothing here is damaged). Returns how many were aborted."""
        with self._lock:
            transports = list(self._transports.values())
        n = 0
        for tr in transports:
            with contextlib.suppress(Exception):
                tr.abort()
                n += 1
        return n

    def abort_one(self, transfer_id: str) -> bool:
        """Abort one send in flight; False when it is not past its handshake (or over)."""
        with self._lock:
            tr = self._transports.get(transfer_id)
        if tr is None:
            return False
        with contextlib.suppress(Exception):
            tr.abort()
        return True

    def serve(self, request: TransferRequest, log: Any, *, digest: str | None = None,
              tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> TransferStats | None:
        """Send ``request``'s transfer from the step it asks for; the stats, or None when
        it failed. Logs and counts the outcome and never raises: a serving thread must
        never die silently. ``digest`` and ``tensors`` replace the endpoint's for this
        request (a reshard: the plan's digest and its packed pieces)."""
        s = self.settings
        digest = self.digest if digest is None else digest
        read = self.tensors if tensors is None else tensors
        start = request.start or 0
        part = request.steps_part
        transport: Transport | None = None
        try:
            run_sender(self.registry, request.transfer_id, digest, s.sender_handshake_timeout)
            transport = self.rendezvous.sender(transfer_scope(s.key("store"), request.transfer_id))
            with self._lock:
                self._transports[request.transfer_id] = transport
            now = _clock.monotonic()
            deadline = now + self.timeout
            wait = self.ready
            ready = None if wait is None else (lambda k: wait(k, deadline))

            def send(tr: Transport) -> TransferStats:
                payload = read()
                bucket = s.bucket_for(self.kind, payload_bytes(payload))
                return send_tensors(tr, payload, bucket, start=start, part=part, ready=ready,
                                    pace=self.pacer.take)

            with self.metrics.sending(self.role.name):
                stats = run_guarded(transport, send, deadline,
                                    connect_deadline=now + s.connect_timeout, stall=self.stall)
            self.metrics.record_sent(self.role.name, stats.bytes, stats.seconds)
            log.info(self.role.done, start=start, part=part, bytes=stats.bytes,
                     gbps=round(stats.gbps, 3))
            return stats
        except NcclBackError as e:
            if isinstance(e, HandshakeTimeoutError) and self.role.counts_handshake_timeouts:
                self.metrics.record_handshake_timeout()
            log.warning(self.role.failed, reason=fallback_reason(e), error=str(e))
        except Exception as e:  # a serving thread must never die silently
            log.error(self.role.crashed, error=repr(e))
        finally:
            if transport is not None:
                with self._lock:
                    self._transports.pop(request.transfer_id, None)
        return None
