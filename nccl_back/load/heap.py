"""The process's heap kept out of garbage collection while a load runs.

A full collection walks every object the process holds, with the GIL held: with torch
imported about 200,000 objects and 70 ms (0.6 s in a vLLM worker), stretched to seconds
on a busy host, during which handshake answers, relay forwarding and liveness marks
stop and peers give up on this worker (``benchmarks/results-log.md``). So while a load
runs, the objects that existed before it are frozen (:func:`gc.freeze`, constant time)
and collections walk only what the load allocates; the last running load unfreezes
them, so nothing is collected less, only later. An application that froze its own heap
or switched the collector off is left as it is.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_loads = 0
"""Loads running in this process (they share one frozen window)."""
_frozen_here = False
"""Whether the window's freeze is ours to undo."""


@contextlib.contextmanager
def kept_out() -> Iterator[None]:
    """The block runs with the heap that existed before the first running load frozen
    (see the module docstring)."""
    global _loads, _frozen_here
    with _lock:
        if _loads == 0:
            _frozen_here = gc.isenabled() and gc.get_freeze_count() == 0
            if _frozen_here:
                gc.freeze()
        _loads += 1
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            if _loads == 0 and _frozen_here:
                gc.unfreeze()
                _frozen_here = False
