"""Faulting a receiver's fresh CPU memory in ahead of the bytes that will land in it.

Freshly built models own memory the kernel has not mapped: each page's first write
traps, costing 30-40 % of gloo's loopback rate (``benchmarks/RESULTS.md``,
``peer_load``). :class:`Prefaulter` maps the coming steps' pages ahead in a daemon thread
with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+: one call per range, no byte
changed). Best effort: CPU memory only, any ``madvise`` error ends it quietly.

Huge pages are not used: with ``defrag=madvise`` a fault compacts memory synchronously
(6.4 s instead of 0.2 s for 1 GiB once), and a 2 MiB parameter holds no aligned one.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import sys
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from nccl_back.log import get_logger

log = get_logger(__name__)

#: ``MADV_POPULATE_WRITE`` (linux/mman.h, since 5.14): fault in writable, write nothing.
MADV_POPULATE_WRITE = 23
#: Bytes faulted in per system call: small enough that a stop request is seen within
#: about a millisecond, large enough that the call's cost is nothing.
CHUNK_BYTES = 4 << 20
#: How far the thread runs ahead of the receiver, in destination bytes (a few of the
#: largest buckets): the receiver never catches it, nor does it compete long with the
#: first steps. Parked at the lead, it is woken once half of it is used up.
LEAD_BYTES = 32 << 20
#: Switched off (tests, benchmarks measuring without it): :class:`Prefaulter` does nothing.
ENABLED = True

_PAGE = mmap.PAGESIZE

#: A byte range ``(address, nbytes)`` of a step's destination memory.
Range = tuple[int, int]


def _madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # ctypes releases the GIL during the call
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages holding ``[address, address + nbytes)`` (rounding out is safe:
    the end pages share the range's mapping); False if the kernel refused."""
    if _MADVISE is None or nbytes <= 0:
        return _MADVISE is not None
    start = address - address % _PAGE
    end = -(-(address + nbytes) // _PAGE) * _PAGE
    return _MADVISE(start, end - start, MADV_POPULATE_WRITE) == 0


class Prefaulter:
    """A daemon thread faulting in each step's destination ranges, in order, up to
    :data:`LEAD_BYTES` ahead of the step the receiver gives :meth:`advance`; a context
    manager (stops and joins)."""

    def __init__(self, steps: Sequence[Sequence[Range]]) -> None:
        self._steps = steps
        # Destination bytes before step k, for k = 0 .. len(steps).
        self._starts = [0, *itertools.accumulate(sum(n for _, n in ranges) for ranges in steps)]
        self._cond = threading.Condition()
        self._at = 0  # the step the receiver waits for
        self._parked: int | None = None  # the step the thread sleeps before, if it does
        self._stop = False
        self._thread: threading.Thread | None = None
        if ENABLED and _MADVISE is not None and any(steps):
            self._thread = threading.Thread(target=self._run, name="nccl-back-prefault", daemon=True)

    def __enter__(self) -> Prefaulter:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def advance(self, k: int) -> None:
        """The receiver now waits for step ``k``: pages before it need no help."""
        if self._thread is None:
            return
        with self._cond:
            self._at = max(self._at, k)
            # Wake the thread only once the receiver has used up half its lead: a wake-up
            # per step would cost a context switch per step.
            if self._parked is not None and self._ahead(self._parked) <= LEAD_BYTES // 2:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()

    def _ahead(self, k: int) -> int:
        """Bytes between the receiver's position and step ``k``."""
        last = len(self._steps)
        return self._starts[min(k, last)] - self._starts[min(self._at, last)]

    def _run(self) -> None:
        k = 0
        while True:
            with self._cond:
                k = max(k, self._at)
                if k < len(self._steps) and self._ahead(k) >= LEAD_BYTES:
                    self._parked = k
                    while not self._stop and self._ahead(k) > LEAD_BYTES // 2:
                        self._cond.wait()
                    self._parked = None
                    k = max(k, self._at)
                if self._stop or k >= len(self._steps):
                    return
            for address, nbytes in self._steps[k]:
                for at in range(0, nbytes, CHUNK_BYTES):
                    if self._stop:
                        return
                    if not populate(address + at, min(CHUNK_BYTES, nbytes - at)):
                        log.debug("prefault_unavailable", errno=ctypes.get_errno())
                        return
            k += 1
