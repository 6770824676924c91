"""JSON read from outside (headers, config files, Redis values, requests), with bounds.

``json.loads`` recurses once per nesting level and raises ``RecursionError`` (not a
``ValueError``) on deep input, and it accepts any size. :func:`loads` checks the size
and the nesting depth *before* parsing, so every bad input is one ``ValueError``
that a caller turns into its own typed error or a skipped record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

#: Deeper than any record, header or model config we read (they are 2 to 5 deep).
DEFAULT_MAX_DEPTH = 32

# A JSON string, escapes included: brackets inside strings are no nesting.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = (ord("{"), ord("["))
_CLOSE = (ord("}"), ord("]"))
# Depth is counted in blocks so that a 100 MiB header needs no 100M-entry array.
_BLOCK = 1 << 20


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of ``data`` outside strings (an upper bound for
    malformed input, which the parser rejects anyway)."""
    bare = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    deepest = depth = 0
    for start in range(0, bare.size, _BLOCK):
        block = bare[start : start + _BLOCK]
        step = (np.isin(block, _OPEN).astype(np.int32) - np.isin(block, _CLOSE).astype(np.int32))
        if not step.any():
            continue
        running = np.cumsum(step, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


def loads(
    data: bytes | str,
    *,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    allow_constants: bool = False,
) -> Any:
    """Parse ``data`` (UTF-8) as JSON, or raise ``ValueError`` saying which bound or
    rule it broke: over ``max_bytes``, nested deeper than ``max_depth``, not UTF-8,
    not JSON. Python's non-standard constants (``NaN``, ``Infinity``) are refused
    unless ``allow_constants`` (model configs written by Python may hold them)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise ValueError(f"{len(raw)} bytes of JSON, over the limit of {max_bytes}")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep, over the limit of {max_depth}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e}") from e
    constant = None if allow_constants else _no_constant
    return json.loads(text, object_pairs_hook=object_pairs_hook, parse_constant=constant)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
