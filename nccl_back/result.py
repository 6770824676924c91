"""What a load reports back to the caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Source = Literal["peer", "storage", "local"]


@dataclass(frozen=True)
class LoadResult:
    """The outcome of one load into a skeleton: ``fallback_reason`` is set whenever storage
    was used after a peer load was tried (or skipped), so no fallback is silent."""

    source: Source
    version: str
    bytes: int
    seconds: float
    peer_id: str | None = None
    fallback_reason: str | None = None
    verified: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase, e.g. ``download``, ``copy``, ``discovery``, ``handshake``,
    ``transfer``, ``verify``."""
    storage_bytes: int = 0
    """Bytes this rank read from storage: ``bytes`` for a download (plus a cooperative
    member's share), a member's share for its ``"peer"`` load, else 0."""
    peer_bytes: int = 0
    """Bytes this rank received from peers: ``bytes`` for a peer load; for the worker
    that gathered a cooperative download, the parts its members sent it."""

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) over the whole load."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
