"""The relay's sending half: a member's endpoint forwarding steps as they arrive."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from nccl_back.config import Settings
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import refuse, run_sender
from nccl_back.coord.registry import Registry
from nccl_back.errors import (
    NcclBackError,
    RegistryError,
    fallback_reason,
)
from nccl_back.log import get_logger
from nccl_back.metrics import Metrics
from nccl_back.transport import Rendezvous, payload_bytes, run_guarded, send_tensors
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay.state import LINGER, MAX_RELAY_SENDS, Member, Progress

log = get_logger(__name__)


class RelayServer:
    """A member's downstream side: answers relay requests while (and shortly after) it
    receives, forwarding each step once :class:`Progress` says it is in place."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        rendezvous: Rendezvous,
        member: Member,
        tensors: dict[str, torch.Tensor],
        manifest_digest: str,
        pacer: Pacer,
        progress: Progress,
        log_: Any,
        *,
        max_sends: int = MAX_RELAY_SENDS,
        send_timeout: float | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.max_sends = max_sends
        self.send_timeout = settings.transfer_timeout if send_timeout is None else send_timeout
        self.registry = registry
        self.rendezvous = rendezvous
        self.member = member
        self.tensors = tensors
        self.digest = manifest_digest
        self.pacer = pacer
        self.progress = progress
        self._log = log_
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._sends: list[threading.Thread] = []
        self._transports: set[Any] = set()
        self.served = 0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"nccl-back-relay-{member.member_id[-6:]}")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> RelayServer:
        self._thread.start()
        return self

    def end(self, ok: bool, reason: str = "") -> None:
        """The member's own load ended; failed: its downstream links fail at once.

        The endpoint lingers ``cohort_window`` + :data:`LINGER` seconds without
        requests, then stops
        (in the background: the caller does not wait for downstream sends).
        """
        if not ok:
            self.progress.fail(reason or "the member fell back")
        self._ended.set()

    def close(self, timeout: float) -> None:
        """Stop now; abort relay sends still running; wait at most ``timeout`` s."""
        self._stop.set()
        with self._lock:
            transports = list(self._transports)
        for tr in transports:
            with contextlib.suppress(Exception):
                tr.abort()
        self._thread.join(timeout)

    def _loop(self) -> None:
        idle_since: float | None = None
        key = self.member.member_id
        while not self._stop.is_set():
            with self._lock:
                self._sends = [t for t in self._sends if t.is_alive()]
                busy = len(self._sends)
            if self._ended.is_set() and busy == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > LINGER + self.settings.cohort_window:
                    break
            else:
                idle_since = None
            try:
                request = self.registry.pop_request(key, timeout=0.2)
            except RegistryError as e:
                self._log.warning("relay_poll_failed", error=str(e))
                self._stop.wait(0.2)
                continue
            if request is None:
                continue
            gave_up = self.progress.failed
            if gave_up is not None:
                # What this member holds failed (or never completed): serve none of it,
                # and say so at once, so the requester attaches elsewhere now.
                self._log.warning("relay_request_refused", reason="gave_up")
                with contextlib.suppress(RegistryError):
                    refuse(self.registry, str(request.get("transfer_id", ""))[:64], "draining",
                           f"relay endpoint {key} gave up: {gave_up}")
                continue
            if busy >= self.max_sends:
                # Said at once, so the requester tries its next upstream now rather
                # than after its handshake timeout.
                self._log.warning("relay_request_refused", reason="busy")
                with contextlib.suppress(RegistryError):
                    refuse(self.registry, str(request.get("transfer_id", ""))[:64], "busy",
                           f"relay endpoint {key} serves {busy} already")
                continue
            idle_since = None
            t = threading.Thread(target=self._send_one, args=(request,), daemon=True,
                                 name=f"nccl-back-relay-send-{key[-6:]}")
            with self._lock:
                self._sends.append(t)
            t.start()
        with contextlib.suppress(RegistryError):
            self.registry.drop_requests(key)
        for t in list(self._sends):
            t.join(self.settings.transfer_timeout)
        # A stopped endpoint must not keep the model alive: a sidecar whose hand-off
        # re-pointed the model into its arena would otherwise hold it twice.
        self.tensors = {}

    def _send_one(self, request: dict[str, Any]) -> None:
        s = self.settings
        transfer_id = str(request.get("transfer_id", ""))[:64]
        start = request.get("start", 0)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            start = 0
        log_ = self._log.bind(transfer_id=transfer_id, peer=str(request.get("receiver"))[:200])
        transport: Any = None
        try:
            run_sender(self.registry, transfer_id, self.digest, s.sender_handshake_timeout)
            transport = self.rendezvous.sender(transfer_scope(s.key("store"), transfer_id))
            with self._lock:
                self._transports.add(transport)
            now = time.monotonic()
            deadline = now + self.send_timeout
            with self.metrics.sending("relay"):
                stats = run_guarded(
                    transport,
                    lambda tr: send_tensors(
                        tr, self.tensors,
                        s.bucket_for(self.member.transport, payload_bytes(self.tensors)),
                        start=start,
                        ready=lambda k: self.progress.wait_for(k, deadline), pace=self.pacer.take),
                    deadline,
                    connect_deadline=now + s.connect_timeout,
                )
            self.metrics.record_sent("relay", stats.bytes, stats.seconds)
            self.served += 1
            log_.info("relayed", start=start, bytes=stats.bytes, gbps=round(stats.gbps, 3))
        except NcclBackError as e:
            log_.warning("relay_failed", reason=fallback_reason(e), error=str(e))
        except Exception as e:  # a relay thread must never die silently
            log_.error("relay_crashed", error=repr(e))
        finally:
            with self._lock:
                self._transports.discard(transport)
