"""The sender's rendezvous: one ``TCPStore`` that receivers reach at a published address.

Both transports bootstrap the same way. The sender hosts one ``TCPStore`` for the
life of the service; each transfer builds its communicator (a ``ProcessGroupGloo`` or
a ``ProcessGroupNCCL``) on ``PrefixStore("{kind}/{transfer_id}/")``, so keys of an
earlier, failed attempt never meet this one. The receiver connects a client store to
the published ``host:port`` with the time left to its deadline as the timeout.
``init_process_group`` is never called: the user's worker may already have one.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import Settings
from ..errors import ConfigError, TransferError
from ..log import get_logger
from .base import Rendezvous, Transport

log = get_logger(__name__)

#: Makes the sender's transport of one transfer: ``(transfer_id, store, settings, device)``.
SenderFactory = Callable[[str, dist.Store, Settings, torch.device], Transport]


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> ``(host, port)``; :class:`ConfigError` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"transport address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), IPv4 or IPv6."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def connect_store(address: str, timeout: float) -> dist.TCPStore:
    """A client store on the sender's rendezvous; waits at most ``timeout`` seconds."""
    host, port = split_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


class StoreRendezvous(Rendezvous):
    """The sender's long-lived ``TCPStore``; receivers reach it at :attr:`address`."""

    def __init__(
        self,
        settings: Settings,
        kind: str,
        make_sender: SenderFactory,
        *,
        device: torch.device,
        port: int = 0,
    ) -> None:
        self.kind = kind
        self.settings = settings
        self.device = device
        self._make_sender = make_sender
        try:
            # TCPStore itself listens on every interface; binding our own socket and
            # handing it over is how bind_host (default: the advertised address) is honoured.
            listener = listen(settings.listen_host, port)
            self._port = int(listener.getsockname()[1])
            # wait_for_workers=False: receivers come and go for the life of the service.
            self._store: dist.TCPStore | None = dist.TCPStore(
                settings.advertise_host,
                self._port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=settings.transfer_timeout),
                master_listen_fd=listener.detach(),  # the store owns (and closes) it now
            )
        except (RuntimeError, OSError) as e:
            raise TransferError(
                f"cannot start the {kind} rendezvous on {settings.listen_host}:{port}: {e}"
            ) from e
        log.debug("rendezvous_started", kind=kind, address=self.address)

    @property
    def address(self) -> str:
        return f"{self.settings.advertise_host}:{self._port}"

    def sender(self, transfer_id: str) -> Transport:
        if self._store is None:
            raise TransferError(f"the {self.kind} rendezvous is closed")
        return self._make_sender(transfer_id, self._store, self.settings, self.device)

    def close(self) -> None:
        # Dropping the last reference stops the store's server thread.
        self._store = None


def delete_prefix(store: dist.Store, prefix: str, fallback: int = 2) -> None:
    """Delete every key under ``prefix`` (a transfer's, from the long-lived sender store).

    Best effort; where the store cannot list keys, the ``{prefix}/0/{rank}`` keys that
    a process group of ``fallback`` ranks writes are deleted by name.
    """
    try:
        listed = getattr(store, "list_keys", None)
        names = ([k for k in listed() if k.startswith(prefix)] if listed is not None
                 else [f"{prefix}/0/{r}" for r in range(fallback)])
        for name in names:
            store.delete_key(name)
    except RuntimeError as e:  # a dead store has nothing left to clean
        log.debug("store_cleanup_failed", prefix=prefix, error=str(e))
