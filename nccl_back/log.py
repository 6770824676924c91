"""Structured logging.

The library only *emits* events through ``get_logger``; it never configures logging
on import. Applications (and our CLI) call :func:`configure` once.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def get_logger(name: str = "nccl_back", **bound: Any) -> Any:
    """A structlog-style logger; events carry ``bound`` keys (rank, version, peer ...).

    The target is chosen at each call, not at creation, so module-level loggers made
    at import follow a later :func:`configure`. Until an application configures
    structlog (our CLI calls :func:`configure`), events go to the standard ``logging``
    logger ``name`` as key=value lines: an application that configured nothing sees
    only warnings and errors (Python's last-resort handler), never stdout noise.
    """
    return _LazyLogger(name, dict(bound))


class _LazyLogger:
    def __init__(self, name: str, bound: dict[str, Any]) -> None:
        self._name = name
        self._bound = bound

    def bind(self, **more: Any) -> _LazyLogger:
        return _LazyLogger(self._name, {**self._bound, **more})

    def _resolve(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self._name).bind(**self._bound)
        return structlog.wrap_logger(
            logging.getLogger(self._name),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.format_exc_info,
                structlog.processors.KeyValueRenderer(key_order=["event"]),
            ],
            wrapper_class=structlog.stdlib.BoundLogger,
        ).bind(**self._bound)

    def __getattr__(self, method: str) -> Any:
        return getattr(self._resolve(), method)


def configure(level: str = "INFO", json: bool = False, stream: Any = None) -> None:
    """Route nccl_back's events to ``stream`` (stderr) as JSON lines or readable text."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        from .errors import ConfigError

        raise ConfigError(f"log level {level!r}: choose DEBUG, INFO, WARNING or ERROR")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
