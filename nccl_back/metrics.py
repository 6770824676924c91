"""Prometheus metrics of one nccl_back service instance.

Each :class:`Metrics` owns its own ``CollectorRegistry`` rather than the process-wide
default, so several services (or tests) in one process never collide on metric names.
Label values come from small fixed sets (:data:`SOURCES`, :data:`FALLBACK_REASONS`,
outcome ``ok``/``failed``) so the number of series stays bounded; every known series
is created at zero up front, so ``rate()`` works from the first scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from nccl_back.errors import (
    FALLBACK_REASONS,
    RECORD_KINDS,
    ConfigError,
    RecordKind,
    fallback_reason,
)

SOURCES = ("peer", "storage", "local")
"""Where a load's weights came from (``LoadResult.source``)."""

SEND_ROLES = ("holder", "relay")
"""Who sent weights to a receiver: a published holder, or a cohort member relaying."""

__all__ = ["CONTENT_TYPE", "FALLBACK_REASONS", "SEND_ROLES", "SOURCES", "Metrics", "fallback_reason"]

# Cold starts range from sub-second (local hand-off) to many minutes (large model from
# storage); the default buckets stop at 10 s.
LOAD_SECONDS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, float("inf"))

UNKNOWN_KIND = "unknown"
"""The ``records_rejected`` label of a kind outside :class:`RecordKind` (never an error)."""

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""HTTP ``Content-Type`` of :meth:`Metrics.render`'s output."""


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ConfigError(f"{what}={value!r}: choose one of {', '.join(allowed)}")
    return value


class Metrics:
    """The counters, histogram and gauges a service updates; :meth:`render` exports them."""

    def __init__(self, prefix: str = "nccl_back") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.loads = Counter(
            f"{prefix}_loads", "Completed weight loads, by source.", ["source"], registry=r
        )
        self.loaded_bytes = Counter(
            f"{prefix}_loaded_bytes", "Bytes of weights loaded, by source.", ["source"], registry=r
        )
        self.load_seconds = Histogram(
            f"{prefix}_load_seconds",
            "Wall time of a weight load, by source.",
            ["source"],
            buckets=LOAD_SECONDS_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            f"{prefix}_fallbacks",
            "Peer loads abandoned for storage, by reason code.",
            ["reason"],
            registry=r,
        )
        self.transfers_served = Counter(
            f"{prefix}_transfers_served",
            "Transfers this worker sent to a receiver, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.verification_failures = Counter(
            f"{prefix}_verification_failures",
            "Peer loads whose integrity hashes differed from the ground truth.",
            registry=r,
        )
        self.records_rejected = Counter(
            f"{prefix}_records_rejected",
            "Redis values skipped as unsigned, badly signed, expired, malformed or without"
            " a TTL, by record kind.",
            ["kind"],
            registry=r,
        )
        self.requests_dropped = Counter(
            f"{prefix}_requests_dropped",
            "Transfer requests dropped because this worker's send queue was full.",
            registry=r,
        )
        self.handshake_timeouts = Counter(
            f"{prefix}_handshake_timeouts",
            "Liveness handshakes that timed out (either side).",
            registry=r,
        )
        self.claims = Gauge(
            f"{prefix}_active_claims",
            "Receivers currently holding a send slot on this worker.",
            registry=r,
        )
        self.ready = Gauge(
            f"{prefix}_ready",
            "1 once weights are loaded, verified and published; 0 before and while draining.",
            registry=r,
        )
        # Sends, by role: bytes and seconds give GB/s (rate of one over rate of the other).
        self.sent_bytes = Counter(
            f"{prefix}_sent_bytes",
            "Payload bytes of completed sends to receivers, by role (holder or relay).",
            ["role"],
            registry=r,
        )
        self.send_seconds = Counter(
            f"{prefix}_send_seconds",
            "Wall seconds of completed sends to receivers (communicator and broadcast), by role.",
            ["role"],
            registry=r,
        )
        self.sends_in_flight = Gauge(
            f"{prefix}_sends_in_flight",
            "Sends to receivers running now, by role (holder or relay).",
            ["role"],
            registry=r,
        )
        for role in SEND_ROLES:
            self.sent_bytes.labels(role=role)
            self.send_seconds.labels(role=role)
            self.sends_in_flight.labels(role=role)
        for source in SOURCES:
            self.loads.labels(source=source)
            self.loaded_bytes.labels(source=source)
            self.load_seconds.labels(source=source)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        for outcome in ("ok", "failed"):
            self.transfers_served.labels(outcome=outcome)
        for kind in (*RECORD_KINDS, UNKNOWN_KIND):
            self.records_rejected.labels(kind=kind)

    def record_load(self, source: str, nbytes: int, seconds: float) -> None:
        """Count one completed load of ``nbytes`` that took ``seconds`` from ``source``."""
        _check(source, SOURCES, "source")
        self.loads.labels(source=source).inc()
        self.loaded_bytes.labels(source=source).inc(nbytes)
        self.load_seconds.labels(source=source).observe(seconds)

    def record_fallback(self, reason: str) -> None:
        """Count one fallback to storage; ``reason`` is a :data:`FALLBACK_REASONS` code."""
        self.fallbacks.labels(reason=_check(reason, FALLBACK_REASONS, "reason")).inc()

    def record_served(self, ok: bool) -> None:
        """Count one transfer this worker sent, successful or not."""
        self.transfers_served.labels(outcome="ok" if ok else "failed").inc()

    @contextmanager
    def sending(self, role: str) -> Iterator[None]:
        """Count a send in flight for the duration of the block; ``role`` is a :data:`SEND_ROLES`."""
        gauge = self.sends_in_flight.labels(role=_check(role, SEND_ROLES, "role"))
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def record_sent(self, role: str, nbytes: int, seconds: float) -> None:
        """Count one completed send of ``nbytes`` payload bytes that took ``seconds``."""
        _check(role, SEND_ROLES, "role")
        self.sent_bytes.labels(role=role).inc(nbytes)
        self.send_seconds.labels(role=role).inc(seconds)

    def record_verification_failure(self) -> None:
        self.verification_failures.inc()

    def record_handshake_timeout(self) -> None:
        self.handshake_timeouts.inc()

    def record_untrusted(self, kind: RecordKind | str) -> None:
        """Count one rejected Redis record by its :class:`RecordKind`.

        Never raises: it runs inside ``load()`` whenever a hostile or stale value is
        skipped, and a counter must not turn a skip into a failed load. A kind outside
        the enumeration (a caller's bug) is counted as ``unknown``.
        """
        label = str(kind) if str(kind) in RECORD_KINDS else UNKNOWN_KIND
        self.records_rejected.labels(kind=label).inc()

    def record_request_dropped(self) -> None:
        self.requests_dropped.inc()

    def set_claims(self, n: int) -> None:
        """Current number of receivers holding a send slot on this worker."""
        self.claims.set(n)

    def set_ready(self, flag: bool) -> None:
        self.ready.set(1 if flag else 0)

    def render(self) -> bytes:
        """All metrics in the Prometheus text exposition format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
