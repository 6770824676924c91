"""Single-flight download: one worker per version (and rank) downloads, the rest wait.

When N workers of a version start together and no peer holds it yet, they would all
hit storage at once (the thundering herd). Instead one is elected with a Redis lease
(``SET NX`` with a TTL, renewed while it downloads); the others poll for a peer, and
receive from it as soon as it publishes (then from each other: every receiver becomes
a sender). If the elected worker dies, its lease expires and a waiter takes over.
A waiter gives up after ``Settings.single_flight_wait`` and downloads itself.

Key: ``ns:dl:{version}:{rank}:{world}`` -> ``{"owner": worker_id}``, TTL = lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .log import get_logger
from .registry import Registry

log = get_logger("nccl_back.election")

# Renew/release only while the lease is still ours: after an expiry another worker
# may hold it, and a late renewal or release must not take it from them.
_RENEW_LUA = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['owner'] == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE_LUA = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['owner'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class DownloadLease:
    """The right to be the one worker downloading ``version`` for ``rank``/``world``."""

    def __init__(
        self, registry: Registry, version: str, rank: int, world: int, owner: str, ttl: float
    ) -> None:
        self.registry = registry
        self.key = registry.key("dl", version, rank, world)
        self.owner = owner
        self.ttl = ttl
        self._renew = registry.client.register_script(_RENEW_LUA)
        self._release = registry.client.register_script(_RELEASE_LUA)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; start renewing it if taken."""
        got = self.registry.set_json(self.key, {"owner": self.owner}, self.ttl, nx=True)
        if got:
            self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                            name="nccl-back-lease")
            self._thread.start()
            log.info("download_lease_acquired", key=self.key, owner=self.owner)
        return got

    def holder(self) -> str | None:
        """The worker holding the lease now, or None."""
        value = self.registry.get_json(self.key)
        return None if value is None else str(value.get("owner"))

    def release(self) -> None:
        """Stop renewing and drop the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl)
            self._thread = None
            try:
                self._release(keys=[self.key], args=[self.owner])
            except Exception as e:  # expiry cleans up anyway
                log.warning("download_lease_release_failed", key=self.key, error=str(e))

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self._renew(keys=[self.key], args=[self.owner, int(self.ttl * 1000)]):
                    log.warning("download_lease_lost", key=self.key, owner=self.owner)
                    return
            except Exception as e:
                log.warning("download_lease_renew_failed", key=self.key, error=str(e))


def wait_for_peer_or_lease(
    lease: DownloadLease,
    find: Callable[[], bool],
    timeout: float,
    *,
    poll: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait until a peer appears (``find()`` is true) or this worker wins the lease.

    Returns ``"peer"``, ``"elected"`` (this worker must download) or ``"timeout"``
    (nobody published within ``timeout``: download yourself). Raises
    :class:`RegistryError` if Redis fails.
    """
    deadline = clock() + timeout
    while True:
        if find():
            return "peer"
        if lease.try_acquire():
            return "elected"
        if clock() >= deadline:
            return "timeout"
        sleep(poll)

