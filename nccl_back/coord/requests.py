"""Transfer requests: the queue a sender (a peer, or a relay member) serves.

A list of signed requests trimmed to the newest :data:`MAX_QUEUED_REQUESTS`, so a flood
written before a genuine request cannot bury it; popped newest first (that receiver is
still waiting). Garbage of another type is replaced by the next push. An empty value is
a wake-up: a closing endpoint pushes one so its own wait ends at its next look (anyone
may push one; it only makes the owner look again).
"""

from __future__ import annotations

from typing import Any

import redis

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.records import TransferRequest
from nccl_back.coord.signed_store import WRONG_TYPE, SignedStore, ms
from nccl_back.errors import RecordKind
from nccl_back.timing import REQUEST_POLL_MAX as POLL_MAX
from nccl_back.timing import REQUEST_POLL_MIN as POLL_MIN
from nccl_back.timing import WAKE_TTL

#: Requests kept in one peer's queue (the newest); a flood beyond it is trimmed away.
MAX_QUEUED_REQUESTS = 256
#: The wake-up value (see the module docstring); it lives a second at most.
WAKE = b""


class RequestRecords(SignedStore):
    """The transfer-request record family."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        super().__init__(settings, client)
        self._idle: dict[str, float] = {}
        """The next pause before a look at each queue found empty (see :data:`POLL_MAX`)."""

    def push_request(self, peer_id: str, request: dict[str, Any]) -> None:
        """Ask ``peer_id`` to serve one transfer (``request`` is JSON-serialisable)."""
        key = self.keys.of(schema.REQUEST, peer_id)
        raw = self.signed(key, request, schema.REQUEST)
        self._call("push_request", lambda: self.lua.push(
            keys=[key], args=[raw, MAX_QUEUED_REQUESTS, ms(self.settings.peer_ttl)]))

    def wake_requests(self, peer_id: str) -> None:
        """End the wait of ``peer_id``'s own :meth:`pop_request` now (it is closing)."""
        key = self.keys.of(schema.REQUEST, peer_id)
        self._call("wake_requests", lambda: self.lua.push(
            keys=[key], args=[WAKE, MAX_QUEUED_REQUESTS, ms(WAKE_TTL)]))

    def pop_request(self, peer_id: str, timeout: float) -> TransferRequest | None:
        """The next valid request for ``peer_id``, waiting at most ``timeout`` seconds;
        else None (at once for a wake-up). Invalid ones are skipped and counted.

        Polled, not blocked on: Redis's blocking pops send the item whole, and anyone may
        push 64 MiB there; the bounded pop leaves an oversized item on the server."""
        key = self.keys.of(schema.REQUEST, peer_id)
        deadline = _clock.monotonic() + timeout
        while True:
            raw = self.pop(key, schema.REQUEST)
            if raw is WRONG_TYPE:
                # Our own queue holds garbage of another type: drop it, receivers re-ask.
                self.reject(RecordKind.REQUEST, key, "wrong Redis type; dropped")
                self._repair(key, "list")
            elif isinstance(raw, bytes) and raw == WAKE:
                return None
            elif raw is not None and (request := self.parse(key, raw, schema.REQUEST)) is not None:
                self._idle.pop(key, None)  # busy: the next look comes soon again
                return request
            left = deadline - _clock.monotonic()
            if left <= 0:
                return None
            if raw is None or raw is WRONG_TYPE:  # look again later (after a rejected item: at once)
                pause = self._idle.get(key, POLL_MIN)
                self._idle[key] = min(pause * 2, POLL_MAX)
                _clock.sleep(min(pause, left))

    def drop_requests(self, peer_id: str) -> None:
        """Forget every request queued for ``peer_id`` (its endpoint is closing)."""
        self.delete(self.keys.of(schema.REQUEST, peer_id))

    def _keep_requests(self, peer_id: str) -> None:
        """Our own queue at a heartbeat: garbage of another type (which would refuse every
        request) dropped, ours kept for another ``peer_ttl``."""
        self._repair(self.keys.of(schema.REQUEST, peer_id), "list", self.settings.peer_ttl,
                     what="heartbeat")
