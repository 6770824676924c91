"""JSON read from outside (headers, config files, Redis values, requests), with bounds.

``json.loads`` raises ``RecursionError`` on deep input and accepts any size;
:func:`loads` checks size and depth first, so every bad input is one ``ValueError``.
The depth check is a numpy scan in fixed-size blocks (O(n), a few MiB), finding strings
from quotes and backslash parity. Not a regular expression: ``re`` keeps ~115 bytes of
backtracking state per string character (2.3 GiB for a 20 MB header string).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

#: Deeper than any record, header or model config we read (they are 2 to 5 deep).
DEFAULT_MAX_DEPTH = 32

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = (ord("{"), ord("["))
_CLOSE = (ord("}"), ord("]"))
# Scanned in blocks so that a 100 MB header needs a few MiB of scratch, not ~40x its size.
_BLOCK = 1 << 18


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of ``data`` outside strings (an upper bound for
    malformed input, which the parser rejects anyway)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    deepest = depth = 0
    in_string = False  # inside a string at the end of the previous block
    run = 0  # backslashes ending the previous block
    for start in range(0, arr.size, _BLOCK):
        block = arr[start : start + _BLOCK]
        idx = np.arange(block.size, dtype=np.int64)
        backslash = block == _BACKSLASH
        # last[j]: index of the last non-backslash at or before j (the previous block's
        # trailing backslashes continue a run from index -1 - run).
        last = np.maximum.accumulate(np.where(backslash, -1 - run, idx))
        quotes = np.flatnonzero(block == _QUOTE)
        before = np.where(quotes > 0, quotes - 1 - last[np.maximum(quotes - 1, 0)], run)
        # A quote after an odd number of backslashes is escaped, the others toggle.
        real = quotes[before % 2 == 0]
        run = int(block.size - 1 - last[-1]) if block.size else run
        brackets = np.flatnonzero(np.isin(block, _OPEN + _CLOSE))
        if brackets.size:
            # Quotes before each bracket, plus the carried state: odd means inside a string.
            toggles = np.searchsorted(real, brackets) + int(in_string)
            outside = brackets[toggles % 2 == 0]
            step = np.where(np.isin(block[outside], _OPEN), 1, -1).astype(np.int64)
            if step.size:
                running = np.cumsum(step) + depth
                deepest = max(deepest, int(running.max()))
                depth = int(running[-1])
        in_string ^= bool(real.size % 2)
    return deepest


def loads(
    data: bytes | str,
    *,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    allow_constants: bool = False,
    parse_int: Callable[[str], Any] | None = None,
    parse_float: Callable[[str], Any] | None = None,
) -> Any:
    """Parse ``data`` (UTF-8) as JSON, or raise ``ValueError`` saying which bound or
    rule it broke: over ``max_bytes``, nested deeper than ``max_depth``, not UTF-8,
    not JSON. Python's non-standard constants (``NaN``, ``Infinity``) are refused
    unless ``allow_constants`` (model configs written by Python may hold them).
    ``parse_int``/``parse_float`` get each number's text (``json.loads``' hooks)."""
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
    del raw
    constant = None if allow_constants else _no_constant
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook, parse_constant=constant,
                          parse_int=parse_int, parse_float=parse_float)
    except RecursionError as e:  # a scan bug must still be one ValueError
        raise ValueError("JSON nested too deep") from e


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
