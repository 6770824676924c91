"""The relay's receiving half: a worker's seats, streams and shares. The relay only offers
sources (:meth:`Seat.tree_upstreams`); asking them is the load layer's
(:mod:`nccl_back.load.rounds`); the sending half is :mod:`.forwarder`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection
from typing import Any, Protocol, TypeVar

import torch

from nccl_back.config import Settings
from nccl_back.coord.records import Member
from nccl_back.coord.registry import Registry
from nccl_back.errors import (
    NcclBackError,
    WeightVerificationError,
)
from nccl_back.metrics import Metrics
from nccl_back.transport import Rendezvous
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay.endpoints import (
    Endpoints,
    Replica,
    Seat,
    Share,
    Stream,
    join,
    share,
    stream,
)
from nccl_back.transport.relay.forwarder import RelayServer
from nccl_back.transport.send import Sends


class DamagedBytes(WeightVerificationError):
    """Raised when verification failed after a transfer; ``blamed`` and ``suspects`` as in
    :class:`.Blame` (what both sent was discarded). Internal: a load reports (or raises
    with ``strict``) :attr:`error`, the integrity check's own."""

    def __init__(self, error: WeightVerificationError, blamed: Collection[str],
                 suspects: Collection[str] = ()) -> None:
        super().__init__(str(error))
        self.error = error
        self.blamed = frozenset(blamed)
        self.suspects = frozenset(suspects) - self.blamed


E = TypeVar("E", Seat, Stream, Share)


class Sender(Protocol):
    """What a relay endpoint borrows from its worker's sender (the PeerServer)."""

    pacer: Pacer

    def rendezvous(self, kind: str, device: torch.device) -> Rendezvous: ...


class Cohorts:
    """This worker's seats, streams and shares, and the relay endpoints it runs."""

    def __init__(self, settings: Settings, registry: Registry, worker_id: str, sender: Sender,
                 metrics: Metrics) -> None:
        self.settings = settings
        self._registry = registry
        self._worker_id = worker_id
        self._sender = sender
        self._metrics = metrics
        self._servers: list[RelayServer] = []
        self._withdrawn: frozenset[str] | None = None
        """Withdrawn (:meth:`withdraw`): the receivers still served; None: serving."""
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.settings.cohort_limit > 1

    def withdraw(self, serving: Collection[str] = ()) -> list[Sends]:
        """Withdraw every relay endpoint of this worker, now and from now on, but for
        ``serving``; their sends, for the closing worker's drain."""
        with self._lock:
            self._withdrawn = frozenset(serving)
            servers = list(self._servers)
        for r in servers:
            r.withdraw(serving)
        return [r.sends for r in servers]

    def askers(self) -> set[str]:
        """The receivers that asked this worker's relay endpoints."""
        with self._lock:
            servers = list(self._servers)
        return set().union(*(r.askers for r in servers))

    def close(self, timeout: float) -> None:
        with self._lock:
            servers, self._servers = self._servers, []
        for r in servers:
            r.close(timeout)

    def find_stream(self, replica: Replica, failed: Collection[str]) -> Member | None:
        """The elected downloader's stream of this rank's flavour, if announced, speaking
        our transport and not failed us (cohorts only)."""
        if not self.enabled:
            return None
        m = self._registry.get_stream(*replica.key)  # None: absent, or untrusted (said why)
        if m is None:
            return None
        if (m.member_id in failed or m.member_id.startswith(self._worker_id + "-")
                or not replica.speaks(m)):
            return None
        return m

    def join(self, replica: Replica, log: Any) -> Seat | None:
        """A seat in the current cohort for this rank, or None (cohorts off, or a failure:
        this rank then receives on its own)."""
        return self._start(join, replica, log, "cohort_join_failed")

    def open_stream(self, replica: Replica, log: Any) -> Stream | None:
        """Stream this rank's download to waiting cohorts, or None (off, or failed)."""
        return self._start(stream, replica, log, "stream_not_announced")

    def open_share(self, replica: Replica, log: Any, member: int) -> Share | None:
        """Serve this rank's part of a cooperative download, or None (off, or failed)."""
        return self._start(functools.partial(share, member=member), replica, log,
                           "share_not_announced")

    def _start(self, start: Callable[[Endpoints], E], replica: Replica, log: Any,
               failed: str) -> E | None:
        """What ``start`` makes of this rank's endpoints, kept for :meth:`close`; None when
        cohorts are off or it failed (logged as ``failed``)."""
        if not self.enabled:
            return None
        try:
            rendezvous = self._sender.rendezvous(replica.kind, replica.device)
            started = start(Endpoints(self.settings, self._registry, rendezvous, self._worker_id,
                                      replica, self._sender.pacer, log, self._metrics))
        except NcclBackError as e:
            log.warning(failed, error=str(e))
            return None
        with self._lock:  # a withdrawn worker's new endpoint is withdrawn at once
            self._servers = [r for r in self._servers if r.alive] + [started.server]
            withdrawn = self._withdrawn
        if withdrawn is not None:
            started.server.withdraw(withdrawn)
        return started
