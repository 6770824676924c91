"""transport.prefault: fresh CPU pages mapped ahead of the receiver, bytes untouched,
the thread bounded and gone with its block."""

from __future__ import annotations

import ctypes
import mmap
import resource
import threading
import time

import pytest
import torch

from nccl_back.transport import prefault
from nccl_back.transport.prefault import Prefaulter, populate

MiB = 1 << 20
_PROBE = torch.empty(MiB, dtype=torch.uint8)
pytestmark = pytest.mark.skipif(not populate(_PROBE.data_ptr(), _PROBE.numel()),
                                reason="no madvise(MADV_POPULATE_WRITE) here (Linux 5.14+)")


def fresh(nbytes: int) -> torch.Tensor:
    """Memory the kernel has not mapped yet: its own anonymous mapping (a ``torch.empty``
    may reuse pages the allocator got back from an earlier tensor)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)


def resident(t: torch.Tensor) -> float:
    """Share of ``t``'s whole pages that are mapped (``mincore``), touching none."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel()) // page * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vec) == 0
    return sum(b & 1 for b in vec) / len(vec)


def threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nccl-back-prefault"]


def test_populate_keeps_every_byte() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (3 * MiB + 5,), dtype=torch.uint8, generator=g)
    before = t.clone()
    assert populate(t.data_ptr() + 3, t.numel() - 7)  # unaligned ends round out to pages
    assert torch.equal(t, before)


def test_pages_are_mapped_before_the_receiver_writes() -> None:
    t = fresh(32 * MiB)
    with Prefaulter([[(t.data_ptr(), t.numel())]]) as ahead:
        assert ahead._thread is not None
        ahead._thread.join(30)
    assert resident(t) == 1.0
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.fill_(1)
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults < 64  # of 8192 pages


def test_the_thread_stays_a_bounded_distance_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "LEAD_BYTES", 8 * MiB)
    steps = [fresh(MiB) for _ in range(16)]  # the lead: 8 steps

    def mapped_once(upto: int) -> None:
        deadline = time.monotonic() + 30
        while resident(steps[upto - 1]) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time to run on, were it not parked

    with Prefaulter([[(t.data_ptr(), t.numel())] for t in steps]) as ahead:
        mapped_once(8)
        assert [resident(t) for t in steps] == [1.0] * 8 + [0.0] * 8
        ahead.advance(3)  # half the lead not used up yet: it stays parked
        time.sleep(0.2)
        assert resident(steps[8]) == 0.0
        ahead.advance(5)  # now it is: it runs to 8 MiB ahead of step 5
        mapped_once(13)
        assert [resident(t) for t in steps] == [1.0] * 13 + [0.0] * 3
        ahead.advance(len(steps))  # the receiver is past all of them: nothing left to do
        assert ahead._thread is not None
        ahead._thread.join(30)
    assert resident(steps[-1]) == 0.0


def test_the_thread_ends_with_its_block_on_failure() -> None:
    held = [fresh(64 * MiB) for _ in range(8)]
    with pytest.raises(RuntimeError, match="receiver failed"), \
            Prefaulter([[(t.data_ptr(), t.numel())] for t in held]):
        assert threads()
        raise RuntimeError("receiver failed")
    assert threads() == []


def test_nothing_to_fault_or_switched_off_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    t = fresh(4 * MiB)
    with Prefaulter([[], []]) as ahead:
        assert ahead._thread is None
    monkeypatch.setattr(prefault, "ENABLED", False)
    with Prefaulter([[(t.data_ptr(), t.numel())]]) as ahead:
        assert ahead._thread is None
        assert threads() == []
    assert resident(t) == 0.0
