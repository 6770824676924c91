"""A cooperative download's members each read their share from real storage (files,
the GCS emulator) into their tensors; their interval CRCs together prove every file,
and a file or a member's report that differs is caught and blamed."""

from __future__ import annotations

import base64
import dataclasses
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import reshard_workers as rw
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.config import Settings
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.s3_emulator import LocalS3
from nccl_back.errors import CheckpointFormatError, ChecksumMismatchError, StorageError
from nccl_back.load import share_read
from nccl_back.load.share_read import Blame, ShareRead, blame, places, prove, read_share, shares
from nccl_back.model.checkpoint import model_headers
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import SpanReader
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.model.storage import Storage
from nccl_back.transport import plan
from nccl_back.transport.parts import parts

from models import fill_random, write_checkpoint

BUCKET = 4096
"""Small enough that the plan has bucketed and in-place steps (``norm`` rides in a bucket)."""


def _source() -> Any:
    return fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(_source(), tmp_path_factory.mktemp("share") / "ckpt", n_shards=2))


def _spec(ckpt: str) -> ModelSpec:
    return ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache") if "://" not in ckpt else None)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _members(spec: ModelSpec, n: int, stage: int, names: Any = None,
             readers: int = Settings().storage_workers) -> tuple[list[Any], list[ShareRead], list[Any]]:
    """Every member's read into its own model (filled with 0xAB beforehand), side by side."""
    storage = Storage(Settings(storage_workers=readers))
    models, reads = [], []
    steps: list[Any] = []
    for i in range(n):
        model = build(lambda: rw.Flat(rw.checkpoint_shapes()))
        tensors = {k: v for k, v in named_tensors(model)[0].items() if names is None or k in names}
        for t in tensors.values():
            t.detach().view(-1).view(torch.uint8).fill_(0xAB)
        steps = plan(tensors, BUCKET)
        reads.append(read_share(storage, spec, model_headers(storage, spec), steps, n, i, tensors,
                                stage_bytes=stage))
        models.append(tensors)
    return models, reads, steps


def _check_parts(models: list[Any], steps: list[Any]) -> None:
    """Each member holds exactly the bytes its part carries (whole tensors, or chunks of
    one), byte for byte; every other byte untouched."""
    want = {n: _bytes(t) for n, t in named_tensors(_source())[0].items()}
    for i, part in enumerate(parts(steps, len(models))):
        expect = {name: bytearray(b"\xab" * len(_bytes(t))) for name, t in models[i].items()}
        for k in part:
            for slot in steps[k].slots:
                lo, hi = (slot.offset, slot.offset + slot.nbytes) if steps[k].direct else (0, slot.nbytes)
                expect[slot.name][lo:hi] = want[slot.name][lo:hi]
        for name, t in models[i].items():
            assert _bytes(t) == bytes(expect[name]), (i, name)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_members_read_their_parts_into_their_tensors_and_together_prove_every_file(ckpt: str, n: int) -> None:
    """Tiny staging: each member's part is exact (a tensor cut between parts too),
    storage serves every byte once, and
    the combined intervals match every file's CRC32C."""
    spec = _spec(ckpt)
    models, reads, steps = _members(spec, n, stage=1000)
    _check_parts(models, steps)
    assert sum(r.bytes for r in reads) == sum(s.size for s in spec.shards)
    prove(spec, reads)


def test_several_readers_at_once_read_what_one_reader_reads(ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A share read as pieces by several readers at once: its requests overlap, and its
    tensors' bytes, byte count and interval CRCs equal those of one reader's read."""
    spec = _spec(ckpt)
    models1, reads1, _ = _members(spec, 3, stage=999, readers=1)
    inflight, most, lock = 0, 0, threading.Lock()
    orig = SpanReader._read_into

    def read_into(self: SpanReader, *a: Any) -> None:
        nonlocal inflight, most
        with lock:
            inflight += 1
            most = max(most, inflight)
        time.sleep(0.002)  # long enough for the others' requests to start meanwhile
        try:
            orig(self, *a)
        finally:
            with lock:
                inflight -= 1

    monkeypatch.setattr(SpanReader, "_read_into", read_into)
    models4, reads4, _ = _members(spec, 3, stage=999, readers=4)
    assert most > 1
    assert [(r.bytes, r.intervals) for r in reads4] == [(r.bytes, r.intervals) for r in reads1]
    for m1, m4 in zip(models1, models4, strict=True):
        assert {k: _bytes(t) for k, t in m4.items()} == {k: _bytes(t) for k, t in m1.items()}


@pytest.mark.parametrize("n", [1, 3])
def test_each_step_of_a_members_part_is_told_once_when_its_bytes_are_in_place(ckpt: str, n: int) -> None:
    """``on_step``: every step of the member's part, each once, each only once all its
    bytes are in the member's tensors (several readers at once, tiny pieces)."""
    spec = _spec(ckpt)
    storage = Storage(Settings(storage_workers=3))
    want = {name: _bytes(t) for name, t in named_tensors(_source())[0].items()}
    for i in range(n):
        tensors = dict(named_tensors(build(lambda: rw.Flat(rw.checkpoint_shapes())))[0])
        steps = plan(tensors, BUCKET)
        told: list[int] = []

        def on_step(k: int, steps: Any = steps, tensors: Any = tensors, told: list[int] = told) -> None:
            for slot in steps[k].slots:
                lo = slot.offset if steps[k].direct else 0
                assert _bytes(tensors[slot.name])[lo:lo + slot.nbytes] == want[slot.name][lo:lo + slot.nbytes]
            told.append(k)

        read_share(storage, spec, model_headers(storage, spec), steps, n, i, tensors, stage_bytes=999,
                   on_step=on_step)
        assert sorted(told) == list(parts(steps, n)[i])


def test_a_shares_first_steps_are_told_before_most_of_it_is_read(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers at once share one link, so a share is read in pieces of at most a
    ``WAVES * readers``-th of it: its first steps go out after about a quarter of its
    bytes landed, not at the end (a part with no step within the stall bound is given
    up on)."""
    spec = _spec(ckpt)
    monkeypatch.setattr(share_read, "MIN_PIECE", 1024)  # this checkpoint is small
    read, lock, at_first = 0, threading.Lock(), []
    orig = SpanReader._read_into

    def read_into(self: SpanReader, uri: str, dest: Any, start: int) -> None:
        nonlocal read
        orig(self, uri, dest, start)
        with lock:
            read += len(dest)

    monkeypatch.setattr(SpanReader, "_read_into", read_into)
    tensors = dict(named_tensors(build(lambda: rw.Flat(rw.checkpoint_shapes())))[0])
    storage = Storage(Settings(storage_workers=2))
    got = read_share(storage, spec, model_headers(storage, spec), plan(tensors, BUCKET), 1, 0, tensors,
                     on_step=lambda k: at_first.append(read) if not at_first else None)
    assert got.bytes == sum(sh.size for sh in spec.shards)
    assert 0 < at_first[0] <= 0.4 * got.bytes, (at_first[0], got.bytes)


def test_members_read_ranged_requests_of_a_bucket(ckpt: str, gcs: LocalGCS) -> None:
    """The same from the GCS emulator, through the real client: parts exact, each
    object's bytes read once in all, every object's CRC32C (its metadata) proven."""
    bucket = gcs.client().create_bucket("b" + uuid.uuid4().hex[:12])
    for f in sorted(Path(ckpt).iterdir()):
        bucket.blob(f"m/{f.name}").upload_from_filename(str(f))
    spec = _spec(f"gs://{bucket.name}/m")
    models, reads, steps = _members(spec, 3, stage=5000)
    _check_parts(models, steps)
    assert sum(r.bytes for r in reads) == sum(s.size for s in spec.shards)
    prove(spec, reads)


def test_members_read_ranged_requests_of_an_s3_bucket(ckpt: str, s3: LocalS3) -> None:
    """The same from an S3-compatible server (moto) through boto3: parts exact, each
    object's bytes read once in all, every object's CRC32C (its checksum) proven."""
    client, name = s3.client(), "b" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=name)
    for f in sorted(Path(ckpt).iterdir()):
        data = f.read_bytes()
        client.put_object(Bucket=name, Key=f"m/{f.name}", Body=data, ChecksumAlgorithm="CRC32C",
                          ChecksumCRC32C=base64.b64encode(
                              google_crc32c.value(data).to_bytes(4, "big")).decode())
    spec = _spec(f"s3://{name}/m")
    models, reads, steps = _members(spec, 3, stage=5000)
    _check_parts(models, steps)
    assert sum(r.bytes for r in reads) == sum(s.size for s in spec.shards)
    prove(spec, reads)


def test_tensors_the_model_does_not_load_are_read_for_their_crc_only(ckpt: str) -> None:
    """A model without ``norm`` and ``q``: their bytes are still read by one member
    (so the files are proven), and no member's tensors are written beyond its part."""
    spec = _spec(ckpt)
    names = set(rw.checkpoint_shapes()) - {"norm", "q"}
    models, reads, steps = _members(spec, 3, stage=777, names=names)
    _check_parts(models, steps)
    assert sum(r.bytes for r in reads) == sum(s.size for s in spec.shards)
    prove(spec, reads)


def test_a_file_changed_after_it_was_listed_fails_the_proof_and_blames_nobody(tmp_path: Path) -> None:
    """One tensor byte flipped at rest after the spec was taken: the proof names the
    file, and reading it again finds storage itself no longer serves the listed file."""
    ckpt = str(write_checkpoint(_source(), tmp_path / "ckpt", n_shards=2))
    spec = _spec(ckpt)
    victim = spec.shards[1].uri
    where = places(model_headers(Storage(Settings()), spec))
    _, start, _ = next(w for w in where.values() if w[0] == victim)
    path = Path(ckpt) / Path(victim).name
    data = bytearray(path.read_bytes())
    data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    _, reads, _ = _members(spec, 3, stage=1000)
    with pytest.raises(ChecksumMismatchError, match=rf"{Path(victim).name}: CRC32C \w+ of the bytes"
                                                    r" loaded \(combined over all members' ranges\)"):
        prove(spec, reads)
    assert blame(Storage(Settings()), spec, victim, reads) == Blame((), changed_at_rest=True)


def test_a_storage_error_in_one_of_several_readers_stops_the_others_and_is_raised(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One of four readers' requests fails for good: the share read raises that error,
    and the other readers start no new request after it (at most the three in flight
    finish), so a failed share costs no more storage than it had read."""
    spec = _spec(ckpt)
    calls, after, lock = 0, 0, threading.Lock()
    failed, fourth = threading.Event(), threading.Event()
    orig = SpanReader._read_into

    def read_into(self: SpanReader, *a: Any) -> None:
        nonlocal calls, after
        with lock:
            calls += 1
            after += failed.is_set()
            fail = calls == 3
            if calls == 4:
                fourth.set()
        time.sleep(0.002)
        if fail:
            # Another request in flight beside it, however busy the machine (a run beside
            # the soak failed before any fourth began: nothing to stop).
            fourth.wait(10)
            failed.set()
            raise StorageError("bucket unreachable after 5 attempts (test)")
        orig(self, *a)

    monkeypatch.setattr(SpanReader, "_read_into", read_into)
    with pytest.raises(StorageError, match=r"bucket unreachable after 5 attempts \(test\)"):
        _members(spec, 1, stage=999, readers=4)
    assert calls > 3 and after <= 3, (calls, after)


def test_a_file_cut_short_after_its_header_was_read_stops_every_member_reading_it(tmp_path: Path) -> None:
    """A file truncated between the header read and the share reads: each member whose
    share is in it stops with one error naming the file and both sizes (nothing placed
    from a short read); the others read theirs."""
    ckpt = str(write_checkpoint(_source(), tmp_path / "ckpt", n_shards=2))
    spec, storage = _spec(ckpt), Storage(Settings())
    headers = model_headers(storage, spec)
    victim = spec.shards[1]
    path = Path(ckpt) / Path(victim.uri).name
    os.truncate(path, victim.size - 100)
    model = build(lambda: rw.Flat(rw.checkpoint_shapes()))
    tensors = named_tensors(model)[0]
    steps = plan(tensors, BUCKET)
    sizes = {sh.uri: sh.size for sh in spec.shards}
    every = shares(steps, places(headers), sizes, 3)
    assert any(u == victim.uri for member in every for u, _, _ in member)
    for i, member in enumerate(every):
        if any(u == victim.uri for u, _, _ in member):
            with pytest.raises(CheckpointFormatError, match=rf"{path}: {victim.size - 100} bytes, its"
                                                            rf" identity says {victim.size} \(changed since"):
                read_share(storage, spec, headers, steps, 3, i, tensors, stage_bytes=1000)
        else:
            assert read_share(storage, spec, headers, steps, 3, i, tensors, stage_bytes=1000).bytes > 0


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.data())
def test_a_member_that_reports_other_bytes_than_storage_serves_is_blamed_alone(
        ckpt: str, n: int, data: st.DataObject) -> None:
    """Any member, any of its intervals, any other CRC: the proof fails naming that
    file, and reading the file again names exactly that member."""
    spec = _spec(ckpt)
    _, reads, _ = _members(spec, n, stage=data.draw(st.integers(100, 100_000)))
    liar = data.draw(st.integers(0, n - 1))
    k = data.draw(st.integers(0, len(reads[liar].intervals) - 1))
    iv = reads[liar].intervals[k]
    forged = dataclasses.replace(iv, crc=iv.crc ^ data.draw(st.integers(1, 0xFFFFFFFF)))
    reads[liar] = dataclasses.replace(
        reads[liar], intervals=(*reads[liar].intervals[:k], forged, *reads[liar].intervals[k + 1:]))
    with pytest.raises(ChecksumMismatchError, match=Path(iv.uri).name):
        prove(spec, reads)
    assert blame(Storage(Settings()), spec, iv.uri, reads) == Blame((liar,), changed_at_rest=False)


def test_shares_of_every_member_are_cut_where_any_member_cuts(ckpt: str) -> None:
    """Members' intervals of one file are equal or disjoint (the proof needs it), and
    each member's header interval matches the header reader's."""
    spec = _spec(ckpt)
    _, reads, _ = _members(spec, 4, stage=1 << 20)
    for s in spec.shards:
        ivs = sorted({(iv.start, iv.end) for r in reads for iv in r.intervals if iv.uri == s.uri})
        assert all(a[1] <= b[0] for a, b in zip(ivs, ivs[1:], strict=False)), ivs


def test_a_tensor_whose_size_differs_from_its_checkpoint_bytes_is_refused(ckpt: str) -> None:
    """A model tensor of another size than its file's bytes: one error naming it."""
    spec = _spec(ckpt)
    storage = Storage(Settings())
    tensors = dict(named_tensors(build(lambda: rw.Flat(rw.checkpoint_shapes())))[0])
    steps = plan(tensors, BUCKET)
    tensors["norm"] = torch.empty(3)
    with pytest.raises(CheckpointFormatError, match=r"norm: 12 bytes in the model, \d+ in its checkpoint file"):
        read_share(storage, spec, model_headers(storage, spec), steps, 1, 0, tensors)


def test_a_tensor_that_is_not_one_run_of_memory_is_filled_through_a_staging_copy(ckpt: str) -> None:
    """A transposed view as the destination: its values equal the checkpoint's."""
    spec = _spec(ckpt)
    storage = Storage(Settings())
    tensors = dict(named_tensors(build(lambda: rw.Flat(rw.checkpoint_shapes())))[0])
    rows, cols = rw.checkpoint_shapes()["up"]
    tensors["up"] = torch.empty(cols, rows).t()
    assert not tensors["up"].is_contiguous()
    steps = plan(tensors, BUCKET)
    prove(spec, [read_share(storage, spec, model_headers(storage, spec), steps, 1, 0, tensors)])
    assert _bytes(tensors["up"]) == _bytes(named_tensors(_source())[0]["up"])


def test_the_shares_split_the_checkpoint_as_the_headers_place_it(ckpt: str) -> None:
    """``places`` from real headers: every model tensor has its file's bytes, and the
    shares over them tile each file."""
    spec = _spec(ckpt)
    headers = model_headers(Storage(Settings()), spec)
    where = places(headers)
    assert set(where) == set(rw.checkpoint_shapes())
    tensors = named_tensors(_source())[0]
    got = shares(plan(tensors, BUCKET), where, {s.uri: s.size for s in spec.shards}, 3)
    assert sum(hi - lo for member in got for _, lo, hi in member) == sum(s.size for s in spec.shards)
