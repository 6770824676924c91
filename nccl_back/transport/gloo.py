"""Gloo transport: CPU tensors over TCP, built without any default process group.

Each transfer builds a fresh ``ProcessGroupGloo`` under its own bootstrap scope
(:mod:`.rendezvous_store`): a gloo group that timed out is dead, and an earlier
attempt's keys must not meet this one.

Measured: a crashed peer makes a pending call raise within ~0.3 s, a stalled one at its
per-call timeout; ``abort()`` neither unblocks a running wait nor closes the
connections (they close once the group and every ``Work`` of it are freed). Hence every
call's timeout is the time left (or the stall bound when shorter), so the watchdog's
worker thread always unwinds by the deadline.
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
            # Bind gloo's sockets to the address peers reach, not what the hostname resolves to.
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
        # Safe from any thread (a running wait ends by its per-call timeout, not this).
        self._aborted.set()
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError as e:  # already torn down: nothing left to abort
                log.debug("gloo_abort_failed", transfer_id=self.transfer_id, error=str(e))

    def close(self) -> None:
        # The connections close only once no Work is left: a failed transfer's error keeps
        # its frames (and pending calls) alive, and the peer's sends would block meanwhile.
        for pending in list(self._pending):
            pending.drop()
        self._pending.clear()
        self._pg = None
        self._drop_bootstrap()


class GlooRendezvous(StoreRendezvous):
    """The sender's endpoint for gloo transfers."""

    kind = "gloo"
    transport = GlooTransport

    def __init__(self, settings: Settings, registry: Registry, *,
                 device: torch.device | None = None) -> None:
        super().__init__(settings, registry, device=device or torch.device("cpu"))


def probe(settings: Settings) -> Probe:
    """gloo in this torch build; a failure when the settings need it (``auto`` may)."""
    if dist.is_available() and dist.is_gloo_available():
        return Probe("gloo")
    if settings.transport in ("auto", "gloo"):
        return Probe("", f"torch {torch.__version__} has no gloo backend",
                     "install a torch build with distributed support")
    return Probe("")


register_transport("gloo", GlooRendezvous, GlooTransport.receiver, devices=("cpu", "cuda"),
                   probe=probe)
