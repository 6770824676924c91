"""Loading from storage into skeletons: exact weights, strict checks before any copy."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from nccl_back.config import Settings
from nccl_back.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    ShardNotFoundError,
    WeightLoadError,
)
from nccl_back.model.checkpoint import INDEX_NAME, flat_skeleton
from nccl_back.model.crc_cache import CACHE_NAME
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import build, manifest, named_tensors

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(30)


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes: skeleton memory may hold NaN, which torch.equal calls unequal."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _snapshot(model: Any) -> dict[str, bytes]:
    tensors, _ = named_tensors(model)
    return {n: _raw(t) for n, t in tensors.items()}


def _assert_same_weights(a: Any, b: Any) -> None:
    assert _snapshot(a) == _snapshot(b)


def _spec(model: Any, directory: Path, cache_dir: str, **kwargs: Any) -> ModelSpec:
    return ModelSpec.from_dir(str(write_checkpoint(model, directory, **kwargs)), cache_dir=cache_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_fills_exact_weights(tmp_path: Path, cache_dir: str, dtype: torch.dtype) -> None:
    """A skeleton loaded from storage holds exactly the checkpoint's weights, tie intact."""
    model = fill_random(TinyTransformer(dtype=dtype), 0)
    spec = _spec(model, tmp_path / "ckpt", cache_dir, n_shards=3)
    skeleton = build(lambda: TinyTransformer(dtype=dtype))
    result = load_from_storage(skeleton, spec)
    _assert_same_weights(model, skeleton)
    assert skeleton.lm_head.weight is skeleton.embed.weight
    assert (result.source, result.version) == ("storage", spec.version)
    assert result.bytes == manifest(model).nbytes
    assert set(result.timings) == {"headers", "copy"}


def test_constructor_state_is_real_after_load(tmp_path: Path, cache_dir: str) -> None:
    """inv_freq (not in the checkpoint) of a built skeleton equals a normal model's; outputs match."""
    model = fill_random(TinyTransformer(), 0)
    spec = _spec(model, tmp_path / "ckpt", cache_dir)
    skeleton = build(TinyTransformer)
    load_from_storage(skeleton, spec)
    assert torch.equal(skeleton.rotary.inv_freq, TinyTransformer().rotary.inv_freq)
    tokens = torch.arange(10).view(1, 10)
    assert torch.equal(skeleton(tokens), model(tokens))


def test_alias_name_fills_tied_tensor(tmp_path: Path, cache_dir: str) -> None:
    """A checkpoint storing the tied weight under its alias (lm_head.weight) fills embed.weight."""
    model = fill_random(TinyTransformer(), 0)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=1, with_index=False)
    tensors, _ = named_tensors(model)
    renamed = {("lm_head.weight" if n == "embed.weight" else n): t for n, t in tensors.items()}
    save_file(renamed, str(ckpt / "model-00001-of-00001.safetensors"))
    skeleton = build(TinyTransformer)
    load_from_storage(skeleton, ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir))
    _assert_same_weights(model, skeleton)


def test_tied_tensor_stored_twice_is_rejected(tmp_path: Path, cache_dir: str) -> None:
    """A checkpoint holding both names of a tied tensor would fill it twice: WeightLoadError."""
    model = fill_random(TinyTransformer(), 0)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=1, with_index=False)
    tensors, _ = named_tensors(model)
    both = {**tensors, "lm_head.weight": tensors["embed.weight"].clone()}
    save_file(both, str(ckpt / "model-00001-of-00001.safetensors"))
    with pytest.raises(WeightLoadError, match=r"filled twice: \['embed.weight \(as embed.weight and lm_head.weight\)'\]"):
        load_from_storage(build(TinyTransformer), ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir))


def test_mapping_model_uses_prefixed_names(tmp_path: Path, cache_dir: str) -> None:
    """A pipeline {name: module} loads from one checkpoint whose names carry the 'name.' prefix."""

    def pipeline() -> dict[str, nn.Module]:
        return {"decoder": TinyTransformer(n_layers=2), "encoder": TinyTransformer(n_layers=1, d=16)}

    model = pipeline()
    fill_random(model, 0)
    spec = _spec(model, tmp_path / "ckpt", cache_dir, n_shards=2)
    assert "encoder.model.layers.0.qkv.weight" in json.loads(
        (tmp_path / "ckpt" / INDEX_NAME).read_text()
    )["weight_map"]
    skeleton = build(pipeline)
    load_from_storage(skeleton, spec)
    _assert_same_weights(model, skeleton)


def test_wrong_dtype_fails_before_any_copy(tmp_path: Path, cache_dir: str) -> None:
    """A skeleton tensor of the wrong dtype raises WeightLoadError naming it; nothing is written."""
    spec = _spec(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", cache_dir)
    skeleton = fill_random(build(TinyTransformer), 99)
    skeleton.model.norm.weight = nn.Parameter(torch.zeros(32, dtype=torch.float16))
    before = _snapshot(skeleton)
    with pytest.raises(
        WeightLoadError,
        match=r"model\.norm\.weight: skeleton expects \[32\] float16, .*model-00002-of-00002\.safetensors has \[32\] float32",
    ):
        load_from_storage(skeleton, spec)
    after = _snapshot(skeleton)
    assert before == after


def test_wrong_shape_is_named(tmp_path: Path, cache_dir: str) -> None:
    """A skeleton with other shapes raises WeightLoadError naming the tensor and both shapes."""
    spec = _spec(fill_random(TinyTransformer(d=32), 0), tmp_path / "ckpt", cache_dir)
    with pytest.raises(WeightLoadError, match=r"embed\.weight: skeleton expects \[64, 16\] float32, .* has \[64, 32\] float32"):
        load_from_storage(build(lambda: TinyTransformer(d=16)), spec)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path, cache_dir: str) -> None:
    """Skeleton tensors absent from the checkpoint, and checkpoint tensors it lacks, are named."""
    spec = _spec(fill_random(TinyTransformer(n_layers=2), 0), tmp_path / "ckpt", cache_dir)
    with pytest.raises(WeightLoadError, match=r"missing from the checkpoint: \['model\.layers\.2\.attn_norm\.bias'"):
        load_from_storage(build(lambda: TinyTransformer(n_layers=3)), spec)
    with pytest.raises(WeightLoadError, match=r"unexpected \(not in the skeleton\): \['model\.layers\.1\.attn_norm\.bias'"):
        load_from_storage(build(lambda: TinyTransformer(n_layers=1)), spec)


def test_truncated_shard_is_named(tmp_path: Path, cache_dir: str) -> None:
    """A truncated safetensors file raises CheckpointFormatError naming the file."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt")
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    with pytest.raises(CheckpointFormatError, match=r"model-00002-of-00002\.safetensors: truncated: tensor"):
        load_from_storage(build(TinyTransformer), spec)


def test_shard_changed_after_fingerprint_is_named(tmp_path: Path, cache_dir: str) -> None:
    """A shard cut short after it was fingerprinted raises CheckpointFormatError naming it."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt")
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    shard = ckpt / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointFormatError, match=r"model-00001-of-00002\.safetensors: truncated"):
        load_from_storage(build(TinyTransformer), spec)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:8] + b"{" * (len(d) - 8), "malformed safetensors header"),
        (lambda d: (2**40).to_bytes(8, "little") + d[8:], "header length .* is over the safetensors limit of 100000000"),
        (lambda d: d[:5], "5 bytes is too short for a safetensors file"),
    ],
    ids=["garbage-json", "huge-length", "five-bytes"],
)
def test_malformed_shard_is_named(tmp_path: Path, cache_dir: str, damage: Any, message: str) -> None:
    """A shard with a garbage header raises CheckpointFormatError naming the file."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt")
    shard = ckpt / "model-00001-of-00002.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    with pytest.raises(CheckpointFormatError, match=rf"model-00001-of-00002\.safetensors: {message}"):
        load_from_storage(build(TinyTransformer), spec)


def test_missing_shard_is_named(tmp_path: Path, cache_dir: str) -> None:
    """A shard deleted after fingerprinting raises ShardNotFoundError naming it."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt")
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ShardNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load_from_storage(build(TinyTransformer), spec)


def test_tensor_in_two_shards_is_rejected(tmp_path: Path, cache_dir: str) -> None:
    """A tensor stored in two shards raises CheckpointFormatError naming both files."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", with_index=False)
    save_file({"embed.weight": torch.zeros(64, 32)}, str(ckpt / "extra.safetensors"))
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    with pytest.raises(CheckpointFormatError, match=r"'embed\.weight' is stored twice: in .*extra\.safetensors and .*model-00001"):
        load_from_storage(build(TinyTransformer), spec)


def test_flat_skeleton_from_headers(tmp_path: Path, cache_dir: str) -> None:
    """flat_skeleton has the checkpoint's names, shapes and dtypes and loads exactly."""
    model = fill_random(TinyTransformer(dtype=torch.bfloat16), 0)
    spec = _spec(model, tmp_path / "ckpt", cache_dir, n_shards=3)
    flat = flat_skeleton(spec)
    assert manifest(flat).entries == manifest(model).entries
    load_from_storage(flat, spec)
    expected, _ = named_tensors(model)
    assert all(_raw(expected[n]) == _raw(t) for n, t in flat.state_dict().items())


def test_progress_reaches_total(tmp_path: Path, cache_dir: str) -> None:
    """The progress callback reports growing byte counts that end at the total."""
    spec = _spec(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", cache_dir)
    calls: list[tuple[int, int, float]] = []
    result = load_from_storage(build(TinyTransformer), spec, progress=lambda *a: calls.append(a))
    done = [c[0] for c in calls]
    assert sorted(done) == done and done[-1] == result.bytes
    assert {c[1] for c in calls} == {result.bytes}


def test_pipeline_rank_loads_only_its_submodules(tmp_path: Path) -> None:
    """A rank holding one sub-module of a pipeline checkpoint loads just that sub-module."""
    from torch import nn

    full = {"transformer": nn.Linear(4, 4), "vae": nn.Linear(2, 3)}
    ckpt = write_checkpoint(fill_random(full, 3), tmp_path / "pipe", n_shards=2)
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=str(tmp_path / "cache"))
    part = {"vae": nn.Linear(2, 3)}
    result = load_from_storage(part, spec)
    assert result.bytes == (2 * 3 + 3) * 4
    assert _raw(part["vae"].weight) == _raw(full["vae"].weight)
    bad = {"vae": nn.Linear(2, 4)}
    with pytest.raises(WeightLoadError, match=r"vae.weight: skeleton expects \[4, 2\] float32"):
        load_from_storage(bad, spec)


def test_flat_skeleton_is_one_allocation(tmp_path: Path) -> None:
    """A header-built skeleton lives in one allocation, in manifest order, and loads exactly."""
    model = fill_random(TinyTransformer(), 5)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=3)
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=str(tmp_path / "cache"))
    sk = flat_skeleton(spec)
    tensors, _ = named_tensors(sk)
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1
    load_from_storage(sk, spec)
    expected, _ = named_tensors(model)
    assert all(_raw(expected[n]) == _raw(t) for n, t in tensors.items())


def _flip_data_byte(path: Path) -> None:
    """Change one tensor byte in place, keeping the file's size (and header)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_changed_local_shard_fails_its_crc(tmp_path: Path) -> None:
    """A local shard whose bytes changed (same size) since fingerprinting fails its CRC32C;
    none of its tensors is reported filled."""
    settings = Settings(cache_dir=str(tmp_path / "cache"))
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=1)
    spec = ModelSpec.from_dir(str(ckpt), settings=settings)
    _flip_data_byte(ckpt / "model-00001-of-00001.safetensors")
    filled: list[str] = []
    with pytest.raises(ChecksumMismatchError, match=rf"00001.safetensors: CRC32C \w+ of the bytes loaded differs from {spec.shards[0].crc32c}"):
        load_from_storage(build(TinyTransformer), spec, settings=settings, on_filled=filled.append)
    assert filled == []


def test_the_load_never_trusts_the_crc_cache(tmp_path: Path) -> None:
    """A warm restart takes the identity from the CRC32C cache, but the load checksums the
    bytes it copies: a cache entry poisoned under an unchanged identity key changes nothing."""
    settings = Settings(cache_dir=str(tmp_path / "cache"))
    model = fill_random(TinyTransformer(), 0)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=1)
    past = time.time() - 60
    os.utime(ckpt / "model-00001-of-00001.safetensors", (past, past))
    spec = ModelSpec.from_dir(str(ckpt), settings=settings)
    cache_file = tmp_path / "cache" / CACHE_NAME
    entries = json.loads(cache_file.read_text())
    (entry,) = entries.values()
    entry["crc32c"] = "deadbeef"
    cache_file.write_text(json.dumps(entries))
    skeleton = build(TinyTransformer)
    load_from_storage(skeleton, spec, settings=settings)
    _assert_same_weights(model, skeleton)
    _flip_data_byte(ckpt / "model-00001-of-00001.safetensors")
    os.utime(ckpt / "model-00001-of-00001.safetensors", (past, past))
    with pytest.raises(ChecksumMismatchError, match="of the bytes loaded differs"):
        load_from_storage(build(TinyTransformer), spec, settings=settings)


def test_fingerprint_uses_the_settings_cache_dir(tmp_path: Path) -> None:
    """ModelSpec.from_dir with settings keeps its CRC32C cache in the settings' cache_dir."""
    settings = Settings(cache_dir=str(tmp_path / "mine"))
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=1)
    past = time.time() - 60
    os.utime(ckpt / "model-00001-of-00001.safetensors", (past, past))
    ModelSpec.from_dir(str(ckpt), settings=settings)
    assert (tmp_path / "mine" / CACHE_NAME).exists()


def _one_shard(directory: Path, header: bytes, data: bytes) -> ModelSpec:
    import struct

    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    return ModelSpec.from_dir(str(directory), cache_dir=str(directory / "cache"))


@pytest.mark.parametrize("shape", [[0], [3, 0], [0, 0, 7]])
def test_zero_element_tensors_of_one_shape_are_not_tied(tmp_path: Path, shape: list[int]) -> None:
    """Several zero-element tensors of one shape and dtype (the reference loads them) are
    distinct tensors of a header-built skeleton, each filled once, not "filled twice"."""
    entry = {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
    header = {"a": entry, "b": entry, "c": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "d": entry}
    spec = _one_shard(tmp_path / "ckpt", json.dumps(header).encode(), bytes(4))
    skeleton = flat_skeleton(spec)
    tensors, aliases = named_tensors(skeleton)
    assert sorted(tensors) == ["a", "b", "c", "d"] and aliases == {}
    result = load_from_storage(skeleton, spec)
    assert result.bytes == 4


@pytest.mark.parametrize("dtype,shape", [("F6_E2M3", [8]), ("F6_E3M2", [8]), ("F4", [4, 3])])
def test_a_dtype_torch_cannot_hold_is_refused_by_tensor_name(tmp_path: Path, dtype: str,
                                                             shape: list[int]) -> None:
    """A valid file with a sub-byte dtype torch has no element type for (F6), or an F4
    tensor whose odd last dimension torch's packed pairs cannot hold: the skeleton build
    refuses it naming the file, the tensor and the dtype."""
    nbytes = math.prod(shape) * (4 if dtype == "F4" else 6) // 8
    header = {"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}
    spec = _one_shard(tmp_path / "ckpt", json.dumps(header).encode(), bytes(nbytes))
    with pytest.raises(CheckpointFormatError, match=rf"model\.safetensors: tensor 'w' has dtype {dtype}"):
        flat_skeleton(spec)


def test_a_strided_skeleton_tensor_loads_exactly(tmp_path: Path) -> None:
    """A skeleton tensor that is not contiguous (a transposed view) gets the checkpoint's
    values element by element, like a contiguous one."""
    source = nn.Linear(3, 4)
    save_file({"weight": source.weight.detach().clone(), "bias": source.bias.detach().clone()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    spec = ModelSpec.from_dir(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    target = nn.Linear(3, 4)
    target.weight = nn.Parameter(torch.empty(3, 4).t())
    assert not target.weight.is_contiguous()
    load_from_storage(target, spec)
    assert _raw(target.weight) == _raw(source.weight) and _raw(target.bias) == _raw(source.bias)
