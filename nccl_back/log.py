"""Structured logging through the standard ``logging`` module.

The library only emits events (:func:`get_logger`): records on the ``nccl_back`` logger
tree, message ``event key=value ...``, the fields also as attributes (the whole event
as ``record.nccl_back``). An application sees them only through its own logging
configuration (a ``NullHandler`` keeps Python's last-resort handler quiet); the CLI, the
demo and the benchmarks call :func:`configure` to print them on stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

import structlog

ROOT = "nccl_back"

# The one thing done on import (the practice for libraries): see the module docstring.
logging.getLogger(ROOT).addHandler(logging.NullHandler())

# LogRecord attributes an event field must not overwrite (logging raises on a clash).
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

_kv = structlog.processors.KeyValueRenderer(sort_keys=False)
_STRUCTLOG_DIR = os.path.dirname(structlog.__file__)


def _stacklevel() -> int:
    """The ``stacklevel`` that makes a record name our caller's file and line, not
    structlog's (vLLM prints ``file.py:line``): the count of structlog frames above the
    last processor, which are the ones left when structlog calls the stdlib logger."""
    level = 0
    frame = sys._getframe(2)  # the processor loop (structlog's) that called _to_record
    while frame is not None and frame.f_code.co_filename.startswith(_STRUCTLOG_DIR):
        level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return max(level, 1)


def _to_record(logger: Any, method: str, event_dict: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Last processor: one stdlib call whose message reads well in any formatter and
    whose ``extra`` carries every field, for JSON formatters and :func:`configure`."""
    extra = {k: v for k, v in event_dict.items() if k not in _RESERVED}
    extra[ROOT] = dict(event_dict)
    rest = {k: v for k, v in event_dict.items() if k != "event"}
    message = f"{event_dict.get('event', '')} {_kv(logger, method, rest)}".rstrip()
    return (message,), {"extra": extra, "stacklevel": _stacklevel()}


_PROCESSORS: list[Any] = [
    # Skip the rendering work for events the stdlib logger would drop anyway.
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    structlog.processors.format_exc_info,
    _to_record,
]


def get_logger(name: str = ROOT, **bound: Any) -> Any:
    """A structlog bound logger over the stdlib logger ``name`` (keep it under ``nccl_back``);
    events carry the ``bound`` keys (rank, version, peer ...)."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
    ).bind(**bound)


class _Formatter(logging.Formatter):
    """Renders one of our records (or any other) with a structlog renderer."""

    def __init__(self, json: bool) -> None:
        super().__init__()
        self._render: Any = (
            structlog.processors.JSONRenderer()
            if json
            else structlog.dev.ConsoleRenderer(colors=False)
        )

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, ROOT, None)
        event: dict[str, Any] = (
            {"event": fields.get("event"), **fields}
            if isinstance(fields, dict)
            else {"event": record.getMessage()}
        )
        event["level"] = record.levelname.lower()
        event["timestamp"] = datetime.fromtimestamp(record.created, timezone.utc).isoformat()
        event["logger"] = record.name
        if record.exc_info and "exception" not in event:
            event["exception"] = self.formatException(record.exc_info)
        return str(self._render(None, record.levelname.lower(), event))


class _Handler(logging.StreamHandler):
    """A stream handler that writes to the *current* ``sys.stderr`` unless given a stream
    (so a test that swaps stderr, or a daemon that redirects it, still gets the lines)."""

    def __init__(self, stream: TextIO | None) -> None:
        self._fixed = stream
        super().__init__(stream)

    @property
    def stream(self) -> TextIO:
        return self._fixed or sys.stderr

    @stream.setter
    def stream(self, value: TextIO | None) -> None:
        self._fixed = value if value is not sys.stderr else self._fixed


def configure(level: str = "INFO", json: bool = False, stream: TextIO | None = None) -> None:
    """Print nccl_back's events on ``stream`` (default stderr) as JSON lines or readable
    text (CLI, demo, benchmarks); calling it again replaces the earlier configuration."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        from nccl_back.errors import ConfigError

        raise ConfigError(f"log level {level!r}: choose DEBUG, INFO, WARNING or ERROR")
    reset()
    handler = _Handler(stream)
    handler.setFormatter(_Formatter(json))
    logger = logging.getLogger(ROOT)
    logger.addHandler(handler)
    logger.setLevel(lvl)
    # The CLI owns the process's output: events must not also reach a root handler.
    logger.propagate = False


def reset() -> None:
    """Undo :func:`configure`: back to the library default (silent unless the app logs)."""
    logger = logging.getLogger(ROOT)
    for h in list(logger.handlers):
        if isinstance(h, _Handler):
            logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
