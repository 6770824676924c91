"""Gloo transport: CPU tensors over TCP, built without any default process group.

Both sides bootstrap through the transfer's signed Redis keys (:mod:`.store`, shared
with NCCL; no rendezvous port is open); each transfer builds a fresh
``ProcessGroupGloo`` under its own scope, because a gloo group that timed out is dead
and keys of an earlier attempt must not meet this one. ``init_process_group`` is never
called.

Measured behaviour this relies on: a crashed peer makes a pending call raise within
~0.3 s; a stalled peer makes it raise at its per-call timeout; ``abort()`` (and
``shutdown()``) neither unblock a wait already running nor close the connections, which
close only when the group and every ``Work`` of it are freed (then the peer's next call
fails within ~0.1 s). Hence every call gets the time left to the deadline as
its own timeout (or the stall bound, :attr:`Transport.call_timeout`, when shorter), so
the watchdog's worker thread always unwinds by the deadline.

What gloo shares with NCCL (the receiver factory, the bootstrap keys, the deadline,
error classification) is :class:`~nccl_back.transport.rendezvous_store.StoreTransport`.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nccl_back.config import Settings
from nccl_back.errors import TransferError, TransferTimeoutError
from nccl_back.log import get_logger
from nccl_back.transport.channel import SENDER_RANK, WORLD_SIZE, Pending, Probe, register_transport
from nccl_back.transport.rendezvous_store import StoreRendezvous, StoreTransport

if TYPE_CHECKING:
    from nccl_back.coord.registry import Registry

log = get_logger(__name__)


class _GlooPending:
    def __init__(self, work: dist.Work, transport: GlooTransport) -> None:
        self._work: dist.Work | None = work
        self._transport = transport

    def wait(self) -> None:
        work = self._work
        if work is None:
            raise TransferError(f"{self._transport._name}: wait after close")
        try:
            work.wait()
        except RuntimeError as e:
            raise self._transport._error("copy", e) from e

    def drop(self) -> None:
        self._work = None


class GlooTransport(StoreTransport):
    """One transfer over a fresh ``ProcessGroupGloo`` of 2 ranks."""

    kind = "gloo"
    per_call_timeout = True

    def __init__(self, rank: int, transfer_id: str, settings: Settings, registry: Registry, *,
                 device: torch.device | None = None) -> None:
        super().__init__(rank, transfer_id, settings, registry,
                         device=device or torch.device("cpu"))
        self._pg: dist.ProcessGroupGloo | None = None
        self._pending: weakref.WeakSet[_GlooPending] = weakref.WeakSet()
        """Calls issued and maybe still referenced (their Work keeps the group alive)."""

    def connect(self, deadline: float) -> None:
        self._deadline = deadline
        try:
            prefixed = self._bootstrap()
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timedelta(seconds=self._left("connect"))
            # Bind gloo's own sockets to the address peers can reach, not to whatever
            # the hostname happens to resolve to.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.settings.advertise_host)]
            self._pg = dist.ProcessGroupGloo(prefixed, self.rank, WORLD_SIZE, opts)
        except TransferError:
            raise
        except (RuntimeError, ValueError, OSError) as e:  # torch's DistStoreError is one
            raise self._error("connect", e) from e
        if self._aborted.is_set():
            raise TransferTimeoutError(f"{self._name} aborted during connect")
        log.debug("gloo_connected", transfer_id=self.transfer_id, rank=self.rank)

    def copy(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        # The per-call timeout: a stalled peer fails this call by the deadline.
        per_call = min(self._left("copy"), self.call_timeout)
        if self._pg is None:
            raise TransferError(f"{self._name}: copy before connect")
        try:
            work = self._pg.broadcast(tensor, src, timedelta(seconds=per_call))  # type: ignore[attr-defined]
        except RuntimeError as e:
            raise self._error("copy", e) from e
        pending = _GlooPending(work, self)
        self._pending.add(pending)
        return pending

    def abort(self) -> None:
        # gloo's abort is safe from any thread (it does not unblock a running wait: the
        # per-call timeout does).
        self._aborted.set()
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError as e:  # already torn down: nothing left to abort
                log.debug("gloo_abort_failed", transfer_id=self.transfer_id, error=str(e))

    def close(self) -> None:
        # Dropping the group joins gloo's threads; every pending call has a timeout of
        # at most the deadline, so this cannot block past it. Its connections close only
        # once no Work is left either: a failed transfer's error keeps its frames, and so
        # their pending calls, for as long as the load keeps the error, and the peer's
        # sends would then block until its own per-call timeout.
        for pending in list(self._pending):
            pending.drop()
        self._pending.clear()
        self._pg = None
        self._drop_bootstrap()


class GlooRendezvous(StoreRendezvous):
    """The sender's endpoint for gloo transfers (see :mod:`.store`)."""

    kind = "gloo"
    transport = GlooTransport

    def __init__(self, settings: Settings, registry: Registry, *,
                 device: torch.device | None = None) -> None:
        super().__init__(settings, registry, device=device or torch.device("cpu"))


def probe(settings: Settings) -> Probe:
    """gloo in this torch build; a failure when the settings need it (``auto`` picks it
    for CPU models, which every machine can hold)."""
    if dist.is_available() and dist.is_gloo_available():
        return Probe("gloo")
    if settings.transport in ("auto", "gloo"):
        return Probe("", f"torch {torch.__version__} has no gloo backend",
                     "install a torch build with distributed support")
    return Probe("")


register_transport("gloo", GlooRendezvous, GlooTransport.receiver, devices=("cpu", "cuda"),
                   probe=probe)
