"""The transport interface: a 2-rank channel between a sender (rank 0) and a receiver (rank 1).

One :class:`Transport` serves one transfer: ``connect``, any number of ``copy`` calls,
``close``. Every wait ends by the deadline given to ``connect``, so a dead or stalled
peer surfaces as a :class:`TransferError` instead of a hang; ``abort`` may come from the
watchdog's thread at any time. The sender's long-lived :class:`Rendezvous` makes one
sender transport per transfer, bootstrapped through signed Redis keys
(:mod:`.rendezvous_store`), never the user's default process group.

Each kind lives in ``nccl_back.transport.{kind}``, which calls :func:`register_transport`;
the factories, ``transport="auto"`` and ``nccl-back check`` all read that one registry.
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
        """Block until done, by the deadline; raises :class:`TransferError` or its timeout."""
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
        """After ``connect``: later waits may run until the transfer's ``deadline``."""
        self._deadline = max(self._deadline, deadline)

    @abstractmethod
    def connect(self, deadline: float) -> None:
        """Create the communicator; every later wait ends by ``deadline``, raises
        :class:`TransferError` if the peer cannot be reached in time."""

    @abstractmethod
    def copy(self, tensor: torch.Tensor, src: int = SENDER_RANK) -> Pending:
        """Issue the asynchronous copy of a contiguous ``tensor`` from rank ``src`` to
        the other (same size on both); neither side may touch it until it is waited on."""

    def finish(self) -> None:
        """After the last copy: wait, by the deadline, until queued device copies are
        done (nothing to wait for where copies are synchronous)."""
        return None

    @property
    def join_grace(self) -> float:
        """Seconds the watchdog waits for the worker thread after asking for an abort."""
        return 5.0

    @abstractmethod
    def abort(self) -> None:
        """Abort the transfer, from any thread; pending and later calls fail (NCCL, whose
        abort is unsafe beside another thread in the library, only signals here)."""

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
    """Every kind's classes, in ``TRANSPORT_KINDS`` order (all of them registered)."""
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
    """The transport for a model on ``device``: ``settings.transport``, or :func:`auto_kind`'s."""
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
    """The sender endpoint for ``kind`` on ``device``; warns when this worker advertises
    loopback to a Redis on another host."""
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
    """A new, unconnected rank-1 transport of ``kind`` reaching the sender at ``address``;
    call it on the thread whose CUDA stream the transfer must follow (NCCL orders after it)."""
    return transport_classes(kind).receiver(settings, registry, address, transfer_id, device=device)
