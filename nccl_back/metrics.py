"""Prometheus metrics of one nccl_back service instance.

Each :class:`Metrics` owns its ``CollectorRegistry``, so services in one process never
collide; label values come from small fixed sets (bounded series), each series created
at zero up front so ``rate()`` works from the first scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

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


M = TypeVar("M", Counter, Gauge, Histogram)
_Label = tuple[str, tuple[str, ...]]
"""A label's name and its fixed values."""


def _primed(kind: type[M], name: str, doc: str, label: _Label | None,
            registry: CollectorRegistry, **options: Any) -> M:
    """A metric of ``kind``; with ``label`` (a name and its fixed values), one series per
    value, created at zero."""
    if label is None:
        return kind(name, doc, registry=registry, **options)
    key, values = label
    metric = kind(name, doc, [key], registry=registry, **options)
    for value in values:
        metric.labels(**{key: value})
    return metric


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ConfigError(f"{what}={value!r}: choose one of {', '.join(allowed)}")
    return value


class Metrics:
    """The counters, histogram and gauges a service updates; :meth:`render` exports them."""

    def __init__(self, prefix: str = "nccl_back") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        def counter(name: str, doc: str, label: _Label | None = None) -> Counter:
            return _primed(Counter, f"{prefix}_{name}", doc, label, self.registry)

        def gauge(name: str, doc: str, label: _Label | None = None) -> Gauge:
            return _primed(Gauge, f"{prefix}_{name}", doc, label, self.registry)

        by_source, by_role = ("source", SOURCES), ("role", SEND_ROLES)
        self.loads = counter("loads", "Completed weight loads, by source.", by_source)
        self.loaded_bytes = counter("loaded_bytes", "Bytes of weights loaded, by source.",
                                    by_source)
        self.load_seconds = _primed(Histogram, f"{prefix}_load_seconds",
                                    "Wall time of a weight load, by source.", by_source,
                                    self.registry, buckets=LOAD_SECONDS_BUCKETS)
        self.fallbacks = counter("fallbacks", "Peer loads abandoned for storage, by reason code.",
                                 ("reason", FALLBACK_REASONS))
        self.transfers_served = counter(
            "transfers_served", "Transfers this worker sent to a receiver, by outcome.",
            ("outcome", ("ok", "failed")))
        self.verification_failures = counter(
            "verification_failures",
            "Peer loads whose integrity hashes differed from the ground truth.")
        self.records_rejected = counter(
            "records_rejected", "Redis values skipped as unsigned, badly signed, expired,"
            " malformed or without a TTL, by record kind.", ("kind", (*RECORD_KINDS, UNKNOWN_KIND)))
        self.requests_dropped = counter(
            "requests_dropped", "Transfer requests dropped because this worker's send queue"
            " was full.")
        self.handshake_timeouts = counter("handshake_timeouts",
                                          "Liveness handshakes that timed out (either side).")
        self.claims = gauge("active_claims",
                            "Receivers currently holding a send slot on this worker.")
        self.ready = gauge("ready", "1 once weights are loaded, verified and published; 0 before"
                           " and while draining.")
        # Sends, by role: bytes and seconds give GB/s (rate of one over rate of the other).
        self.sent_bytes = counter("sent_bytes", "Payload bytes of completed sends to receivers,"
                                  " by role (holder or relay).", by_role)
        self.send_seconds = counter("send_seconds", "Wall seconds of completed sends to receivers"
                                    " (communicator and broadcast), by role.", by_role)
        self.sends_in_flight = gauge("sends_in_flight", "Sends to receivers running now, by role"
                                     " (holder or relay).", by_role)

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
        """Count one rejected Redis record by its :class:`RecordKind`; never raises (a
        counter must not turn a skip into a failed load): an unknown kind counts as ``unknown``."""
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
