"""The transport interface: a 2-rank channel between a sender (rank 0) and a receiver (rank 1).

One :class:`Transport` serves exactly one transfer: ``connect`` (build the
communicator), any number of ``copy`` calls (one step each, from one rank to the
other), then ``close``. All waits are bounded
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

Kinds. Each kind (:data:`nccl_back.transport_kinds.TRANSPORT_KINDS`) lives in the module
of its name, ``nccl_back.transport.{kind}``, which calls :func:`register_transport` with
its rendezvous and receiver factories, the device types it carries and its probe for
``nccl-back check``. Everything here reads that one registry: the factories
(:func:`open_rendezvous`, :func:`receiver_transport`), the choice of ``transport="auto"``
(:func:`auto_kind`) and the check's probes (:func:`all_transports`); adding a transport
is a module and a name in :mod:`nccl_back.transport_kinds`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from nccl_back import _clock
from nccl_back.errors import ConfigError
from nccl_back.transport_kinds import TRANSPORT_KINDS

if TYPE_CHECKING:
    from nccl_back.config import Settings
    from nccl_back.coord.registry import Registry

SENDER_RANK = 0
RECEIVER_RANK = 1
WORLD_SIZE = 2


class Pending(Protocol):
    """An issued copy; ``wait()`` returns once this side's part of it is complete."""

    def wait(self) -> None:
        """Block until done, at most until the transport's deadline.

        Raises :class:`TransferError` (peer failed) or :class:`TransferTimeoutError`.
        """
        ...


C = TypeVar("C", bound="_Closing")


class _Closing(ABC):
    """Closed on leaving a ``with`` block."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport(_Closing):
    """One transfer's communicator between a sender (rank 0) and a receiver (rank 1)."""

    kind: str
    """One of :data:`~nccl_back.transport_kinds.TRANSPORT_KINDS`."""

    def __init__(self, rank: int, transfer_id: str, device: torch.device) -> None:
        if rank not in (SENDER_RANK, RECEIVER_RANK):
            raise ConfigError(f"transport rank={rank}: must be 0 (sender) or 1 (receiver)")
        self.rank = rank
        self.transfer_id = transfer_id
        self.device = device
        self._deadline = float("inf")
        self.call_timeout = float("inf")
        """Seconds one copy may wait, at most (the stall bound, set by the watchdog);
        a transport with :attr:`per_call_timeout` fails a longer wait as a timeout."""
        self.progress_at = _clock.monotonic()
        """When the last step completed (``_clock.monotonic``), for the stall watchdog."""

    per_call_timeout: bool = False
    """Whether each copy gets :attr:`call_timeout` as its own timeout (gloo), so a
    timeout before the deadline is the stall bound's."""

    def progressed(self) -> None:
        """A step (a copy this side waited on) completed; called by the data plane."""
        self.progress_at = _clock.monotonic()

    def extend_deadline(self, deadline: float) -> None:
        """After ``connect``: later waits may run until ``deadline`` (the transfer's,
        later than the short one the connect phase had)."""
        self._deadline = max(self._deadline, deadline)

    @abstractmethod
    def connect(self, deadline: float) -> None:
        """Create the communicator; every later wait ends by ``deadline`` (``_clock.monotonic``).

        Raises :class:`TransferError` if the peer cannot be reached in time.
        """

    @abstractmethod
    def copy(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        """Issue the copy of a contiguous ``tensor`` from rank ``src`` to the other rank
        (asynchronous; both ranks call it with a tensor of the same size).

        On rank ``src`` ``tensor`` is read, on the other written; until the returned
        :class:`Pending` is waited on, neither side may touch it.
        """

    def finish(self) -> None:
        """After the last copy: wait, bounded by the deadline, until this side's
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


class Rendezvous(_Closing):
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


class RendezvousFactory(Protocol):
    """Makes a kind's sender endpoint: transfers bootstrap through ``registry``'s Redis."""

    def __call__(self, settings: Settings, registry: Registry, *, device: torch.device) -> Rendezvous:
        ...


class ReceiverFactory(Protocol):
    """Makes a kind's unconnected rank-1 transport for one transfer with ``address``."""

    def __call__(self, settings: Settings, registry: Registry, address: str, transfer_id: str, *,
                 device: torch.device) -> Transport:
        ...


@dataclass(frozen=True)
class Probe:
    """What ``nccl-back check`` found of one transport kind on this machine."""

    found: str
    """What this machine offers of the kind, one phrase ('': nothing to say)."""
    problem: str = ""
    """Why the settings cannot use it here ('': they can, or do not need it)."""
    fix: str = ""


@dataclass(frozen=True)
class TransportClasses:
    """What implements one transport kind."""

    kind: str
    rendezvous: RendezvousFactory
    receiver: ReceiverFactory
    devices: tuple[str, ...]
    """Device types (``torch.device.type``) whose tensors this kind carries."""
    probe: Callable[[Settings], Probe]
    """Whether this machine can run the kind as ``settings`` would (``nccl-back check``)."""


_REGISTRY: dict[str, TransportClasses] = {}


def register_transport(kind: str, rendezvous: RendezvousFactory, receiver: ReceiverFactory, *,
                       devices: tuple[str, ...], probe: Callable[[Settings], Probe]) -> None:
    """Called once by ``nccl_back.transport.{kind}`` at import: its classes for ``kind``."""
    if kind not in TRANSPORT_KINDS:
        raise ConfigError(f"transport {kind!r} is not one of {TRANSPORT_KINDS}"
                          " (nccl_back.transport_kinds)")
    _REGISTRY[kind] = TransportClasses(kind, rendezvous, receiver, devices, probe)


def transport_classes(kind: str) -> TransportClasses:
    """The registered classes of ``kind``, importing its module on first use (a kind's
    module needs nothing of its devices to import: the nccl module loads on a CPU host)."""
    found = _REGISTRY.get(kind)
    if found is not None:
        return found
    if kind not in TRANSPORT_KINDS:
        raise ConfigError(f"transport {kind!r}: choose one of {TRANSPORT_KINDS}")
    importlib.import_module(f"nccl_back.transport.{kind}")
    return _REGISTRY[kind]


def all_transports() -> dict[str, TransportClasses]:
    """Every kind's classes, in ``TRANSPORT_KINDS`` order; asserts the registry covers
    exactly those."""
    found: dict[str, TransportClasses] = {k: transport_classes(k) for k in TRANSPORT_KINDS}
    assert set(_REGISTRY) == set(TRANSPORT_KINDS), (sorted(_REGISTRY), TRANSPORT_KINDS)
    return found


def auto_kind(device_type: str) -> str:
    """The kind ``transport="auto"`` picks for tensors on ``device_type``: of the kinds
    that carry them, the one made for the fewest device types (the specialised path:
    NCCL, CUDA only, between GPUs); for a device type no kind names, the most general
    kind (it may still move them, and a load falls back to storage if not)."""
    kinds = list(all_transports().values())
    carriers = [c for c in kinds if device_type in c.devices]
    if carriers:
        return min(carriers, key=lambda c: len(c.devices)).kind
    return max(kinds, key=lambda c: len(c.devices)).kind


def resolve_kind(settings: Settings, device: torch.device) -> str:
    """The transport to use for a model on ``device``: ``settings.transport``, or
    :func:`auto_kind`'s for the device when it is ``auto``."""
    if settings.transport != "auto":
        classes = transport_classes(settings.transport)
        if device.type not in classes.devices:
            others = [k for k, c in all_transports().items() if device.type in c.devices]
            raise ConfigError(
                f"transport={settings.transport} needs the model on a"
                f" {' or '.join(d.upper() for d in classes.devices)} device, it is on {device};"
                f" use transport={' or '.join([*others, 'auto'])}"
            )
        return settings.transport
    return auto_kind(device.type)


def open_rendezvous(
    settings: Settings, kind: str, *, device: torch.device, registry: Registry
) -> Rendezvous:
    """The sender endpoint for ``kind`` on ``device``; transfers bootstrap through
    ``registry``'s Redis (:mod:`.store`). Warns when this worker advertises loopback to a
    Redis on another host."""
    return transport_classes(kind).rendezvous(settings, registry, device=device)


def receiver_transport(
    settings: Settings,
    kind: str,
    address: str,
    transfer_id: str,
    *,
    device: torch.device,
    registry: Registry,
) -> Transport:
    """A new, unconnected rank-1 transport of ``kind`` reaching the sender at ``address``.

    Call it on the thread whose CUDA stream holds the work the transfer must follow
    (the loader's): an NCCL transport orders itself after that stream's queued work.
    """
    return transport_classes(kind).receiver(settings, registry, address, transfer_id, device=device)
