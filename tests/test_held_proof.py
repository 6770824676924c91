"""The elected worker of a cooperative download proves every file from the bytes it
holds (its tensors, every member's part landed) plus the bytes no tensor holds, read
from storage itself: a byte altered in any member's part is caught and that member
blamed; a file changed at rest is told apart. Real files and the GCS emulator."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import reshard_workers as rw
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.config import Settings
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.errors import ChecksumMismatchError
from nccl_back.load.held_proof import held_reads
from nccl_back.load.share_read import Blame, blame, places, prove, shares
from nccl_back.model.checkpoint import model_headers
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.model.storage import Storage
from nccl_back.transport import plan

from models import fill_random, write_checkpoint

BUCKET = 4096
"""Small enough that the plan has bucketed and in-place steps (a tensor cut between parts)."""


def _source() -> Any:
    return fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(_source(), tmp_path_factory.mktemp("held") / "ckpt", n_shards=2))


def _spec(ckpt: str) -> ModelSpec:
    return ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache") if "://" not in ckpt else None)


def _held(names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The elected worker's tensors once every part landed: the checkpoint's bytes."""
    return {k: v.clone() for k, v in named_tensors(_source())[0].items() if names is None or k in names}


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_every_file_proves_from_the_held_tensors_and_the_bytes_no_tensor_holds(ckpt: str, n: int) -> None:
    """Every part landed intact: the proof passes, and storage served only what no
    tensor holds (headers, padding), each member's share CRC-ed from memory."""
    spec, storage = _spec(ckpt), Storage(Settings())
    tensors = _held()
    reads = held_reads(storage, spec, model_headers(storage, spec), plan(tensors, BUCKET), n, tensors,
                       stage_bytes=1000)
    prove(spec, reads)
    assert [r.member for r in reads] == list(range(n))
    total = sum(s.size for s in spec.shards)
    assert sum(r.bytes for r in reads) == total - _tensor_bytes(tensors)
    assert all(r.intervals for r in reads)  # every member's share is covered by its own intervals


def test_tensors_the_model_does_not_load_are_read_from_storage_for_the_proof(ckpt: str) -> None:
    """A model without ``norm`` and ``q``: their bytes are read from storage, so the
    files are still proven whole."""
    spec, storage = _spec(ckpt), Storage(Settings())
    tensors = _held(set(rw.checkpoint_shapes()) - {"norm", "q"})
    reads = held_reads(storage, spec, model_headers(storage, spec), plan(tensors, BUCKET), 3, tensors)
    prove(spec, reads)
    assert sum(r.bytes for r in reads) == sum(s.size for s in spec.shards) - _tensor_bytes(tensors)


def test_the_proof_holds_from_a_bucket_through_the_real_client(ckpt: str, gcs: LocalGCS) -> None:
    """The same against the GCS emulator: the bytes no tensor holds come as ranged reads."""
    bucket = gcs.client().create_bucket("b" + uuid.uuid4().hex[:12])
    for f in sorted(Path(ckpt).iterdir()):
        bucket.blob(f"m/{f.name}").upload_from_filename(str(f))
    spec, storage = _spec(f"gs://{bucket.name}/m"), Storage(Settings())
    tensors = _held()
    prove(spec, held_reads(storage, spec, model_headers(storage, spec), plan(tensors, BUCKET), 3, tensors))


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5), st.data())
def test_a_byte_altered_in_any_members_part_is_caught_and_that_member_blamed(
        ckpt: str, n: int, data: st.DataObject) -> None:
    """Any member count, any tensor byte, any change: the proof fails naming the file,
    and reading it again names exactly the member whose share holds that byte."""
    spec, storage = _spec(ckpt), Storage(Settings())
    headers = model_headers(storage, spec)
    tensors = _held()
    steps = plan(tensors, BUCKET)
    where = places(headers)
    name = data.draw(st.sampled_from(sorted(tensors)))
    raw = tensors[name].view(-1).view(torch.uint8)
    at = data.draw(st.integers(0, raw.numel() - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    uri, start, _ = where[name]
    every = shares(steps, where, {s.uri: s.size for s in spec.shards}, n)
    member = next(i for i, spans in enumerate(every) for u, lo, hi in spans if u == uri and lo <= start + at < hi)
    reads = held_reads(storage, spec, headers, steps, n, tensors, stage_bytes=data.draw(st.integers(64, 10_000)))
    with pytest.raises(ChecksumMismatchError, match=Path(uri).name):
        prove(spec, reads)
    assert blame(storage, spec, uri, reads) == Blame((member,), changed_at_rest=False)


@pytest.mark.parametrize("n", [4, 5])
def test_a_tensor_cut_between_two_parts_blames_the_member_of_the_altered_side(ckpt: str, n: int) -> None:
    """A tensor whose bytes two members' shares split: a byte altered on either side of
    the cut names that side's member only."""
    spec, storage = _spec(ckpt), Storage(Settings())
    headers = model_headers(storage, spec)
    where = places(model_headers(storage, spec))
    steps = plan(_held(), BUCKET)
    every = shares(steps, where, {s.uri: s.size for s in spec.shards}, n)
    cuts = [(i, name, hi - start) for i, spans in enumerate(every) for uri, _, hi in spans
            for name, (u, start, end) in where.items() if u == uri and start < hi < end]
    assert cuts, "no tensor is cut between two parts at this size"
    before, name, at = cuts[0]
    after = next(i for i, spans in enumerate(every)
                 for u, lo, _ in spans if u == where[name][0] and lo == where[name][1] + at)
    assert before != after
    for flipped, member in ((at - 1, before), (at, after)):
        tensors = _held()
        tensors[name].view(-1).view(torch.uint8)[flipped] ^= 0x10
        reads = held_reads(storage, spec, headers, steps, n, tensors)
        assert blame(storage, spec, where[name][0], reads) == Blame((member,), changed_at_rest=False)


def test_a_tensor_changed_at_rest_after_listing_still_proves_from_the_listed_bytes_held(
        tmp_path: Path) -> None:
    """A tensor byte flipped in the file after the spec was taken: what the elected worker
    holds (the listed bytes, from its members) still proves; storage served no tensor."""
    ckpt = str(write_checkpoint(_source(), tmp_path / "ckpt", n_shards=2))
    spec, storage = _spec(ckpt), Storage(Settings())
    headers = model_headers(storage, spec)
    uri, start, _ = places(headers)["up"]
    path = Path(ckpt) / Path(uri).name
    data = bytearray(path.read_bytes())
    data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    tensors = _held()
    prove(spec, held_reads(storage, spec, headers, plan(tensors, BUCKET), 3, tensors))


def test_a_header_changed_at_rest_fails_the_proof_and_blames_nobody(tmp_path: Path) -> None:
    """A header byte (no tensor holds it) changed after listing: the proof fails on that
    file, and reading it again finds storage itself no longer serves the listed file."""
    ckpt = str(write_checkpoint(_source(), tmp_path / "ckpt", n_shards=2))
    spec, storage = _spec(ckpt), Storage(Settings())
    headers = model_headers(storage, spec)
    victim = spec.shards[0].uri
    path = Path(ckpt) / Path(victim).name
    data = bytearray(path.read_bytes())
    data[2] ^= 0x01  # the header's length field: bytes no tensor holds
    path.write_bytes(bytes(data))
    tensors = _held()
    reads = held_reads(storage, spec, headers, plan(tensors, BUCKET), 3, tensors)
    with pytest.raises(ChecksumMismatchError, match=Path(victim).name):
        prove(spec, reads)
    assert blame(storage, spec, victim, reads) == Blame((), changed_at_rest=True)


def test_a_tensor_that_is_not_one_run_of_memory_is_proven_by_its_values(ckpt: str) -> None:
    """A transposed view holding the checkpoint's values: CRC-ed as the file lays them out."""
    spec, storage = _spec(ckpt), Storage(Settings())
    tensors = _held()
    tensors["up"] = tensors["up"].t().contiguous().t()
    assert not tensors["up"].is_contiguous()
    prove(spec, held_reads(storage, spec, model_headers(storage, spec), plan(tensors, BUCKET), 2, tensors))
