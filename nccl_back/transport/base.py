"""The transport interface: a 2-rank broadcast channel, sender rank 0, receiver rank 1.

One :class:`Transport` serves exactly one transfer: ``connect`` (build the
communicator), any number of ``broadcast`` calls, then ``close``. All waits are bounded
by the deadline given to ``connect`` (the watchdog's deadline), so a dead or stalled
peer surfaces as :class:`TransferError` / :class:`TransferTimeoutError` instead of a
hang. ``abort`` may be called from another thread (the watchdog) at any time.

The sender side also has a long-lived :class:`Rendezvous`: its ``address`` (the host
its transports bind on) is published in the registry, and it makes one sender transport
per transfer. No rendezvous port is opened: each transfer bootstraps its communicator
through its own signed, size-bounded keys in Redis (a timed-out group is dead; the next
transfer gets fresh keys), see :mod:`.store` for why and what that guarantees. The
default process group is never touched: the user's worker may already have one.

Progress: the data plane calls :meth:`Transport.progressed` each time a step completes,
so the watchdog can abort a transfer that stalls (no step within the stall bound) long
before its deadline, whatever the transport.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

from nccl_back.errors import ConfigError

if TYPE_CHECKING:
    from nccl_back.config import Settings
    from nccl_back.coord.registry import Registry

SENDER_RANK = 0
RECEIVER_RANK = 1
WORLD_SIZE = 2

KINDS = ("gloo", "nccl")


class Pending(Protocol):
    """An issued broadcast; ``wait()`` returns once this side's part of it is complete."""

    def wait(self) -> None:
        """Block until done, at most until the transport's deadline.

        Raises :class:`TransferError` (peer failed) or :class:`TransferTimeoutError`.
        """
        ...


class Transport(ABC):
    """One transfer's communicator between a sender (rank 0) and a receiver (rank 1)."""

    kind: str
    """``gloo`` or ``nccl``."""

    def __init__(self, rank: int, transfer_id: str, device: torch.device) -> None:
        if rank not in (SENDER_RANK, RECEIVER_RANK):
            raise ConfigError(f"transport rank={rank}: must be 0 (sender) or 1 (receiver)")
        self.rank = rank
        self.transfer_id = transfer_id
        self.device = device
        self._deadline = float("inf")
        self.call_timeout = float("inf")
        """Seconds one broadcast may wait, at most (the stall bound, set by the
        watchdog); transports that support it (gloo) fail a longer wait as a timeout."""
        self.progress_at = time.monotonic()
        """When the last step completed (``time.monotonic``), for the stall watchdog."""

    def progressed(self) -> None:
        """A step (a broadcast this side waited on) completed; called by the data plane."""
        self.progress_at = time.monotonic()

    def extend_deadline(self, deadline: float) -> None:
        """After ``connect``: later waits may run until ``deadline`` (the transfer's,
        later than the short one the connect phase had)."""
        self._deadline = max(self._deadline, deadline)

    @abstractmethod
    def connect(self, deadline: float) -> None:
        """Create the communicator; every later wait ends by ``deadline`` (``time.monotonic``).

        Raises :class:`TransferError` if the peer cannot be reached in time.
        """

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        """Issue the broadcast of a contiguous ``tensor`` from rank ``src`` (asynchronous).

        On the sender ``tensor`` is read, on the receiver written; until the returned
        :class:`Pending` is waited on, neither side may touch it.
        """

    def finish(self) -> None:
        """After the last broadcast: wait, bounded by the deadline, until this side's
        results are ready (queued device copies done). Called by the watchdog's worker.

        Nothing to wait for where the data plane's copies are synchronous (gloo/CPU).
        """
        return None

    @property
    def join_grace(self) -> float:
        """Seconds the watchdog waits for the worker thread after asking for an abort."""
        return 5.0

    @abstractmethod
    def abort(self) -> None:
        """Abort the transfer, from any thread; pending and later calls fail.

        Transports whose native abort is unsafe while another thread is inside the
        library (NCCL) only signal here, and their owner thread aborts.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the communicator and its sockets/threads; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Rendezvous(ABC):
    """The sender's long-lived endpoint: receivers reach it at :attr:`address`."""

    kind: str

    @property
    @abstractmethod
    def address(self) -> str:
        """What a receiver needs to reach this sender (``host:port``), for the registry."""

    @abstractmethod
    def sender(self, transfer_id: str) -> Transport:
        """A new, unconnected rank-0 transport for one transfer."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening; idempotent."""

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_kind(settings: Settings, device: torch.device) -> str:
    """The transport to use for a model on ``device``: ``settings.transport`` or, if
    ``auto``, nccl for CUDA tensors and gloo otherwise."""
    if settings.transport != "auto":
        if settings.transport == "nccl" and device.type != "cuda":
            raise ConfigError(
                f"transport=nccl needs the model on a CUDA device, it is on {device};"
                " use transport=gloo or auto"
            )
        return settings.transport
    return "nccl" if device.type == "cuda" else "gloo"


def open_rendezvous(
    settings: Settings, kind: str, *, device: torch.device, registry: Registry
) -> Rendezvous:
    """The sender endpoint for ``kind`` (``gloo`` or ``nccl``) on ``device``; transfers
    bootstrap through ``registry``'s Redis (:mod:`.store`). Warns when this worker
    advertises loopback to a Redis on another host."""
    if kind == "gloo":
        from nccl_back.transport.gloo import GlooRendezvous

        return GlooRendezvous(settings, registry, device=device)
    if kind == "nccl":
        from nccl_back.transport.nccl import NcclRendezvous

        return NcclRendezvous(settings, registry, device=device)
    raise ConfigError(f"transport {kind!r}: choose one of {KINDS}")


def receiver_transport(
    settings: Settings,
    kind: str,
    address: str,
    transfer_id: str,
    *,
    device: torch.device,
    registry: Registry,
) -> Transport:
    """A new, unconnected rank-1 transport reaching the sender at ``address``.

    Call it on the thread whose CUDA stream holds the work the transfer must follow
    (the loader's): an NCCL transport orders itself after that stream's queued work.
    """
    if kind == "gloo":
        from nccl_back.transport.gloo import GlooTransport

        return GlooTransport.receiver(settings, registry, address, transfer_id, device=device)
    if kind == "nccl":
        from nccl_back.transport.nccl import NcclTransport

        return NcclTransport.receiver(settings, registry, address, transfer_id, device=device)
    raise ConfigError(f"transport {kind!r}: choose one of {KINDS}")
