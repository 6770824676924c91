"""The ranged storage load of a sharded skeleton: each rank reads only its pieces'
spans, the ranks' interval CRCs prove every file, and a changed byte fails the load.

In one process (the two ranks' loads side by side, as the load layer combines them) and
in real processes (a TP=2 worker of gloo-joined ranks, real Redis, WeightService)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import reshard_workers as rw
import torch

from nccl_back.config import Settings
from nccl_back.dev.gcs import LocalGCS
from nccl_back.errors import ChecksumMismatchError
from nccl_back.model.crc import check_file
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import RangedLoad, cut_points, gaps
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
    """Every rank's ranged load, combined as the load layer does: spans, cuts, rank 0's gaps."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache") if "://" not in ckpt else None)
    ranks = [_rank(ckpt, spec, r, world, scheme) for r in range(world)]
    loads = [RangedLoad(spec, sh, Storage(Settings()), stage_bytes=stage) for _, sh in ranks]
    spans = [s for ld in loads for s in ld.spans]
    if after_spans is not None:
        after_spans()
    runs = [ld.run(model, cut_points(spans), gaps(spec.shards, spans) if r == 0 else [])
            for r, (ld, (model, _)) in enumerate(zip(loads, ranks, strict=True))]
    return spec, [m for m, _ in ranks], [res for res, _ in runs], [ivs for _, ivs in runs]


def _check(spec: ModelSpec, intervals: list[Any]) -> None:
    for s in spec.shards:
        check_file(s.uri, s.size, s.crc32c,
                   [(r, iv) for r, ivs in enumerate(intervals) for iv in ivs if iv.uri == s.uri])


@pytest.mark.parametrize("scheme", ["megatron", "cols"])
def test_each_rank_gets_the_whole_checkpoint_cut_bytes_and_the_files_are_proven(ckpt: str, scheme: str) -> None:
    """Tiny staging chunks, fused / row / column pieces: bytes equal the whole-buffer cut's, CRCs combine."""
    spec, models, _, intervals = _ranged(ckpt, 2, scheme, stage=100)
    for rank, model in enumerate(models):
        want, sh = _rank(ckpt, spec, rank, 2, scheme)
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


def test_column_pieces_are_read_once_in_total(ckpt: str) -> None:
    """Row slices are sub-spans: two ranks of dim-0 pieces read each tensor byte once;
    row-parallel (dim-1) pieces cost each rank the tensor's whole span."""
    spec, _, results, _ = _ranged(ckpt, 2, "megatron")
    data = sum(s.size for s in spec.shards) - sum(len(h.raw) for h in RangedLoad(
        spec, _rank(ckpt, spec, 0, 2, "megatron")[1], Storage(Settings())).headers)
    shapes = rw.checkpoint_shapes()
    twice = sum(torch.Size(shapes[n]).numel() * 4 for n in ("o", "down", "norm"))
    assert sum(r.bytes for r in results) == data + twice
    assert max(r.bytes for r in results) < data


def test_a_byte_changed_after_listing_fails_the_file_it_is_in(ckpt: str) -> None:
    """A flipped byte of a piece only rank 1 reads: the combined CRC names its file."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache"))
    path, offset = _only_rank1_reads(ckpt, spec)

    def flip() -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))

    spec, _, _, intervals = _ranged(ckpt, 2, "megatron", after_spans=flip)
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
    from nccl_back.model.checkpoint import locate, model_headers

    _, info = locate(model_headers(Storage(Settings()), spec))["embed"]
    return info.uri, info.end - 1


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
    each tensor byte once in total but the replicated norm (each rank's own, 0.3%)."""
    fleet.start(2, "rows")
    reports = fleet.reports(2)
    assert all(r["source"] == "storage" and r["identical"] for r in reports), reports
    norm = rw.checkpoint_shapes()["norm"][0] * 4
    assert sum(r["bytes"] for r in reports) == _data_bytes(ckpt) + norm
    assert all(r["timings"]["storage.verify"] >= 0 for r in reports)


@pytest.mark.timeout(240)
def test_tp2_megatron_worker_is_bit_exact_and_reads_row_parallel_tensors_per_rank(
        fleet: Fleet, ckpt: str) -> None:
    """Fused, column and row-parallel pieces: bit-exact; row-parallel tensors (and the
    replicated norm) are each rank's whole span, every other byte is read once."""
    fleet.start(2, "megatron")
    reports = fleet.reports(2)
    assert all(r["source"] == "storage" and r["identical"] for r in reports), reports
    shapes = rw.checkpoint_shapes()
    twice = sum(torch.Size(shapes[n]).numel() * 4 for n in ("o", "down", "norm"))
    assert sum(r["bytes"] for r in reports) == _data_bytes(ckpt) + twice


@pytest.mark.timeout(240)
def test_a_byte_changed_after_listing_fails_the_load_on_every_rank(fleet: Fleet, ckpt: str) -> None:
    """One byte flipped after the listing, in rows only rank 1 reads: every rank raises
    ChecksumMismatchError naming the file, and no rank reports weights."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=fleet.settings["cache_dir"])
    path, offset = _only_rank1_reads(ckpt, spec)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    fleet.start(2, "rows", spec=spec)
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
