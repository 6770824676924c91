"""The ranged storage load of a sharded skeleton: each rank reads only its pieces'
spans, the ranks' interval CRCs prove every file, and a changed byte fails the load.

In one process (the two ranks' loads side by side, as the load layer combines them) and
in real processes (a TP=2 worker of gloo-joined ranks, real Redis, WeightService)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import reshard_workers as rw
import torch

from nccl_back.config import Settings
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
    spec = ModelSpec.from_dir(ckpt, cache_dir=str(Path(ckpt).parent / "cache"))
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


def _only_rank1_reads(ckpt: str, spec: ModelSpec) -> tuple[str, int]:
    """The file and offset of the last byte of ``embed`` (rows only rank 1 holds)."""
    from nccl_back.model.checkpoint import locate, model_headers

    _, info = locate(model_headers(Storage(Settings()), spec))["embed"]
    return info.uri, info.end - 1
