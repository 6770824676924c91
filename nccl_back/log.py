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
    """A structlog logger; events carry ``bound`` keys (rank, version, peer ...).

    Until an application calls :func:`configure` (or configures structlog itself),
    events go to the standard ``logging`` logger ``name`` as key=value lines, so an
    application that configured nothing sees only warnings and errors (Python's
    last-resort handler) and nothing is printed to stdout.
    """
    if structlog.is_configured():
        return structlog.get_logger(name).bind(**bound)
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    ).bind(**bound)


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
