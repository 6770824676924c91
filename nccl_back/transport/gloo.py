"""Gloo transport: CPU tensors over TCP, built without any default process group.

Both sides bootstrap through the transfer's signed Redis keys (:mod:`.store`, shared
with NCCL; no rendezvous port is open); each transfer builds a fresh
``ProcessGroupGloo`` under its own scope, because a gloo group that timed out is dead
and keys of an earlier attempt must not meet this one. ``init_process_group`` is never
called.

Measured behaviour this relies on: a crashed peer makes a pending call raise within
~0.3 s; a stalled peer makes it raise at its per-call timeout; ``abort()`` does not
unblock a wait already running. Hence every call gets the time left to the deadline as
its own timeout (or the stall bound, :attr:`Transport.call_timeout`, when shorter), so
the watchdog's worker thread always unwinds by the deadline.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.errors import TransferError, TransferStalledError, TransferTimeoutError
from nccl_back.log import get_logger
from nccl_back.transport.base import (
    RECEIVER_RANK,
    SENDER_RANK,
    WORLD_SIZE,
    Pending,
    Transport,
    register_transport,
)
from nccl_back.transport.store import RedisStore, StoreRendezvous, split_address

if TYPE_CHECKING:
    from nccl_back.coord.registry import Registry

log = get_logger(__name__)


class GlooRendezvous(StoreRendezvous):
    """The sender's endpoint for gloo transfers (see :mod:`.store`)."""

    kind = "gloo"

    def __init__(self, settings: Settings, registry: Registry, *,
                 device: torch.device | None = None) -> None:
        super().__init__(settings, registry, device=device or torch.device("cpu"))

    def _sender(self, transfer_id: str, registry: Registry) -> GlooTransport:
        return GlooTransport(SENDER_RANK, transfer_id, self.settings, registry, device=self.device)


class _GlooPending:
    def __init__(self, work: dist.Work, transport: GlooTransport) -> None:
        self._work = work
        self._transport = transport

    def wait(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as e:
            raise self._transport._error("broadcast", e) from e


class GlooTransport(Transport):
    """One transfer over a fresh ``ProcessGroupGloo`` of 2 ranks."""

    kind = "gloo"

    def __init__(
        self,
        rank: int,
        transfer_id: str,
        settings: Settings,
        registry: Registry,
        *,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(rank, transfer_id, device or torch.device("cpu"))
        self.settings = settings
        self._registry = registry  # the bootstrap keys' Redis (:class:`RedisStore`)
        self._store: RedisStore | None = None
        self._pg: dist.ProcessGroupGloo | None = None
        self._deadline = float("inf")
        self._aborted = threading.Event()

    @classmethod
    def receiver(
        cls, settings: Settings, registry: Registry, address: str, transfer_id: str, *,
        device: torch.device | None = None,
    ) -> GlooTransport:
        """The rank-1 side of a transfer with the sender at ``address`` (checked for form:
        the bootstrap itself goes through Redis)."""
        split_address(address)
        return cls(RECEIVER_RANK, transfer_id, settings, registry, device=device)

    def _left(self) -> float:
        left = self._deadline - _clock.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"gloo transfer {self.transfer_id}: deadline passed")
        return left

    def _error(self, what: str, e: BaseException) -> TransferError:
        if self._aborted.is_set():
            return TransferTimeoutError(f"gloo transfer {self.transfer_id} aborted during {what}: {e}")
        # gloo words its timeouts differently by where they fire ("Timed out waiting ...",
        # "Application timeout caused pair closure").
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        if timed_out and _clock.monotonic() < self._deadline:
            # The per-call timeout fired before the deadline: it was the stall bound.
            return TransferStalledError(f"gloo transfer {self.transfer_id}: {what} stalled"
                                        f" (no progress for {self.call_timeout:g} s): {e}")
        if _clock.monotonic() >= self._deadline or timed_out:
            return TransferTimeoutError(f"gloo transfer {self.transfer_id}: {what} timed out: {e}")
        return TransferError(f"gloo transfer {self.transfer_id}: {what} failed (peer gone?): {e}")

    def connect(self, deadline: float) -> None:
        self._deadline = deadline
        left = self._left()
        try:
            self._store = RedisStore(self._registry, self._prefix, self.settings.key("rendezvous"),
                                     _clock.monotonic() + left)
            prefixed = dist.PrefixStore("gloo", self._store)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timedelta(seconds=self._left())
            # Bind gloo's own sockets to the address peers can reach, not to whatever
            # the hostname happens to resolve to.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.settings.advertise_host)]
            self._pg = dist.ProcessGroupGloo(prefixed, self.rank, WORLD_SIZE, opts)
        except TransferError:
            raise
        except (RuntimeError, ValueError, OSError) as e:  # torch's DistStoreError is one
            raise self._error("connect", e) from e
        if self._aborted.is_set():
            raise TransferTimeoutError(f"gloo transfer {self.transfer_id} aborted during connect")
        log.debug("gloo_connected", transfer_id=self.transfer_id, rank=self.rank)

    def broadcast(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        if self._aborted.is_set():
            raise TransferTimeoutError(f"gloo transfer {self.transfer_id} was aborted")
        if self._pg is None:
            raise TransferError(f"gloo transfer {self.transfer_id}: broadcast before connect")
        try:
            # The per-call timeout: a stalled peer fails this call by the deadline.
            per_call = min(self._left(), self.call_timeout)
            work = self._pg.broadcast(tensor, src, timedelta(seconds=per_call))  # type: ignore[attr-defined]
        except RuntimeError as e:
            raise self._error("broadcast", e) from e
        return _GlooPending(work, self)

    def abort(self) -> None:
        self._aborted.set()
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError as e:  # already torn down: nothing left to abort
                log.debug("gloo_abort_failed", transfer_id=self.transfer_id, error=str(e))

    def close(self) -> None:
        # Dropping the group joins gloo's threads; every pending call has a timeout of
        # at most the deadline, so this cannot block past it.
        self._pg = None
        if self._store is not None:
            # Not right after connect: the peer may still be reading our key then.
            self._store.close()
            self._store = None

    @property
    def _prefix(self) -> str:
        return f"gloo/{self.transfer_id}"



register_transport("gloo", GlooRendezvous, GlooTransport.receiver, devices=("cpu", "cuda"))
