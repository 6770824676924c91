"""A cooperative download's shares (``load/share_read.py``): every byte of every file read
by exactly one worker, each worker's share the bytes of its part of the plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.errors import CheckpointFormatError, TransferError
from nccl_back.load.share_read import shares
from nccl_back.transport import plan
from nccl_back.transport.parts import part_steps, parts
from nccl_back.transport_kinds import MAX_PARTS


@st.composite
def checkpoints(draw: Any) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, int, int]],
                                    dict[str, int], int, int]:
    """Tensors laid out in 1-3 files in name order, with a header, padding and
    unloaded tensors between them; a bucket size; a number of workers."""
    count = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=count, max_size=count))
    tensors = {f"t{j:02d}": torch.empty(sz, dtype=torch.uint8, device="meta")
               for j, sz in enumerate(sizes)}
    files = draw(st.integers(1, 3))
    where: dict[str, tuple[str, int, int]] = {}
    at: dict[str, int] = {}
    for j, name in enumerate(sorted(tensors)):
        uri = f"f{min(j * files // count, files - 1)}"
        if uri not in at:
            at[uri] = draw(st.integers(0, 300))  # the header
        at[uri] += draw(st.integers(0, 64))  # padding, or a tensor the model does not load
        where[name] = (uri, at[uri], at[uri] + sizes[j])
        at[uri] += sizes[j]
    ends = {uri: end + draw(st.integers(0, 100)) for uri, end in at.items()}
    ends["unused"] = draw(st.integers(0, 50))  # a file no step touches
    return tensors, where, ends, draw(st.integers(64, 4096)), draw(st.integers(1, MAX_PARTS))


@settings(max_examples=300, deadline=None)
@given(checkpoints())
def test_every_byte_of_every_file_is_read_by_exactly_one_worker(case: Any) -> None:
    """The workers' spans tile each file: no byte twice, none left out."""
    tensors, where, sizes, bucket, n = case
    got = shares(plan(tensors, bucket), where, sizes, n)
    assert len(got) == n
    for uri, size in sizes.items():
        spans = sorted((lo, hi) for worker in got for u, lo, hi in worker if u == uri)
        assert all(lo < hi for lo, hi in spans)
        at = 0
        for lo, hi in spans:
            assert lo == at, (uri, spans)
            at = hi
        assert at == size, (uri, spans)


@settings(max_examples=300, deadline=None)
@given(checkpoints())
def test_each_worker_reads_the_bytes_of_its_part_of_the_plan(case: Any) -> None:
    """Every tensor byte a step of part i carries lies in worker i's spans, and each
    worker's spans are in file order, adjacent ones merged."""
    tensors, where, sizes, bucket, n = case
    steps = plan(tensors, bucket)
    got = shares(steps, where, sizes, n)
    for i, part in enumerate(parts(steps, n)):
        for k in part:
            for slot in steps[k].slots:
                uri, start, end = where[slot.name]
                lo, hi = (start + slot.offset, start + slot.offset + slot.nbytes) if steps[k].direct \
                    else (start, end)
                assert any(u == uri and a <= lo and hi <= b for u, a, b in got[i]), (slot, got[i])
    for worker in got:
        assert worker == sorted(worker)
        assert all(not (a[0] == b[0] and a[2] == b[1]) for a, b in zip(worker, worker[1:], strict=False))


@settings(max_examples=300, deadline=None)
@given(checkpoints(), st.data())
def test_a_failed_members_part_spread_over_k_readers_is_carried_exactly_once(case: Any, data: Any) -> None:
    """Part j's sub-parts tile its steps in order (each step in exactly one), each within
    one step of an even share of the part's bytes, and name no step of another part."""
    tensors, where, sizes, bucket, n = case
    steps = plan(tensors, bucket)
    j = data.draw(st.integers(0, n - 1))
    k = data.draw(st.integers(1, MAX_PARTS))
    whole = part_steps(steps, (j, n))
    subs = [part_steps(steps, (j, n, s, k)) for s in range(k)]
    assert [x for sub in subs for x in sub] == whole
    total = sum(steps[x].nbytes for x in whole)
    biggest = max((steps[x].nbytes for x in whole), default=0)
    for sub in subs:
        assert abs(sum(steps[x].nbytes for x in sub) - total / k) <= biggest


@pytest.mark.parametrize("part", [(1, 1), (0, 2, 2, 2), (0, 2, 0), (0, 2, -1, 3), (0, 65)])
def test_a_part_or_sub_part_that_does_not_exist_is_refused(part: tuple[int, ...]) -> None:
    """A part outside its split (or a sub-part outside its own) is refused by name."""
    steps = plan({"t": torch.empty(64, dtype=torch.uint8, device="meta")}, 16)
    with pytest.raises(TransferError, match=r"(no such part|parts=65: must be 1 to 64)"):
        part_steps(steps, part)


def test_a_tensor_of_the_plan_missing_from_the_checkpoint_is_refused() -> None:
    """A step whose tensor has no place in the checkpoint: CheckpointFormatError naming it."""
    tensors = {"a": torch.empty(10, dtype=torch.uint8, device="meta")}
    with pytest.raises(CheckpointFormatError, match="^a: in the plan but not in the checkpoint$"):
        shares(plan(tensors, 64), {}, {"f": 10}, 2)


def test_overlapping_tensors_are_refused() -> None:
    """Two tensors claiming the same bytes cannot both be proven: refused, naming the file."""
    tensors = {"a": torch.empty(10, dtype=torch.uint8, device="meta"),
               "b": torch.empty(10, dtype=torch.uint8, device="meta")}
    with pytest.raises(CheckpointFormatError, match="^f: tensors overlap at byte 5$"):
        shares(plan(tensors, 64), {"a": ("f", 0, 10), "b": ("f", 5, 15)}, {"f": 15}, 2)


def test_a_tensor_outside_its_file_is_refused() -> None:
    """A place past the file's end: refused, naming the tensor and the file."""
    tensors = {"a": torch.empty(10, dtype=torch.uint8, device="meta")}
    with pytest.raises(CheckpointFormatError, match=r"^a: bytes \[5, 15\) outside f$"):
        shares(plan(tensors, 64), {"a": ("f", 5, 15)}, {"f": 12}, 1)
