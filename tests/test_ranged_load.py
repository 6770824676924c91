"""The ranged storage load of a sharded skeleton: each rank reads only its pieces'
spans, the ranks' interval CRCs prove every file, and a changed byte fails the load.

In one process (the two ranks' loads side by side, as the load layer combines them) and
in real processes (a TP=2 worker of gloo-joined ranks, real Redis, WeightService)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import reshard_workers as rw
import torch
from hypothesis import given
from hypothesis import strategies as st

from nccl_back.config import Settings
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.errors import ChecksumMismatchError
from nccl_back.model.crc import check_file
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import Chunk, Need, Needs, RangedLoad, cut_points, gaps, schedule
from nccl_back.model.sharding import Sharding, load_sharded, sharding
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.model.storage import Storage

from models import fill_random, write_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=5)
    return str(write_checkpoint(model, tmp_path / "ckpt", n_shards=2))


def _rank(ckpt: str, spec: ModelSpec, rank: int, world: int, scheme: str) -> tuple[Any, Sharding]:
    model = build(lambda: rw.Flat(rw.tp_shapes(world, scheme)))
    return model, sharding(model, spec, rw.describe(rank, world, scheme), Settings())


def _bytes(model: Any) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in named_tensors(model)[0].items()}


def _ranged(ckpt: str, world: int, scheme: str, stage: int = 1 << 20,
            after_spans: Any = None) -> tuple[ModelSpec, list[Any], list[Any], list[Any]]:
    """Every rank's ranged load, combined as the load layer does (needs, the schedule,
    cuts, rank 0's gaps, each shared chunk from its reader to every rank), in lockstep."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache") if "://" not in ckpt else None)
    ranks = [_rank(ckpt, spec, r, world, scheme) for r in range(world)]
    loads = [RangedLoad(spec, sh, Storage(Settings()), stage_bytes=stage) for _, sh in ranks]
    sched = schedule([ld.needs for ld in loads])
    spans = sched.every_read
    if after_spans is not None:
        after_spans()
    cuts, holes = cut_points(spans), gaps(spec.shards, spans)
    for r, (ld, (model, _)) in enumerate(zip(loads, ranks, strict=True)):
        ld.begin(model, cuts, sched, r, holes if r == 0 else [])
        ld.read_own(holes if r == 0 else [])
    for c in sched.chunks():
        sent = loads[c.owner].read_chunk(c)
        for r, ld in enumerate(loads):
            got = sent if r == c.owner else ld.buffer(c.nbytes)
            got.copy_(sent)
            ld.place(c, got)
    runs = [ld.finish() for ld in loads]
    return spec, [m for m, _ in ranks], [res for res, _ in runs], [ivs for _, ivs in runs]


def _check(spec: ModelSpec, intervals: list[Any]) -> None:
    for s in spec.shards:
        check_file(s.uri, s.size, s.crc32c,
                   [(r, iv) for r, ivs in enumerate(intervals) for iv in ivs if iv.uri == s.uri])


@pytest.mark.parametrize(("scheme", "world"), [("megatron", 2), ("cols", 2), ("megatron", 4)])
def test_each_rank_gets_the_whole_checkpoint_cut_bytes_and_the_files_are_proven(
        ckpt: str, scheme: str, world: int) -> None:
    """Tiny staging chunks, fused / row / column pieces, shared tensors handed over in
    many chunks: bytes equal the whole-buffer cut's, CRCs combine."""
    spec, models, _, intervals = _ranged(ckpt, world, scheme, stage=100)
    for rank, model in enumerate(models):
        want, sh = _rank(ckpt, spec, rank, world, scheme)
        load_sharded(want, spec, Settings(), sh)
        assert _bytes(model) == _bytes(want)
    _check(spec, intervals)


def test_ranks_read_their_spans_of_remote_objects_through_ranged_requests(ckpt: str, gcs: LocalGCS) -> None:
    """The same load from a bucket (the GCS emulator): ranged requests, the same bytes,
    every object's CRC32C (from its metadata) proven."""
    bucket = gcs.client().create_bucket("b" + uuid.uuid4().hex[:12])
    for f in sorted(Path(ckpt).iterdir()):
        bucket.blob(f"m/{f.name}").upload_from_filename(str(f))
    spec, models, _, intervals = _ranged(f"gs://{bucket.name}/m", 2, "megatron", stage=1000)
    for rank, model in enumerate(models):
        want, sh = _rank(ckpt, spec, rank, 2, "megatron")
        load_sharded(want, spec, Settings(), sh)  # the whole-object downloads, cut
        assert _bytes(model) == _bytes(want)
    _check(spec, intervals)


@pytest.mark.parametrize(("scheme", "world"), [("megatron", 2), ("cols", 2), ("megatron", 4)])
def test_every_tensor_byte_is_read_once_by_the_group(ckpt: str, scheme: str, world: int) -> None:
    """Column pieces are sub-spans; row-parallel (dim-1) pieces and the replicated norm
    are split into one block per rank, balanced by bytes: the group reads the
    checkpoint's tensor bytes exactly once, no rank much more than its part."""
    spec, _, results, _ = _ranged(ckpt, world, scheme)
    data = _data_bytes(ckpt)
    assert sum(r.bytes for r in results) == data
    assert max(r.bytes for r in results) < data / world * 1.5


def test_the_schedule_splits_shared_tensors_into_balanced_blocks_that_tile_them(ckpt: str) -> None:
    """Per shared tensor: blocks tile the rows every rank needs, one per rank, within
    one row of each other; tensors whose spans are disjoint stay each rank's own."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache"))
    loads = [RangedLoad(spec, _rank(ckpt, spec, r, 4, "megatron")[1], Storage(Settings())) for r in range(4)]
    sched = schedule([ld.needs for ld in loads])
    assert sorted(sched.names) == ["down", "norm", "o"]
    for need, blocks, _step in sched.shared:
        assert [k for k, _, _ in blocks] == [0, 1, 2, 3]
        assert [(lo, hi) for _, lo, hi in blocks] == list(zip(
            [need.lo] + [hi for _, _, hi in blocks[:-1]], [hi for _, _, hi in blocks], strict=True))
        assert (need.lo, need.hi) == (0, rw.checkpoint_shapes()[need.name][0])
        sizes = [hi - lo for _, lo, hi in blocks]
        assert max(sizes) - min(sizes) <= 1


@given(st.integers(1, 8), st.lists(st.tuples(st.integers(1, 40), st.integers(1, 16),
                                             st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)),
                                                      min_size=1, max_size=8)), max_size=6),
       st.integers(1, 300))
def test_every_byte_of_every_needed_row_is_read_by_exactly_one_rank(
        world: int, tensors: list[Any], stage: int) -> None:
    """Any needs: the ranks' reads are disjoint and cover every needed row; a shared
    tensor's blocks are within one row of each other; chunks fit the staging size (or
    are one row) and tile each block in order."""
    needs: list[list[Need]] = [[] for _ in range(world)]
    at = 0
    for i, (rows, row_bytes, wanted) in enumerate(tensors):
        for r, (a, b) in enumerate(wanted[:world]):
            lo, hi = sorted((min(a, rows), min(b, rows)))
            if hi > lo:
                needs[r].append(Need(f"t{i}", "f", at, row_bytes, lo, hi))
        at += rows * row_bytes
    sched = schedule([Needs((), tuple(n), stage) for n in needs])
    read = sorted((lo, hi) for _, lo, hi in sched.every_read if hi > lo)
    assert all(a[1] <= b[0] for a, b in zip(read, read[1:], strict=False)), read
    covered = [False] * at
    for lo, hi in read:
        covered[lo:hi] = [True] * (hi - lo)
    for n in (n for rank in needs for n in rank):
        assert all(covered[n.start + n.lo * n.row_bytes:n.start + n.hi * n.row_bytes])
    for need, blocks, _ in sched.shared:
        sizes = [hi - lo for _, lo, hi in blocks]
        assert sum(sizes) == need.hi - need.lo and max(sizes) - min(sizes) <= 1
    by_block: dict[tuple[str, int], list[Chunk]] = {}
    for c in sched.chunks():
        assert c.nbytes <= max(stage, c.need.row_bytes) and c.nbytes <= sched.chunk_bytes
        by_block.setdefault((c.need.name, c.owner), []).append(c)
    for chunks in by_block.values():
        assert [c.rows[0] for c in chunks] == [chunks[0].block[0]] + [c.rows[1] for c in chunks[:-1]]
        assert chunks[-1].rows[1] == chunks[-1].block[1]


@pytest.mark.parametrize("name", ["embed", "o"])
def test_a_byte_changed_after_listing_fails_the_file_it_is_in(ckpt: str, name: str) -> None:
    """A flipped byte of a piece only rank 1 reads, or of the block of row-parallel
    ``o`` rank 1 reads for both: the combined CRC names its file."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache"))
    path, offset = _last_byte(ckpt, spec, name)
    spec, _, _, intervals = _ranged(ckpt, 2, "megatron", after_spans=lambda: _flip(path, offset))
    with pytest.raises(ChecksumMismatchError, match=f"{os.path.basename(path)}: CRC32C .* differs"):
        _check(spec, intervals)


def test_bytes_nobody_holds_are_read_by_rank_0_for_their_crc_only(ckpt: str) -> None:
    """A checkpoint tensor no rank holds (norm): rank 0 reads it as a gap, so every byte
    of every file is still proven; the skeletons stay as loaded."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache"))
    shapes = {n: s for n, s in rw.tp_shapes(2, "rows").items() if n != "norm"}
    loads, models = [], []
    for rank in range(2):
        model = build(lambda: rw.Flat(shapes))
        described = {n: t for n, t in rw.describe(rank, 2, "rows").items() if n != "norm"}
        loads.append(RangedLoad(spec, sharding(model, spec, described, Settings()), Storage(Settings())))
        models.append(model)
    spans = [s for ld in loads for s in ld.spans]
    holes = gaps(spec.shards, spans)
    assert [hi - lo for _, lo, hi in holes] == [rw.checkpoint_shapes()["norm"][0] * 4]
    runs = [ld.run(m, cut_points(spans), holes if r == 0 else [])
            for r, (ld, m) in enumerate(zip(loads, models, strict=True))]
    _check(spec, [ivs for _, ivs in runs])
    assert runs[0][0].bytes - runs[1][0].bytes == holes[0][2] - holes[0][1]


def _only_rank1_reads(ckpt: str, spec: ModelSpec) -> tuple[str, int]:
    """The file and offset of the last byte of ``embed`` (rows only rank 1 holds)."""
    return _last_byte(ckpt, spec, "embed")


def _last_byte(ckpt: str, spec: ModelSpec, name: str) -> tuple[str, int]:
    """The file and offset of checkpoint tensor ``name``'s last byte (in the last
    rank's rows, or block of a shared tensor)."""
    from nccl_back.model.checkpoint import locate, model_headers

    _, info = locate(model_headers(Storage(Settings()), spec))[name]
    return info.uri, info.end - 1


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- a TP=2 worker of real processes ------------------------------------------------------

from test_reshard import Fleet  # noqa: E402  (the reshard tests' processes, reused)


@pytest.fixture
def fleet(ckpt: str, redis_url: str, namespace: str, cache_dir: str) -> Any:
    f = Fleet(ckpt, {"redis_url": redis_url, "namespace": namespace, "cache_dir": cache_dir,
                     "advertise_host": "127.0.0.1", "peer_ttl": 3.0, "secret": "s" * 32})
    yield f
    f.close()


def _data_bytes(ckpt: str) -> int:
    """The checkpoint's tensor bytes (its files less their headers)."""
    return sum(torch.Size(s).numel() * 4 for s in rw.checkpoint_shapes().values())


@pytest.mark.timeout(240)
def test_tp2_worker_first_load_is_bit_exact_and_reads_the_checkpoint_once(fleet: Fleet, ckpt: str) -> None:
    """A TP=2 worker of column-parallel pieces loads its exact bytes from storage, reading
    each tensor byte once in total (the replicated norm once, by halves, handed over)."""
    fleet.start(2, "rows")
    reports = fleet.reports(2)
    assert all(r["source"] == "storage" and r["identical"] for r in reports), reports
    assert sum(r["bytes"] for r in reports) == _data_bytes(ckpt)
    assert all(r["timings"]["storage.verify"] >= 0 for r in reports)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_worker_is_bit_exact_and_reads_the_checkpoint_once(fleet: Fleet, ckpt: str, world: int) -> None:
    """Fused, column and row-parallel pieces and the replicated norm, TP=2 and TP=4:
    bit-exact, and the group reads every tensor byte exactly once (1.00x): row-parallel
    o/down and the norm are read by blocks, one per rank, and broadcast."""
    fleet.start(world, "megatron")
    reports = fleet.reports(world)
    assert all(r["source"] == "storage" and r["identical"] for r in reports), reports
    assert sum(r["bytes"] for r in reports) == _data_bytes(ckpt)
    assert all(r["bytes"] > 0 for r in reports)


@pytest.mark.timeout(240)
def test_a_rank_whose_block_read_fails_fails_every_rank_without_a_hang(fleet: Fleet) -> None:
    """Rank 1's reads of its shared blocks fail: it still enters every broadcast, then
    raises its StorageError; rank 0 raises ConsensusError naming rank 1; no rank reports
    weights and none waits out a collective's timeout."""
    t = time.monotonic()
    fleet.start(2, "megatron", fault="fail_shared_read")
    reports = fleet.reports(2, errors=True)
    assert time.monotonic() - t < 60
    assert all("source" not in r for r in reports), reports
    assert reports[1]["error"].startswith("StorageError: injected"), reports[1]["error"]
    assert reports[0]["error"].startswith("ConsensusError: rank 1"), reports[0]["error"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheme", ["rows", "megatron"])
def test_a_byte_changed_after_listing_fails_the_load_on_every_rank(fleet: Fleet, ckpt: str,
                                                                   scheme: str) -> None:
    """One byte flipped after the listing, in rows only rank 1 reads (``rows``) or in
    row-parallel ``o``'s block that rank 1 reads and broadcasts (``megatron``): every rank
    raises ChecksumMismatchError naming the file, and no rank reports weights."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=fleet.settings["cache_dir"])
    path, offset = _only_rank1_reads(ckpt, spec) if scheme == "rows" else _last_byte(ckpt, spec, "o")
    _flip(path, offset)
    fleet.start(2, scheme, spec=spec)
    reports = fleet.reports(2, errors=True)
    for r in reports:
        assert "source" not in r, r
        assert r["error"].startswith("ChecksumMismatchError"), r["error"]
        assert os.path.basename(path) in r["error"], r["error"]


@pytest.mark.timeout(240)
def test_a_single_rank_sharded_load_still_works(fleet: Fleet, ckpt: str) -> None:
    """World 1 with a sharding (pieces that are whole tensors): bit-exact, every byte read once."""
    fleet.start(1, "megatron")
    (r,) = fleet.reports(1)
    assert r["source"] == "storage" and r["identical"], r
    assert r["bytes"] == _data_bytes(ckpt)
