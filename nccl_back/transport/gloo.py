"""Gloo transport: CPU tensors over TCP, built without any default process group.

The sender's ``TCPStore`` rendezvous is shared with NCCL (:mod:`.store`); each
transfer builds a fresh ``ProcessGroupGloo`` on ``PrefixStore("xfer/{id}/")``,
because a gloo group that timed out is dead and keys of an earlier attempt must not
meet this one. ``init_process_group`` is never called.

Measured behaviour this relies on: a crashed peer makes a pending call raise within
~0.3 s; a stalled peer makes it raise at its per-call timeout; ``abort()`` does not
unblock a wait already running. Hence every call gets the time left to the deadline as
its own timeout, so the watchdog's worker thread always unwinds by the deadline.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import Settings
from ..errors import TransferError, TransferTimeoutError
from ..log import get_logger
from .base import RECEIVER_RANK, SENDER_RANK, WORLD_SIZE, Pending, Transport
from .store import StoreRendezvous, connect_store, delete_prefix, split_address

log = get_logger(__name__)


class GlooRendezvous(StoreRendezvous):
    """The sender's long-lived ``TCPStore`` for gloo transfers (see :mod:`.store`)."""

    def __init__(self, settings: Settings, *, device: torch.device | None = None, port: int = 0) -> None:
        super().__init__(settings, "gloo", _gloo_sender, device=device or torch.device("cpu"),
                         port=port)


def _gloo_sender(transfer_id: str, store: dist.Store, settings: Settings,
                 device: torch.device) -> GlooTransport:
    return GlooTransport(SENDER_RANK, transfer_id, store, settings, device=device)


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
        store: dist.Store | None,
        settings: Settings,
        *,
        device: torch.device | None = None,
        address: str | None = None,
    ) -> None:
        super().__init__(rank, transfer_id, device or torch.device("cpu"))
        self.settings = settings
        self._store = store
        self._address = address
        self._owns_store = store is None
        self._pg: dist.ProcessGroupGloo | None = None
        self._deadline = float("inf")
        self._aborted = threading.Event()

    @classmethod
    def receiver(
        cls, settings: Settings, address: str, transfer_id: str, *, device: torch.device | None = None
    ) -> GlooTransport:
        """The rank-1 side; it connects a client store to the sender's ``address``."""
        split_address(address)
        return cls(RECEIVER_RANK, transfer_id, None, settings, device=device, address=address)

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"gloo transfer {self.transfer_id}: deadline passed")
        return left

    def _error(self, what: str, e: BaseException) -> TransferError:
        if self._aborted.is_set():
            return TransferTimeoutError(f"gloo transfer {self.transfer_id} aborted during {what}: {e}")
        if time.monotonic() >= self._deadline or "Timed out" in str(e):
            return TransferTimeoutError(f"gloo transfer {self.transfer_id}: {what} timed out: {e}")
        return TransferError(f"gloo transfer {self.transfer_id}: {what} failed (peer gone?): {e}")

    def connect(self, deadline: float) -> None:
        self._deadline = deadline
        left = self._left()
        try:
            if self._store is None:
                self._store = connect_store(self._address or "", left)
            prefixed = dist.PrefixStore(self._prefix, self._store)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timedelta(seconds=self._left())
            # Bind gloo's own sockets to the address peers can reach, not to whatever
            # the hostname happens to resolve to.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.settings.advertise_host)]
            self._pg = dist.ProcessGroupGloo(prefixed, self.rank, WORLD_SIZE, opts)
        except (RuntimeError, ValueError, OSError) as e:
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
            work = self._pg.broadcast(tensor, src, timedelta(seconds=self._left()))  # type: ignore[attr-defined]
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
        if self._owns_store:
            self._store = None
        elif self._store is not None:
            # The sender's store lives as long as the service: without this, every
            # transfer would leave its rendezvous keys in it forever.
            delete_prefix(self._store, self._prefix)
            self._store = None

    @property
    def _prefix(self) -> str:
        return f"xfer/{self.transfer_id}/"

