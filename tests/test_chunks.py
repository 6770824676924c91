"""A tensor sent in chunks: each chunk lands in place on its own, in a non-contiguous
destination too, so parts may cut between a tensor's chunks and a relay member may
forward each chunk as it lands (real gloo transfers between two threads)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_transport import _redis, in_process_pair, mismatches  # noqa: F401

from nccl_back.transport import plan, recv_tensors, send_tensors
from nccl_back.transport.parts import parts

BUCKET = 4096


def _strange(seed: int) -> dict[str, torch.Tensor]:
    """Non-contiguous tensors of several chunks: a transpose, a 3-D permute, a strided
    slice; odd element counts so that chunks end mid-row."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.t": torch.randn(97, 61, generator=g).t(),
        "b.perm": torch.randn(7, 13, 33, generator=g).to(torch.bfloat16).permute(2, 0, 1),
        "c.step": torch.randn(41, 200, generator=g)[:, ::2],
        "d.flat": torch.randn(3001, generator=g),
    }


def _like(want: dict[str, torch.Tensor], fill: float = 7.0) -> dict[str, torch.Tensor]:
    """Destinations laid out as the sources (the same strides), filled with ``fill``."""
    return {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).fill_(fill)
            if t.storage_offset() == 0 else torch.full(t.shape, fill, dtype=t.dtype)
            for n, t in want.items()}


def _elements(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``t`` in row-major order (a copy)."""
    return t.reshape(-1)[lo:hi].clone()


def test_three_senders_fill_non_contiguous_tensors_whose_chunks_the_parts_cut() -> None:
    """Parts 0-2 of 3, sent at once into non-contiguous destinations, cut inside
    tensors: every element arrives, bit for bit."""
    want = _strange(1)
    steps = plan(want, BUCKET)
    split = parts(steps, 3)
    cut_inside = [p[0] for p in split[1:] if p and steps[p[0]].direct and steps[p[0]].slots[0].offset > 0]
    assert cut_inside, "the parts should cut a tensor between its chunks"
    got = _like(want)
    assert not any(t.is_contiguous() for n, t in got.items() if n != "d.flat")
    errors: list[Any] = [None] * 3

    def one(i: int) -> None:
        errors[i] = in_process_pair(lambda t: send_tensors(t, want, BUCKET, part=(i, 3)),
                                    lambda t: recv_tensors(t, got, BUCKET, part=(i, 3)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert errors == [(None, None)] * 3
    assert mismatches(got, want) == []


def test_a_reported_chunk_of_a_non_contiguous_tensor_is_already_in_place() -> None:
    """on_step(k): chunk k's elements are in the destination then, not only once the
    tensor's last chunk landed (a relay member forwards what was reported)."""
    want = _strange(2)
    steps = plan(want, BUCKET)
    got = _like(want)
    wrong: list[int] = []

    def check(k: int) -> None:
        step = steps[k]
        if step.direct:
            slot = step.slots[0]
            item = want[slot.name].element_size()
            lo, hi = slot.offset // item, (slot.offset + slot.nbytes) // item
            if not torch.equal(_elements(got[slot.name], lo, hi), _elements(want[slot.name], lo, hi)):
                wrong.append(k)

    assert in_process_pair(lambda t: send_tensors(t, want, BUCKET),
                           lambda t: recv_tensors(t, got, BUCKET, on_step=check)) == (None, None)
    assert wrong == []
    assert mismatches(got, want) == []


def test_a_sender_forwarding_as_chunks_land_sends_each_chunks_current_bytes() -> None:
    """A non-contiguous source filled chunk by chunk while it is sent (``ready(k)``
    returns once chunk k is in place): the receiver gets every chunk's bytes as they were
    when it went out, not a copy of the tensor taken at its first chunk."""
    want = _strange(3)
    steps = plan(want, BUCKET)
    src = _like(want, fill=-1.0)

    def ready(k: int) -> None:
        for slot in steps[k].slots:
            item = want[slot.name].element_size()
            lo = slot.offset // item if steps[k].direct else 0
            hi = (slot.offset + slot.nbytes) // item if steps[k].direct else want[slot.name].numel()
            idx = torch.unravel_index(torch.arange(lo, hi), want[slot.name].shape)
            src[slot.name][idx] = want[slot.name][idx]

    got = _like(want)
    assert in_process_pair(lambda t: send_tensors(t, src, BUCKET, ready=ready),
                           lambda t: recv_tensors(t, got, BUCKET)) == (None, None)
    assert mismatches(got, want) == []


@pytest.mark.parametrize("bucket", [4097, 4099, 1001])
def test_chunks_are_whole_elements_whatever_the_bucket_size(bucket: int) -> None:
    """A bucket size no element size divides: every chunk holds whole elements, and a
    transfer in parts is still exact."""
    want = _strange(4)
    steps = plan(want, bucket)
    for step in steps:
        if step.direct:
            item = want[step.slots[0].name].element_size()
            assert step.slots[0].offset % item == 0 and step.nbytes % item == 0
    got = _like(want)
    for i in range(2):
        assert in_process_pair(lambda t, i=i: send_tensors(t, want, bucket, part=(i, 2)),
                               lambda t, i=i: recv_tensors(t, got, bucket, part=(i, 2))) == (None, None)
    assert mismatches(got, want) == []


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.data())
def test_any_layout_and_any_part_count_deliver_every_element(dims: list[int], data: Any) -> None:
    """Any shape, any permutation of its dimensions, 1-4 parts: exact."""
    perm = data.draw(st.permutations(range(len(dims))))
    base = torch.arange(int(torch.tensor(dims).prod()), dtype=torch.float32).view(*dims)
    want = {"x": base.permute(*perm), "y": torch.arange(50, dtype=torch.int16)}
    bucket = data.draw(st.integers(16, 64)) * 4
    n = data.draw(st.integers(1, 4))
    got = _like(want)
    for i in range(n):
        assert in_process_pair(lambda t, i=i: send_tensors(t, want, bucket, part=(i, n)),
                               lambda t, i=i: recv_tensors(t, got, bucket, part=(i, n))) == (None, None)
    assert mismatches(got, want) == []
