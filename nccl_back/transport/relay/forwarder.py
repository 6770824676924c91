"""The relay's sending half: a member's endpoint forwarding steps as they arrive.

A receiver asks again only once its pull ended, so a request from a receiver this
endpoint still sends that part to supersedes the send (the receiver gave up on it, which
this side, waiting for its next step, cannot know). The old send is aborted and frees
its slot; otherwise the re-asking children of a re-attached member would be refused as
busy by their own slots.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.records import Member, TransferRequest
from nccl_back.coord.registry import Registry
from nccl_back.errors import RegistryError
from nccl_back.metrics import Metrics
from nccl_back.transport import Rendezvous
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay.state import LINGER, MAX_RELAY_SENDS, Progress
from nccl_back.transport.send import ASKERS, RELAY, Sends, answer, decline, refuse_queued


class RelayServer:
    """A member's downstream side: answers relay requests while (and shortly after) it
    receives, forwarding each step once it is in place."""

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
        self.registry = registry
        self.member = member
        self.tensors = tensors
        self.progress = progress
        self._log = log_
        self._stop = threading.Event()
        self._withdrawn = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[tuple[str, int | None], tuple[threading.Thread, str]] = {}
        """Sends in flight by (receiver, part): the thread and its transfer id."""
        self._superseded: list[threading.Thread] = []
        self._idle_since: float | None = None
        self._serving: frozenset[str] = frozenset()
        """Receivers still served once withdrawn (a close's owed ones)."""
        self.askers: set[str] = set()
        """Receivers that asked this endpoint (at most :data:`ASKERS`)."""
        self.unannounce: Callable[[], None] | None = None
        """Drops the record that announces it, if any (a stream's)."""
        self.served = 0
        # Read at each send: a stopped endpoint drops its tensors (see _loop).
        self.sends = Sends(RELAY, settings, registry, self.metrics, pacer, rendezvous,
                           manifest_digest, member.transport, lambda: self.tensors,
                           settings.transfer_timeout if send_timeout is None else send_timeout,
                           ready=progress.wait_for)
        """Its sends (the shared send path), for a closing worker's drain."""
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"nccl-back-relay-{member.member_id[-6:]}")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> RelayServer:
        self._thread.start()
        return self

    def end(self, ok: bool, reason: str = "") -> None:
        """The member's own load ended (failed: its downstream links fail at once); the
        endpoint stops in the background after ``cohort_window`` + :data:`LINGER` idle."""
        if not ok:
            self.progress.fail(reason or "the member fell back")
        self._ended.set()

    def withdraw(self, serving: Collection[str] = ()) -> None:
        """Refuse new requests but from ``serving`` and mark the endpoint gone (the seats
        below skip it); sends in flight go on, for the closing worker's drain."""
        self._serving = frozenset(serving)
        self._withdrawn.set()
        if not serving and self.unannounce is not None:
            self.unannounce()
        with contextlib.suppress(RegistryError):
            self.registry.mark_gone(self.member.member_id,
                                    self.settings.transfer_timeout + self.settings.busy_wait)

    def close(self, timeout: float) -> None:
        """Stop now, aborting relay sends still running; wait at most ``timeout`` s."""
        self._stop.set()
        self.sends.abort()
        # A send waiting for a step not held yet ends now: its receiver sees the close.
        self.progress.fail("the relay endpoint closed")
        key = self.member.member_id
        with contextlib.suppress(RegistryError):  # else it sees the stop within a poll
            self.registry.wake_requests(key)
        self._thread.join(timeout)
        refuse_queued(self.registry, key, RELAY, self._log)  # and a wake-up nobody popped

    def _busy(self) -> int:
        """Relay sends still running (finished ones are forgotten)."""
        with self._lock:
            self._running = {k: v for k, v in self._running.items() if v[0].is_alive()}
            return len(self._running)

    def _lingered(self) -> bool:
        """Whether the member's load ended and no request came for the linger."""
        if not self._ended.is_set() or self._busy():
            self._idle_since = None
            return False
        now = _clock.monotonic()
        self._idle_since = self._idle_since or now
        return now - self._idle_since > LINGER + self.settings.cohort_window

    def _loop(self) -> None:
        key = self.member.member_id
        answer(self.registry, key, RELAY, self._log, self._stop, 0.2, self._admit, self._lingered)
        with contextlib.suppress(RegistryError):
            # For as long as the chain that seats us lives (the join's TTL).
            self.registry.mark_gone(key, self.settings.transfer_timeout + self.settings.busy_wait)
        if self.unannounce is not None:
            self.unannounce()
        refuse_queued(self.registry, key, RELAY, self._log)
        for t in [t for t, _ in self._running.values()] + self._superseded:
            t.join(self.settings.transfer_timeout)
        # A stopped endpoint must not keep the model alive (a hand-off's arena would
        # otherwise hold it twice).
        self.tensors = {}

    def _admit(self, request: TransferRequest) -> None:
        key = self.member.member_id
        if len(self.askers) < ASKERS:
            self.askers.add(request.receiver)
        if self._withdrawn.is_set() and request.receiver not in self._serving:
            decline(self.registry, request, "draining", f"relay endpoint {key} is closing",
                    self._log, RELAY, reason="closing")
            return
        gave_up = self.progress.failed
        if gave_up is not None:
            # What it holds failed (or never completed): serve none of it.
            decline(self.registry, request, "draining", f"relay endpoint {key} gave up: {gave_up}",
                    self._log, RELAY, reason="gave_up")
            return
        self._supersede(request)
        busy = self._busy()
        if busy >= self.max_sends:
            decline(self.registry, request, "busy", f"relay endpoint {key} serves {busy} already",
                    self._log, RELAY, reason="busy")
            return
        self._idle_since = None
        t = threading.Thread(target=self._send_one, args=(request,), daemon=True,
                             name=f"nccl-back-relay-send-{key[-6:]}")
        with self._lock:
            self._running[request.receiver, request.part] = (t, request.transfer_id)
        t.start()

    def _supersede(self, request: TransferRequest) -> None:
        """Abort the send to ``request``'s receiver and part still in flight, if any (see
        the module docstring); its thread ends at its next step or bound."""
        with self._lock:
            old = self._running.pop((request.receiver, request.part), None)
            if old is None or not old[0].is_alive():
                return
            self._superseded = [t for t in self._superseded if t.is_alive()] + [old[0]]
        self.sends.abort_one(old[1])
        self._log.info("relay_send_superseded", peer=request.receiver, part=request.part,
                       was=old[1], transfer_id=request.transfer_id)

    def _send_one(self, request: TransferRequest) -> None:
        log = self._log.bind(transfer_id=request.transfer_id, peer=request.receiver)
        if self.sends.serve(request, log) is not None:
            self.served += 1
