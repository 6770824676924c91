"""The process's heap kept out of garbage collection while a load runs.

A full collection of Python's cyclic garbage collector walks every object the process
holds, with the GIL held. With torch imported that is about 200,000 objects and 70 ms
(in a vLLM worker, 0.6 s: :mod:`nccl_back.engines.common`); during a load every thread
of the worker stops for it: handshake answers, the relay's forwarding, the liveness
marks. On a busy host the pause stretches to seconds and peers give up on this worker
(``benchmarks/results-log.md``, "The late starts were garbage-collection pauses"). So while
a load runs, the objects that existed before it are frozen (:func:`gc.freeze` moves
them to the permanent generation, in constant time) and collections walk only what the
load allocates; the last load of the process to end unfreezes them. Nothing is
collected less: garbage among the frozen objects is collected once they are unfrozen.

An application that froze its own heap (``gc.get_freeze_count()`` above zero when the
first load starts), or switched the collector off, is left as it is: unfreezing at the
end would undo its choice.
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
