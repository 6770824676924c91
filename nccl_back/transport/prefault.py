"""Faulting a receiver's fresh CPU memory in ahead of the bytes that will land in it.

A model an engine has just built (``torch.empty`` per parameter) owns memory the
kernel has not mapped yet: the first write to each 4 KiB page traps, and the kernel
zeroes and maps it. Receiving into such memory loses 30-40 % of gloo's loopback rate
to those faults (``benchmarks/RESULTS.md``, ``peer_load``). :class:`Prefaulter` maps
the pages of the steps still to come in a daemon thread with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), which faults a whole range in one
system call (cheaper than a trap per page) and never changes a byte; the receiving
thread then writes into mapped memory.

Best effort and invisible: CPU memory only (device memory has no such faults), Linux
only, any ``madvise`` error ends the prefaulting quietly (the writes then fault the
pages in themselves). The thread takes no memory beyond what the tensors own, stays a bounded
number of steps ahead of the receiver, skips what the receiver has already passed and
is stopped and joined when the transfer ends, on every path.

Huge pages (``MADV_HUGEPAGE``) would cut the faults' cost by half again but are not
used: with the usual ``defrag=madvise`` a fault in such a range compacts memory
synchronously (measured here: 6.4 s instead of 0.2 s for 1 GiB once, on a host whose
memory was mostly page cache), and a parameter of 2 MiB holds no aligned huge page.
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
#: How far the thread runs ahead of the receiver, in destination bytes (a few steps of
#: the largest automatic bucket): far enough that the receiver never catches it up, not
#: so far that it competes with the first steps for long. Parked at the lead, it is
#: woken when the receiver has used up half of it.
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
    """Fault in the pages holding ``[address, address + nbytes)``; False if the kernel
    refused (too old, or memory it cannot populate). The pages at either end belong to
    the same mapping as the range's first and last byte, so rounding out is safe."""
    if _MADVISE is None or nbytes <= 0:
        return _MADVISE is not None
    start = address - address % _PAGE
    end = -(-(address + nbytes) // _PAGE) * _PAGE
    return _MADVISE(start, end - start, MADV_POPULATE_WRITE) == 0


class Prefaulter:
    """A daemon thread faulting in ``steps[k]``'s ranges, in step order, from the
    receiver's position to :data:`LEAD_BYTES` ahead of it; a context manager (stops and
    joins).

    ``steps`` holds, per step of the transfer, the ranges its bytes will be written to
    (empty where there is nothing to fault in). The receiver calls :meth:`advance` with
    the step it now waits for.
    """

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
